"""Routed experts: the grouped forward against its per-token reference, backend selection on a
whole MoE model, and the expert-stats recorder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specmoe.config import ArchConfig, MoEConfig
from specmoe.layers.moe.backends import MOE_BACKENDS, expert_stats, moe_blocks, set_moe_backend
from specmoe.layers.moe.experts import RoutedExperts
from specmoe.layers.moe.stats import ExpertStatsRecorder, NullExpertStats
from specmoe.loader.model_loader import LoadedModel
from specmoe.models.decoder import DecoderModel
from specmoe.worker.model_runner import ModelRunner

NUM_EXPERTS = 8
HIDDEN = 32
INTERMEDIATE = 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _experts(seed: int = 0) -> RoutedExperts:
    torch.manual_seed(seed)
    experts = RoutedExperts(NUM_EXPERTS, HIDDEN, INTERMEDIATE)
    with torch.no_grad():
        experts.w13.normal_(0, 0.2)
        experts.w2.normal_(0, 0.2)
    return experts


def _random_routing(num_tokens: int, top_k: int, gen: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (as top-k routing gives) and positive weights."""
    scores = torch.rand(num_tokens, NUM_EXPERTS, generator=gen)
    topk_ids = scores.topk(top_k, dim=-1).indices                       # [T, k] int64
    topk_weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1  # [T, k]
    return topk_ids, topk_weights


