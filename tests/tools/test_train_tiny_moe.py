"""`tools/train_tiny_moe.py`: the corpus split, the tokenizer, and a smoke training run whose
loss goes down and whose output loads through our loader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import train_tiny_moe as train  # noqa: E402

from specmoe.config import ModelConfig  # noqa: E402
from specmoe.loader.model_loader import load_model  # noqa: E402


@pytest.fixture(scope="module")
def corpus_dir() -> Path:
    """The domain corpus shipped in the repository (the tools' default)."""
    path = train.default_corpus_dir()
    assert sorted(path.glob("*.txt")), f"no corpus text in {path}"
    return path


def test_split_holds_out_the_tail_of_every_file(corpus_dir: Path):
    split = train.split_corpus(corpus_dir, 0.1, max_chars_per_file=5000)
    assert split.train.keys() == split.val.keys()
    for name in split.train:
        text = (corpus_dir / f"{name}.txt").read_text(encoding="utf-8")[:5000]
        assert split.train[name] + split.val[name] == text
        assert 0 < len(split.val[name]) <= 0.15 * len(text)
        assert split.train[name].endswith("\n")


def test_tokenizer_is_byte_level_with_special_tokens(corpus_dir: Path):
    split = train.split_corpus(corpus_dir, 0.1, max_chars_per_file=20_000)
    tok = train.train_tokenizer(list(split.train.values()), 300)
    assert len(tok) == 300
    assert tok.convert_tokens_to_ids(train.SPECIAL_TOKENS) == [0, 1, 2]
    text = "unseen ✓ bytes: Ω"  # byte-level: nothing is out of vocabulary
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    stream = train.encode_stream(tok, ["a b", "c"])
    assert stream.dtype == torch.long and (stream == 0).sum() == 2  # one EOT per text


@pytest.mark.slow
def test_smoke_run_loss_goes_down_and_loads(corpus_dir: Path, tmp_path: Path):
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train.main(["--smoke", "--corpus-dir", str(corpus_dir),
                           "--out-dir", str(tmp_path), "--target-steps", "24"]) == 0
    finally:
        torch.set_num_threads(num_threads)
    for name in ("tiny-moe", "tiny-moe-draft"):
        log = json.loads((tmp_path / name / "train_log.json").read_text())
        losses = log["step_loss"]
        # The first evaluation comes after the steep early drop, so later ones differ from it
        # by noise; the held-out loss must instead end well below the untrained model's.
        last = log["val_loss"][-1][1]
        assert last < losses[0] - 0.3, f"{name}: validation loss {last}, initial {losses[0]}"
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
        loaded = load_model(ModelConfig(str(tmp_path / name), dtype="float32", device="cpu"))
        assert loaded.load_tokenizer().eos_token == "<|endoftext|>"
    assert json.loads((tmp_path / "tiny-moe" / "train_log.json").read_text())[
        "step_aux_loss"][0] > 0  # the router load-balancing loss is on
