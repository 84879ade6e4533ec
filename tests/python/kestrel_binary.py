"""Locating the `kestrel` binary the Python tests drive: $KESTREL_BIN (the test command sets it), else
build/src/kestrel; the tests skip when neither exists (a Python-only checkout) and fail on a KESTREL_BIN that is not
an executable."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def kestrel_bin() -> str:
    path = os.environ.get("KESTREL_BIN")
    if path:
        if not os.access(path, os.X_OK):
            pytest.fail(f"KESTREL_BIN={path} is not an executable")
        return path
    default = REPO / "build" / "src" / "kestrel"
    if not os.access(default, os.X_OK):
        pytest.skip(f"no kestrel binary at {default} (build it or set KESTREL_BIN)")
    return str(default)
