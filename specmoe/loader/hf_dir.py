"""Reading a HuggingFace model directory: config.json and *.safetensors shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def read_hf_config(model_dir: Path) -> dict:
    """The parsed config.json of `model_dir`.

    Raises:
        FileNotFoundError: when config.json is missing.
    """
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a HuggingFace model directory: "
                                "no config.json")
    return json.loads(path.read_text())


def safetensors_files(model_dir: Path) -> list[Path]:
    """The directory's safetensors shards, sorted.

    Raises:
        FileNotFoundError: when there are none (.bin checkpoints are not supported).
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (PyTorch .bin "
                                "checkpoints are not supported)")
    return files


def iter_safetensors(model_dir: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard as (checkpoint name, tensor in `dtype` on CPU)."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)
