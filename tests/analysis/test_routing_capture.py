"""Routing capture on the bundled tiny MoE (`tiny-moe`, fp32): rows tagged prefill / decode /
accepted / rejected agree with the engine's own counts, with a draft model and with n-gram
speculation, in a batch, after an early stop and under preemption; accepted drafts route
exactly as the same tokens do without speculation (fp32 greedy); capture is detached after
use and costs nothing when off."""

from __future__ import annotations

import numpy as np
import pytest

from specmoe import LLM, SamplingParams
from specmoe.analysis.routing_stats import analyze_routing
from specmoe.analysis.routing_capture import RoutingCapture, record_routing
from specmoe.analysis.routing_trace import RoutingTrace, read_trace, write_trace
from specmoe.engine.core import NullStepObserver
from specmoe.entrypoints.cli import main
from specmoe.layers.moe.backends import moe_blocks
from specmoe.layers.moe.stats import NullExpertStats

TARGET, DRAFT = "tiny-moe", "tiny-moe-draft"
PROMPTS = [
    "The city council approved the new budget on Tuesday, and the mayor said that the",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    "Once upon a time there was a little girl who lived in a village near the forest. She",
]
SPECULATIVE = {
    "draft_model": {"method": "draft", "draft_model": DRAFT, "num_speculative_tokens": 4},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(TARGET, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def plain_run(plain):
    return record_routing(plain, PROMPTS, GREEDY)


@pytest.fixture(scope="module", params=list(SPECULATIVE))
def spec_run(request, plain):
    return record_routing(plain.with_speculative(SPECULATIVE[request.param]), PROMPTS, GREEDY)


def _rows(trace: RoutingTrace, seq: str, phases=("prefill", "decode", "accepted")):
    """Row indices of `seq` in the given phases, by position."""
    idx = [i for i in range(trace.num_rows)
           if trace.seq[i] == seq and trace.phase[i] in phases]
    return sorted(idx, key=lambda i: trace.pos[i])


def _check_sequence(trace: RoutingTrace, out) -> None:
    """One non-rejected row per fed position, with the sequence's token: positions
    0 .. P + len(out) - 2 (the last token is never fed), or up to P + len(out) - 1 when the
    last token is an accepted draft (a stop among drafts); phase counts equal the engine's."""
    seq, s = out.request_id, out.spec_stats
    tokens = out.prompt_token_ids + out.token_ids
    rows = _rows(trace, seq)
    num_fed = len(tokens) - 1 if trace.phase[rows[-1]] != "accepted" else len(rows)
    assert num_fed in (len(tokens) - 1, len(tokens))
    assert trace.pos[rows].tolist() == list(range(num_fed))
    assert trace.token[rows].tolist() == tokens[:num_fed]
    count = lambda phase: sum(1 for i in range(trace.num_rows)  # noqa: E731
                              if trace.seq[i] == seq and trace.phase[i] == phase)
    assert count("prefill") == len(out.prompt_token_ids)
    assert count("accepted") == s.num_accepted_tokens
    assert count("rejected") == s.num_draft_tokens - s.num_accepted_tokens
    assert count("decode") == num_fed - len(out.prompt_token_ids) - s.num_accepted_tokens


def test_plain_decoding_has_only_prefill_and_decode_rows(plain_run):
    outs, trace = plain_run
    assert trace.num_experts == 32 and trace.top_k == 4 and trace.model == TARGET
    assert trace.experts.shape == (trace.num_rows, len(trace.moe_layers), 4)
    for out in outs:
        assert out.spec_stats.num_drafts == 0
        _check_sequence(trace, out)
    assert trace.phase_counts()["accepted"] == trace.phase_counts()["rejected"] == 0


def test_speculative_rows_match_the_engine_counts(spec_run):
    outs, trace = spec_run
    assert sum(o.spec_stats.num_accepted_tokens for o in outs) > 0
    assert sum(o.spec_stats.num_draft_tokens - o.spec_stats.num_accepted_tokens
               for o in outs) > 0  # both phases are exercised
    for out in outs:
        _check_sequence(trace, out)


def test_rejected_drafts_are_the_drafted_tokens_after_the_accepted_ones(spec_run):
    """A rejected row sits at a position whose sequence token differs from it, or after
    another rejected row of the same window."""
    outs, trace = spec_run
    for out in outs:
        tokens = out.prompt_token_ids + out.token_ids
        rejected = _rows(trace, out.request_id, ("rejected",))
        first_of_window = [i for i in rejected if trace.pos[i] - 1 not in
                           trace.pos[rejected].tolist()]
        for i in first_of_window:
            assert trace.token[i] != tokens[trace.pos[i]]


def test_accepted_tokens_route_as_without_speculation(plain_run, spec_run):
    """fp32 greedy: every token on the sequence (accepted drafts included) has the expert ids
    and gate weights it has in a run without speculation at the same position."""
    (plain_outs, plain_trace), (outs, trace) = plain_run, spec_run
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_outs]
    for out, ref in zip(outs, plain_outs):
        rows, ref_rows = _rows(trace, out.request_id), _rows(plain_trace, ref.request_id)
        accepted = [j for j, i in enumerate(rows) if trace.phase[i] == "accepted"]
        assert accepted
        assert np.array_equal(trace.experts[rows], plain_trace.experts[ref_rows])
        np.testing.assert_allclose(trace.weights[rows], plain_trace.weights[ref_rows],
                                   atol=1e-5, rtol=0)


def test_weights_are_the_top_k_gate_weights(spec_run):
    _, trace = spec_run
    w = trace.weights
    assert not np.isnan(w).any() and (w > 0).all() and (w <= 1).all()
    assert (np.diff(w, axis=-1) <= 0).all()  # most weighted first


def test_accepted_drafts_cut_by_a_stop_token_are_rejected(plain):
    """A stop token among accepted drafts: the drafts accepted after it are not kept, so they
    are tagged rejected and the engine's accepted count still matches."""
    llm = plain.with_speculative(SPECULATIVE["draft_model"])
    outs, trace = record_routing(llm, PROMPTS[0], GREEDY)
    out = outs[0]
    output_start = len(out.prompt_token_ids)
    stop = None
    for i in _rows(trace, out.request_id, ("accepted",)):
        pos, token = int(trace.pos[i]), int(trace.token[i])
        nxt = [j for j in _rows(trace, out.request_id) if trace.pos[j] == pos + 1]
        if (token not in out.token_ids[:pos - output_start] and nxt
                and trace.phase[nxt[0]] == "accepted"):
            stop = token
            break
    if stop is None:
        pytest.skip("no accepted draft followed by another accepted draft")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            stop_token_ids=[stop])
    llm = plain.with_speculative(SPECULATIVE["draft_model"])  # a fresh prefix cache
    outs, trace = record_routing(llm, PROMPTS[0], params)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == stop
    _check_sequence(trace, outs[0])
    last = _rows(trace, outs[0].request_id)[-1]  # the stop token was fed as a draft
    assert trace.phase[last] == "accepted" and trace.token[last] == stop
    assert trace.pos[last] == len(outs[0].prompt_token_ids) + len(outs[0].token_ids) - 1
    assert trace.phase_counts()["rejected"] > 0


