"""The decoder layers of a bf16 model on CPU in one native call per forward.

`DecoderModel.forward` runs its layers through `FusedLayers.try_run` when every layer is a
plain pre-norm block (`DecoderLayer` with grouped-query `Attention`: never DeepSeek's
Multi-head Latent Attention, whose latent cache the kernels do not read; no q/k clipping, no
per-head q/k norm, no hooks, one RoPE table) whose MLP is a `GatedMLP` or a sparse MoE block
the driver runs as its modules do (`specmoe.models.fused_moe`: the "fused" expert backend or
int4 quantised experts, no expert-stats recorder), whose projections are bf16 `Linear`s with
packed weights or (dense and shared-expert ones) `Int4Linear`s on our int4 kernel (at most
`gemv_int4.MAX_ROWS` rows then, as a draft model's steps have), and the kernels take the
shapes. Otherwise, and with the CPU kernels switched off, it runs the modules one by one,
which are the reference: the driver calls the same kernels with the same arguments
(`specmoe.kernels.decoder`), so the two give the same bits
(tests/models/test_fused_layers.py). Inputs the modules would reject (a position past the
RoPE table, a cache slot out of range) also go to the modules, which raise.

The pointer table is built at a model's first forward and checked in O(1) per forward
(walking ~1000 module attributes every forward is slow, once a decode step's weights have
flushed them from the caches): it is rebuilt when a KV cache, a forward hook or the number
of layers changes, when any module, parameter or buffer is assigned anywhere (torch's
global registration hooks bump `generation()`), and when a packed weight copy changes
(`PackedWeight.generation`). What those do not see: a tensor's storage swapped through
`.data` and plain attributes edited after the first forward (`clip_qkv`, `eps`, ...); call
`model.fused_layers.invalidate()` after such edits.
"""

from __future__ import annotations

import ctypes
import operator

import torch
from torch.nn.modules import module as torch_module

from specmoe.kernels import attention, decoder, gemv_int4, moe_common
from specmoe.kernels.gemv import PackedWeight
from specmoe.layers.attention import Attention
from specmoe.layers.linear import Linear
from specmoe.layers.mlp import GatedMLP
from specmoe.layers.norm import RMSNorm
from specmoe.layers.paged_attention import AttentionMetadata
from specmoe.layers.quantization import Int4Linear
from specmoe.layers.rotary import RotaryEmbedding
from specmoe.models import fused_moe
from specmoe.models.decoder_layer import DecoderLayer

BF16 = torch.bfloat16
# sources per layer: 4 norms (q and k: None unless OLMoE's), 4 x (weights, bias) (MLP ones
# None in a MoE layer), 2 caches, the MoE block's (None in a dense layer)
PER_LAYER = 14 + fused_moe.PER_MOE
MOE_AT = 14  # where a layer's MoE sources start

_enabled = True
_generation = 0  # module, parameter and buffer assignments seen anywhere


def _bump(*_) -> None:
    global _generation
    _generation += 1


for _register in (torch_module.register_module_module_registration_hook,
                  torch_module.register_module_parameter_registration_hook,
                  torch_module.register_module_buffer_registration_hook):
    _register(_bump)


def generation() -> tuple[int, int]:
    """What a table is current for: (module/parameter/buffer assignments, packed copy
    changes) so far."""
    return _generation, PackedWeight.generation


def set_enabled(enabled: bool) -> None:
    """Turn the fused path on or off for this process (off: the modules run one by one,
    as they do anyway with the CPU kernels off; for A/B timing and tests). An engine sets
    it from its `KernelConfig` around each step (`worker.kernel_switches`)."""
    global _enabled
    _enabled = bool(enabled)


def is_enabled() -> bool:
    """Whether the fused path is switched on (it may still not apply to a model)."""
    return _enabled


def _modules_of(layer) -> list:
    attn, mlp = layer.attn, layer.mlp
    mods = [layer, layer.input_norm, layer.post_attn_norm, attn, attn.rotary, attn.qkv_proj,
            attn.o_proj]
    if attn.qk_norm != "none":
        mods += [attn.q_norm, attn.k_norm]
    if type(mlp) is GatedMLP:
        return mods + [mlp, mlp.gate_up_proj, mlp.down_proj]
    return mods + fused_moe.moe_modules(mlp)


def _hook_dicts(modules) -> list:
    return [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]


def _intercepted(modules) -> bool:
    """Whether hooks or a per-instance forward would make `modules` do more than the
    driver does."""
    return _hooked(_hook_dicts(modules)) or any("forward" in m.__dict__ for m in modules)


