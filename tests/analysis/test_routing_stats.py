"""Routing analysis on hand-made traces (hand-computed overlap, unique experts and load), the
independence baselines (uniform: its closed form against exact enumeration; popularity: against
Monte Carlo), the JSONL schema (round trip, clear errors naming line and field) and
`specmoe routing analyze`."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from specmoe.analysis.routing_stats import (analyze_routing, popularity_baseline,
                                            sequence_runs, uniform_baseline)
from specmoe.analysis.routing_trace import (SCHEMA, RoutingTrace, parse_trace, read_trace,
                                            write_trace)
from specmoe.entrypoints.cli import main


def _header(num_experts: int = 4, top_k: int = 2, moe_layers=(0,)) -> dict:
    return {"schema": SCHEMA, "num_experts": num_experts, "top_k": top_k,
            "moe_layers": list(moe_layers), "model": "hand-made"}


def _row(seq: str, pos: int, experts, phase: str = "decode", **extra) -> dict:
    return {"seq": seq, "pos": pos, "token": pos, "phase": phase, "experts": experts, **extra}


def _trace(rows: list[dict], **header) -> RoutingTrace:
    return parse_trace([json.dumps(_header(**header))] + [json.dumps(r) for r in rows])


def _one_layer(seq: str, sets: list[list[int]], start: int = 0, phase: str = "decode"):
    return [_row(seq, start + i, [e], phase) for i, e in enumerate(sets)]


# --- hand-computed figures ------------------------------------------------------------------


def test_overlap_unique_and_load_of_a_hand_made_sequence():
    # N=4, k=2, one layer: {0,1} {1,2} {2,3} {0,1}
    trace = _trace(_one_layer("a", [[0, 1], [1, 2], [2, 3], [0, 1]]))
    a = analyze_routing(trace, max_distance=4, max_window=5)
    # d=1: |.∩.| = 1, 1, 0 -> 2/3 / k; d=2: 0, 1 -> 1/2 / k; d=3: 2 -> 1; d=4: no pair
    np.testing.assert_allclose(a.overlap[:, 0], [1 / 3, 1 / 4, 1.0, np.nan])
    assert a.num_pairs.tolist() == [3, 2, 1, 0]
    # W=2 unions: 3, 3, 4; W=3: 4, 4; W=4: 4; W=5: no window
    np.testing.assert_allclose(a.unique[:, 0], [2, 10 / 3, 4, 4, np.nan])
    assert a.num_windows.tolist() == [4, 3, 2, 1, 0]
    # load: expert 0: 2, 1: 3, 2: 2, 3: 1 tokens; mean 2
    assert a.expert_load.tolist() == [[2, 3, 2, 1]]
    np.testing.assert_allclose(a.expert_frequency, [[0.5, 0.75, 0.5, 0.25]])
    np.testing.assert_allclose(a.load_max_over_mean, [1.5])
    np.testing.assert_allclose(a.load_cv, [math.sqrt(0.5) / 2])
    assert (a.num_sequences, a.num_tokens) == (1, 4)
    np.testing.assert_allclose(a.overlap_uniform, 0.5)
    np.testing.assert_allclose(a.overlap_popularity, [(0.25 + 0.5625 + 0.25 + 0.0625) / 2])


def test_pairs_and_windows_stay_within_runs_of_consecutive_positions():
    """Two layers; sequence a has positions 0-2 and 5-6 (a gap), sequence b positions 0-1:
    no pair or window spans the gap or crosses sequences."""
    rows = [_row("a", 0, [[0, 1], [0, 1]]), _row("a", 1, [[0, 2], [2, 3]]),
            _row("b", 0, [[2, 3], [0, 1]]), _row("a", 2, [[0, 1], [2, 3]]),
            _row("b", 1, [[2, 3], [1, 2]]), _row("a", 6, [[1, 3], [0, 1]]),
            _row("a", 5, [[0, 3], [0, 1]])]
    a = analyze_routing(_trace(rows, moe_layers=(1, 3)), max_distance=3, max_window=3)
    assert [len(r) for r in sequence_runs(_trace(rows, moe_layers=(1, 3)))] == [3, 2, 2]
    # d=1 pairs: a0-a1, a1-a2, a5-a6, b0-b1. layer 1: 1, 1, 1, 2; layer 3: 0, 2, 2, 1
    np.testing.assert_allclose(a.overlap[0], [5 / 8, 5 / 8])
    # d=2 pairs: a0-a2 only. layer 1: 2; layer 3: 0
    np.testing.assert_allclose(a.overlap[1], [1.0, 0.0])
    assert a.num_pairs.tolist() == [4, 1, 0]
    # W=2 windows as the d=1 pairs: layer 1 unions 3, 3, 3, 2; layer 3: 4, 2, 2, 3
    np.testing.assert_allclose(a.unique[1], [11 / 4, 11 / 4])
    # W=3: a0-a2 only: layer 1 {0,1,2} = 3; layer 3 {0,1,2,3} = 4
    np.testing.assert_allclose(a.unique[2], [3, 4])
    np.testing.assert_allclose(a.unique_mean, a.unique.mean(axis=1))
    assert (a.num_sequences, a.num_tokens) == (2, 7)


def test_phases_select_rows_and_a_rejected_draft_yields_its_position():
    rows = (_one_layer("s", [[0, 1], [0, 2]], phase="prefill")
            + [_row("s", 2, [[2, 3]], "accepted"), _row("s", 3, [[0, 1]], "rejected"),
               _row("s", 3, [[1, 3]], "decode")])
    trace = _trace(rows)
    a = analyze_routing(trace, max_distance=1, max_window=2)
    assert a.num_tokens == 4  # the rejected draft at position 3 is off the sequence
    # pairs: {0,1}{0,2} -> 1, {0,2}{2,3} -> 1, {2,3}{1,3} -> 1
    np.testing.assert_allclose(a.overlap_mean, [0.5])
    only_prefill = analyze_routing(trace, max_distance=2, max_window=1, phases=["prefill"])
    assert only_prefill.num_tokens == 2 and only_prefill.num_pairs.tolist() == [1, 0]
    with_rejected = analyze_routing(trace, 1, 1, phases=["decode", "rejected"])
    assert with_rejected.num_tokens == 1  # position 3: the decode row wins over the draft
    assert with_rejected.expert_load.tolist() == [[0, 1, 0, 1]]
    only_rejected = analyze_routing(trace, 1, 1, phases=["rejected"])
    assert only_rejected.expert_load.tolist() == [[1, 1, 0, 0]]


def test_a_repeated_position_keeps_its_last_row():
    rows = _one_layer("s", [[0, 1], [0, 1]]) + [_row("s", 1, [[2, 3]], "decode")]
    a = analyze_routing(_trace(rows), max_distance=1, max_window=1)
    assert a.num_tokens == 2 and a.overlap_mean.tolist() == [0.0]


def test_bad_arguments_name_the_value():
    trace = _trace(_one_layer("s", [[0, 1]]))
    with pytest.raises(ValueError, match="max_distance=0"):
        analyze_routing(trace, max_distance=0)
    with pytest.raises(ValueError, match="max_window=-1"):
        analyze_routing(trace, max_window=-1)
    with pytest.raises(ValueError, match="'drafted'"):
        analyze_routing(trace, phases=["decode", "drafted"])
    with pytest.raises(ValueError, match="no rows of phases"):
        analyze_routing(trace, phases=["accepted"])


# --- baselines ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts,top_k", [(5, 2), (6, 3), (4, 1)])
def test_uniform_baseline_is_the_exact_expectation(num_experts, top_k):
    """N(1 - (1 - k/N)^W) equals the mean union size over every W-tuple of k-subsets."""
    subsets = [set(c) for c in itertools.combinations(range(num_experts), top_k)]
    for w in (1, 2, 3):
        exact = np.mean([len(set().union(*t)) for t in itertools.product(subsets, repeat=w)])
        np.testing.assert_allclose(uniform_baseline(num_experts, top_k, 3)[w - 1], exact)
    np.testing.assert_allclose(uniform_baseline(128, 8, 4)[3], 128 * (1 - (1 - 8 / 128) ** 4))


def _skewed_trace(rng: np.random.Generator, num_tokens: int, num_experts: int, top_k: int,
                  num_layers: int) -> RoutingTrace:
    """Tokens routed independently, with a Zipf-like expert popularity per layer."""
    experts = np.empty((num_tokens, num_layers, top_k), np.int64)
    for layer in range(num_layers):
        p = 1.0 / np.arange(1, num_experts + 1) ** (1.0 + 0.3 * layer)
        p = rng.permutation(p / p.sum())
        for t in range(num_tokens):
            experts[t, layer] = rng.choice(num_experts, top_k, replace=False, p=p)
    return RoutingTrace(num_experts, top_k, list(range(num_layers)), ["s"] * num_tokens,
                        np.arange(num_tokens), np.full(num_tokens, -1), np.full(num_tokens,
                        "decode"), experts, np.full(experts.shape, np.nan, np.float32))


def test_popularity_baseline_matches_monte_carlo():
    """sum_e [1 - (1 - q_e)^W] equals the mean union of W tokens drawn independently from the
    trace's own tokens (Monte Carlo, 20000 draws per W), within 4 standard errors."""
    rng = np.random.default_rng(0)
    trace = _skewed_trace(rng, 400, 16, 4, 2)
    a = analyze_routing(trace, max_window=6)
    for w in (2, 4, 6):
        draws = rng.integers(0, trace.num_rows, size=(20000, w))
        for layer in range(2):
            ids = trace.experts[draws, layer].reshape(20000, -1)  # [draws, w * k]
            onehot = np.zeros((20000, 16), bool)
            np.put_along_axis(onehot, ids, True, axis=1)
            union = onehot.sum(axis=1)
            stderr = union.std() / math.sqrt(len(union))
            assert abs(union.mean() - a.unique_popularity[w - 1, layer]) < 4 * stderr
    # independent tokens: the measured unique experts sit on the popularity baseline
    np.testing.assert_allclose(a.unique, a.unique_popularity, rtol=0.03)
    # popularity-weighted routing never exceeds the uniform baseline (Jensen), equal at W=1
    assert (a.unique_popularity <= a.unique_uniform[:, None] + 1e-9).all()
    np.testing.assert_allclose(a.unique_popularity[0], [4, 4])


