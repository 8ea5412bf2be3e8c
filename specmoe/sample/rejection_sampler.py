"""Lossless verification of draft tokens: speculative (rejection) sampling (L5).

Sources:
    - Leviathan, Kalman and Matias, 2023, "Fast Inference from Transformers via Speculative
      Decoding", arXiv 2211.17192, Algorithm 1 and Sec. 3 (acceptance probability
      min(1, p(x) / q(x)); on rejection sample from norm(max(0, p - q)); Appendix A.1 proves the
      output is distributed as p).
    - Chen et al., 2023, "Accelerating Large Language Model Decoding with Speculative Sampling",
      arXiv 2302.01318, Algorithm 2 (the same modified rejection scheme over K drafts, with a
      bonus token sampled from the target's last distribution when all K are accepted).

Greedy rows (temperature 0) accept a draft token while it equals the target argmax, which is the
temperature -> 0 limit of the scheme above and reproduces greedy decoding exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specmoe.kernels.argmax import argmax
from specmoe.sample.ops import (SamplingTensors, compute_probs, draw_random,
                                exponential_race)


@dataclass(slots=True)
class RejectionOutput:
    """Result of verifying one batch of drafts.

    Attributes:
        output_token_ids: [batch_size, K + 1] int64: the accepted draft tokens, then one
            recovered token (at the first rejection) or bonus token (all K accepted), then -1
            padding. Row b emits `num_accepted[b] + 1` tokens.
        num_accepted: [batch_size] int64 in [0, K]: accepted draft tokens per request.
    """

    output_token_ids: Tensor
    num_accepted: Tensor


def rejection_sample(target_logits: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
                     sampling: SamplingTensors,
                     generators: list[torch.Generator | None]) -> RejectionOutput:
    """Verify K draft tokens per request against the target model, losslessly.

    For sampled rows, with p_i = compute_probs(target_logits[:, i]) and q_i the draft
    distribution: draft x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)) (Leviathan
    et al., 2023, Algorithm 1; Chen et al., 2023, Algorithm 2); at the first rejection the
    recovered token is sampled from norm(max(0, p_i - q_i)) (from p_i if that is all zero); if
    all K drafts are accepted a bonus token is sampled from p_K. Each emitted token is then
    distributed exactly as p (Leviathan et al., 2023, Appendix A.1). With `draft_probs=None`
    (a deterministic proposer such as n-gram) q_i is one-hot on x_i: accept with probability
    p_i(x_i), recover from p_i with x_i removed.

    Greedy rows (temperature 0) accept x_i while it equals argmax(target_logits[:, i]) and emit
    the target argmax at the first mismatch, or at position K (bonus) when all match.

    Vectorised over batch and positions; the only host loop is over generator groups when
    drawing random numbers. No host synchronisation. Random draws per row (skipped when every
    row is greedy), from `generators[b]`: uniforms [K], then exponentials [K + 1, vocab_size]
    (see `ops.draw_random` for rows sharing a generator).

    Args:
        target_logits: [batch_size, K + 1, vocab_size] float: target logits at the positions
            of [last token, x_1 .. x_K]; position K gives the bonus token distribution.
        draft_token_ids: [batch_size, K] integer draft tokens (K may be 0).
        draft_probs: [batch_size, K, vocab_size] float draft distributions q (already
            processed by the draft's own sampling parameters), or None.
        sampling: batch_size rows of sampling parameters, one per request.
        generators: batch_size `torch.Generator | None`, on the logits' device type.

    Returns:
        RejectionOutput with output_token_ids [batch_size, K + 1] and num_accepted
        [batch_size].

    Raises:
        ValueError: if any shape, dtype or count does not match the others.
    """
    _validate(target_logits, draft_token_ids, draft_probs, sampling, generators)
    batch_size, num_positions, vocab_size = target_logits.shape
    num_draft = num_positions - 1
    draft_token_ids = draft_token_ids.long()
    target_argmax = argmax(target_logits)  # [batch_size, K + 1]
    is_accepted = draft_token_ids == target_argmax[:, :num_draft]  # [batch_size, K]
    if not sampling.all_greedy:
        draws = draw_random(generators, num_draft, (num_positions, vocab_size),
                            target_logits.device)
        probs = compute_probs(target_logits.reshape(-1, vocab_size),
                              sampling.repeat_rows(num_positions))
        probs = probs.view(batch_size, num_positions, vocab_size)  # [batch_size, K + 1, V]
        is_sampled_accepted = _accept_sampled(probs, draft_token_ids, draft_probs,
                                              draws.uniforms)
        is_accepted = torch.where(sampling.is_greedy[:, None], is_accepted,
                                  is_sampled_accepted)
    num_accepted = is_accepted.long().cumprod(dim=1).sum(dim=1)  # [batch_size]
    greedy_emitted = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [batch_size]
    if sampling.all_greedy:
        emitted = greedy_emitted
    else:  # [batch_size] recovered or bonus token
        sampled = _recover_or_bonus(probs, draft_token_ids, draft_probs, num_accepted,
                                    draws.exponentials)
        emitted = torch.where(sampling.is_greedy, greedy_emitted, sampled)
    return RejectionOutput(_assemble(draft_token_ids, num_accepted, emitted), num_accepted)


def _accept_sampled(probs: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
                    uniforms: Tensor) -> Tensor:
    """[batch_size, K] bool: u_i < p_i(x_i) / q_i(x_i), i.e. accept w.p. min(1, p/q).

    Written as u * q < p: no division, and q = 0 accepts whenever p > 0 (ratio +inf).
    """
    num_draft = draft_token_ids.shape[1]
    index = draft_token_ids[..., None]  # [batch_size, K, 1]
    target_p = probs[:, :num_draft].gather(2, index).squeeze(2)  # [batch_size, K]
    if draft_probs is None:
        return uniforms < target_p
    draft_q = draft_probs.float().gather(2, index).squeeze(2)  # [batch_size, K]
    return uniforms * draft_q < target_p


def _recover_or_bonus(probs: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
                      num_accepted: Tensor, exponentials: Tensor) -> Tensor:
    """[batch_size] int64: a sample of norm(max(0, p_j - q_j)) at j = num_accepted.

    q_K is taken as 0, so position K (all accepted) samples the bonus token from p_K. Falls back
    to p_j where the residual is all zero. The exponentials at j are independent of the
    acceptance decisions that chose j, so the race stays exact.
    """
    batch_size, num_positions, vocab_size = probs.shape
    num_draft = num_positions - 1
    if num_draft == 0:  # plain sampling of one token
        return exponential_race(probs[:, 0], exponentials[:, 0])
    index = num_accepted[:, None, None].expand(batch_size, 1, vocab_size)  # [batch_size, 1, V]
    target_p = probs.gather(1, index).squeeze(1)  # [batch_size, V]
    is_bonus = (num_accepted == num_draft)[:, None]  # [batch_size, 1]
    if draft_probs is None:
        position = num_accepted.clamp(max=num_draft - 1)[:, None]  # [batch_size, 1]
        token = draft_token_ids.gather(1, position)  # [batch_size, 1]
        draft_q = torch.zeros_like(target_p).scatter_(1, token, 1.0)  # [batch_size, V]
    else:
        padded = torch.nn.functional.pad(draft_probs.float(), (0, 0, 0, 1))  # [B, K + 1, V]
        draft_q = padded.gather(1, index).squeeze(1)  # [batch_size, V]
    residual = (target_p - draft_q.masked_fill(is_bonus, 0.0)).clamp_min(0.0)
    has_residual = residual.sum(dim=-1, keepdim=True) > 0  # [batch_size, 1]
    residual = torch.where(has_residual, residual, target_p)
    position_exponentials = exponentials.gather(1, index).squeeze(1)  # [batch_size, V]
    return exponential_race(residual, position_exponentials)


def _assemble(draft_token_ids: Tensor, num_accepted: Tensor, emitted: Tensor) -> Tensor:
    """[batch_size, K + 1] int64: accepted drafts, the emitted token, then -1."""
    batch_size, num_draft = draft_token_ids.shape
    padded = torch.nn.functional.pad(draft_token_ids, (0, 1), value=-1)  # [batch_size, K + 1]
    positions = torch.arange(num_draft + 1, device=draft_token_ids.device)  # [K + 1]
    n = num_accepted[:, None]  # [batch_size, 1]
    out = torch.where(positions < n, padded, -1)
    return torch.where(positions == n, emitted[:, None], out)


def _validate(target_logits: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
              sampling: SamplingTensors, generators: list[torch.Generator | None]) -> None:
    if target_logits.dim() != 3 or target_logits.shape[1] < 1:
        raise ValueError("target_logits must have shape [batch_size, K + 1, vocab_size], got "
                         f"{tuple(target_logits.shape)}")
    batch_size, num_positions, vocab_size = target_logits.shape
    expected = (batch_size, num_positions - 1)
    if tuple(draft_token_ids.shape) != expected:
        raise ValueError(f"draft_token_ids must have shape {expected} (batch_size, K) to match "
                         f"target_logits {tuple(target_logits.shape)}, got "
                         f"{tuple(draft_token_ids.shape)}")
    if draft_token_ids.is_floating_point() or draft_token_ids.is_complex():
        raise ValueError(f"draft_token_ids must be an integer tensor, got {draft_token_ids.dtype}")
    if draft_probs is not None and tuple(draft_probs.shape) != (*expected, vocab_size):
        raise ValueError(f"draft_probs must have shape {(*expected, vocab_size)} "
                         f"(batch_size, K, vocab_size) or be None, got "
                         f"{tuple(draft_probs.shape)}")
    if sampling.num_rows != batch_size:
        raise ValueError(f"sampling has {sampling.num_rows} rows, expected one per request "
                         f"(batch_size={batch_size})")
    if len(generators) != batch_size:
        raise ValueError(f"got {len(generators)} generators, expected one per request "
                         f"(batch_size={batch_size})")