def _hooked(hook_dicts: list) -> bool:
    """Whether a forward hook, global or in `hook_dicts` (`_hook_dicts` of the modules),
    would make the modules do more than the driver does."""
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or any(hook_dicts))


def _plain_layer(layer, rotary, eps: float, scale: float) -> bool:
    """A pre-norm block the driver computes as the modules do: a dense SwiGLU MLP or a
    MoE block `fused_moe.plain_moe` takes; no q/k norm or OLMoE's over the whole query and
    key projections."""
    attn = getattr(layer, "attn", None)
    if not (type(layer) is DecoderLayer and type(attn) is Attention
            and (type(layer.mlp) is GatedMLP or fused_moe.plain_moe(layer.mlp))
            and type(layer.input_norm) is RMSNorm
            and type(layer.post_attn_norm) is RMSNorm and attn.rotary is rotary
            and type(rotary) is RotaryEmbedding and attn.qk_norm in ("none", "full")
            and attn.clip_qkv is None and attn.scale == scale
            and layer.input_norm.eps == layer.post_attn_norm.eps == eps):
        return False
    return attn.qk_norm == "none" or (type(attn.q_norm) is RMSNorm is type(attn.k_norm)
                                      and attn.q_norm.eps == attn.k_norm.eps == eps)


def _dims_supported(config) -> bool:
    hd = config.head_dim
    return (config.hidden_size % 16 == 0 and config.intermediate_size % 16 == 0
            and hd % 32 == 0 and hd <= 256
            and config.num_attention_heads % config.num_key_value_heads == 0)


def _projection_shapes(cfg) -> tuple[tuple[int, int], ...]:
    """[out, in] of the QKV, output, gate/up and down projections under `cfg`."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return (q + 2 * kv, h), (h, q), (2 * i, h), (h, i)


def _layer_rows(sources: list) -> list[list]:
    """`sources` (`FusedLayers._sources`) per layer: norm weights (input, post-attention, q,
    k), 4 x (weights, bias), k and v caches, the MoE block's sources."""
    return [sources[j:j + PER_LAYER] for j in range(2, len(sources), PER_LAYER)]


def _bf16_vector(t: torch.Tensor | None, size: int) -> bool:
    return t is None or (t.is_cpu and t.dtype is BF16 and t.is_contiguous()
                         and t.shape == (size,))


def _projection(m, shape: tuple[int, int]) -> tuple:
    """(weights, bias) of a projection as the driver reads them: a bf16 `Linear`'s packed
    weight and bias, an `Int4Linear`'s `Int4Weights` (bias inside) and None; (None, None)
    for what the driver does not run (another type, dtype or shape [out, in] than `shape`,
    no int4 kernel weights)."""
    if type(m) is Linear:
        w = m.weight
        if w.dtype is BF16 and (w.is_cpu or w.is_meta) and tuple(w.shape) == shape:
            return m.weight_panels.get(w), m.bias
    elif type(m) is Int4Linear and m.cpu_kernel is not None:
        if (m.cpu_kernel.num_out, m.cpu_kernel.num_in) == shape:
            return m.cpu_kernel, None
    return None, None


def _lin(weights, bias) -> decoder.Lin:
    if weights is None:  # a MoE layer's dense MLP slots
        return decoder.Lin(None, None, 0)
    if isinstance(weights, gemv_int4.Int4Weights):
        return decoder.Lin(ctypes.addressof(weights._c), None, 1)
    return decoder.Lin(weights.data_ptr(), None if bias is None else bias.data_ptr(), 0)