def test_popularity_baseline_of_uniform_frequencies_is_the_uniform_baseline():
    freq = np.full((3, 32), 4 / 32)
    np.testing.assert_allclose(popularity_baseline(freq, 8),
                               np.repeat(uniform_baseline(32, 4, 8)[:, None], 3, axis=1))


# --- JSONL schema ---------------------------------------------------------------------------


def test_write_read_round_trip(tmp_path):
    rows = [_row("a", 0, [[0, 1], [2, 3]], "prefill", weights=[[0.7, 0.3], [0.6, 0.4]]),
            _row("a", 1, [[3, 1], [0, 2]], "rejected"),
            {"seq": "b", "pos": 4, "token": None, "phase": "accepted",
             "experts": [[1, 2], [1, 0]], "weights": [[0.5, 0.25], [1, 0]]}]
    trace = _trace(rows, moe_layers=(2, 5))
    again = read_trace(write_trace(trace, tmp_path / "t.jsonl"))
    assert again.header() == trace.header()
    assert again.seq == trace.seq and again.phase.tolist() == trace.phase.tolist()
    assert again.pos.tolist() == [0, 1, 4] and again.token.tolist() == [0, 1, -1]
    assert np.array_equal(again.experts, trace.experts)
    np.testing.assert_allclose(again.weights, trace.weights, equal_nan=True)
    assert np.isnan(again.weights[1]).all()
    assert again.phase_counts() == {"prefill": 1, "decode": 0, "accepted": 1, "rejected": 1}
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert "weights" not in json.loads(lines[2]) and json.loads(lines[3])["token"] is None


