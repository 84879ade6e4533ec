"""LoRARequest: which adapter a request runs through, as vLLM's (lora_name, lora_int_id, lora_path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # > 0, unique per adapter: requests with the same id share its weights (and cached prefixes)
    lora_path: str    # a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
