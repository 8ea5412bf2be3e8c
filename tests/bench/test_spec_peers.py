"""`specmoe bench spec` peers without running any: peer checks, the llama-cpp wiring of
`run_peers` with fake engines, greedy output comparison and the report's peer rows. None of
this needs llama-cpp-python installed."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from specmoe.bench import llamacpp_peer, spec_peers
from specmoe.bench.report import peer_table
from specmoe.bench.spec import BenchPrompt


def test_check_peers_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown peers \\['vllm'\\]"):
        spec_peers.check_peers(["transformers", "vllm"])
    spec_peers.check_peers(["transformers"])


def test_missing_llama_cpp_names_make_peers(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(llamacpp_peer.PeerUnavailableError, match="make peers"):
        spec_peers.check_peers(["llama-cpp"])
    # a ValueError, so the CLI prints it as an error message, not a traceback
    assert issubclass(llamacpp_peer.PeerUnavailableError, ValueError)


def test_ban_tokens_sets_logits_to_minus_inf():
    scores = np.zeros(8, dtype=np.float32)
    out = llamacpp_peer.ban_tokens({5, 2})(np.array([1, 2]), scores)
    assert np.isneginf(out[[2, 5]]).all() and (np.delete(out, [2, 5]) == 0).all()


def test_compare_outputs_counts_differing_prompts():
    outputs = {"llama-cpp plain": [[1, 2, 3], [4, 5, 6], [7, 8]],
               "ours plain": [[1, 2, 3], [4, 0, 6], [7, 8, 9]],
               "transformers plain": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]}
    got = spec_peers.compare_outputs(outputs, (("llama-cpp plain", "ours plain"),
                                               ("llama-cpp prompt lookup", "ours plain")))
    assert got == {"llama-cpp plain vs ours plain": {
        "differing_prompts": 2, "num_prompts": 3, "first_difference": [None, 1, 2]}}


def test_run_peers_wires_llama_cpp_modes(monkeypatch):
    """Ours and llama-cpp modes run on every prompt of the first group; the ratios and the
    greedy comparison come out of their (fake) tokens and seconds."""
    calls = []

    def fake_ours(engine, ids, k, max_tokens):
        calls.append(("ours", k, tuple(ids)))
        return [7] * max_tokens, max_tokens / 8.0          # 8 tok/s

    def fake_modes(model, prompts, max_tokens, eos, lookup):
        assert (model, prompts, max_tokens, sorted(eos), lookup) == (
            "t.gguf", [[7, 2], [3]], 4, [9], spec_peers.PROMPT_LOOKUP_TOKENS)
        return {"llama-cpp plain": lambda ids: ([7] * 3 + [ids[0]], 0.4),          # 10 tok/s
                "llama-cpp prompt lookup": lambda ids: ([7] * 4, 0.8)}             # 5 tok/s

    monkeypatch.setattr(spec_peers, "ours_generate", fake_ours)
    monkeypatch.setattr(llamacpp_peer, "llamacpp_modes", fake_modes)
    monkeypatch.setattr(llamacpp_peer, "import_llama_cpp", lambda: None)
    cfg = SimpleNamespace(peers=["llama-cpp"], max_tokens=4, target="t.gguf")
    engines = {"plain": SimpleNamespace(processor=SimpleNamespace(eos_token_ids={9}))}
    prompts = [BenchPrompt("humaneval", [7, 2]), BenchPrompt("humaneval", [3]),
               BenchPrompt("gsm8k", [4])]
    res = spec_peers.run_peers(cfg, engines, prompts, rows=[])
    assert calls == [("ours", 0, (7, 2)), ("ours", 0, (3,))]
    assert res["group"] == "humaneval" and res["k"] == 0
    assert res["tokens_per_s"] == {"ours plain": [8.0, 8.0], "llama-cpp plain": [10.0, 10.0],
                                   "llama-cpp prompt lookup": [5.0, 5.0]}
    assert res["ratios"] == pytest.approx({"ours plain / llama-cpp plain": 0.8,
                                           "ours plain / llama-cpp prompt lookup": 1.6})
    # ours emits 7 7 7 7; llama-cpp plain's last token is the prompt's first id
    assert res["greedy_comparison"] == {"llama-cpp plain vs ours plain": {
        "differing_prompts": 1, "num_prompts": 2, "first_difference": [None, 3]}}


def test_peer_table_renders_llama_cpp_rows():
    peers = {"group": "humaneval", "k": 4,
             "tokens_per_s": {"ours plain": [6.0, 8.0], "ours draft K=4": [12.0, 14.0],
                              "transformers plain": [4.0, 4.0],
                              "llama-cpp plain": [10.0, 11.0],
                              "llama-cpp prompt lookup": [7.0, 8.0]},
             "ratios": {"ours plain / llama-cpp plain": 0.66,
                        "ours draft K=4 / llama-cpp prompt lookup": 1.75},
             "greedy_comparison": {"llama-cpp plain vs ours plain": {
                 "differing_prompts": 1, "num_prompts": 2, "first_difference": [None, 17]}}}
    table = "\n".join(peer_table(peers))
    assert "| llama-cpp plain | 10.50 |" in table
    assert "| llama-cpp prompt lookup | 7.50 |" in table
    assert "| ours plain / llama-cpp plain | 0.66x |" in table
    assert "| ours draft K=4 / llama-cpp prompt lookup | 1.75x |" in table
    assert "| llama-cpp plain vs ours plain | 1/2 | -, 17 |" in table
    assert "quantised" in table
    # transformers-only results render as before: no llama-cpp note, no comparison table
    plain = {k: v for k, v in peers.items() if k != "greedy_comparison"}
    plain["tokens_per_s"] = {"ours plain": [6.0], "transformers plain": [4.0]}
    assert "quantised" not in "\n".join(peer_table(plain))
    assert "greedy output" not in "\n".join(peer_table(plain))