BAD_ROWS = [  # (JSONL line after the header, words the error must contain)
    ('{"seq": "a", "pos": 0, "phase": "decode"}', ["line 2", "'experts'", "missing"]),
    ('{"pos": 0, "phase": "decode", "experts": [[0, 1]]}', ["line 2", "'seq'", "missing"]),
    ('{"seq": "a", "pos": 0, "phase": "decode", "experts": [[0, 1, 2]]}',
     ["line 2", "'experts'", "top_k=2"]),
    ('{"seq": "a", "pos": 0, "phase": "decode", "experts": [[0, 4]]}',
     ["line 2", "'experts'", "expert id 4", "num_experts=4"]),
    ('{"seq": "a", "pos": 0, "phase": "decode", "experts": [[0, 1], [0, 1]]}',
     ["line 2", "'experts'", "1 lists"]),
    ('{"seq": "a", "pos": 0, "phase": "decode", "experts": [[1, 1]]}',
     ["line 2", "'experts'", "repeats"]),
    ('{"seq": "a", "pos": 0, "phase": "decode", "experts": [[0, 1.5]]}',
     ["line 2", "'experts'", "1.5", "integer"]),
    ('{"seq": "a", "pos": -1, "phase": "decode", "experts": [[0, 1]]}', ["line 2", "'pos'"]),
    ('{"seq": "a", "pos": 0, "phase": "draft", "experts": [[0, 1]]}',
     ["line 2", "'phase'", "'draft'"]),
    ('{"seq": 7, "pos": 0, "phase": "decode", "experts": [[0, 1]]}', ["line 2", "'seq'"]),
    ('{"seq": "a", "pos": 0, "token": "x", "phase": "decode", "experts": [[0, 1]]}',
     ["line 2", "'token'"]),
    ('{"seq": "a", "pos": 0, "phase": "decode", "experts": [[0, 1]], "weights": [[0.5]]}',
     ["line 2", "'weights'"]),
    ('{"seq": "a", "pos": 0, "phase": "decode", "experts": [[0, 1]], "weights": [[1, NaN]]}',
     ["line 2", "'weights'", "finite"]),
    ('{"seq": "a", "pos": 0, "phase": "decode", "experts": [[0, 1]]', ["line 2", "not valid JSON"]),
    ('[1, 2]', ["line 2", "JSON object"]),
]


