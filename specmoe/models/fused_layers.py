"""The decoder layers of a dense bf16 model on CPU in one native call per forward.

`DecoderModel.forward` runs its layers through `FusedLayers.try_run` when every layer is a
plain dense pre-norm block (`DecoderLayer` with `GatedMLP`, no q/k norm or clipping) whose
projections are bf16 `Linear`s with packed weights or `Int4Linear`s on our int4 kernel (at
most `gemv_int4.MAX_ROWS` rows then, as a draft model's steps have), and the kernels take
the shapes. Otherwise, and with the CPU kernels switched off, it runs the modules one by
one, which are the reference: the driver calls the same kernels with the same arguments
(`specmoe.kernels.decoder`), so the two give the same bits
(tests/models/test_fused_layers.py).
"""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels import decoder, gemv_int4
from specmoe.layers.linear import Linear
from specmoe.layers.mlp import GatedMLP
from specmoe.layers.paged_attention import AttentionMetadata
from specmoe.layers.quantization import Int4Linear

BF16 = torch.bfloat16
PER_LAYER = 12  # sources per layer: 2 norms, 4 x (weights, bias), 2 caches

_enabled = True


def set_enabled(enabled: bool) -> None:
    """Turn the fused path on or off for this process (off: the modules run one by one,
    as they do anyway with the CPU kernels off; for A/B timing and tests)."""
    global _enabled
    _enabled = bool(enabled)


def _plain_layer(layer) -> bool:
    return (type(layer.mlp) is GatedMLP and layer.attn.qk_norm == "none"
            and layer.attn.clip_qkv is None)


def _dims_supported(config) -> bool:
    hd = config.head_dim
    return (config.hidden_size % 16 == 0 and config.intermediate_size % 16 == 0
            and hd % 32 == 0 and hd <= 256
            and config.num_attention_heads % config.num_key_value_heads == 0)


def _bf16_vector(t: torch.Tensor | None, size: int) -> bool:
    return t is None or (t.is_cpu and t.dtype is BF16 and t.is_contiguous()
                         and t.shape == (size,))


def _projection(m) -> tuple:
    """(weights, bias) of a projection as the driver reads them: a bf16 `Linear`'s packed
    weight and bias, an `Int4Linear`'s `Int4Weights` (bias inside) and None; (None, None)
    for what the driver does not run (another type or dtype, no int4 kernel weights)."""
    if type(m) is Linear:
        w = m.weight
        if w.dtype is BF16 and (w.is_cpu or w.is_meta):
            return m.weight_panels.get(w), m.bias
    elif type(m) is Int4Linear and m.cpu_kernel is not None:
        return m.cpu_kernel, None
    return None, None


def _lin(weights, bias) -> decoder.Lin:
    if isinstance(weights, gemv_int4.Int4Weights):
        return decoder.Lin(ctypes.addressof(weights._c), None, 1)
    return decoder.Lin(weights.data_ptr(), None if bias is None else bias.data_ptr(), 0)