def _check(experts: RoutedExperts, x: torch.Tensor, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor) -> None:
    with torch.no_grad():
        grouped = experts(x, topk_ids, topk_weights)
        reference = experts.forward_reference(x, topk_ids, topk_weights)
    assert grouped.shape == x.shape and grouped.dtype == x.dtype
    torch.testing.assert_close(grouped, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens,top_k", [(16, 2), (37, 3), (5, 1), (64, 4)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grouped_equals_reference_random_routing(num_tokens, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    _check(_experts(seed), x, *_random_routing(num_tokens, top_k, gen))


def test_experts_without_tokens():
    """Only experts 1 and 6 are used: the other six see zero tokens."""
    gen = torch.Generator().manual_seed(3)
    num_tokens = 9
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    topk_ids = torch.tensor([[1, 6], [6, 1]] * 4 + [[1, 6]])
    topk_weights = torch.rand(num_tokens, 2, generator=gen)
    _check(_experts(), x, topk_ids, topk_weights)


def test_only_the_last_expert_used():
    """Leading experts empty and the last one full: offsets past empty groups stay right."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, HIDDEN, generator=gen)
    _check(_experts(), x, torch.full((6, 1), NUM_EXPERTS - 1), torch.rand(6, 1, generator=gen))


def test_all_tokens_on_one_expert():
    gen = torch.Generator().manual_seed(5)
    experts = _experts()
    x = torch.randn(12, HIDDEN, generator=gen)
    topk_ids = torch.full((12, 1), 5)
    topk_weights = torch.rand(12, 1, generator=gen)
    _check(experts, x, topk_ids, topk_weights)
    with torch.no_grad():  # and it is that expert's output, scaled
        expected = experts.expert_forward(5, x) * topk_weights
        torch.testing.assert_close(experts(x, topk_ids, topk_weights), expected,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, NUM_EXPERTS])
def test_single_token(top_k):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, HIDDEN, generator=gen)
    _check(_experts(), x, *_random_routing(1, top_k, gen))


def test_top_k_equals_num_experts():
    """k = N: every expert gets every token."""
    gen = torch.Generator().manual_seed(7)
    experts = _experts()
    x = torch.randn(10, HIDDEN, generator=gen)
    topk_ids, topk_weights = _random_routing(10, NUM_EXPERTS, gen)
    _check(experts, x, topk_ids, topk_weights)
    with torch.no_grad():  # a dense mixture of all experts
        dense = torch.stack([experts.expert_forward(e, x) for e in range(NUM_EXPERTS)], 1)
        w = torch.zeros(10, NUM_EXPERTS).scatter_(1, topk_ids, topk_weights)
        torch.testing.assert_close(experts(x, topk_ids, topk_weights),
                                   (dense * w.unsqueeze(-1)).sum(1), atol=1e-5, rtol=1e-5)


def test_no_tokens():
    x = torch.randn(0, HIDDEN)
    _check(_experts(), x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))


def test_zero_weight_contributes_nothing():
    gen = torch.Generator().manual_seed(8)
    experts = _experts()
    x = torch.randn(4, HIDDEN, generator=gen)
    topk_ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    weights = torch.tensor([[1.0, 0.0]] * 4)
    with torch.no_grad():
        expected = torch.cat([experts.expert_forward(int(e), x[t:t + 1])
                              for t, e in enumerate(topk_ids[:, 0])])
        torch.testing.assert_close(experts(x, topk_ids, weights), expected,
                                   atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- a whole MoE model

MOE_LAYERS = [1, 2]  # layer 0 dense


def _moe_arch() -> ArchConfig:
    moe = MoEConfig(num_experts=NUM_EXPERTS, top_k=2, moe_intermediate_size=16,
                    norm_topk_prob=False, shared_expert_intermediate_size=24,
                    has_shared_expert_gate=True, moe_layers=MOE_LAYERS)
    return ArchConfig(architecture="Qwen2MoeForCausalLM", vocab_size=96, hidden_size=HIDDEN,
                      intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=64, attention_bias=True, moe=moe)


@pytest.fixture()
def runner() -> ModelRunner:
    torch.manual_seed(0)
    arch = _moe_arch()
    model = DecoderModel(arch, arch.max_position_embeddings)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norm weights and biases
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    model.eval().requires_grad_(False)
    loaded = LoadedModel(model, arch, Path("."), torch.device("cpu"), torch.float32,
                         arch.max_position_embeddings)
    return ModelRunner(loaded)


def _prefill_then_decode(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    cache = runner.new_cache(len(ids))
    logits = [runner.forward(cache, ids[:20]), runner.forward(cache, ids[20:24])]
    logits += [runner.forward(cache, [t]) for t in ids[24:]]
    return torch.cat(logits)  # [len(ids), vocab_size]


def test_moe_blocks_in_layer_order(runner):
    blocks = moe_blocks(runner.model)
    assert [b.layer_idx for b in blocks] == MOE_LAYERS


def test_model_logits_same_with_grouped_and_reference_backends(runner):
    ids = torch.randint(0, 96, (28,), generator=torch.Generator().manual_seed(1)).tolist()
    set_moe_backend(runner.model, "grouped")
    grouped = _prefill_then_decode(runner, ids)
    set_moe_backend(runner.model, "reference")
    for block in moe_blocks(runner.model):
        assert block.run_experts.__func__ is RoutedExperts.forward_reference
    reference = _prefill_then_decode(runner, ids)
    torch.testing.assert_close(grouped, reference, atol=1e-5, rtol=1e-5)
    set_moe_backend(runner.model, "grouped")
    for block in moe_blocks(runner.model):
        assert block.run_experts.__func__ is RoutedExperts.forward
    torch.testing.assert_close(_prefill_then_decode(runner, ids), grouped, atol=0, rtol=0)


def test_unknown_backend_raises(runner):
    with pytest.raises(ValueError, match="fused_triton") as info:
        set_moe_backend(runner.model, "fused_triton")
    for name in MOE_BACKENDS:
        assert name in str(info.value)  # names what would be accepted


def test_expert_stats_recorder(runner):
    recorder = ExpertStatsRecorder()
    expert_stats(runner.model).subscribe(recorder)
    block_inputs: dict[int, list[torch.Tensor]] = {}
    hooks = [b.register_forward_hook(
        lambda m, args, out: block_inputs.setdefault(m.layer_idx, []).append(args[0]))
        for b in moe_blocks(runner.model)]
    cache = runner.new_cache(16)
    runner.forward(cache, list(range(7)))  # prefill, 7 tokens
    runner.forward(cache, [7])             # decode, 1 token
    runner.forward(cache, [8, 9, 10])      # verification window, 3 tokens
    for h in hooks:
        h.remove()

    assert sorted(recorder.routing) == MOE_LAYERS  # dense layer 0 records nothing
    assert sorted(recorder.unique_experts) == MOE_LAYERS
    for layer in MOE_LAYERS:
        shapes = [tuple(ids.shape) for ids in recorder.routing[layer]]
        assert shapes == [(7, 2), (1, 2), (3, 2)]
        block = moe_blocks(runner.model)[MOE_LAYERS.index(layer)]
        for ids, x, num_unique in zip(recorder.routing[layer], block_inputs[layer],
                                      recorder.unique_experts[layer]):
            assert ids.dtype == torch.int64 and ids.device.type == "cpu"
            assert torch.equal(ids, block.router(x).topk_ids)  # the ids actually routed to
            assert num_unique == len(set(ids.flatten().tolist()))
            assert 2 <= num_unique <= min(NUM_EXPERTS, ids.numel())
        assert recorder.unique_experts[layer][1] == 2  # one token: its k distinct experts

    expert_stats(runner.model).unsubscribe(recorder)  # unsubscribing stops recording
    assert all(type(b.stats) is NullExpertStats for b in moe_blocks(runner.model))
    runner.forward(cache, [11])
    assert [len(v) for v in recorder.routing.values()] == [3, 3]


def test_expert_stats_hub_fans_out_to_its_subscribers(runner):
    """Two recorders subscribed to one model's hub see the same forwards; one that leaves
    sees no more; with none left the blocks hold the no-op recorder the fused driver needs."""
    hub = expert_stats(runner.model)
    assert hub is expert_stats(runner.model)  # one hub per model
    quiet = [b.stats for b in moe_blocks(runner.model)]
    first, second = ExpertStatsRecorder(), ExpertStatsRecorder()
    cache = runner.new_cache(16)
    with hub.subscribed(first):
        hub.subscribe(second)
        hub.subscribe(second)  # subscribing twice records once
        runner.forward(cache, list(range(5)))
        hub.unsubscribe(second)
        runner.forward(cache, [5])
    runner.forward(cache, [6])
    for layer in MOE_LAYERS:
        assert [tuple(t.shape) for t in first.routing[layer]] == [(5, 2), (1, 2)]
        assert torch.equal(first.routing[layer][0], second.routing[layer][0])
        assert len(second.routing[layer]) == 1
    assert hub.subscribers == ()
    assert all(type(b.stats) is NullExpertStats for b in moe_blocks(runner.model))
    # the blocks' own no-op recorders come back, so the fused driver keeps its table
    assert all(b.stats is q for b, q in zip(moe_blocks(runner.model), quiet))


# ---- the grouped_mm backend and choosing a backend from configuration ----------------------


@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (16, 2), (37, 3), (64, 4), (320, 8)])
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
def test_grouped_mm_equals_reference(num_tokens, top_k, skewed):
    """Random and skewed routings (most pairs on two experts, some experts empty)."""
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    topk_ids, topk_weights = _random_routing(num_tokens, top_k, gen)
    if skewed:
        scores = torch.rand(num_tokens, NUM_EXPERTS, generator=gen)
        scores[:, :2] += 10 * torch.rand(num_tokens, 2, generator=gen)
        topk_ids = scores.topk(top_k, dim=-1).indices
    experts = _experts(top_k)
    with torch.no_grad():
        out = experts.forward_grouped_mm(x, topk_ids, topk_weights)
        ref = experts.forward_reference(x, topk_ids, topk_weights)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_grouped_mm_bf16_within_rounding_of_the_fp32_reference():
    gen = torch.Generator().manual_seed(7)
    experts = _experts(7)
    x = torch.randn(40, HIDDEN, generator=gen)
    topk_ids, topk_weights = _random_routing(40, 4, gen)
    with torch.no_grad():
        ref = experts.forward_reference(x, topk_ids, topk_weights)
        out = experts.to(torch.bfloat16).forward_grouped_mm(
            x.bfloat16(), topk_ids, topk_weights.bfloat16())
    # bf16 keeps 8 bits: inputs, weights, the hidden activations and the output each round
    torch.testing.assert_close(out.float(), ref, atol=0.05 * ref.abs().max().item(), rtol=0.05)


def test_grouped_mm_backend_gives_the_reference_logits(runner):
    ids = torch.randint(0, 96, (28,), generator=torch.Generator().manual_seed(2)).tolist()
    set_moe_backend(runner.model, "reference")
    reference = _prefill_then_decode(runner, ids)
    set_moe_backend(runner.model, "grouped_mm")
    for block in moe_blocks(runner.model):
        assert block.run_experts.__func__ is RoutedExperts.forward_grouped_mm
    torch.testing.assert_close(_prefill_then_decode(runner, ids), reference,
                               atol=1e-5, rtol=1e-5)
    set_moe_backend(runner.model, "grouped")


def test_auto_backend_follows_device_and_kernels():
    from specmoe.config import MOE_BACKEND_CHOICES
    from specmoe.layers.moe.backends import resolve_moe_backend
    assert set(MOE_BACKEND_CHOICES) == {"auto", *MOE_BACKENDS}
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_moe_backend("auto", cpu, native_kernels=True) == "fused"
    assert resolve_moe_backend("auto", cpu, native_kernels=False) == "grouped_mm"
    assert resolve_moe_backend("auto", cuda, native_kernels=False) == "grouped_mm"
    assert resolve_moe_backend("reference", cpu, native_kernels=True) == "reference"
    with pytest.raises(ValueError, match="'loop'"):
        resolve_moe_backend("loop", cpu, native_kernels=True)


def test_model_config_refuses_an_unknown_backend():
    from specmoe.config import ModelConfig
    with pytest.raises(ValueError, match="moe_backend='fast'"):
        ModelConfig("m", moe_backend="fast")
