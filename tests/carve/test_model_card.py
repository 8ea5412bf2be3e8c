"""`specmoe models card` (issue 25, item 3): the acceptance replay is draft-then-verify (by
hand and against the engine's own speculative runs), and the card of a trained tiny carve
has every section with figures that add up."""

from __future__ import annotations

import json

import pytest
from carve_sources import DRAFT

from specmoe import LLM, SamplingParams
from specmoe.analysis.model_card import (CardConfig, accepted_runs, draft_acceptor,
                                         measure_card, ngram_acceptor, replay)
from specmoe.analysis.model_card_report import write_card

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_accepted_runs_count_consecutive_matches():
    assert accepted_runs([True, True, False, True, True, True, False]) == [2, 1, 0, 3, 2, 1, 0]
    assert accepted_runs([]) == []


def test_replay_steps_like_draft_then_verify():
    runs = accepted_runs([True, True, False, True, True, True, False, True, True])
    acceptor = lambda pos, k: (k, min(runs[pos], k))  # noqa: E731
    # token 0 comes from the prompt's forward; K=2: pos 1 accepts 1 (-> 3), pos 3 accepts 2
    # (-> 6), pos 6 accepts 0 (-> 7), pos 7 drafts only one (one token is left after it),
    # accepted (-> 9): 4 decode steps for the 8 tokens after the first
    assert replay(9, acceptor, 2) == {"steps": 4, "drafts": 4, "drafted": 7, "accepted": 4}
    # K=1: positions 1, 3, 5 and 7 each accept their one draft
    assert replay(9, acceptor, 1) == {"steps": 4, "drafts": 4, "drafted": 4, "accepted": 4}
    assert replay(1, acceptor, 2)["steps"] == 0


def test_ngram_acceptor_replays_prompt_lookup():
    prompt = [5, 6, 7, 8, 9]
    output = [5, 6, 7, 1, 2]
    accepted_at = ngram_acceptor(prompt, output, (1, 3))
    # after the prompt, the last token 9 never occurred before: nothing proposed
    assert accepted_at(0, 3) == (0, 0)
    # after [.., 9, 5], "5" matched at 0: proposes 6, 7, 8; the output has 6, 7, 1
    assert accepted_at(1, 3) == (3, 2)


def test_replay_matches_the_engines_speculative_runs(trained):
    """Replayed acceptance of the dense original drafting for the carve, and of n-gram, equals
    what the engine's greedy speculative decoding accepts, at K = 1..3."""
    target = LLM(str(trained), dtype="float32")
    draft = LLM(DRAFT, dtype="float32")
    prompts = [target.tokenizer.encode(t) for t in
               ("def add(a, b):\n    return", "The cat sat on the mat. The cat", "1, 2, 3, 4,")]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = [o.token_ids for o in target.generate(prompts, sp)]
    for method, make in (("draft", lambda p, o: draft_acceptor(draft.target, p, o)),
                         ("ngram", lambda p, o: ngram_acceptor(p, o, (1, 3)))):
        for k in (1, 2, 3):
            spec = target.with_speculative({"method": method, "num_speculative_tokens": k,
                                            "draft_model": DRAFT if method == "draft" else None})
            for p, o in zip(prompts, outputs):
                got = spec.generate([p], sp)[0]
                assert got.token_ids == o
                want = replay(len(o), make(p, o), k)
                assert (got.spec_stats.num_accepted_tokens, got.spec_stats.num_draft_tokens) == \
                    (want["accepted"], want["drafted"]), (method, k, p)


def test_card_of_a_trained_carve(trained, tmp_path):
    """The dense original is also the draft: against the dense target it is always accepted."""
    cfg = CardConfig(model=str(trained), dense=DRAFT, draft=DRAFT, dtype="float32",
                     datasets=["humaneval", "gsm8k"], num_prompts=2, max_tokens=16, max_k=3,
                     check_k=2, eval_windows=1, window=64)
    card = measure_card(cfg, progress=lambda _: None)
    assert card["carve"]["settings"]["num_experts"] == 12
    from specmoe.analysis.model_card import _carve_json
    assert _carve_json(DRAFT) is None  # an alias of a model that was not carved
    held = card["held_out"]
    assert held["all"]["tokens"] == sum(q["tokens"] for k, q in held.items() if k != "all")
    for q in held.values():
        assert q["dense_perplexity"] > 1 and q["carved_perplexity"] > 1
    dense_draft = card["acceptance"]["dense"]["draft"]
    assert [r["k"] for r in dense_draft] == [1, 2, 3]
    assert all(r["accepted"] == r["drafted"] for r in dense_draft)
    carved_draft = card["acceptance"]["carved"]["draft"]
    assert all(r["accepted"] <= r["drafted"] for r in carved_draft)
    assert card["routing"]["num_experts"] == 12 and card["routing"]["top_k"] == 4
    assert card["routing"]["num_sequences"] == 4
    g = card["greedy_agreement"]
    assert g["tokens"] == 4 * 16 and 0 <= g["shared_prefix_fraction"] <= 1
    for target in ("carved", "dense"):
        for method, c in card["check"][target].items():
            assert c["lossless"], (target, method)
            replayed = card["acceptance"][target][method][1]["mean_acceptance_length"]
            assert c["mean_acceptance_length"] == pytest.approx(replayed)
    paths = write_card(card, tmp_path / "card")
    assert [p.name for p in paths] == ["card.json", "README.md", "acceptance_vs_k.png"]
    text = (tmp_path / "card" / "README.md").read_text()
    assert "Held-out perplexity" in text and "| n-gram | carved |" in text
    assert json.loads((tmp_path / "card" / "card.json").read_text())["config"]["max_k"] == 3