def test_preempted_requests_are_not_recorded_twice():
    """A KV cache too small for the batch preempts requests, which recompute their tokens;
    each position still has one sequence row and the counts still match."""
    small = LLM(TARGET, dtype="float32", device="cpu",
                scheduler={"num_kv_blocks": 10, "block_size": 8},
                speculative=SPECULATIVE["ngram"])
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs, trace = record_routing(small, PROMPTS * 2, params)
    assert small.engine.stats.num_preemptions > 0
    for out in outs:
        _check_sequence(trace, out)


def test_prefix_cache_hits_have_no_rows(plain):
    """Positions served from the prefix cache are not computed, so they have no rows."""
    llm = plain.with_speculative(None)
    first, _ = record_routing(llm, PROMPTS[0], GREEDY)
    outs, trace = record_routing(llm, PROMPTS[0], GREEDY)
    rows = _rows(trace, outs[0].request_id)
    num_prompt = len(outs[0].prompt_token_ids)
    hit = num_prompt - trace.phase_counts()["prefill"]
    assert hit > 0 and hit % 16 == 0  # whole KV cache blocks
    assert trace.pos[rows].tolist() == list(range(hit, num_prompt + len(outs[0].token_ids) - 1))


def test_capture_is_detached_after_use_and_on_error(plain):
    blocks = moe_blocks(plain.target.model)
    assert all(isinstance(b.stats, NullExpertStats) for b in blocks)
    assert type(plain.engine.step_observer) is NullStepObserver
    with pytest.raises(ValueError, match="empty"):
        record_routing(plain, [[]], GREEDY)
    assert all(isinstance(b.stats, NullExpertStats) for b in blocks)
    assert type(plain.engine.step_observer) is NullStepObserver


def test_observer_without_recorder_fails_clearly(plain):
    llm = plain.with_speculative(None)
    llm.engine.step_observer = RoutingCapture(32, 4, [0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="attached"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))


def test_dense_model_has_no_routing():
    dense = LLM(DRAFT, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="no MoE layers"):
        record_routing(dense, PROMPTS[0], GREEDY)


def test_trace_round_trips_and_analyses(spec_run, tmp_path):
    _, trace = spec_run
    again = read_trace(write_trace(trace, tmp_path / "t.jsonl"))
    assert np.array_equal(again.experts, trace.experts) and again.seq == trace.seq
    a = analyze_routing(again)
    assert a.num_tokens == sum(trace.phase_counts()[p] for p in ("prefill", "decode",
                                                                 "accepted"))
    assert 0 < a.overlap_mean[0] <= 1 and (a.unique_mean <= a.unique_uniform + 1e-9).all()


def test_generate_cli_writes_a_trace(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    assert main(["generate", "--model", TARGET, "--draft", DRAFT, "-k", "3", "--max-tokens",
                 "12", "--routing-trace", str(path), "--prompt", PROMPTS[0]]) == 0
    trace = read_trace(path)
    counts = trace.phase_counts()
    assert counts["prefill"] > 0 and counts["accepted"] + counts["rejected"] > 0
    assert "routing trace" in capsys.readouterr().err
    assert main(["generate", "--model", TARGET, "--routing-trace",
                 str(tmp_path / "no" / "t.jsonl"), "--prompt", "x"]) == 2
    assert "--routing-trace" in capsys.readouterr().err
