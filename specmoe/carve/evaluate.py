"""Quality of a carve in plain torch (float32): held-out perplexity of the dense and the
carved model on the same windows, and how often their next-token argmax agree."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmoe.carve import dense


@dataclass
class Quality:
    """perplexity: exp(mean next-token NLL) over all predicted positions; argmax_agreement:
    share of positions where the carved model's argmax is the dense model's (None for the
    dense model itself)."""

    perplexity: float
    argmax_agreement: float | None
    tokens: int


def carved_ffn(carved: dict):
    """`dense.forward`'s ffn hook running the carved layers (others dense)."""
    def ffn(index: int, w: dict, x: torch.Tensor) -> torch.Tensor:
        if index not in carved:
            return dense.dense_ffn(w, x)
        return carved[index](x.reshape(-1, x.shape[-1])).view(x.shape)
    return ffn


def quality(ckpt: dense.DenseCheckpoint, windows: torch.Tensor, carved: dict | None = None,
            batch: int = 4) -> tuple[Quality, Quality]:
    """(dense, carved) quality on windows [n, S] int64 (carved None: the dense one twice)."""
    nll = {"dense": 0.0, "carved": 0.0}
    agree, count = 0, 0
    ffn = None if carved is None else carved_ffn(carved)
    with torch.no_grad():
        for start in range(0, windows.shape[0], batch):
            ids = windows[start:start + batch]
            target = ids[:, 1:].reshape(-1)
            ref = dense.forward(ckpt, ids)[:, :-1].reshape(target.numel(), -1)
            got = ref if ffn is None else dense.forward(ckpt, ids, ffn)[:, :-1].reshape(
                target.numel(), -1)
            nll["dense"] += float(F.cross_entropy(ref, target, reduction="sum"))
            nll["carved"] += float(F.cross_entropy(got, target, reduction="sum"))
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            count += target.numel()
    ppl = {k: float(torch.tensor(v / count).exp()) for k, v in nll.items()}
    return Quality(ppl["dense"], None, count), Quality(ppl["carved"], agree / count, count)