class FusedLayers:
    """The layer table of one `DecoderModel` (which passes itself to `try_run`: no
    reference back, so a dropped model is freed at once), rebuilt when what it points at
    may have moved (see the module docstring) or after `invalidate()`."""

    def __init__(self) -> None:
        self._forget()

    def _forget(self) -> None:
        self._key: list | None = None
        self._kv: list = []
        self._generation: tuple | None = None  # None: gather the sources every forward
        self._hooks: list = []
        self._ptrs: list = []
        self._table = self._dims = None
        self._has_int4 = False
        self._num_slots = 0
        self._moes: list = []  # the C `Moe` records the table points at
        # (block, its recorder, its expert backend) per MoE block: plain attributes, which
        # `ExpertStatsHub` and `set_moe_backend` assign without a generation change
        self._moe_state: list = []
        self._moe_sizes: decoder.MoeSizes | None = None

    def invalidate(self) -> None:
        """Rebuild the table at the next forward (after edits it cannot see: storage
        swapped through `.data`, plain attributes such as `clip_qkv` or `eps`)."""
        self._forget()

    def __getstate__(self) -> dict:
        """Copies and pickles (of the model) leave the table behind: it holds raw
        addresses; the copy builds its own at its first forward."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self._forget()

    def try_run(self, model, x: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> torch.Tensor | None:
        """model's layers over x ([T, hidden] bf16, not modified) -> [T, hidden], or None
        when the fused path does not apply (then run the modules). Raises RuntimeError if
        a kernel fails midway (out of memory; nothing else that passes the checks here)."""
        if not (_enabled and model.config.mla is None and not torch.is_grad_enabled()
                and x.is_cpu and x.dtype is BF16 and x.dim() == 2
                and 0 < x.shape[0] <= attention.MAX_ROWS
                and x.shape[1] == model.config.hidden_size and decoder.available()
                and len(kv_caches) == len(model.layers) > 0):
            return None
        if not self._unchanged(kv_caches) and not self._rebuild(model, kv_caches):
            return None
        if (self._has_int4 and x.shape[0] > gemv_int4.MAX_ROWS) or not self._inputs_ok(
                x.shape[0], positions, meta):
            return None
        out = x.contiguous().clone()
        decoder.run_layers(self._dims, self._table, out, positions, meta.slot_mapping,
                           meta.sequences, meta.sliding_window or 0, self._moe_sizes)
        return out

    def _inputs_ok(self, t: int, positions: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Positions inside the RoPE table, slots inside the caches (else the modules run
        and raise)."""
        slots = meta.slot_mapping
        if not (meta.num_tokens == t and positions.shape == (t,) == slots.shape
                and positions.dtype is torch.int64 is slots.dtype and positions.is_cpu
                and slots.is_cpu and positions.is_contiguous() and slots.is_contiguous()):
            return False
        sizes = self._moe_sizes
        if sizes.any and decoder.moe_scratch_bytes(sizes, t, self._dims.hidden
                                                   ) > moe_common.SCRATCH_BUDGET:
            return False  # the modules run the experts in chunks of tokens
        p_min, p_max = map(int, torch.aminmax(positions))
        s_min, s_max = map(int, torch.aminmax(slots))
        return 0 <= p_min and p_max < self._dims.max_position and 0 <= s_min \
            and s_max < self._num_slots

    def _unchanged(self, kv_caches) -> bool:
        """Whether the table is current (see the module docstring): the same KV caches, no
        assignment or packed copy change since it was built, no forward hooks, each MoE
        block's expert-stats recorder and expert backend the ones it was built with. Only kept
        while every bf16 projection's weight is released to the meta device: a dense one
        may change its values in place, which `_sources` follows through
        `PackedWeight.get` on every forward."""
        return (self._generation == generation() and len(kv_caches) == len(self._kv)
                and all(map(operator.is_, kv_caches, self._kv)) and not _hooked(self._hooks)
                and all(b.stats is st and b.run_experts is run for b, st, run in self._moe_state))

    def _rebuild(self, model, kv_caches) -> bool:
        """Gather the sources and rebuild the table; False when the fused path does not
        apply to them."""
        self._generation = None
        now = generation()
        sources = self._sources(model, kv_caches)
        if sources is None or not self._fits(model, sources):
            return False
        ptrs = [s.data_ptr() for s in sources if isinstance(s, torch.Tensor)]
        if self._key is None or len(sources) != len(self._key) or ptrs != self._ptrs or any(
                a is not b for a, b in zip(sources, self._key)):
            self._build(model, sources)
            self._ptrs = ptrs
        modules = [m for layer in model.layers for m in _modules_of(layer)]
        self._kv, self._hooks = list(kv_caches), _hook_dicts(modules)
        self._moe_state = [(m, m.stats, m.run_experts) for m in (
            layer.mlp for layer in model.layers) if type(m) is not GatedMLP]
        if all(m.weight.is_meta for m in modules if type(m) is Linear) and all(
                fused_moe.weights_released(layer.mlp) for layer in model.layers
                if type(layer.mlp) is not GatedMLP):
            self._generation = now
        return True

    def _sources(self, model, kv_caches) -> list | None:
        """The RoPE tables, then per layer: the norm weights, (weights, bias) of each
        projection (`_projection`) and the KV caches; None when a layer or projection is
        one the driver does not run as the modules do."""
        cfg, layer0 = model.config, model.layers[0]
        if not _dims_supported(cfg) or not hasattr(layer0, "attn"):
            return None
        rotary = layer0.attn.rotary
        eps, scale = layer0.input_norm.eps, layer0.attn.scale
        shapes = _projection_shapes(cfg)
        out: list = [rotary.cos, rotary.sin]
        for layer, cache in zip(model.layers, kv_caches):
            if (len(cache) != 2 or cache[0].dtype is not BF16 or not _plain_layer(
                    layer, rotary, eps, scale) or _intercepted(_modules_of(layer))):
                return None  # an int8 or float32 cache, or a layer the driver cannot run
            k_cache, v_cache = cache
            attn, mlp = layer.attn, layer.mlp
            out += [layer.input_norm.weight, layer.post_attn_norm.weight]
            out += ([attn.q_norm.weight, attn.k_norm.weight] if attn.qk_norm == "full"
                    else [None, None])
            dense = type(mlp) is GatedMLP
            projections = (attn.qkv_proj, attn.o_proj, *((mlp.gate_up_proj, mlp.down_proj)
                                                         if dense else ()))
            for m, shape in zip(projections, shapes):
                weights, bias = _projection(m, shape)
                if weights is None:
                    return None
                out += [weights, bias]
            moe_sources = [None] * fused_moe.PER_MOE
            if not dense:
                out += [None] * 4
                moe_sources = fused_moe.moe_sources(mlp, cfg.hidden_size)
                if moe_sources is None:
                    return None
            out += [k_cache, v_cache, *moe_sources]
        return out

    def _fits(self, model, sources: list) -> bool:
        """Whether every tensor of `sources` has the dtype, device, layout and shape the
        kernels take (packed weights are checked by `PackedWeight`, int4 ones by
        `Int4Weights`, their shapes by `_projection`)."""
        cfg = model.config
        h, hd = cfg.hidden_size, cfg.head_dim
        cos, sin = sources[:2]
        if not (cos.dtype is sin.dtype is torch.float32 and cos.is_contiguous()
                and sin.is_contiguous() and cos.shape == sin.shape and cos.dim() == 2
                and cos.shape[1] * 2 == hd):
            return False
        # the norms, then the projections' biases (their out sizes)
        qn, kvn = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        sizes = (h, h, qn, kvn, *(out for out, _ in _projection_shapes(cfg)))
        rows = _layer_rows(sources)
        for row, layer in zip(rows, model.layers):
            vectors = row[:4] + row[5:12:2]
            if not all(_bf16_vector(t, size) for t, size in zip(vectors, sizes)):
                return False
            if row[MOE_AT + 2] is not None and not all(
                    _bf16_vector(t, size) for t, size in zip(
                        [row[MOE_AT + j] for j in (1, 5, 7, 9)],
                        fused_moe.bias_sizes(layer.mlp, h))):
                return False
            k, v = row[12:14]
            if not (k.shape == v.shape and k.dim() == 3
                    and k.shape[1:] == (cfg.num_key_value_heads, hd) and all(
                        c.is_cpu and c.dtype is BF16 and c.is_contiguous() for c in (k, v))):
                return False
        int4 = any(isinstance(w, gemv_int4.Int4Weights) for row in rows for w in row[4:12:2])
        return not int4 or decoder.int4_available()

    def _build(self, model, sources: list) -> None:
        cfg, layer0 = model.config, model.layers[0]
        rows = _layer_rows(sources)
        self._moes = [None if row[MOE_AT + 2] is None else fused_moe.build_moe(
            layer.mlp, row[MOE_AT:]) for row, layer in zip(rows, model.layers)]
        layers = [decoder.Layer(*(None if t is None else t.data_ptr() for t in row[:4]),
                                *(_lin(row[k], row[k + 1]) for k in range(4, 12, 2)),
                                None if m is None else ctypes.pointer(m),
                                row[12].data_ptr(), row[13].data_ptr())
                  for row, m in zip(rows, self._moes)]
        self._table = (decoder.Layer * len(layers))(*layers)
        self._moe_sizes = decoder.MoeSizes(layers)
        self._has_int4 = self._moe_sizes.int4_linear or any(
            lin.int4 for lay in layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down))
        self._num_slots = min(row[12].shape[0] for row in rows)  # k and v alike (`_fits`)
        cos, sin = sources[:2]
        self._dims = decoder.Dims(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cos.shape[0], layer0.input_norm.eps, layer0.attn.scale,
            cos.data_ptr(), sin.data_ptr())
        self._key = sources
