"""PEFT adapter files for the LoRA tests: a copy of an adapter that `make-model --lora-out` wrote, with new random
F32 weights drawn from a seed. No tests live here."""

import json
import os
import random
import struct
from pathlib import Path


def random_adapter(template: str, out: str, seed: int, scale: float = 0.05, widen: str = "") -> str:
    """Writes to `out` the adapter `template` with every tensor replaced by uniform(-scale, scale) F32 values; with
    `widen`, the first tensor whose name contains it gets one more column than the model has (a wrong shape)."""
    data = Path(template, "adapter_model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    rng = random.Random(seed)
    entries, blobs, offset = {}, [], 0
    for name in sorted(header):
        shape = list(header[name]["shape"])
        if widen and widen in name:
            shape[1] += 1
            widen = ""
        count = shape[0] * shape[1]
        blob = struct.pack(f"<{count}f", *(rng.uniform(-scale, scale) for _ in range(count)))
        entries[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(entries).encode()
    head += b" " * (-len(head) % 8)
    os.makedirs(out, exist_ok=True)
    Path(out, "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    Path(out, "adapter_config.json").write_text(Path(template, "adapter_config.json").read_text())
    return out
