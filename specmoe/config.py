"""Engine configuration: one aggregate of small validated dataclasses (L0: no torch).

`ArchConfig` is the model architecture parsed from a HuggingFace `config.json` (or GGUF
metadata turned into one) by the model family's parser in `specmoe.models`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SPECULATIVE_METHODS = ("ngram", "draft", "self")
SPECULATIVE_POLICIES = ("static", "batch_size_table", "adaptive")
QUANTIZATION_METHODS = ("int8", "int4")
# and "gguf": a .gguf file's own blocks kept at their type (`specmoe.loader.gguf_blocks`)
WEIGHT_QUANTIZATIONS = (*QUANTIZATION_METHODS, "gguf")
# How routed experts run (`specmoe.layers.moe.backends`): "auto" picks per device and kernels.
MOE_BACKEND_CHOICES = ("auto", "fused", "grouped", "grouped_mm", "reference")
# How expert-parallel ranks exchange tokens (`specmoe.layers.moe.expert_parallel`).
EXPERT_PARALLEL_DISPATCH = ("replicated", "all_to_all")
# Router options (`specmoe.layers.moe.router`), DeepSeek-V2/V3's names.
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class KernelConfig:
    """Which native-kernel behaviours one engine loads and runs with (docs/kernels.md). Each
    field is None (the process-wide setting: the environment variable named, read at
    import, or the module's setter) or a bool this engine applies around its loading and its
    steps (`worker.kernel_switches`), so that two engines in one process may differ.
    Expert-parallel worker ranks (processes of their own) keep their process's settings.

    Attributes:
        cpu_kernels: our native CPU kernels where they apply (False: torch's;
            SPECMOE_DISABLE_CPU_KERNELS).
        fused_layers: whole decoder layers in one native call where they apply.
        int4_batch_invariant: every row count through int4 kernel calls of at most 16 rows
            (SPECMOE_INT4_BATCH_INVARIANT).
        one_row_prefetch: software prefetch in one-row panel passes (as timed at the first
            large model's load; SPECMOE_ONE_ROW_PREFETCH).
        fixed_threads: keep torch's thread count instead of yielding cores to busy
            neighbours (SPECMOE_FIXED_THREADS).

    Raises:
        ValueError: a field that is neither None nor a bool.
    """

    cpu_kernels: bool | None = None
    fused_layers: bool | None = None
    int4_batch_invariant: bool | None = None
    one_row_prefetch: bool | None = None
    fixed_threads: bool | None = None

    def __post_init__(self) -> None:
        for name in ("cpu_kernels", "fused_layers", "int4_batch_invariant",
                     "one_row_prefetch", "fixed_threads"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"invalid kernels {name}={value!r}: must be true, false or "
                                 "None (the process-wide setting)")


@dataclass
class MoEConfig:
    """Mixture-of-Experts block shape and routing.

    Attributes:
        num_experts: routed experts per MoE layer (N).
        top_k: experts each token is routed to (k).
        moe_intermediate_size: hidden width of one routed expert.
        norm_topk_prob: renormalise the top-k softmax weights to sum to 1.
        shared_expert_intermediate_size: width of the always-on shared expert (0: none).
        has_shared_expert_gate: scale the shared expert by sigmoid(x @ w_gate) (Qwen2-MoE).
        moe_layers: indices of layers whose MLP is an MoE block (others are dense).
        scoring_func: "softmax" (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2) or "sigmoid"
            (DeepSeek-V3) over the router logits.
        topk_method: "greedy" (top-k over all experts), "group_limited_greedy" (DeepSeek-V2:
            keep the topk_group groups with the largest maximum score, then top-k inside
            them) or "noaux_tc" (DeepSeek-V3: choose on score + a learnt per-expert
            correction bias, groups ranked by the sum of their two best, weights from the
            uncorrected scores).
        n_group: expert groups (N must be a multiple); 1 unless grouped.
        topk_group: groups kept per token by the grouped methods.
        routed_scaling_factor: the routed experts' output is scaled by it (DeepSeek).
    """

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    has_shared_expert_gate: bool = False
    moe_layers: list[int] = field(default_factory=list)
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        _check_sizes(self, ("num_experts", "top_k", "moe_intermediate_size"))
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"invalid MoE top_k={self.top_k}: must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"invalid MoE scoring_func={self.scoring_func!r}: choose one of "
                             f"{SCORING_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"invalid MoE topk_method={self.topk_method!r}: choose one of "
                             f"{TOPK_METHODS}")
        grouped = self.topk_method != "greedy"
        if self.n_group < 1 or self.num_experts % self.n_group or (
                grouped and not 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"invalid MoE groups n_group={self.n_group}, topk_group="
                             f"{self.topk_group} for {self.num_experts} experts: n_group must "
                             f"divide num_experts and 1 <= topk_group <= n_group")
        if grouped and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"invalid MoE top_k={self.top_k}: more than the "
                             f"{self.topk_group} kept groups of "
                             f"{self.num_experts // self.n_group} experts hold")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"invalid MoE routed_scaling_factor="
                             f"{self.routed_scaling_factor}: must be > 0")


@dataclass
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434 sec. 2.1): keys and values
    of all heads are up-projected from one compressed latent per token, which is all the KV
    cache holds, beside one RoPE'd key shared by the heads.

    Attributes:
        q_lora_rank: rank of the query's low-rank compression (q_a_proj, its RMSNorm, then
            q_b_proj), or None for one q_proj (DeepSeek-V2-Lite).
        kv_lora_rank: width of the latent c_kv (the cache holds it per token and layer).
        qk_nope_head_dim: per-head query/key dimensions without RoPE.
        qk_rope_head_dim: per-head query dimensions with RoPE, and of the shared RoPE'd key.
        v_head_dim: per-head value dimension.
        rope_interleave: the RoPE dimensions pair up as (0, 1), (2, 3), ... (DeepSeek's
            layout) rather than (i, i + d/2) (the "neox" halves).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        _check_sizes(self, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                            "v_head_dim"))
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank < 1):
            raise ValueError(f"invalid MLA q_lora_rank={self.q_lora_rank!r}: must be None or "
                             "an int >= 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"invalid MLA qk_rope_head_dim={self.qk_rope_head_dim}: RoPE "
                             "rotates pairs, it must be even")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key dimension (no RoPE part, then RoPE part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the KV cache holds per token and layer: c_kv then the RoPE'd key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class ArchConfig:
    """Decoder-only transformer architecture (Llama-style attention, dense or MoE MLP).

    Attributes:
        architecture: HuggingFace architecture name, e.g. "LlamaForCausalLM".
        qk_norm: "none", "per_head" (Qwen3: RMSNorm over head_dim) or "full" (OLMoE: over
            the whole projected q/k).
        rope_scaling: None or a dict with "rope_type" in ("linear", "llama3", "yarn") and its
            fields.
        sliding_window: attention window in tokens (None: full attention).
        clip_qkv: clamp q, k, v projections to [-clip_qkv, clip_qkv] (OLMoE), or None.
        mla: Multi-head Latent Attention (DeepSeek-V2/V3) instead of grouped-query
            attention, or None. With it, head_dim is the RoPE dimension (qk_rope_head_dim,
            as transformers writes it) and num_key_value_heads equals num_attention_heads.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str = "none"
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    clip_qkv: float | None = None
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_sizes(self, ("vocab_size", "hidden_size", "num_hidden_layers",
                            "num_attention_heads", "num_key_value_heads", "head_dim",
                            "max_position_embeddings"))
        # 0 where every layer is MoE (no dense MLP to size)
        _check_sizes(self, ("intermediate_size",), least=0 if self._all_moe() else 1)
        _check_positive_finite(self, ("rms_norm_eps", "rope_theta"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        if self.qk_norm not in ("none", "per_head", "full"):
            raise ValueError(f"invalid qk_norm={self.qk_norm!r}")
        if self.mla is not None and self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"MLA expands its latent to every head: num_key_value_heads="
                             f"{self.num_key_value_heads} must equal num_attention_heads="
                             f"{self.num_attention_heads}")

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def _all_moe(self) -> bool:
        return self.moe is not None and set(self.moe.moe_layers) >= set(
            range(self.num_hidden_layers))

    @property
    def kv_cache_values_per_token(self) -> int:
        """Values one layer's KV cache holds per token: a key and a value per key/value
        head, or for MLA the latent and the shared RoPE'd key (`MLAConfig.latent_dim`)."""
        if self.mla is not None:
            return self.mla.latent_dim
        return 2 * self.num_key_value_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """Weights of one layer's q, k, v and o projections (biases and norms left out);
        for MLA its q (or q_a and q_b), kv_a, kv_b and o projections."""
        if self.mla is not None:
            return self._mla_params(self.mla)
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size

    def _mla_params(self, m: MLAConfig) -> int:
        h, heads = self.hidden_size, self.num_attention_heads
        q_out = heads * m.qk_head_dim
        q = h * q_out if m.q_lora_rank is None else m.q_lora_rank * (h + q_out)
        kv = h * m.latent_dim + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h

    def gated_mlp_params(self, intermediate_size: int) -> int:
        """Weights of a gated MLP (gate, up and down projections) of that hidden width."""
        return 3 * self.hidden_size * intermediate_size

    @property
    def num_params(self) -> int:
        """Weights of the whole model: embedding, LM head unless tied, and every layer's
        attention and dense MLP or MoE block (routed experts, shared expert, router); norms
        and biases left out."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        moe_layers = set(self.moe.moe_layers) if self.moe is not None else set()
        dense = self.gated_mlp_params(self.intermediate_size)
        return embed + sum(self.attention_params + (self._moe_params(self.moe)
                                                    if i in moe_layers else dense)
                           for i in range(self.num_hidden_layers))

    def _moe_params(self, m: MoEConfig) -> int:
        return (m.num_experts * (self.gated_mlp_params(m.moe_intermediate_size)
                                 + self.hidden_size)
                + self.gated_mlp_params(m.shared_expert_intermediate_size))


def _check_sizes(obj, names: tuple[str, ...], least: int = 1) -> None:
    """Raise ValueError naming the first of `obj`'s attributes `names` that is not an int
    >= `least` (a bool, a float or a string from a malformed config.json included)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"invalid {name}={value!r}: must be an int >= {least}")


def _check_positive_finite(obj, names: tuple[str, ...]) -> None:
    """Raise ValueError naming the first of `obj`'s attributes `names` that is not a finite
    number > 0 (NaN and infinity included)."""
    for name in names:
        value = getattr(obj, name)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not 0 < value < float("inf")):
            raise ValueError(f"invalid {name}={value!r}: must be a finite number > 0")


@dataclass
class ModelConfig:
    """Which model to load and how.

    Attributes:
        model: a HuggingFace model directory, a .gguf file, or an alias (`smollm2-135m`).
        dtype: "float32" or "bfloat16" (float16 on CUDA).
        device: "cpu", "cuda" or "cuda:N"; None picks CUDA when present.
        max_model_len: context limit in tokens (None: the model's max_position_embeddings).
        quantization: None (weights in `dtype`), "int8" or "int4" weight-only quantisation of
            the dense projections (see `specmoe.layers.quantization`), or "gguf": a .gguf
            file's quantised matrices kept as its own blocks, run by the GGUF block kernel
            (`specmoe.loader.gguf_blocks`; CPU only).
        moe_backend: how a MoE model's routed experts run: "fused" (the layer in one
            native call, CPU bf16; elsewhere "grouped"), "grouped" (a loop over active
            experts on the native decode kernel), "grouped_mm" (sorted tokens and two grouped
            matmuls: no Python loop, any device), "reference" (per token; slow, the oracle)
            or "auto" ("fused" on a CPU where the bf16 kernels run, else "grouped_mm").
            Ignored by dense models.
    """

    model: str
    dtype: str = "float32"
    device: str | None = None
    max_model_len: int | None = None
    quantization: str | None = None
    moe_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"invalid dtype={self.dtype!r}: must be one of {SUPPORTED_DTYPES}")
        _check_quantization("quantization", self.quantization)
        if self.moe_backend not in MOE_BACKEND_CHOICES:
            raise ValueError(f"invalid moe_backend={self.moe_backend!r}: must be one of "
                             f"{MOE_BACKEND_CHOICES}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"invalid max_model_len={self.max_model_len}: must be >= 2")


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings.

    Attributes:
        method: "ngram" (prompt lookup), "draft" (a separate draft model) or "self" (a MoE
            target drafting with fewer routed experts, `spec_decode.self_draft`).
        num_speculative_tokens: K, draft tokens verified per step (>= 1).
        draft_model: path or alias of the draft model (method "draft").
        self_draft_experts: K', the routed experts per token of a self-draft (method
            "self"; 1 <= K' < the target's top-k, checked when the target is loaded).
        prompt_lookup_min: smallest n-gram matched (method "ngram").
        prompt_lookup_max: largest n-gram matched; longer matches are tried first.
        draft_quantization: None, "int8" or "int4" for the draft model's weights (a draft
            reads all its weights for every token it drafts, so fewer bytes pay directly).
        policy: how each step's K is chosen: "static" (every request drafts its own K, or
            num_speculative_tokens), "batch_size_table" (the K of the range holding the
            number of running requests, capped by each request's own K) or "adaptive" (per
            request and step, the K that maximises the batch's expected tokens per second
            from measured acceptance and step times, `spec_decode.adaptive`; at most the
            request's own K).
        batch_size_table: for policy "batch_size_table", ranges of running requests to K,
            with vLLM's keys, e.g. {"1-4": 4, "5-16": 2, "17-4096": 0} ("8": the range 8-8);
            a batch size in no range does not speculate; no K above num_speculative_tokens.
        disable_by_batch_size: pause speculation for every request in a step while at least
            this many requests are running, requests that set their own K included (vLLM's
            speculative_disable_by_batch_size); None: never. Has no effect above the
            scheduler's max_num_seqs. A large batch is bound by compute, where verifying K
            drafts per request can cost more than it saves: `specmoe bench throughput` shows
            from which batch size on for a model and machine.
        match_trim: whether the "adaptive" policy cuts each prompt-lookup proposal to the
            drafts worth their rows given its match length (`spec_decode.match_trim`).
    """

    method: str
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    self_draft_experts: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    draft_quantization: str | None = None
    disable_by_batch_size: int | None = None
    policy: str = "static"
    batch_size_table: dict | None = None
    match_trim: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"invalid speculative method={self.method!r}: must be one of "
                             f"{SPECULATIVE_METHODS}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"invalid num_speculative_tokens={self.num_speculative_tokens}: "
                             "must be >= 1")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model (a path or alias)")
        if (self.method == "self") != (self.self_draft_experts is not None):
            raise ValueError(f"speculative method 'self' and self_draft_experts go together "
                             f"(method={self.method!r}, self_draft_experts="
                             f"{self.self_draft_experts!r})")
        if self.self_draft_experts is not None and (
                isinstance(self.self_draft_experts, bool)
                or not isinstance(self.self_draft_experts, int) or self.self_draft_experts < 1):
            raise ValueError(f"invalid self_draft_experts={self.self_draft_experts!r}: must "
                             "be an int >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"invalid prompt_lookup_min={self.prompt_lookup_min}, "
                             f"prompt_lookup_max={self.prompt_lookup_max}: need "
                             "1 <= min <= max")
        _check_quantization("draft_quantization", self.draft_quantization)
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError(f"invalid disable_by_batch_size={self.disable_by_batch_size}: "
                             "must be >= 2 (or None: never pause speculation)")
        self._check_policy()

    def _check_policy(self) -> None:
        if self.policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"invalid speculative policy={self.policy!r}: must be one of "
                             f"{SPECULATIVE_POLICIES}")
        if not isinstance(self.match_trim, bool):
            raise ValueError(f"invalid match_trim={self.match_trim!r}: must be true or false")
        if (self.policy == "batch_size_table") != (self.batch_size_table is not None):
            raise ValueError("speculative policy 'batch_size_table' and batch_size_table go "
                             f"together (policy={self.policy!r}, batch_size_table="
                             f"{self.batch_size_table!r})")
        if self.batch_size_table is None:
            return
        for lo, hi, k in parse_batch_size_table(self.batch_size_table):
            if k > self.num_speculative_tokens:
                raise ValueError(f"invalid batch_size_table K={k} for batch sizes {lo}-{hi}: "
                                 f"above num_speculative_tokens={self.num_speculative_tokens}")


def parse_draft(draft: str) -> dict:
    """The `SpeculativeConfig` fields a --draft value names: "ngram" (prompt lookup),
    "self:experts=K" (the MoE target drafting with K routed experts per token), else a draft
    model's path or alias.

    Raises:
        ValueError: a "self:" value that is not "self:experts=K" with K an integer.
    """
    if draft == "ngram":
        return {"method": "ngram"}
    if not draft.startswith("self:"):
        return {"method": "draft", "draft_model": draft}
    key, _, value = draft[len("self:"):].partition("=")
    if key != "experts" or not value.isdigit():
        raise ValueError(f"invalid --draft {draft!r}: a self-draft is self:experts=K "
                         "(K routed experts per token, fewer than the target's)")
    return {"method": "self", "self_draft_experts": int(value)}


def parse_batch_size_table(table: dict) -> tuple[tuple[int, int, int], ...]:
    """vLLM-style batch-size ranges to K, e.g. {"1-4": 4, "5-16": 2, "17-4096": 0}, as sorted
    (first, last, K) triples.

    Raises:
        ValueError: an empty table or not a dict, a key that is not "N" or "N-M" with
            1 <= N <= M, a K that is not an int >= 0, or overlapping ranges (naming them).
    """
    if not isinstance(table, dict) or not table:
        raise ValueError(f"invalid batch_size_table={table!r}: must be a non-empty dict of "
                         "'N-M' ranges to K")
    rows = []
    for key, k in table.items():
        lo, sep, hi = str(key).partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            first = last = 0
        if not 1 <= first <= last:
            raise ValueError(f"invalid batch_size_table range {key!r}: must be 'N' or 'N-M' "
                             "with 1 <= N <= M")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"invalid batch_size_table K={k!r} for {key!r}: must be an "
                             "int >= 0")
        rows.append((first, last, k))
    rows.sort()
    for (a_lo, a_hi, _), (b_lo, b_hi, _) in zip(rows, rows[1:]):
        if b_lo <= a_hi:
            raise ValueError(f"batch_size_table ranges {a_lo}-{a_hi} and {b_lo}-{b_hi} "
                             "overlap")
    return tuple(rows)


def batch_size_table_k(rows: tuple[tuple[int, int, int], ...], batch_size: int) -> int:
    """K of the range of `parse_batch_size_table` rows holding batch_size (0: none does)."""
    return next((k for lo, hi, k in rows if lo <= batch_size <= hi), 0)


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")


@dataclass
class SchedulerConfig:
    """Continuous batching and KV cache settings.

    Attributes:
        max_num_seqs: cap on running requests (the batch size of a decode step).
        max_num_batched_tokens: token budget of one step (prompt chunks, last tokens and draft
            tokens together); a longer prompt is prefilled in chunks (chunked prefill).
        block_size: token positions per KV cache block.
        num_kv_blocks: KV cache blocks of the target model; None sizes the cache from
            `kv_cache_memory_bytes` (capped at what max_num_seqs full-length requests need).
        kv_cache_memory_bytes: memory for the target's KV cache when num_kv_blocks is None
            (default: $SPECMOE_KV_CACHE_SPACE GiB if set, as vLLM's CPU backend reads
            VLLM_CPU_KVCACHE_SPACE, else 1 GiB; each engine allocates its own).
        enable_prefix_caching: requests sharing a prompt prefix reuse its full KV blocks.
        kv_cache_dtype: the target's KV cache: "auto" (the model's dtype), "bfloat16",
            "float32", or "int8" (one scale per token and KV head:
            `specmoe.layers.int8_kv`; not for MLA models).

    Raises:
        ValueError: a size that is not an int >= 1, a kv_cache_dtype not in
            KV_CACHE_DTYPES, or a $SPECMOE_KV_CACHE_SPACE that is not a number of GiB > 0.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = field(default_factory=lambda: default_kv_cache_bytes())
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"invalid kv_cache_dtype={self.kv_cache_dtype!r}: must be one of "
                             f"{KV_CACHE_DTYPES}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "kv_cache_memory_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"invalid {name}={getattr(self, name)!r}: must be an int >= 1")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 1):
            raise ValueError(f"invalid num_kv_blocks={self.num_kv_blocks!r}: must be None or "
                             "an int >= 1")


