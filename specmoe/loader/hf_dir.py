"""Reading a HuggingFace model directory: config.json and *.safetensors shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


def read_hf_config(model_dir: Path) -> dict:
    """The parsed config.json of `model_dir`.

    Raises:
        FileNotFoundError: when config.json is missing.
        ValueError: naming the file, when it is not a JSON object.
    """
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a HuggingFace model directory: "
                                "no config.json")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object of "
                         "model settings")
    return config


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


def check_safetensors(model_dir: Path) -> list[Path]:
    """The directory's shards, each opened once so that a damaged one fails before anything
    is allocated (the library checks the header and that the file holds every tensor it
    lists).

    Raises:
        FileNotFoundError: no shards (`safetensors_files`).
        ValueError: naming the shard whose header or length is wrong.
    """
    files = safetensors_files(model_dir)
    for file in files:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except SafetensorError as exc:
            raise ValueError(f"{file} is not a readable safetensors file ({exc}); it may be "
                             "truncated or damaged") from None
    return files


def iter_safetensors(model_dir: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard as (checkpoint name, tensor in `dtype` on CPU).

    The shards are checked here, before the first tensor is asked for.

    Raises:
        FileNotFoundError, ValueError: as `check_safetensors`.
    """
    return _tensors(check_safetensors(model_dir), dtype)


# safetensors' dtype names (the format's header) and their torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _tensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Each shard's tensors in file order, each read into memory of its own. The library
    checked every header and length (`check_safetensors`); reading with file reads rather
    than through its memory map keeps the file's pages out of this process's resident
    memory, which would otherwise grow by the whole shard (5 GB for common shards)."""
    for file in files:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
                yield name, _read_tensor(f, 8 + header_len, info).to(dtype)


def _read_tensor(f, base: int, info: dict) -> torch.Tensor:
    start, end = info["data_offsets"]
    kind = _DTYPES.get(info["dtype"])
    if kind is None:
        raise ValueError(f"{f.name}: tensor dtype {info['dtype']} is not supported (one of "
                         f"{sorted(_DTYPES)})")
    if end == start:
        return torch.empty(info["shape"], dtype=kind)
    buf = bytearray(end - start)
    f.seek(base + start)
    f.readinto(buf)
    return torch.frombuffer(buf, dtype=kind).reshape(info["shape"])
