"""Appending emitted tokens to a request and deciding where it stops.

When verification emits several tokens at once, they are appended one at a time and the
earliest stop wins (EOS, stop token, stop string, max_tokens, context limit): nothing after
it is kept. A stop string is cut from the text, and the token that completed it is the last
token kept (token ids and logprobs are trimmed alike).
"""

from __future__ import annotations

from specmoe.outputs import TokenLogprob
from specmoe.request import Request


class OutputProcessor:
    """Finish logic and detokenisation for requests of one engine.

    Args:
        tokenizer: a transformers tokenizer (only `decode` is used), or None when prompts and
            outputs are token ids only (stop strings then cannot be used).
        eos_token_ids: token ids that end generation unless `ignore_eos` is set.
        max_model_len: context limit; a request stops with "length" when it reaches it.
    """

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(self, req: Request, token_ids: list[int],
               logprobs: list[TokenLogprob] | None = None) -> int:
        """Append `token_ids` (emitted in order) until the request finishes.

        Returns:
            the number of tokens kept (a prefix of `token_ids`).
        """
        for i, token in enumerate(token_ids):
            req.append_output_tokens([token])
            if logprobs is not None:
                req.output_logprobs.append(logprobs[i])
            self._check_stop(req, token)
            if req.is_finished:
                self._finalize_text(req)
                return i + 1
        return len(token_ids)

    def _check_stop(self, req: Request, token: int) -> None:
        params = req.params
        if token in self.eos_token_ids and not params.ignore_eos:
            req.finish_reason = "stop"
        elif token in params.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        elif params.stop and self._check_stop_strings(req):
            req.finish_reason = "stop"
        elif len(req.output_token_ids) >= params.max_tokens:
            req.finish_reason = "length"
        elif req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"

    def _check_stop_strings(self, req: Request) -> bool:
        # An incomplete UTF-8 character decodes as U+FFFD; a stop string may end in it.
        previous_len = len(req.text.rstrip("\ufffd"))
        req.text = self.decode(req.output_token_ids)
        best = None
        for stop in req.params.stop:
            at = req.text.find(stop, max(0, previous_len - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        req.text = req.text[:best[0]]
        req.stop_reason = best[1]
        return True

    def _finalize_text(self, req: Request) -> None:
        if not isinstance(req.stop_reason, str):  # a stop string already cut the text
            req.text = self.decode(req.output_token_ids)

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
