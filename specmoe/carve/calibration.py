"""Calibration and held-out text for carving: the repository's domain corpus
(`data/corpus/*.txt`: code, prose, papers, web; see its README and license) cut into
fixed-length token windows. The last `held_out_fraction` of every file (cut at a line
boundary) is held out for perplexity; windows are drawn from the rest, seeded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_WINDOW = 256
HELD_OUT_FRACTION = 0.1


def default_corpus_dir() -> Path:
    """`data/corpus/` of the repository this package runs from.

    Raises:
        FileNotFoundError: not there (an installed package without its repository: pass
            --corpus-dir).
    """
    path = Path(__file__).resolve().parents[2] / "data" / "corpus"
    if not any(path.glob("*.txt")):
        raise FileNotFoundError(f"no calibration corpus at {path}: pass --corpus-dir with "
                                ".txt files")
    return path


@dataclass
class CorpusText:
    """Per file (stem -> text): what calibration draws from and what is held out."""

    train: dict[str, str]
    held_out: dict[str, str]


def split_corpus(corpus_dir: Path, held_out_fraction: float = HELD_OUT_FRACTION
                 ) -> CorpusText:
    """Each `*.txt` file (but LICENSE*) split at the line boundary nearest (1 - fraction) of its length.

    Raises:
        FileNotFoundError: no .txt file in `corpus_dir`.
    """
    files = sorted(f for f in Path(corpus_dir).glob("*.txt")
                   if not f.name.upper().startswith("LICENSE"))
    if not files:
        raise FileNotFoundError(f"no .txt files in {corpus_dir}")
    train, held = {}, {}
    for f in files:
        text = f.read_text(encoding="utf-8")
        cut = text.rfind("\n", 0, int(len(text) * (1 - held_out_fraction))) + 1
        train[f.stem], held[f.stem] = text[:cut], text[cut:]
    return CorpusText(train, held)


def _encode(tokenizer, text: str) -> torch.Tensor:
    """A whole file's ids; verbose=False: the stream is cut into windows, so its length
    over the model's context is expected (transformers would warn)."""
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False, verbose=False))


def windows(tokenizer, texts: dict[str, str], num_windows: int, window: int,
            seed: int) -> torch.Tensor:
    """`num_windows` windows of `window` tokens, spread evenly over the files (by count),
    each starting at a seeded random offset of its file's token stream.

    Returns:
        [num_windows, window] int64.
    Raises:
        ValueError: a file shorter than one window.
    """
    gen = torch.Generator().manual_seed(seed)
    streams = {name: _encode(tokenizer, text)
               for name, text in sorted(texts.items())}
    names = list(streams)
    rows = []
    for i in range(num_windows):
        stream = streams[names[i % len(names)]]
        if stream.numel() < window:
            raise ValueError(f"corpus file {names[i % len(names)]!r} has {stream.numel()} "
                             f"tokens, fewer than one window of {window}")
        start = int(torch.randint(0, stream.numel() - window + 1, (1,), generator=gen))
        rows.append(stream[start:start + window])
    return torch.stack(rows)


def per_file_windows(tokenizer, texts: dict[str, str], per_file: int, window: int
                     ) -> dict[str, torch.Tensor]:
    """For held-out perplexity per domain: each file's first `per_file` non-overlapping
    windows (fewer if the file is short), [n, window] int64 per file stem."""
    out = {}
    for name, text in sorted(texts.items()):
        stream = _encode(tokenizer, text)
        n = min(per_file, stream.numel() // window)
        if n:
            out[name] = stream[:n * window].view(n, window)
    return out
