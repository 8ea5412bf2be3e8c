"""Read a llama.cpp GGUF file as a HuggingFace-style checkpoint.

A `GGUFCheckpoint` gives what the HuggingFace-style loader consumes from a model directory:

- `hf_config`: a `config.json`-style dict built from the GGUF metadata;
- `iter_tensors(dtype)`: every tensor under its HuggingFace checkpoint name (the names that
  `save_pretrained` writes, with one tensor per expert), dequantised and in PyTorch layout.

Dequantisation is done by the `gguf` package (`gguf.quants.dequantize`), never by hand.

The file is read through `gguf_header.GGUFHeader` (metadata decoded on demand, tensor data
as views of one read-only memory map). Layout conventions (from the GGUF spec):
- GGUF lists dimensions fastest-varying first (ggml `ne[0]` is the row length), the reverse of
  numpy/PyTorch. A HF linear weight `[out, in]` is stored with GGUF shape `[in, out]`; the
  reader's `data` (and `dequantize`'s result) is already in numpy order `[out, in]`.
- Stacked experts (`ffn_*_exps`) have GGUF shape `[in, out, num_experts]`, numpy
  `[num_experts, out, in]`; they are split into `num_experts` HF tensors `[out, in]`.
- llama.cpp permutes the rows of `q_proj`/`k_proj` for arch `llama` (GPT-J style interleaved
  rotary pairs instead of HF's rotate-half halves); `iter_tensors` undoes it. Source:
  llama.cpp `convert_hf_to_gguf.py`, `LlamaModel.permute`. The `qwen2`, `qwen2moe`,
  `qwen3moe` and `olmoe` converters do not permute (their llama.cpp rope type is NEOX).
- `deepseek2` (DeepSeek-V2 and -V3) is not permuted either; its MLA metadata, V2/V3 routing
  and the split `attn_k_b`/`attn_v_b` form of kv_b_proj are read by `gguf_deepseek2`.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from specmoe.kernels.gguf_gemm import GGUFWeight
from specmoe.loader.gguf_deepseek2 import deepseek2_config, merge_kv_b
from specmoe.loader.gguf_header import GGUFHeader, TensorInfo
from specmoe.loader.gguf_names import (
    FAMILIES,
    GLOBAL_NAMES,
    LEGACY_EXPERT_BASES,
    SKIPPED_BLOCK,
    SKIPPED_GLOBAL,
)

# Values of `general.architecture` this module reads. Mixtral-style MoE GGUFs use `llama`
# with `llama.expert_count` > 0.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "olmoe", "deepseek2")


_BLOCK_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.(?P<base>\w+?)(?:\.(?P<expert>\d+))?\.(?P<kind>weight|bias)")



@dataclass(frozen=True, slots=True)
class _TensorPlan:
    """What to do with one GGUF tensor."""

    gguf_name: str
    hf_names: tuple[str, ...]  # one name, or one per expert for a stacked tensor
    num_rope_heads: int | None  # undo LlamaModel.permute with this many heads
    is_stacked: bool  # [num_experts, out, in] -> num_experts tensors
    expert_index: int | None  # legacy per-expert tensor: its expert
    is_row_vector: bool  # [hidden] -> [1, hidden] (shared_expert_gate)
    kv_b_parts: tuple[str, str] | None = None  # MLA: merge these attn_k_b, attn_v_b tensors


class GGUFCheckpoint:
    """A GGUF file read as a HuggingFace checkpoint (config dict + named tensors).

    Args:
        path: the `.gguf` file (a single file; split GGUFs are not supported).

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: `path` is not a regular file or not a readable GGUF file; its
            `general.architecture` is missing or not in `SUPPORTED_ARCHITECTURES`; or it holds
            a tensor this module cannot name in HuggingFace terms (all such names are listed),
            or (`deepseek2`) a layer's `attn_k_b` without its `attn_v_b` or the reverse.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.architecture = self._architecture()
        self._family = FAMILIES[self._family_name()]
        self._plans = self._build_plans()

    # ---------------------------------------------------------------- metadata

    def metadata(self, key: str, default: Any = None) -> Any:
        """The value of GGUF metadata `key` (int, float, bool, str or list), or `default`."""
        field = self._reader.get_field(key)
        if field is None:
            return default
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            return float(str(np.float32(value)))  # shortest repr: 1e-05, not 9.9999997e-06
        if isinstance(value, np.generic):
            return value.item()
        return value

    def _arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.metadata(f"{self.architecture}.{suffix}", default)

    def _architecture(self) -> str:
        arch = self.metadata("general.architecture")
        if arch is None:
            raise ValueError(f"{self.path}: GGUF file has no 'general.architecture' metadata")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: unsupported GGUF architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        return arch

    def _family_name(self) -> str:
        if self.architecture == "llama" and (self._arch_key("expert_count") or 0) > 0:
            return "mixtral"
        return self.architecture

    @property
    def hf_config(self) -> dict[str, Any]:
        """A HuggingFace `config.json`-style dict (JSON-serialisable) built from the metadata.

        Raises:
            ValueError: a required metadata key is missing (the message names it), the rope
                scaling type is neither `linear` nor `yarn`, or (`deepseek2`) the expert
                gating function is neither softmax nor sigmoid.
        """
        config = self._base_config()
        config.update(self._rope_config())
        if self.architecture == "deepseek2":
            config.update(deepseek2_config(str(self.path), self._arch_key, self._required, config.get("rope_scaling")))
        else:
            config.update(self._moe_config())
        config.update(self._token_id_config())
        return config

    def _base_config(self) -> dict[str, Any]:
        hidden_size = self._required("embedding_length")
        num_heads = self._required("attention.head_count")
        is_qwen2 = self.architecture in ("qwen2", "qwen2moe")
        return {
            "architectures": [self._family.hf_architecture],
            "model_type": self._family.model_type,
            "vocab_size": self._vocab_size(),
            "hidden_size": hidden_size,
            "intermediate_size": self._intermediate_size(),
            "num_hidden_layers": self._required("block_count"),
            "num_attention_heads": num_heads,
            "num_key_value_heads": self._arch_key("attention.head_count_kv", num_heads),
            "head_dim": self._arch_key("attention.key_length", hidden_size // num_heads),
            "hidden_act": "silu",
            "rms_norm_eps": self._arch_key("attention.layer_norm_rms_epsilon", 1e-6),
            "max_position_embeddings": self._arch_key("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": is_qwen2 or any(f"blk.0.{b}.bias" in self._tensors for b in ("attn_q", "attn_kv_a_mqa")),
        }

    def _required(self, suffix: str) -> Any:
        value = self._arch_key(suffix)
        if value is None:
            raise ValueError(f"{self.path}: missing GGUF metadata '{self.architecture}.{suffix}'")
        return value

    def _vocab_size(self) -> int:
        vocab_size = self._arch_key("vocab_size")
        if vocab_size is None:
            tokens = self._reader.get_field("tokenizer.ggml.tokens")  # its length, not decoded
            vocab_size = tokens.count if tokens is not None else self._gguf_rows("token_embd.weight")
        return int(vocab_size)

    def _gguf_rows(self, name: str) -> int | None:
        """Rows (out features) of a GGUF matrix: GGUF shape [in, out, ...] -> out."""
        tensor = self._tensors.get(name)
        return None if tensor is None else int(tensor.shape[1])

    def _intermediate_size(self) -> int | None:
        size = self._arch_key("feed_forward_length")
        if self._family.model_type in ("mixtral", "olmoe"):  # HF uses it as the expert size
            size = self._arch_key("expert_feed_forward_length", size) or self._gguf_rows("blk.0.ffn_gate_exps.weight")
        return size if size is not None else self._gguf_rows("blk.0.ffn_gate.weight")

    def _rope_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"rope_theta": float(self._arch_key("rope.freq_base", 10000.0))}
        scaling_type = self._arch_key("rope.scaling.type")
        factor = self._arch_key("rope.scaling.factor")
        if scaling_type is None and self._arch_key("rope.scale_linear") is not None:
            scaling_type, factor = "linear", self._arch_key("rope.scale_linear")
        if scaling_type in (None, "none") or factor in (None, 1.0):
            return config
        if scaling_type == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        elif scaling_type == "yarn":
            original = self._arch_key("rope.scaling.original_context_length")
            config["rope_scaling"] = {"rope_type": "yarn", "factor": float(factor)}
            if original is not None:
                config["rope_scaling"]["original_max_position_embeddings"] = int(original)
        else:
            raise ValueError(
                f"{self.path}: unsupported rope scaling type {scaling_type!r}; supported: linear, yarn, none"
            )
        return config

    def _moe_config(self) -> dict[str, Any]:
        num_experts = self._arch_key("expert_count") or 0
        if num_experts == 0:
            return {}
        model_type = self._family.model_type
        config: dict[str, Any] = {"num_experts_per_tok": self._required("expert_used_count")}
        config["num_local_experts" if model_type == "mixtral" else "num_experts"] = num_experts
        if model_type in ("qwen2_moe", "qwen3_moe"):
            config["moe_intermediate_size"] = self._arch_key("expert_feed_forward_length") or self._gguf_rows(
                "blk.0.ffn_gate_exps.weight"
            )
        if model_type == "qwen3_moe":
            config["norm_topk_prob"] = bool(self._arch_key("expert_weights_norm", True))
        if model_type in ("qwen2_moe", "olmoe"):
            config["norm_topk_prob"] = False
        if model_type == "qwen2_moe":
            config["shared_expert_intermediate_size"] = self._arch_key(
                "expert_shared_feed_forward_length"
            ) or self._gguf_rows("blk.0.ffn_gate_shexp.weight")
        return config

    def _token_id_config(self) -> dict[str, Any]:
        config = {}
        for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
            value = self.metadata(f"tokenizer.ggml.{gguf_key}")
            if value is not None:
                config[hf_key] = int(value)
        return config

    @property
    def rope_freq_factors(self) -> torch.Tensor | None:
        """llama.cpp's `rope_freqs` tensor, or None when the file has none.

        Returns:
            float32 tensor [head_dim // 2]: per-dimension divisors of the rotary frequencies
            (llama.cpp divides theta_i by factor_i). Written by the converter for Llama 3.x
            "llama3" rope scaling, whose parameters the GGUF metadata does not keep, so they
            are not in `hf_config`.
        """
        tensor = self._tensors.get("rope_freqs.weight")
        return None if tensor is None else torch.from_numpy(_dequantize(tensor))

    # ---------------------------------------------------------------- tensors

    def _build_plans(self) -> list[_TensorPlan]:
        plans: list[_TensorPlan] = []
        unknown: list[str] = []
        for name in self._tensors:
            if name in SKIPPED_GLOBAL:
                continue
            plan = self._plan_global(name) or self._plan_block(name)
            if plan is None:
                unknown.append(name)
            elif plan.hf_names:
                plans.append(plan)
        if unknown:
            raise ValueError(
                f"{self.path}: GGUF tensors with no HuggingFace name for architecture "
                f"{self._family.hf_architecture}: {', '.join(unknown)}"
            )
        return plans

    def _plan_global(self, name: str) -> _TensorPlan | None:
        hf_name = GLOBAL_NAMES.get(name)
        if hf_name is None:
            return None
        return _TensorPlan(name, (hf_name,), None, False, None, False)

    def _plan_block(self, name: str) -> _TensorPlan | None:
        match = _BLOCK_TENSOR.fullmatch(name)
        if match is None:
            return None
        base, kind, expert = match["base"], match["kind"], match["expert"]
        if base in SKIPPED_BLOCK:
            return _TensorPlan(name, (), None, False, None, False)
        prefix = f"model.layers.{match['layer']}."
        if expert is not None:  # legacy per-expert tensor
            template = self._family.expert_names.get(LEGACY_EXPERT_BASES.get(base, ""))
            if template is None:
                return None
            hf_name = f"{prefix}{template.format(e=int(expert))}.{kind}"
            return _TensorPlan(name, (hf_name,), None, False, int(expert), False)
        if (template := self._family.expert_names.get(base)) is not None:
            num_experts = int(self._tensors[name].shape[-1])  # GGUF [in, out, num_experts]
            hf_names = tuple(f"{prefix}{template.format(e=e)}.{kind}" for e in range(num_experts))
            return _TensorPlan(name, hf_names, None, True, None, False)
        if self._family.has_split_kv_b and base in ("attn_k_b", "attn_v_b"):
            return self._plan_split_kv_b(name, base, match["layer"], prefix)
        if (whole_name := (self._family.whole_names or {}).get(base)) is not None:
            return _TensorPlan(name, (prefix + whole_name,), None, False, None, False)
        if (hf_base := self._family.block_names.get(base)) is None:
            return None
        return _TensorPlan(
            name, (f"{prefix}{hf_base}.{kind}",), self._num_rope_heads(base), False, None, base == "ffn_gate_inp_shexp"
        )

    def _plan_split_kv_b(self, name: str, base: str, layer: str, prefix: str) -> _TensorPlan:
        """kv_b_proj from attn_k_b + attn_v_b, planned on attn_k_b; nothing from attn_v_b, or
        from either when the file also has attn_kv_b (which then gives kv_b_proj)."""
        k_b, v_b = f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"
        partner = v_b if base == "attn_k_b" else k_b
        if f"blk.{layer}.attn_kv_b.weight" in self._tensors:
            return _TensorPlan(name, (), None, False, None, False)
        if partner not in self._tensors:
            raise ValueError(f"{self.path}: {name} without {partner}: cannot rebuild kv_b_proj")
        if base == "attn_v_b":
            return _TensorPlan(name, (), None, False, None, False)
        return _TensorPlan(name, (f"{prefix}self_attn.kv_b_proj.weight",), None, False, None, False, (k_b, v_b))

    def _num_rope_heads(self, base: str) -> int | None:
        if not self._family.is_rope_permuted or base not in ("attn_q", "attn_k"):
            return None
        num_heads = self._required("attention.head_count")
        return num_heads if base == "attn_q" else self._arch_key("attention.head_count_kv", num_heads)

    def tensor_names_hf(self) -> list[str]:
        """The HuggingFace checkpoint names of all tensors, in file order (experts expanded)."""
        return [hf_name for plan in self._plans for hf_name in plan.hf_names]

    def iter_tensors(self, dtype: torch.dtype, keep_types: frozenset = frozenset()
                     ) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
        """Yield `(hf_name, tensor)` for every tensor, dequantised to `dtype` on the CPU;
        matrices whose type is in `keep_types` come as `GGUFTensor`s (the file's blocks,
        copied out of the mapping, rows in HF order) instead.

        Shapes are the HuggingFace ones: linear weights [out, in], biases and norms [n],
        embeddings [vocab_size, hidden_size], router `gate` [num_experts, hidden_size],
        `shared_expert_gate` [1, hidden_size]; stacked experts become `num_experts` separate
        (non-aliasing) [out, in] tensors. For arch `llama`, q_proj/k_proj rows are returned in
        HF order (llama.cpp's `LlamaModel.permute` undone). For `deepseek2`, kv_b_proj
        [H * (qk_nope + v), kv_lora_rank] is rebuilt from attn_k_b and attn_v_b when the file
        splits it, and the V3 router's e_score_correction_bias is [num_experts].

        Raises:
            NotImplementedError: from `gguf.quants.dequantize` for a quantisation type the
                `gguf` package cannot dequantise.
            ValueError: (`deepseek2`) attn_k_b and attn_v_b shapes that do not split one kv_b.
        """
        for plan in self._plans:
            kept = self._kept_blocks(plan, keep_types)
            if kept is not None:
                yield from kept
                continue
            if plan.kv_b_parts is not None:
                array = merge_kv_b(*(_dequantize(self._tensors[part]) for part in plan.kv_b_parts))
            else:
                array = _dequantize(self._tensors[plan.gguf_name])  # float32, numpy order
            for name in plan.kv_b_parts or (plan.gguf_name,):
                self._release(self._tensors[name])
            if plan.num_rope_heads is not None:
                array = undo_llama_rope_permute(array, plan.num_rope_heads)
            if plan.is_row_vector and array.ndim == 1:
                array = array[None, :]  # [1, hidden_size]
            tensor = torch.from_numpy(array).to(dtype)
            if plan.is_stacked:  # [num_experts, out, in]
                for expert, hf_name in enumerate(plan.hf_names):
                    yield hf_name, tensor[expert].clone()
            else:
                yield plan.hf_names[0], tensor


    def _kept_blocks(self, plan: _TensorPlan, keep_types: frozenset
                     ) -> list[tuple[str, GGUFTensor]] | None:
        """The plan's tensor as `GGUFTensor`s (one per expert of a stack), or None when its
        type is not kept or it is not a plain matrix."""
        tensor = self._tensors[plan.gguf_name]
        if (tensor.tensor_type not in keep_types or plan.kv_b_parts is not None
                or plan.is_row_vector or len(tensor.shape) not in (2, 3)):
            return None
        blocks = np.array(tensor.data)  # [out, row_bytes] or [experts, out, row_bytes]
        self._release(tensor)
        if plan.num_rope_heads is not None:
            blocks = undo_llama_rope_permute(blocks, plan.num_rope_heads)
        weight = GGUFWeight(int(tensor.tensor_type), torch.from_numpy(blocks), int(tensor.shape[0]))
        if not plan.is_stacked:
            return [(plan.hf_names[0], GGUFTensor(weight))]
        return [(name, GGUFTensor(weight.expert(e), weight, e))
                for e, name in enumerate(plan.hf_names)]

    def _release(self, tensor: TensorInfo) -> None:
        """Drop the file's pages under `tensor` from this process's resident memory once it
        is read (MADV_DONTNEED on the reader's read-only mapping: the page cache keeps them,
        and a later read maps them again), so reading a file larger than the memory left
        never holds it whole."""
        mapping = self._reader.mapping
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
        end = min(len(mapping), tensor.data_offset + tensor.n_bytes)
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


@dataclass(frozen=True)
class GGUFTensor:
    """A checkpoint matrix kept as GGUF blocks (`iter_tensors(keep_types=...)`): `weight`
    [out, in] (an expert's view of `stack` for a stacked tensor, expert `expert`)."""

    weight: GGUFWeight
    stack: GGUFWeight | None = None
    expert: int | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.weight.out_features, self.weight.in_features))

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def to(self, device: torch.device) -> "GGUFTensor":
        """Itself on the CPU.

        Raises:
            ValueError: another device (the blocks run on the CPU kernel).
        """
        if torch.device(device).type != "cpu":
            raise ValueError(f"GGUF blocks run on the CPU, not {device}: load with "
                             "quantization=None to dequantise them for another device")
        return self

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The values as [out, in] in `dtype` (the file's exact values, rounded to dtype)."""
        return self.weight.dequantize().to(dtype)


def _open_reader(path: Path) -> GGUFHeader:
    """The file's header; its errors name `path` (`GGUFHeader` checks the magic)."""
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{path} is not a file; expected a .gguf file")
    return GGUFHeader(path)


def _dequantize(tensor: TensorInfo) -> np.ndarray:
    """Dequantise one GGUF tensor to a float32 array in numpy order (GGUF dims reversed)."""
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if np.may_share_memory(array, tensor.data):  # F32 is a view of the read-only memmap
        array = array.copy()
    return np.asarray(array, dtype=np.float32).reshape(shape)


def undo_llama_rope_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's rotary row permutation of a q_proj/k_proj weight or bias.

    Source: llama.cpp `convert_hf_to_gguf.py`, `LlamaModel.permute`, which writes
    `w.reshape(n_head, 2, dim // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`
    (HF rotate-half order -> interleaved pairs), with `n_head` = num_attention_heads for q and
    num_key_value_heads for k. This is the inverse: view rows as [n_head, head_dim // 2, 2]
    and swap back.

    Args:
        weight: [num_heads * head_dim, ...] in GGUF (interleaved) row order.
        num_heads: heads the rows belong to.

    Returns:
        Array of the same shape and dtype in HuggingFace row order.

    Raises:
        ValueError: the row count is not a multiple of 2 * num_heads.
    """
    num_rows = weight.shape[0]
    if num_heads <= 0 or num_rows % (2 * num_heads) != 0:
        raise ValueError(f"cannot undo rope permutation: {num_rows} rows is not a multiple of 2 * {num_heads} heads")
    half_head_dim = num_rows // num_heads // 2
    return weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


TOKENIZER_CACHE_ENV = "SPECMOE_TOKENIZER_CACHE_DIR"
DEFAULT_TOKENIZER_CACHE = "~/.cache/specmoe/tokenizers"


def tokenizer_cache_dir() -> Path | None:
    """`$SPECMOE_TOKENIZER_CACHE_DIR` (`off`: no cache), else ~/.cache/specmoe/tokenizers."""
    value = os.environ.get(TOKENIZER_CACHE_ENV, "").strip()
    if value.lower() == "off":
        return None
    return Path(value or DEFAULT_TOKENIZER_CACHE).expanduser()


def load_gguf_tokenizer(path: str | os.PathLike) -> Any:
    """Build the HF tokenizer stored in a GGUF file, offline (local file only), through an
    on-disk cache.

    Building it means transformers parsing the whole file's metadata (seconds for a
    150k-token vocabulary), so the built tokenizer is saved (`save_pretrained`) under
    `tokenizer_cache_dir()` in a folder keyed by the file's resolved path, size, mtime and a
    hash of its first MiB; the next load of the same unchanged file reads that folder. A
    changed file gets a new key; a cache folder that fails to load is rebuilt; deleting the
    cache is always safe.

    The build: `transformers.AutoTokenizer.from_pretrained(dirname, gguf_file=basename,
    local_files_only=True)`. AutoTokenizer first builds a model config from the GGUF and
    refuses architectures transformers cannot load from GGUF (e.g. `olmoe`); then the
    architecture-independent `PreTrainedTokenizerFast` builder is used on the same metadata.

    Returns:
        A transformers fast tokenizer.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: transformers cannot build a tokenizer from the file's metadata (the
            AutoTokenizer error, with the fallback's error chained).
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    root = tokenizer_cache_dir()
    cached = None if root is None else root / _tokenizer_key(path)
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        with contextlib.suppress(OSError, ValueError):
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
    tokenizer = _build_gguf_tokenizer(path)
    if cached is not None:
        _save_atomically(tokenizer, cached)
    return tokenizer


def _tokenizer_key(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
    return f"{path.stem[:64]}-{digest.hexdigest()[:24]}"


def _save_atomically(tokenizer, folder: Path) -> None:
    """Save into a temporary sibling, then rename: a reader never sees half a folder. A
    cache that cannot be written (read-only home, full disk, another process first) is
    only skipped."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    except OSError:
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_gguf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory, name = str(path.parent), path.name
    try:
        return AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except ValueError as auto_error:
        try:
            return PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name,
                                                           local_files_only=True)
        except (ValueError, KeyError) as fallback_error:
            raise auto_error from fallback_error
