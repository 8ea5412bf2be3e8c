"""Expert placement files (`layers.moe.placement`): a measured placement round-trips through
its JSON file, balancing a skewed load lowers the busiest rank's load, bad files are refused
with the bad value named; the token slices of the all-to-all dispatch."""

from __future__ import annotations

import json

import pytest

from specmoe.layers.moe.expert_parallel import token_slices
from specmoe.layers.moe.placement import (ExpertMap, max_over_mean, placement_report,
                                          read_placement, write_placement)

SKEWED = [100.0, 90.0, 80.0, 70.0, 1.0, 1.0, 1.0, 1.0]


def test_a_placement_round_trips_through_its_file(tmp_path):
    report = placement_report(SKEWED, 2, {"model": "m"})
    path = write_placement(report, tmp_path / "placement.json")
    emap = read_placement(path, 2, num_experts=len(SKEWED))
    assert emap == ExpertMap.balanced(SKEWED, 2)
    data = json.loads(path.read_text())
    assert data["load"] == SKEWED and data["source"] == {"model": "m"}
    assert data["num_ranks"] == 2 and data["num_experts"] == 8
    assert data["predicted"]["contiguous"]["rank_load"] == [340.0, 4.0]
    assert sum(data["predicted"]["balanced"]["rank_load"]) == sum(SKEWED)


def test_balancing_a_skewed_load_lowers_the_busiest_rank():
    contiguous = ExpertMap.contiguous(len(SKEWED), 2).rank_loads(SKEWED)
    balanced = ExpertMap.balanced(SKEWED, 2).rank_loads(SKEWED)
    assert max(balanced) < max(contiguous)
    assert max_over_mean(balanced) < 1.05 < max_over_mean(contiguous)
    report = placement_report(SKEWED, 2)["predicted"]
    assert report["balanced"]["max_over_mean"] < report["contiguous"]["max_over_mean"]
    assert max_over_mean([0.0, 0.0]) == 1.0


def test_a_hand_written_placement_is_read(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"placement": [0, 1, 0, 1]}))
    assert read_placement(path, 2, 4).local_experts(1) == [1, 3]


@pytest.mark.parametrize("content, num_experts, match", [
    ("{not json", 4, r"not JSON"),
    (json.dumps({"placement": [0, 1, 0, 1]}), 6, r"places 4 experts; the model has 6"),
    (json.dumps({"placement": [0, 1, 2, 1]}), 4, r"expert 2 on rank 2, outside 0\.\.1"),
    (json.dumps({"placement": [0, -1, 0, 1]}), 4, r"expert 1 on rank -1"),
    (json.dumps({"placement": [0, 0, 0, 0]}), 4, r"ranks \[1\] hold no expert"),
    (json.dumps({"placement": [0, "1", 0, 1]}), 4, r"list of int ranks, got \[0, '1', 0, 1\]"),
    (json.dumps({"placement": []}), 4, r"list of int ranks, got \[\]"),
    (json.dumps([0, 1, 0, 1]), 4, r"list of int ranks, got None"),
    (json.dumps({"placement": [0, 1], "num_ranks": 4}), 2, r"num_ranks=4: expert_parallel_size "
                                                          r"is 2"),
    (json.dumps({"placement": [0, 1], "num_experts": 3}), 2, r"num_experts=3 but"),
])
def test_bad_placement_files_are_refused_naming_the_value(tmp_path, content, num_experts,
                                                          match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        read_placement(path, 2, num_experts)
    assert str(path) in str(info.value)


def test_a_missing_placement_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json: no such file"):
        read_placement(tmp_path / "nope.json", 2)


def test_token_slices_cover_the_batch_once():
    assert token_slices(1, 2) == [0, 0, 1]         # rank 0 gets no token
    assert token_slices(5, 2) == [0, 2, 5]
    assert token_slices(0, 2) == [0, 0, 0]
    for t in (1, 5, 17, 80):
        for r in (1, 2, 3):
            b = token_slices(t, r)
            assert b[0] == 0 and b[-1] == t and all(x <= y for x, y in zip(b, b[1:]))
            assert max(y - x for x, y in zip(b, b[1:])) == -(-t // r)
