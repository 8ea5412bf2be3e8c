"""Batched verification: one rejection-sampling call per group of requests with equal K, or
one argmax over every row where all requests are greedy.

A step's requests may verify different numbers of drafts (per-request K, drafts cut by the
budget, proposers that find no match). Rows are grouped by their draft count so each call has
a rectangular [G, k + 1, vocab] block of target logits. Grouping, rather than padding, keeps
every request's random draws a function of its own k alone: a seeded request then samples the
same tokens whatever runs beside it (see `rejection_sample`, which draws k uniforms and
(k + 1) x vocab exponentials per row from the row's own generator).

Greedy requests draw nothing, so a batch of them needs neither groups nor the sampler: one
argmax over all their logits rows and a comparison per request give `rejection_sample`'s
greedy tokens (its reference; tests/engine/test_verification_stack.py checks they agree). The
sampler's dozen tensor operations per group cost ~0.5 ms a step at eight requests on a 2-core
CPU, 3% of a SmolLM2 step, and per-request K made several groups per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmoe.kernels.argmax import argmax
from specmoe.sample.ops import SamplingTensors
from specmoe.sample.rejection_sampler import rejection_sample
from specmoe.sampling_params import SamplingParams


@dataclass(slots=True)
class VerifyRow:
    """One request's verification input.

    Attributes:
        logits: [k + 1, vocab_size] float32 target logits at [last, d_1 .. d_k].
        draft_token_ids: the k drafts.
        draft_probs: [k, vocab_size] draft distributions q, or None (one-hot q).
        params: the request's sampling parameters.
        generator: the request's generator.
    """

    logits: torch.Tensor
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None
    params: SamplingParams
    generator: torch.Generator | None


@dataclass(slots=True)
class VerifyResult:
    """Tokens emitted for one request: its accepted drafts, then a recovered or bonus token.

    Attributes:
        token_ids: num_accepted + 1 tokens.
        num_accepted: accepted drafts.
    """

    token_ids: list[int]
    num_accepted: int


def verify_rows(rows: list[VerifyRow]) -> list[VerifyResult]:
    """Rejection-sample every row, grouped by draft count (all greedy: `_verify_greedy`);
    results in the order of rows."""
    if rows and all(r.params.is_greedy for r in rows):
        return _verify_greedy(rows)
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(len(row.draft_token_ids), []).append(i)
    results: list[VerifyResult | None] = [None] * len(rows)
    for members in groups.values():
        for i, result in zip(members, _verify_group([rows[i] for i in members])):
            results[i] = result
    return results


def _verify_group(rows: list[VerifyRow]) -> list[VerifyResult]:
    logits = _stack(rows)  # [G, k + 1, vocab_size]
    device = logits.device
    draft_ids = torch.tensor([r.draft_token_ids for r in rows], dtype=torch.long,
                             device=device).view(len(rows), -1)  # [G, k]
    sampling = SamplingTensors.from_params([r.params for r in rows], device)
    out = rejection_sample(logits, draft_ids, _draft_probs(rows, draft_ids),
                           sampling, [r.generator for r in rows])
    tokens, num_accepted = out.output_token_ids.tolist(), out.num_accepted.tolist()
    return [VerifyResult(t[:n + 1], n) for t, n in zip(tokens, num_accepted)]


def _verify_greedy(rows: list[VerifyRow]) -> list[VerifyResult]:
    """Greedy rows: each accepts its drafts while they equal the target argmax at their
    position and emits the argmax at the first mismatch (at position k: the bonus token),
    as `rejection_sample` does for greedy rows, from one argmax over all the rows."""
    best = argmax(_flat(rows)).tolist()  # [sum of k + 1]
    results, offset = [], 0
    for r in rows:
        drafts = r.draft_token_ids
        target = best[offset:offset + len(drafts) + 1]
        offset += len(target)
        n = 0
        while n < len(drafts) and drafts[n] == target[n]:
            n += 1
        results.append(VerifyResult([*drafts[:n], target[n]], n))
    return results


def _back_to_back(rows: list[VerifyRow]) -> bool:
    """Whether the rows' logits lie back to back in one tensor, each contiguous, of one
    dtype and vocabulary (the usual case: consecutive slices of the forward's logits)."""
    first = rows[0].logits
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for r in rows:
        t = r.logits
        if not (t.is_contiguous() and t.dtype == first.dtype and t.dim() == first.dim()
                and t.shape[1:] == first.shape[1:] and t.data_ptr() == end
                and t.untyped_storage().data_ptr() == storage):
            return False
        end += t.numel() * t.element_size()
    return True


def _flat(rows: list[VerifyRow]) -> torch.Tensor:
    """The rows' [k + 1, vocab_size] logits as one [sum of k + 1, vocab_size] tensor: a view
    where they lie back to back (`_back_to_back`), which a copy would add to every step,
    else a concatenated copy."""
    first = rows[0].logits
    if first.dim() == 2 and _back_to_back(rows):
        total = sum(r.logits.shape[0] for r in rows)
        return first.as_strided((total, first.shape[1]), (first.shape[1], 1))
    return torch.cat([r.logits for r in rows])


def _stack(rows: list[VerifyRow]) -> torch.Tensor:
    """The rows' logits as one [G, k + 1, vocab_size] tensor: a view where they lie back to
    back (`_back_to_back`) with one shape, else a stacked copy."""
    first = rows[0].logits
    if all(r.logits.shape == first.shape for r in rows) and _back_to_back(rows):
        return first.as_strided((len(rows), *first.shape), (first.numel(), *first.stride()))
    return torch.stack([r.logits for r in rows])


def _draft_probs(rows: list[VerifyRow], draft_ids: torch.Tensor) -> torch.Tensor | None:
    """[G, k, vocab_size] q, one-hot for rows without probs; None if no row has any."""
    if all(r.draft_probs is None for r in rows) or draft_ids.shape[1] == 0:
        return None
    vocab_size = rows[0].logits.shape[-1]
    one_hot = torch.nn.functional.one_hot(draft_ids, vocab_size).float()  # [G, k, vocab]
    return torch.stack([one_hot[i] if r.draft_probs is None else r.draft_probs.float()
                        for i, r in enumerate(rows)])
