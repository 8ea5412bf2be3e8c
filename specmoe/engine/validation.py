"""Checks of a request against the loaded model, shared by the Python API and the server.

`SamplingParams` checks what holds for any model (types, finiteness, ranges). What depends on
the model runs here, before a request reaches the engine, so that no value can fail an engine
step that other requests share: token ids inside the vocabulary, a prompt that leaves room in
the context, logprobs no wider than the vocabulary, stop strings only with a tokenizer, and a
temperature no smaller than the sampler's dtype handles.

Every failure is a ValueError whose message starts "invalid <field>" and names the value and
what would be accepted (the server turns it into a 400 with `param` = the field).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmoe.sampling_params import SamplingParams

# The sampler divides float32 logits by the temperature after shifting them by the row maximum
# (`sample.ops.compute_probs`), so any normal float32 is safe; a subnormal one is not a
# temperature anyone means, and its reciprocal overflows.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class RequestValidator:
    """The model-dependent limits of one engine.

    Attributes:
        vocab_size: the target's vocabulary (token ids in [0, vocab_size)).
        max_model_len: context limit in tokens; a prompt must leave at least one slot.
        has_tokenizer: text prompts and stop strings need one.
        max_speculative_tokens: the largest per-request K the engine's speculation policy
            honours (the adaptive policy: its K; None: any, as the static policy).
    """

    vocab_size: int
    max_model_len: int
    has_tokenizer: bool
    max_speculative_tokens: int | None = None

    def check_prompt(self, token_ids: list[int]) -> None:
        """Raises ValueError ("invalid prompt ...") for an empty prompt, an id outside the
        vocabulary or not an int, or a prompt that leaves no room to generate."""
        if not token_ids:
            raise ValueError("invalid prompt: it is empty (0 tokens)")
        bad = [t for t in token_ids if not _in_vocab(t, self.vocab_size)]
        if bad:
            raise ValueError(f"invalid prompt token ids {bad[:5]}: must be integers in "
                             f"[0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"invalid prompt: {len(token_ids)} tokens leave no room to "
                             f"generate within max_model_len={self.max_model_len}")

    def check_params(self, params: SamplingParams) -> None:
        """Raises ValueError ("invalid <field>=...") for values the model cannot serve."""
        if 0 < params.temperature < MIN_TEMPERATURE:
            raise ValueError(f"invalid temperature={params.temperature!r}: must be 0 (greedy) "
                             f"or at least {MIN_TEMPERATURE:.3g}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"invalid logprobs={params.logprobs}: at most the vocabulary "
                             f"size {self.vocab_size}")
        bad = [t for t in params.stop_token_ids if not _in_vocab(t, self.vocab_size)]
        if bad:
            raise ValueError(f"invalid stop_token_ids {bad[:5]}: must be integers in "
                             f"[0, {self.vocab_size})")
        if params.stop and not self.has_tokenizer:
            raise ValueError("invalid stop: stop strings need a tokenizer; this model has none")
        k, cap = params.num_speculative_tokens, self.max_speculative_tokens
        if k is not None and cap is not None and k > cap:
            raise ValueError(f"invalid num_speculative_tokens={k}: the adaptive speculation "
                             f"policy drafts at most {cap} tokens a step (the engine's K)")


def _in_vocab(token: object, vocab_size: int) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_size
