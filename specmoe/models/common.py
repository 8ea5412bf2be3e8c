"""Parsing the fields every family shares from a HuggingFace config.json dict."""

from __future__ import annotations

from typing import Any

from specmoe.config import MoEConfig


def required(hf: dict, *names: str) -> Any:
    """The first present of `names` in `hf`.

    Raises:
        ValueError: naming the missing field(s) and the architecture.
    """
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    arch = (hf.get("architectures") or ["?"])[0]
    raise ValueError(f"config.json of {arch} lacks {' or '.join(names)}")


def rope_fields(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the transformers-4 fields (`rope_theta`,
    `rope_scaling`) or the transformers-5 `rope_parameters` dict."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    scaling = hf.get("rope_scaling") or params or None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


def eos_ids(hf: dict) -> list[int]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [int(eos)]


def common_fields(hf: dict) -> dict:
    """ArchConfig keyword arguments shared by all Llama-style families."""
    hidden = required(hf, "hidden_size")
    heads = required(hf, "num_attention_heads")
    theta, scaling = rope_fields(hf)
    return dict(
        architecture=required(hf, "architectures")[0],
        vocab_size=required(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=required(hf, "intermediate_size"),
        num_hidden_layers=required(hf, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
    )


def sparse_layers(hf: dict, num_layers: int) -> list[int]:
    """Layers with an MoE block under Qwen-MoE's `decoder_sparse_step` / `mlp_only_layers`."""
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or [])
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


def reject_sliding_window(hf: dict) -> None:
    """Raise ValueError for Qwen-style `use_sliding_window`, whose per-layer windows
    (`max_window_layers`, `layer_types`) we do not implement."""
    if hf.get("use_sliding_window"):
        arch = (hf.get("architectures") or ["?"])[0]
        raise ValueError(f"{arch} with use_sliding_window=true is not supported")


def qwen_moe_config(hf: dict, num_layers: int, shared_size: int = 0) -> MoEConfig:
    """The MoEConfig of Qwen2-MoE / Qwen3-MoE configs (fine-grained experts, optional
    shared expert with a sigmoid gate, `norm_topk_prob` off unless set)."""
    return MoEConfig(
        num_experts=required(hf, "num_experts", "num_local_experts"),
        top_k=required(hf, "num_experts_per_tok"),
        moe_intermediate_size=required(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared_size,
        has_shared_expert_gate=shared_size > 0,
        moe_layers=sparse_layers(hf, num_layers))
