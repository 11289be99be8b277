"""Which weights a model has: a short hash of its folder's safetensors files."""

from __future__ import annotations

import hashlib
from pathlib import Path


def weights_hash(folder: Path | str) -> str | None:
    """Short sha256 of a model folder's weights (None where the folder holds no safetensors):
    identifies a model beyond its name, whatever dtype it is later loaded in."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]