KV_CACHE_SPACE_ENV = "SPECMOE_KV_CACHE_SPACE"


def default_kv_cache_bytes() -> int:
    """$SPECMOE_KV_CACHE_SPACE (GiB, a number > 0) in bytes, else 1 GiB.

    Raises:
        ValueError: naming the variable and its value, when it is not a number > 0.
    """
    text = os.environ.get(KV_CACHE_SPACE_ENV, "").strip()
    if not text:
        return 1 << 30
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not 0 < gib < float("inf"):
        raise ValueError(f"invalid {KV_CACHE_SPACE_ENV}={text!r}: must be a number of GiB > 0")
    return max(1, int(gib * (1 << 30)))


def _check_quantization(name: str, value: str | None) -> None:
    if value is not None and value not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"invalid {name}={value!r}: must be None or one of "
                         f"{WEIGHT_QUANTIZATIONS}")


@dataclass(frozen=True)
class ExpertParallelConfig:
    """Expert parallelism of a MoE target (`specmoe.worker.expert_parallel`).

    Attributes:
        size: processes the routed experts are sharded over (1: none).
        dispatch: "replicated" (every rank computes its experts' share of the whole batch,
            one all_reduce per MoE layer) or "all_to_all" (each rank dispatches its slice of
            the batch's tokens to the ranks holding their experts, three all_to_all and one
            all_gather per MoE layer); the same output either way.
        placement: "contiguous" (rank r holds experts [r N / R, (r + 1) N / R)) or the path
            of a placement file (`specmoe expert-placement`, `layers.moe.placement`), read
            by every rank: under torchrun it must exist on every machine.
        timeout_s: seconds a collective may wait for the other ranks: a rank that died or
            hangs turns into an error on rank 0 after at most this long.

    Raises:
        ValueError: a size that is not an int >= 1, an unknown dispatch, an empty placement,
            a timeout that is not a number > 0.
    """

    size: int = 1
    dispatch: str = "replicated"
    placement: str = "contiguous"
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"invalid expert_parallel_size={self.size!r}: must be an int >= 1")
        if self.dispatch not in EXPERT_PARALLEL_DISPATCH:
            raise ValueError(f"invalid expert_parallel_dispatch={self.dispatch!r}: must be one "
                             f"of {EXPERT_PARALLEL_DISPATCH}")
        if not isinstance(self.placement, str) or not self.placement.strip():
            raise ValueError(f"invalid expert_placement={self.placement!r}: 'contiguous' or "
                             "the path of a placement file")
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                or not 0 < self.timeout_s < float("inf")):
            raise ValueError(f"invalid expert_parallel_timeout_s={self.timeout_s!r}: must be "
                             "a number of seconds > 0")


@dataclass
class EngineConfig:
    """The aggregate configuration of one engine."""

    model: ModelConfig
    speculative: SpeculativeConfig | None = None
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
