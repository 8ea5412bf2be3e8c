"""Random tiny models written to disk for tests that need a real checkpoint but no real
weights (engine, server and fuzz tests): they load through the normal HuggingFace-directory
loader in milliseconds. Also random experts, routings and weights and a small Qwen2-MoE
config for the kernel and fused-driver tests, and tiny DeepSeek-V2/V3 configs."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

TINY_LLAMA = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)


def save_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """A random Llama (TINY_LLAMA's shape, `overrides` replacing any of its fields) saved as
    a HuggingFace directory at `path`, without tokenizer files; returns `path`."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def random_bf16_experts(n: int, h: int, i: int, seed: int = 0):
    """N random bf16 SwiGLU experts (H=h, I=i) scaled so that activations stay O(1), for the
    expert kernel tests."""
    from specmoe.layers.moe.experts import RoutedExperts
    torch.manual_seed(seed)
    experts = RoutedExperts(n, h, i)
    with torch.no_grad():
        experts.w13.normal_(0, h ** -0.5)
        experts.w2.normal_(0, i ** -0.5)
    return experts.to(torch.bfloat16).requires_grad_(False)


def random_routing(t: int, n: int, k: int, gen: torch.Generator, skewed: bool = False,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's output for t tokens over n experts, for the expert kernel tests: k
    distinct experts per token (as top-k routing gives), positive weights of `dtype`;
    skewed: most tokens pick experts 0 and 1 (more than 32 rows each from T = 36) and a
    fixed few more, many experts see none."""
    scores = torch.rand(t, n, generator=gen)
    if skewed:
        scores[:, :2] += 10 * (torch.rand(t, 1, generator=gen) < 0.9)
        scores[:, 2:min(n, 2 + k)] += 1
    ids = scores.topk(k, dim=-1).indices                            # [T, k] int64
    weights = (torch.rand(t, k, generator=gen) + 0.1).to(dtype)    # [T, k]
    return ids, weights


def randomize_(model: torch.nn.Module, seed: int = 0, zero_router: bool = False
               ) -> torch.nn.Module:
    """Every parameter of `model` random in place, N(0, 0.1^2) (norm weights 1 + that),
    from a generator seeded with `seed`; zero_router: the MoE routers' gates zero (every
    expert tied). Returns the model, in eval mode without gradients."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1 + noise if name.endswith("norm.weight") else noise)
            if zero_router and name.endswith("router.gate.weight"):
                p.zero_()
    return model.eval().requires_grad_(False)


def qwen2_moe_arch(moe_intermediate_size: int, shared_gate: bool = True):
    """A small Qwen2-MoE-style `ArchConfig` for the fused decoder driver tests: 3 layers, the
    first and last MoE (16 experts, top 4, a shared expert of 96 with its sigmoid gate if
    `shared_gate`), the middle one dense; hidden 128, vocabulary 300."""
    from specmoe.config import ArchConfig, MoEConfig
    moe = MoEConfig(num_experts=16, top_k=4, moe_intermediate_size=moe_intermediate_size,
                    norm_topk_prob=True, shared_expert_intermediate_size=96,
                    has_shared_expert_gate=shared_gate, moe_layers=[0, 2])
    return ArchConfig(architecture="Qwen2MoeForCausalLM", vocab_size=300, hidden_size=128,
                      intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=512, attention_bias=True,
                      moe=moe)


# DeepSeek (Multi-head Latent Attention): transformers' eager attention repeats key/value
# heads num_attention_heads // num_key_value_heads times, so the two must be equal.
_DEEPSEEK = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                 n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
_DEEPSEEK_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                      mscale=0.707, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                      rope_theta=10000.0)
DEEPSEEK_CASES = ("deepseek_v2_lite", "deepseek_v2_group_limited", "deepseek_v3",
                  "deepseek_v3_yarn_halves")


def deepseek_config(case: str, **base) -> transformers.PretrainedConfig:
    """A tiny DeepSeek transformers config (3 layers, the first dense; 8 routed experts top
    2 and a shared expert; kv_lora_rank 32, qk_nope 16, qk_rope 8, v 16, 4 heads); `base`
    gives the rest (vocab_size, hidden_size, intermediate_size, ...; its values for those
    fields are replaced).

    Cases: "deepseek_v2_lite" (q_proj without LoRA, greedy softmax routing),
    "deepseek_v2_group_limited" (q LoRA 48, group-limited greedy, scaling 2),
    "deepseek_v3" (q LoRA 48, sigmoid noaux_tc over 2 groups keeping 1, renormalised,
    scaling 2.5), "deepseek_v3_yarn_halves" (YaRN with mscale, RoPE on halves rather than
    interleaved pairs, no q LoRA, 4 groups keeping 2, not renormalised)."""
    cfg = {**base, **_DEEPSEEK}
    if case == "deepseek_v2_lite":
        return transformers.DeepseekV2Config(**cfg, q_lora_rank=None)
    if case == "deepseek_v2_group_limited":
        return transformers.DeepseekV2Config(**cfg, q_lora_rank=48,
                                             topk_method="group_limited_greedy", n_group=2,
                                             topk_group=1, routed_scaling_factor=2.0)
    if case == "deepseek_v3":
        return transformers.DeepseekV3Config(**cfg, q_lora_rank=48, n_group=2, topk_group=1,
                                             routed_scaling_factor=2.5)
    if case == "deepseek_v3_yarn_halves":
        return transformers.DeepseekV3Config(**cfg, q_lora_rank=None, n_group=4,
                                             topk_group=2, rope_interleave=False,
                                             norm_topk_prob=False,
                                             rope_parameters=_DEEPSEEK_YARN)
    raise KeyError(case)