class FusedLayers:
    """The layer table of one `DecoderModel`, rebuilt when a module, weight, packed copy or
    KV cache it points at is replaced.

    Args:
        model: a `specmoe.models.decoder.DecoderModel`.
    """

    def __init__(self, model) -> None:
        self.model = model
        # (the projections' types are checked per forward: quantisation may replace them)
        self.eligible = (_dims_supported(model.config)
                         and all(map(_plain_layer, model.layers)))
        self._forget()

    def _forget(self) -> None:
        self._key: list | None = None
        self._kv: list = []
        self._watch: list | None = None
        self._table = self._dims = None
        self._has_int4 = False

    def __getstate__(self) -> dict:
        """Copies and pickles (of the model) leave the table behind: it holds raw
        addresses; the copy builds its own at its first forward."""
        state = dict(self.__dict__)
        state.update(_key=None, _kv=[], _watch=None, _table=None, _dims=None, _has_int4=False)
        return state

    def try_run(self, x: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor | None:
        """The layers over x ([T, hidden] bf16, not modified) -> [T, hidden], or None when
        the fused path does not apply (then run the modules). Raises RuntimeError if the
        driver fails midway (it does not for inputs that pass the checks here)."""
        if not (_enabled and self.eligible and not torch.is_grad_enabled() and x.is_cpu
                and x.dtype is BF16 and x.dim() == 2 and decoder.available()
                and len(kv_caches) == len(self.model.layers)
                and self._inputs_ok(x, positions, meta)):
            return None
        if not self._unchanged(kv_caches) and not self._rebuild(kv_caches):
            return None
        if self._has_int4 and x.shape[0] > gemv_int4.MAX_ROWS:
            return None
        out = x.contiguous().clone()
        decoder.run_layers(self._dims, self._table, out, positions, meta.slot_mapping,
                           meta.sequences, meta.sliding_window or 0)
        return out

    def _inputs_ok(self, x: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata) -> bool:
        rotary = self.model.layers[0].attn.rotary
        t = x.shape[0]
        return (x.shape[1] == self.model.config.hidden_size and meta.num_tokens == t
                and positions.shape == (t,) and positions.dtype is torch.int64
                and positions.is_cpu and positions.is_contiguous() and t > 0
                and meta.slot_mapping.is_cpu and meta.slot_mapping.is_contiguous()
                and int(positions.min()) >= 0 and int(positions.max()) < rotary.cos.shape[0])

    def _unchanged(self, kv_caches) -> bool:
        """Whether the table is current, checked cheaply (plain dict lookups, not
        `_sources`' module attributes, ~25 us for 28 layers against ~250 us): the same KV
        caches, submodules, parameters, packed copies and int4 weights as when it was
        built. Only kept while every bf16 projection's weight is released to the meta
        device: a dense one may change its values in place, which `_sources` follows
        through `PackedWeight.get`."""
        return (self._watch is not None
                and all(a is b for a, b in zip(kv_caches, self._kv, strict=True))
                and all(d.get(k) is o for d, k, o in self._watch))

    def _rebuild(self, kv_caches) -> bool:
        """Gather the sources, rebuild the table if one moved; False when the fused path
        does not apply to them."""
        sources = self._sources(kv_caches)
        if sources is None:
            return False
        if self._key is None or any(a is not b for a, b in zip(sources, self._key)):
            if not self._fits(sources):
                return False
            self._build(sources)
        self._watch_sources(kv_caches)
        return True

    def _sources(self, kv_caches) -> list | None:
        """The RoPE tables, then per layer: the norm weights, (weights, bias) of each
        projection (`_projection`) and the KV caches; None when a projection is one the
        driver does not run."""
        rotary = self.model.layers[0].attn.rotary
        out: list = [rotary.cos, rotary.sin]
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            attn, mlp = layer.attn, layer.mlp
            out += [layer.input_norm.weight, layer.post_attn_norm.weight]
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                weights, bias = _projection(m)
                if weights is None:
                    return None
                out += [weights, bias]
            out += [k_cache, v_cache]
        return out

    def _fits(self, sources: list) -> bool:
        """Whether every tensor of `sources` has the dtype, device, layout and shape the
        kernels take (packed weights are checked by `PackedWeight`, int4 ones by
        `Int4Weights`)."""
        cfg = self.model.config
        h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        cos, sin = sources[:2]
        if not (cos.dtype is sin.dtype is torch.float32 and cos.is_contiguous()
                and sin.is_contiguous() and cos.shape == sin.shape and cos.shape[1] * 2 == hd):
            return False
        sizes = (h, h, q + 2 * kv, h, 2 * i, h)  # norms, then the projections' biases
        for j in range(2, len(sources), PER_LAYER):
            row = sources[j:j + PER_LAYER]
            vectors = row[:2] + row[3:10:2]
            if not all(_bf16_vector(t, size) for t, size in zip(vectors, sizes)):
                return False
            if not all(c.is_cpu and c.dtype is BF16 and c.is_contiguous() and c.dim() == 3
                       and c.shape[1:] == (cfg.num_key_value_heads, hd) for c in row[10:]):
                return False
        int4 = any(isinstance(w, gemv_int4.Int4Weights) for w in sources[4::2])
        return not int4 or decoder.int4_available()

    def _build(self, sources: list) -> None:
        cfg = self.model.config
        rows = []
        for j in range(2, len(sources), PER_LAYER):
            row = sources[j:j + PER_LAYER]
            lins = [_lin(row[k], row[k + 1]) for k in range(2, 10, 2)]
            rows.append(decoder.Layer(row[0].data_ptr(), row[1].data_ptr(), *lins,
                                      row[10].data_ptr(), row[11].data_ptr()))
        self._table = (decoder.Layer * len(rows))(*rows)
        self._has_int4 = any(lay.qkv.int4 or lay.o.int4 or lay.gate_up.int4 or lay.down.int4
                             for lay in rows)
        cos, sin = sources[:2]
        self._dims = decoder.Dims(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cos.shape[0], self.model.layers[0].input_norm.eps,
            self.model.layers[0].attn.scale, cos.data_ptr(), sin.data_ptr())
        self._key = sources

    def _watch_sources(self, kv_caches) -> None:
        """What `_unchanged` compares: the entries of the module, parameter and buffer dicts
        the sources were read through, or nothing (None) while a bf16 projection keeps a
        dense weight."""
        self._kv, self._watch = list(kv_caches), None
        attn0 = self.model.layers[0].attn
        rotary = attn0.rotary
        watch = [(attn0._modules, "rotary", rotary)]
        watch += [(rotary._buffers, k, v) for k, v in rotary._buffers.items()]
        watch += [(self.model._modules, "layers", self.model.layers)]
        watch += [(self.model.layers._modules, k, v)
                  for k, v in self.model.layers._modules.items()]
        for layer in self.model.layers:
            projections = [layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj]
            if any(type(m) is Linear and not m.weight.is_meta for m in projections):
                return
            parents = [layer, layer.input_norm, layer.post_attn_norm, layer.attn, layer.mlp]
            for parent in parents + projections:
                watch += [(parent._modules, k, v) for k, v in parent._modules.items()]
                watch += [(parent._parameters, k, v) for k, v in parent._parameters.items()]
            for m in projections:
                if type(m) is Linear:
                    watch += [(m.__dict__, "weight_panels", m.weight_panels),
                              (m.weight_panels.__dict__, "packed", m.weight_panels.packed)]
                else:
                    watch.append((m.__dict__, "cpu_kernel", m.cpu_kernel))
        self._watch = watch
