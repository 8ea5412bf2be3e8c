"""The decoder layers of a dense bf16 model on CPU in one native call per forward.

`DecoderModel.forward` runs its layers through `FusedLayers.try_run` when every layer is a
plain dense pre-norm block (`DecoderLayer` with `GatedMLP`, bf16 `Linear` projections with
packed weights, no q/k norm or clipping) and the kernels take the shapes; otherwise, and
with the CPU kernels switched off, it runs the modules one by one, which are the reference:
the driver calls the same kernels with the same arguments (`specmoe.kernels.decoder`), so
the two give the same bits (tests/models/test_fused_layers.py).
"""

from __future__ import annotations


import torch

from specmoe.kernels import decoder
from specmoe.layers.linear import Linear
from specmoe.layers.mlp import GatedMLP
from specmoe.layers.paged_attention import AttentionMetadata

BF16 = torch.bfloat16


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


def _packed(m: Linear) -> torch.Tensor | None:
    """m's packed weight, or None when the kernel does not read its weight (not bf16)."""
    w = m.weight
    return m.weight_panels.get(w) if w.dtype is BF16 and (w.is_cpu or w.is_meta) else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedLayers:
    """The layer table of one `DecoderModel`, rebuilt when a weight, packed copy or KV
    cache it points at is replaced.

    Args:
        model: a `specmoe.models.decoder.DecoderModel`.
    """

    def __init__(self, model) -> None:
        self.model = model
        cfg = model.config
        # (the projections' types are checked per forward: quantisation may replace them)
        self.eligible = _dims_supported(cfg) and all(map(_plain_layer, model.layers))
        self._key: list | None = None
        self._kv: list = []
        self._watch: list | None = None
        self._table = None
        self._dims = None

    def try_run(self, x: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor | None:
        """The layers over x ([T, hidden] bf16, not modified) -> [T, hidden], or None when
        the fused path does not apply (then run the modules). Raises RuntimeError if the
        driver fails midway (it does not for inputs that pass the checks here)."""
        if not (_enabled and self.eligible and not torch.is_grad_enabled() and x.is_cpu
                and x.dtype is BF16 and x.dim() == 2 and decoder.available()):
            return None
        if not self._inputs_ok(x, positions, meta):
            return None
        if len(kv_caches) != len(self.model.layers):
            return None
        if not self._unchanged(kv_caches):
            sources = self._sources(kv_caches)
            if sources is None:
                return None
            if self._key is None or any(a is not b for a, b in zip(sources, self._key)):
                if not self._fits(sources):
                    return None
                self._build(sources)
            self._watch_sources(kv_caches)
        out = x.contiguous().clone()
        decoder.run_layers(self._dims, self._table, out, positions, meta.slot_mapping,
                           meta.sequences, meta.sliding_window or 0)
        return out

    def _unchanged(self, kv_caches) -> bool:
        """Whether the table is current, checked cheaply (plain dict lookups, not
        `_sources`' module attributes): the same KV caches, submodules, parameters and
        packed copies as when it was built, and every projection weight released to the
        meta device (a dense one may change its values in place, which `_sources` checks
        through `PackedWeight.get`)."""
        return (self._watch is not None
                and all(a is b for a, b in zip(kv_caches, self._kv, strict=True))
                and all(d.get(k) is o for d, k, o in self._watch))

    def _watch_sources(self, kv_caches) -> None:
        self._kv, self._watch = list(kv_caches), None
        watch = [(self.model.layers[0].attn._modules, "rotary", self.model.layers[0].attn.rotary)]
        for layer in self.model.layers:
            mods = [layer.input_norm, layer.post_attn_norm, layer.attn, layer.mlp]
            linears = [layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj]
            if not all(m.weight.is_meta for m in linears):
                return
            for parent in mods:
                watch += [(parent._modules, k, v) for k, v in parent._modules.items()]
                watch += [(parent._parameters, k, v) for k, v in parent._parameters.items()]
            for m in linears:
                watch += [(m._parameters, k, v) for k, v in m._parameters.items()]
                watch += [(m.__dict__, "weight_panels", m.weight_panels),
                          (m.weight_panels.__dict__, "packed", m.weight_panels.packed)]
            watch += [(layer._modules, k, v) for k, v in layer._modules.items()]
        rotary = self.model.layers[0].attn.rotary
        watch += [(rotary._buffers, k, v) for k, v in rotary._buffers.items()]
        self._watch = watch

    def _inputs_ok(self, x: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata) -> bool:
        rotary = self.model.layers[0].attn.rotary
        t = x.shape[0]
        return (x.shape[1] == self.model.config.hidden_size and meta.num_tokens == t
                and positions.shape == (t,) and positions.dtype is torch.int64
                and positions.is_cpu and positions.is_contiguous() and t > 0
                and meta.slot_mapping.is_cpu and meta.slot_mapping.is_contiguous()
                and int(positions.min()) >= 0 and int(positions.max()) < rotary.cos.shape[0])

    def _sources(self, kv_caches) -> list | None:
        """Every tensor the table points at: the RoPE tables, then per layer the fields of
        `decoder.Layer` in order (weights as their packed copies); None when a projection is
        not a `Linear` (quantised)."""
        rotary = self.model.layers[0].attn.rotary
        out: list = [rotary.cos, rotary.sin]
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches):
            attn, mlp = layer.attn, layer.mlp
            qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
            if not type(qkv) is type(o) is type(gate_up) is type(down) is Linear:
                return None
            out += [layer.input_norm.weight, _packed(qkv), qkv.bias, _packed(o), o.bias,
                    layer.post_attn_norm.weight, _packed(gate_up), gate_up.bias, _packed(down),
                    down.bias, k_cache, v_cache]
        return out

    def _fits(self, sources: list) -> bool:
        """Whether every tensor of `sources` has the dtype, device, layout and shape the
        kernels take (packed weights are checked by `PackedWeight`)."""
        cfg = self.model.config
        h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        cos, sin = sources[:2]
        if not (cos.dtype is sin.dtype is torch.float32 and cos.is_contiguous()
                and sin.is_contiguous() and cos.shape == sin.shape and cos.shape[1] * 2 == hd):
            return False
        sizes = (h, q + 2 * kv, h, h, 2 * i, h)  # norms and biases, in field order
        n = len(decoder.LAYER_FIELDS)
        for j in range(2, len(sources), n):
            norm_in, w_qkv, b_qkv, w_o, b_o, norm_post, w_gu, b_gu, w_down, b_down, k, v = \
                sources[j:j + n]
            if any(w is None for w in (w_qkv, w_o, w_gu, w_down)):
                return False
            vectors = (norm_in, b_qkv, b_o, norm_post, b_gu, b_down)
            if not all(_bf16_vector(t, size) for t, size in zip(vectors, sizes)):
                return False
            if not all(c.is_cpu and c.dtype is BF16 and c.is_contiguous() and c.dim() == 3
                       and c.shape[1:] == (cfg.num_key_value_heads, hd) for c in (k, v)):
                return False
        return True

    def _build(self, sources: list) -> None:
        cfg = self.model.config
        n = len(decoder.LAYER_FIELDS)
        rows = [decoder.Layer(*map(_ptr, sources[i:i + n])) for i in range(2, len(sources), n)]
        self._table = (decoder.Layer * len(rows))(*rows)
        cos, sin = sources[:2]
        self._dims = decoder.Dims(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cos.shape[0], self.model.layers[0].input_norm.eps,
            self.model.layers[0].attn.scale, cos.data_ptr(), sin.data_ptr())
        self._key = sources
