"""Tiny checkpoints with one fault planted, for the loader's tests (``qwen_checkpoint`` in conftest)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file


def copy_with(src: Path, dst: Path, *, drop: str | None = None, add: dict | None = None,
              config: dict | None = None) -> Path:
    """A copy of the checkpoint folder ``src`` in ``dst`` with tensor ``drop`` removed, the tensors
    ``add`` added or replaced and the config keys ``config`` changed."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    if drop:
        del tensors[drop]
    tensors.update(add or {})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    for extra in ("hf_quant_config.json",):
        if (src / extra).exists():
            (dst / extra).write_text((src / extra).read_text())
    return dst
