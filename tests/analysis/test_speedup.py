"""Speedup synthesis S(B, K) = AL / (Tt(B, K+1)/Tt(B, 1) + K Td/Tt) and acceptance lengths."""

from __future__ import annotations

import json

import pytest

from specmoe.analysis.speedup import (load_acceptance_lengths, parse_acceptance_lengths,
                                      speedup, speedup_table)


def test_speedup_table_by_hand():
    tt = {(1, 1): 10.0, (1, 2): 11.0, (1, 3): 12.0, (8, 1): 20.0, (8, 2): 40.0, (8, 3): 60.0}
    td = {1: 1.0, 8: 2.0}
    table = speedup_table(tt, td, {1: 1.8, 2: 2.4, 4: 3.3})   # K=4 needs T=5: skipped
    rows = {(r["B"], r["K"]): r for r in table["rows"]}
    assert set(rows) == {(1, 1), (1, 2), (8, 1), (8, 2)}
    assert rows[1, 2]["speedup"] == pytest.approx(2.4 / (1.2 + 2 * 0.1))
    assert rows[8, 1]["speedup"] == pytest.approx(1.8 / (2.0 + 0.1))
    assert table["best"][1] == {"K": 2, "speedup": pytest.approx(2.4 / 1.4)}
    assert table["best"][8]["speedup"] < 1.0
    assert table["breakeven_batch_size"] == 8


def test_speedup_table_with_a_given_draft_ratio_and_no_breakeven():
    tt = {(1, 1): 1.0, (1, 2): 1.0}
    table = speedup_table(tt, None, {1: 1.5}, draft_cost_ratio=0.0)
    assert table["best"][1]["speedup"] == pytest.approx(1.5)
    assert table["breakeven_batch_size"] is None
    assert speedup(3.0, 1.5, 0.5) == pytest.approx(1.5)


def test_bundled_acceptance_lengths_are_the_real_pair_figures():
    al = load_acceptance_lengths()
    assert sorted(al) == [1, 2, 3, 4, 5, 6, 8]
    assert all(1.0 <= al[k] <= k + 1 for k in al)
    assert al[4] > al[1]
    assert load_acceptance_lengths(proposer="ngram", group="humaneval")[1] >= 1.0
    with pytest.raises(ValueError, match="group='nope'"):
        load_acceptance_lengths(group="nope")


def test_acceptance_lengths_from_a_bench_spec_file(tmp_path):
    path = tmp_path / "results.json"
    rows = [{"group": "all", "proposer": "draft", "k": 2, "temperature": 0.0,
             "mean_acceptance_length": 2.5},
            {"group": "all", "proposer": "draft", "k": 2, "temperature": 0.7,
             "mean_acceptance_length": 1.5},
            {"group": "all", "proposer": "none", "k": 0, "temperature": 0.0,
             "mean_acceptance_length": 1.0}]
    path.write_text(json.dumps({"rows": rows}))
    assert load_acceptance_lengths(path) == {2: 2.5}
    assert load_acceptance_lengths(path, temperature=0.7) == {2: 1.5}
    with pytest.raises(ValueError, match="proposer='ngram'"):
        load_acceptance_lengths(path, proposer="ngram")


def test_parse_acceptance_lengths():
    assert parse_acceptance_lengths("1=1.8, 4=3.3") == {1: 1.8, 4: 3.3}
    for bad in ("1:1.8", "0=1.0", "2=3.5", "x=1"):
        with pytest.raises(ValueError, match="invalid acceptance length"):
            parse_acceptance_lengths(bad)
