"""Architecture name -> model family (config parser and checkpoint mapping table)."""

from __future__ import annotations

from types import ModuleType

from specmoe.config import ArchConfig
from specmoe.models import deepseek, llama, mixtral, olmoe, qwen2_moe, qwen3, qwen3_moe

_FAMILIES: tuple[ModuleType, ...] = (llama, mixtral, qwen2_moe, qwen3, qwen3_moe, olmoe,
                                     deepseek)
_BY_ARCH = {arch: fam for fam in _FAMILIES for arch in fam.ARCHITECTURES}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)


def family_for(hf_config: dict) -> ModuleType:
    """The family module for a config.json dict.

    Raises:
        ValueError: naming the architecture and listing the supported ones.
    """
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    raise ValueError(f"unsupported architecture {archs or hf_config.get('model_type')!r}: "
                     f"supported are {', '.join(supported_architectures())}")


def parse_arch_config(hf_config: dict) -> ArchConfig:
    """Parse a config.json dict into an ArchConfig with its family's parser."""
    return family_for(hf_config).parse_config(hf_config)
