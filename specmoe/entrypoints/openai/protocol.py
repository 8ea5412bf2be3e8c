"""Request and response models of the OpenAI-compatible API (pydantic).

Requests follow OpenAI's field names and ranges; unknown fields are refused (400 naming the
field), as OpenAI's API does. Extensions (vLLM-style, as extra body fields): top_k, min_p,
ignore_eos, stop_token_ids and num_speculative_tokens (per-request K; 0 turns speculation
off). Responses carry `usage` and, as an extension, `spec_decode` (the request's speculation
statistics summed over its choices).

Types are strict: a bool is never read from 1 or "yes", a float never from a string or a
bool (an int is a float), and NaN or infinity is refused. Every text (prompt, message,
name, stop string, user) must be valid Unicode: a lone surrogate such as "\\ud800" cannot
be encoded as UTF-8 and is refused with a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_N = 16
MAX_LOGPROBS = 20
MAX_SPECULATIVE_TOKENS = 16
MAX_STOP_STRINGS = 16
# Engine requests one HTTP request may create: its prompts times n (vLLM caps n alone). Each
# engine request holds its own KV cache blocks and slot, so one call cannot flood the queue.
MAX_ENGINE_REQUESTS_PER_CALL = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (also for null)
# Integer fields are strict: true or 3.5 is refused, not read as 1 or 3.

NonNegInt = Annotated[int, Field(ge=0, strict=True)]
StrictInt = Annotated[int, Field(strict=True)]  # token ids: not true, not 1.0 or 1e3
StrictBool = Annotated[bool, Field(strict=True)]
# An int or a float, finite; not a bool and not a string (strict mode takes ints for floats).
StrictFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]


def check_text(value, what: str = "text"):
    """`value` unchanged when every string in it (a str, or nested lists of them) can be
    encoded as UTF-8. Raises ValueError naming the first lone surrogate (index in the string)
    otherwise; the tokenizer would fail on it with a TypeError (a 500)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{what} contains a lone surrogate U+{ord(value[exc.start]):04X} at character "
                f"{exc.start}: text must be valid Unicode (encodable as UTF-8)") from None
    elif isinstance(value, list):
        for item in value:
            check_text(item, what)
    return value


def num_prompts(prompt) -> int:
    """How many prompts a completions `prompt` holds: a string or a token-id list is one."""
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return 1
    return len(prompt)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """`include_usage`: a last chunk with the usage of the whole request.
    `continuous_usage_stats` (vLLM): every chunk carries the usage so far."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(strict=True, default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(strict=True, default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(strict=True, default=None, ge=0, lt=2**63)
    frequency_penalty: StrictFloat = 0.0
    presence_penalty: StrictFloat = 0.0
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    # extensions
    top_k: int = Field(strict=True, default=0, ge=-1)
    min_p: StrictFloat = Field(default=0.0, ge=0.0, le=1.0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[NonNegInt] | None = None
    num_speculative_tokens: int | None = Field(strict=True, default=None, ge=0,
                                               le=MAX_SPECULATIVE_TOKENS)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return check_text(stops, "a stop string")

    @field_validator("user")
    @classmethod
    def _check_user(cls, v: str | None) -> str | None:
        return check_text(v, "user")

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _check_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict | None) -> None:
        if v:
            raise ValueError("logit_bias is not supported")
        return None

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, v, info):
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed with stream=true")
        return v


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(strict=True, default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(strict=True, default=None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False
    best_of: int | None = Field(strict=True, default=None, ge=1, le=MAX_N)
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v, info: ValidationInfo):
        """Non-empty, valid Unicode, and at most MAX_ENGINE_REQUESTS_PER_CALL prompts x n
        (n is validated first: it is declared earlier)."""
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(isinstance(p, (str, list)) and len(p) == 0 for p in v):
            raise ValueError("prompt must not contain an empty prompt")
        n = info.data.get("n", 1)
        if num_prompts(v) * n > MAX_ENGINE_REQUESTS_PER_CALL:
            raise ValueError(
                f"{num_prompts(v)} prompts x n={n} make {num_prompts(v) * n} engine requests; "
                f"at most {MAX_ENGINE_REQUESTS_PER_CALL} per request: send fewer prompts per "
                "request or a smaller n")
        return check_text(v, "the prompt")

    @field_validator("max_tokens")
    @classmethod
    def _default_max_tokens(cls, v: int | None) -> int:
        """null means OpenAI's default (16), as an absent field does."""
        return COMPLETIONS_DEFAULT_MAX_TOKENS if v is None else v

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(f"best_of={v} is not supported (only best_of == n, here {n})")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: text or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _check_text(cls, v: str) -> str:
        return check_text(v, "the text")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", "name")
    @classmethod
    def _check_text(cls, v, info: ValidationInfo):
        return v if not isinstance(v, str) else check_text(v, f"the {info.field_name}")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(strict=True, default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(strict=True, default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs needs logprobs=true")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SpecDecodeInfo(BaseModel):
    """Speculation statistics of a response (extension), summed over its choices."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_acceptance_length: float = 1.0
    acceptance_per_position: list[float] = Field(default_factory=list)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    spec_decode: SpecDecodeInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    spec_decode: SpecDecodeInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    spec_decode: SpecDecodeInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specmoe"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def random_id(prefix: str) -> str:
    """A unique response id such as "cmpl-3f2a..."."""
    return f"{prefix}-{uuid.uuid4().hex}"
