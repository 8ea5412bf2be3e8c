"""Random-weight GGUF files with the exact shape, tensor names and metadata of real models
(`specmoe models synth --like NAME --type TYPE --out FILE`).

The speed of a forward depends on the shapes and bytes it reads, not on the values, so a file
of the real shape with seeded random weights times like the real model; only routing and
acceptance need real weights. The layout is llama.cpp's (`convert_hf_to_gguf.py`): tensor
names `token_embd`, `blk.{i}.attn_q`, ..., routed experts stacked as `ffn_{gate,up,down}_exps`
[experts, out, in], the metadata keys of each llama.cpp architecture, 1-D tensors (norms) and
routers in F32, every other matrix in the requested type (quantised by the `gguf` package:
F32, F16, BF16, Q8_0, Q4_0, Q4_1; the K-quants need llama.cpp's own quantiser). The file is
written tensor by tensor (routed experts expert by expert), so memory stays at one expert's
float32 weights whatever the model's size.

The tokenizer is a donor GGUF's (`tokenizer_from`, default the bundled SmolLM2), its token
list padded with control tokens to the shape's vocabulary, so text prompts work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from specmoe.utils import progress

# Matrices in the requested type; these stay F32 as llama.cpp keeps them (precision).
_F32_MATRICES = ("ffn_gate_inp",)
TYPES = {name: gguf.GGMLQuantizationType[name]
         for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")}


@dataclass(frozen=True)
class GGUFShape:
    """A model's shape in llama.cpp's terms.

    Attributes:
        arch: llama.cpp architecture ("qwen3moe", "olmoe", "llama" for Mixtral too).
        intermediate_size: width of a dense MLP (llama.cpp's feed_forward_length; for
            Mixtral, written as llama.cpp does, its experts' width).
        num_experts, top_k, expert_ffn: routed experts (0: a dense model), their width
            (0: written only as feed_forward_length, as llama.cpp does for Mixtral).
        qk_norm: "none", "per_head" (Qwen3: RMSNorm over head_dim) or "full" (OLMoE).
        norm_topk_prob: renormalise the top-k routing weights.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    context_length: int
    rope_theta: float
    rms_eps: float
    num_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    norm_topk_prob: bool = True
    qk_norm: str = "none"

    @property
    def moe_ffn(self) -> int:
        return self.expert_ffn or self.intermediate_size


# The shapes of the MoEs people run (their published config.json values).
LIKE = {
    "qwen3-30b-a3b": GGUFShape("qwen3moe", vocab_size=151936, hidden_size=2048, num_layers=48,
                               num_heads=32, num_kv_heads=4, head_dim=128,
                               intermediate_size=6144, context_length=40960,
                               rope_theta=1e6, rms_eps=1e-6, num_experts=128, top_k=8,
                               expert_ffn=768, qk_norm="per_head"),
    "olmoe-1b-7b": GGUFShape("olmoe", vocab_size=50304, hidden_size=2048, num_layers=16,
                             num_heads=16, num_kv_heads=16, head_dim=128,
                             intermediate_size=1024, context_length=4096, rope_theta=10000.0,
                             rms_eps=1e-5, num_experts=64, top_k=8, expert_ffn=1024,
                             norm_topk_prob=False, qk_norm="full"),
    "mixtral-8x7b": GGUFShape("llama", vocab_size=32000, hidden_size=4096, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128,
                              intermediate_size=14336, context_length=32768, rope_theta=1e6,
                              rms_eps=1e-5, num_experts=8, top_k=2),
}


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the file: GGUF name, numpy shape ([experts,] out, in), its type, and
    the standard deviation of its random values (0: ones, as a norm's weight)."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    std: float

    @property
    def num_params(self) -> int:
        return int(np.prod(self.shape))


def shape_like(name: str, **overrides) -> GGUFShape:
    """`LIKE[name]`, with `overrides` replacing fields (a smaller model of the same layout).

    Raises:
        ValueError: an unknown name.
    """
    if name not in LIKE:
        raise ValueError(f"unknown model shape {name!r}: choose one of {sorted(LIKE)}")
    return dataclasses.replace(LIKE[name], **overrides)


def plan_tensors(shape: GGUFShape, qtype: gguf.GGMLQuantizationType) -> list[PlannedTensor]:
    """Every tensor of a file of `shape`, in llama.cpp's order."""
    matrix = _matrix(qtype)
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    out = [matrix("token_embd.weight", (shape.vocab_size, h), 1.0)]
    for i in range(shape.num_layers):
        b = f"blk.{i}."
        out += [PlannedTensor(b + "attn_norm.weight", (h,), TYPES["F32"], 0.0),
                matrix(b + "attn_q.weight", (q, h)), matrix(b + "attn_k.weight", (kv, h)),
                matrix(b + "attn_v.weight", (kv, h)), matrix(b + "attn_output.weight", (h, q))]
        out += _qk_norms(b, shape)
        out.append(PlannedTensor(b + "ffn_norm.weight", (h,), TYPES["F32"], 0.0))
        out += _ffn(b, shape, matrix)
    out += [PlannedTensor("output_norm.weight", (h,), TYPES["F32"], 0.0),
            matrix("output.weight", (shape.vocab_size, h))]
    return out


def _matrix(qtype: gguf.GGMLQuantizationType):
    def make(name: str, shape: tuple[int, ...], std: float | None = None) -> PlannedTensor:
        kind = TYPES["F32"] if name.split(".")[-2] in _F32_MATRICES else qtype
        return PlannedTensor(name, shape, kind, shape[-1] ** -0.5 if std is None else std)
    return make


def _qk_norms(b: str, shape: GGUFShape) -> list[PlannedTensor]:
    if shape.qk_norm == "none":
        return []
    q, k = ((shape.head_dim, shape.head_dim) if shape.qk_norm == "per_head" else
            (shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim))
    return [PlannedTensor(b + "attn_q_norm.weight", (q,), TYPES["F32"], 0.0),
            PlannedTensor(b + "attn_k_norm.weight", (k,), TYPES["F32"], 0.0)]


def _ffn(b: str, shape: GGUFShape, matrix) -> list[PlannedTensor]:
    h = shape.hidden_size
    if not shape.num_experts:
        f = shape.intermediate_size
        return [matrix(b + "ffn_gate.weight", (f, h)), matrix(b + "ffn_up.weight", (f, h)),
                matrix(b + "ffn_down.weight", (h, f))]
    e, f = shape.num_experts, shape.moe_ffn
    return [matrix(b + "ffn_gate_inp.weight", (e, h)),
            matrix(b + "ffn_gate_exps.weight", (e, f, h)),
            matrix(b + "ffn_up_exps.weight", (e, f, h)),
            matrix(b + "ffn_down_exps.weight", (e, h, f))]


def write_like(shape: GGUFShape, qtype_name: str, out: str | Path, tokenizer_from: Path,
               seed: int = 0, name: str = "synthetic") -> Path:
    """Write a GGUF file of `shape` with seeded random weights in `qtype_name` to `out`,
    tensor by tensor (progress through `utils.progress`), with `tokenizer_from`'s (a GGUF
    file's) tokenizer padded to the shape's vocabulary.

    Raises:
        ValueError: an unknown type, a donor tokenizer larger than the vocabulary, or
            `out` naming a directory.
    """
    if qtype_name not in TYPES:
        raise ValueError(f"unknown GGUF type {qtype_name!r}: choose one of {sorted(TYPES)} "
                         "(K-quants: quantise an F16 file with llama.cpp's llama-quantize)")
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory: synth --like writes one .gguf file")
    plan = plan_tensors(shape, TYPES[qtype_name])
    writer = gguf.GGUFWriter(out, shape.arch)
    _add_metadata(writer, shape, name)
    _add_tokenizer(writer, tokenizer_from, shape.vocab_size)
    for t in plan:
        byte_shape = gguf.quant_shape_to_byte_shape(t.shape, t.qtype) if _is_quantised(t) \
            else t.shape
        dtype = np.uint8 if _is_quantised(t) else _NUMPY[t.qtype]
        nbytes = int(np.prod(byte_shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(t.name, byte_shape, np.dtype(dtype), nbytes,
                               raw_dtype=t.qtype if _is_quantised(t) else None)
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    report = progress.current()
    for t, data in report.items(((t, _values(t, rng)) for t in plan), f"writing {out.name}",
                                size=lambda item: item[1].nbytes):
        writer.write_tensor_data(data)
    writer.close()
    return out


_NUMPY = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


def _is_quantised(t: PlannedTensor) -> bool:
    return t.qtype not in _NUMPY


def _values(t: PlannedTensor, rng: np.random.Generator) -> np.ndarray:
    """The tensor's data as written: ones for a norm, else N(0, std^2) values in its type;
    stacked experts are made one expert at a time (bounded memory)."""
    if t.std == 0.0:
        return np.ones(t.shape, dtype=np.float32)
    if len(t.shape) == 3:
        return np.stack([_values(dataclasses.replace(t, shape=t.shape[1:]), rng)
                         for _ in range(t.shape[0])])
    values = rng.standard_normal(t.shape, dtype=np.float32) * np.float32(t.std)
    if t.qtype in _NUMPY:
        return values.astype(_NUMPY[t.qtype])
    return gguf.quants.quantize(values, t.qtype)


def _add_metadata(writer: gguf.GGUFWriter, s: GGUFShape, name: str) -> None:
    writer.add_name(name)
    writer.add_block_count(s.num_layers)
    writer.add_context_length(s.context_length)
    writer.add_embedding_length(s.hidden_size)
    writer.add_feed_forward_length(s.intermediate_size)
    writer.add_head_count(s.num_heads)
    writer.add_head_count_kv(s.num_kv_heads)
    if s.head_dim != s.hidden_size // s.num_heads:
        writer.add_key_length(s.head_dim)
        writer.add_value_length(s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.rms_eps)
    writer.add_vocab_size(s.vocab_size)
    if s.num_experts:
        writer.add_expert_count(s.num_experts)
        writer.add_expert_used_count(s.top_k)
        if s.expert_ffn:
            writer.add_expert_feed_forward_length(s.expert_ffn)
        if s.arch == "qwen3moe":
            writer.add_expert_weights_norm(s.norm_topk_prob)


def _add_tokenizer(writer: gguf.GGUFWriter, donor: Path, vocab_size: int) -> None:
    """The donor GGUF's tokenizer fields, its tokens padded to `vocab_size`."""
    reader = gguf.GGUFReader(donor)

    def field(key: str):
        f = reader.get_field(key)
        return None if f is None else f.contents()
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    if tokens is None or len(tokens) > vocab_size:
        raise ValueError(f"{donor}: its tokenizer ({0 if tokens is None else len(tokens)} "
                         f"tokens) does not fit a vocabulary of {vocab_size}")
    pad = vocab_size - len(tokens)
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre") or "default")
    writer.add_token_list(list(tokens) + [f"<|synth_pad_{k}|>" for k in range(pad)])
    writer.add_token_types(list(types) + [gguf.TokenType.CONTROL] * pad)
    if (merges := field("tokenizer.ggml.merges")) is not None:
        writer.add_token_merges(list(merges))
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id)):
        if (value := field(f"tokenizer.ggml.{key}")) is not None:
            add(int(value))
    if (template := field("tokenizer.chat_template")) is not None:
        writer.add_chat_template(template)


def active_params(shape: GGUFShape) -> int:
    """Weights one token reads: all but the routed experts it is not routed to and the
    embedding (a row of it)."""
    plan = plan_tensors(shape, TYPES["F32"])
    routed = sum(t.num_params for t in plan if "_exps" in t.name)
    embed = shape.vocab_size * shape.hidden_size
    total = sum(t.num_params for t in plan)
    return total - embed - routed + routed * shape.top_k // max(shape.num_experts, 1)
