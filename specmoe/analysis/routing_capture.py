"""Capturing a routing trace from a running engine (`record_routing`).

A captured trace has one non-rejected row per computed position of each sequence: positions
served from the prefix cache have none (they were not computed), the last emitted token has
none unless it was an accepted draft (a sampled token is fed back only in the next step), and
positions recomputed after a preemption are not recorded twice. Routing is recorded for the
target model only (a draft model's routing is not part of the trace).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specmoe.analysis.routing_trace import RoutingTrace, concat_traces, empty_trace
from specmoe.engine.core import NullStepObserver
from specmoe.engine.scheduler import ScheduledRequest
from specmoe.layers.moe.backends import expert_stats, moe_blocks
from specmoe.outputs import RequestOutput
from specmoe.request import Request


class RoutingCapture(NullStepObserver):
    """Records a routing trace while an engine runs: an expert-stats recorder for the target's
    MoE blocks (subscribed to `backends.expert_stats`) and a step observer for the engine
    (`EngineCore.step_observer`) that tags the rows of each forward.

    During a step the routing stays on the model's device; `on_step_verified` (the step's
    output boundary) copies it to the host once. Use `record_routing` rather than attaching
    it by hand.

    Args:
        num_experts: N.
        top_k: k.
        moe_layers: the model's MoE layer indices, in order.
        model: the model's name, for the header.
    """

    def __init__(self, num_experts: int, top_k: int, moe_layers: Sequence[int],
                 model: str | None = None) -> None:
        self.header = empty_trace(num_experts, top_k, moe_layers, model)
        self._layer_index = {layer: i for i, layer in enumerate(moe_layers)}
        self._ids: list[torch.Tensor | None] = [None] * len(moe_layers)
        self._weights: list[torch.Tensor | None] = [None] * len(moe_layers)
        self._num_recorded: dict[str, int] = {}  # seq -> positions below have a sequence row
        self._parts: list[RoutingTrace] = []

    def record(self, layer_idx: int, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> None:
        """topk_ids, topk_weights [num_tokens, k] of one MoE layer's forward (kept until the
        step's `on_step_verified`; a later forward replaces them)."""
        i = self._layer_index[layer_idx]
        self._ids[i], self._weights[i] = topk_ids.detach(), topk_weights.detach()

    def on_step_verified(self, scheduled: list[ScheduledRequest],
                         requests: dict[str, Request], num_accepted: dict[str, int]) -> None:
        """Tag the rows of the step's forward and keep them (see the module docstring).

        Raises:
            RuntimeError: the recorded routing does not cover the step's forward (the
                capture is not attached to this engine's target).
        """
        experts, weights = self._take(sum(len(s.token_ids) for s in scheduled))
        seqs, positions, tokens, phases, keep = [], [], [], [], []
        for s in scheduled:
            for pos, token, phase in self._tag(s, requests.get(s.request_id), num_accepted):
                keep.append(phase is not None)
                if phase is not None:
                    seqs.append(s.request_id)
                    positions.append(pos)
                    tokens.append(token)
                    phases.append(phase)
        if seqs:
            mask = np.array(keep)
            h = self.header
            self._parts.append(RoutingTrace(
                h.num_experts, h.top_k, h.moe_layers, seqs, np.array(positions, np.int64),
                np.array(tokens, np.int64), np.array(phases, "<U8"), experts[mask],
                weights[mask], h.model))

    def _tag(self, s: ScheduledRequest, req: Request | None,
             num_accepted: dict[str, int]) -> list[tuple[int, int, str | None]]:
        """(position, token id, phase or None = not recorded) of each of s's rows."""
        num_gap = len(s.token_ids) - s.num_draft_tokens
        positions = range(s.start_pos, s.start_pos + len(s.token_ids))
        if req is None:  # aborted while the step ran
            return [(p, t, None) for p, t in zip(positions, s.token_ids)]
        done = self._num_recorded.get(s.request_id, 0)
        num_prompt = len(req.prompt_token_ids)
        phases: list[str | None] = [
            None if p < done else "prefill" if p < num_prompt else "decode"
            for p in positions[:num_gap]]
        n_acc = num_accepted.get(s.request_id, 0)
        phases += ["accepted"] * n_acc + ["rejected"] * (s.num_draft_tokens - n_acc)
        self._num_recorded[s.request_id] = max(done, s.start_pos + num_gap + n_acc)
        return list(zip(positions, s.token_ids, phases))

    def _take(self, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's routing on the host: experts [T, L, k] int64, weights [T, L, k]
        float32; clears it."""
        if any(x is None or x.shape[0] != num_tokens for x in self._ids):
            shapes = [None if x is None else tuple(x.shape) for x in self._ids]
            raise RuntimeError(f"routing capture: the step computed {num_tokens} tokens but "
                               f"the MoE layers recorded {shapes}: is the capture attached "
                               "to this engine's target model?")
        experts = torch.stack(self._ids, dim=1).cpu().numpy().astype(np.int64)
        weights = torch.stack(self._weights, dim=1).float().cpu().numpy()
        self._ids = [None] * len(self._ids)
        self._weights = [None] * len(self._weights)
        return experts, weights

    def trace(self) -> RoutingTrace:
        """Everything recorded so far, rows in the order they were computed."""
        return concat_traces([self.header, *self._parts])


def record_routing(llm, prompts, sampling_params=None
                   ) -> tuple[list[RequestOutput], RoutingTrace]:
    """Generate with `llm` (an `LLM` with a MoE target) while recording its routing.

    Attaches a `RoutingCapture` to the target's MoE blocks and to the engine, runs
    `llm.generate(prompts, sampling_params)`, and restores the previous recorder and
    observer (also on error). Sequence ids in the trace are the outputs' request ids.

    Returns:
        the outputs (as `LLM.generate`) and the trace.
    Raises:
        ValueError: the target has no MoE layers; otherwise as `LLM.generate`.
    """
    model = llm.target.model
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"model {llm.config.model.model!r} has no MoE layers: there is no "
                         "routing to record")
    capture = RoutingCapture(blocks[0].router.num_experts, blocks[0].router.top_k,
                             [b.layer_idx for b in blocks], llm.config.model.model)
    previous_observer = llm.engine.step_observer
    llm.engine.step_observer = capture
    try:
        with expert_stats(model).subscribed(capture):
            outputs = llm.generate(prompts, sampling_params)
    finally:
        llm.engine.step_observer = previous_observer
    return outputs, capture.trace()