@pytest.mark.parametrize("line,words", BAD_ROWS, ids=[str(i) for i in range(len(BAD_ROWS))])
def test_bad_rows_name_the_line_and_field(line, words):
    good = json.dumps(_row("a", 0, [[0, 1]]))
    with pytest.raises(ValueError) as info:
        parse_trace([json.dumps(_header()), line, good], "t.jsonl")
    for word in words:
        assert word in str(info.value)
    assert str(info.value).startswith("t.jsonl line 2")


@pytest.mark.parametrize("header,words", [
    ({"num_experts": 4, "top_k": 2, "moe_layers": [0]}, ["line 1", "'schema'"]),
    ({**_header(), "top_k": 5}, ["line 1", "top_k=5"]),
    ({**_header(), "num_experts": "4"}, ["line 1", "num_experts='4'"]),
    ({**_header(), "moe_layers": []}, ["line 1", "moe_layers"]),
    ({k: v for k, v in _header().items() if k != "top_k"}, ["line 1", "'top_k'", "missing"]),
])
def test_bad_headers_are_refused(header, words):
    with pytest.raises(ValueError) as info:
        parse_trace([json.dumps(header)])
    for word in words:
        assert word in str(info.value)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty routing trace"):
        read_trace(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_trace(tmp_path / "nope.jsonl")


# --- JSON and CLI ---------------------------------------------------------------------------


def test_to_json_is_strict_json_with_both_baselines_labelled():
    a = analyze_routing(_trace(_one_layer("a", [[0, 1], [1, 2], [2, 3]])), 4, 4)
    data = json.loads(json.dumps(a.to_json(), allow_nan=False))
    assert data["overlap"]["mean"][3] is None  # no pair at d=4
    unique = data["unique_experts"]
    assert unique["baseline_uniform"]["formula"] == "N(1 - (1 - k/N)^W)"
    assert unique["baseline_popularity"]["formula"] == "sum_e [1 - (1 - q_e)^W]"
    np.testing.assert_allclose(unique["baseline_uniform"]["mean"], uniform_baseline(4, 2, 4))
    assert data["expert_load"]["max_over_mean"]["0"] == pytest.approx(2 / 1.5)  # load 1, 2, 2, 1


def test_cli_prints_tables_and_writes_json_and_plots(tmp_path, capsys):
    rows = _one_layer("a", [[0, 1], [1, 2], [2, 3], [0, 1]], phase="prefill")
    path = write_trace(_trace(rows), tmp_path / "t.jsonl")
    assert main(["routing", "analyze", str(path), "--out", str(tmp_path / "out"),
                 "--max-distance", "3", "--max-window", "4", "--phases", "prefill"]) == 0
    out = capsys.readouterr().out
    for text in ("Overlap", "Unique experts", "uniform", "popularity", "0.333", "3.33"):
        assert text in out
    data = json.loads((tmp_path / "out" / "routing_analysis.json").read_text())
    assert data["phases"] == ["prefill"] and data["overlap"]["distances"] == [1, 2, 3]
    for name in ("overlap_vs_distance.png", "unique_experts_vs_window.png"):
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_trace_exits_2_naming_line_and_field(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_header()) + "\n" + json.dumps(_row("a", 0, [[0, 9]])) + "\n")
    assert main(["routing", "analyze", str(path)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl line 2" in err and "'experts'" in err and "expert id 9" in err
