"""OutputProcessor: where a request stops when verification emits several tokens at once.

A verification step hands `append` a block [accepted drafts..., recovered/bonus]; the earliest
stop in the block wins (EOS, stop token id, stop string, max_tokens, context limit) and nothing
after it is kept: token ids and logprobs are trimmed alike, and a stop string is cut from the
text. Uses the real SmolLM2 tokenizer (byte-level BPE, EOS = <|im_end|> = 2).
"""

from __future__ import annotations

import pytest

from specmoe.engine.output_processor import OutputProcessor
from specmoe.outputs import TokenLogprob
from specmoe.request import Request
from specmoe.sampling_params import SamplingParams

EOS = 2  # <|im_end|>
IM_START = 1  # <|im_start|>, a special token (skipped when decoding)
PROMPT = [IM_START, 9690, 198]  # three tokens; only the count matters here
MAX_MODEL_LEN = 1000


@pytest.fixture(scope="module")
def tokenizer():
    from specmoe.loader.aliases import ALIASES
    from specmoe.loader.gguf_file import load_gguf_tokenizer
    try:
        path = ALIASES["smollm2-135m"].path()
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2-135M GGUF not installed: {exc}")
    tok = load_gguf_tokenizer(path)
    assert tok.eos_token_id == EOS
    return tok


@pytest.fixture(scope="module")
def processor(tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer, {EOS}, MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def encode(tokenizer):
    def _encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)
    return _encode


def _request(**params) -> Request:
    params.setdefault("max_tokens", 100)
    return Request("r0", None, list(PROMPT), SamplingParams(**params))


def _logprobs(tokens: list[int], offset: int = 0) -> list[TokenLogprob]:
    """Distinct fake logprobs so trimming is visible: entry i has logprob -(offset + i)."""
    return [TokenLogprob(t, -float(offset + i), [(t, -float(offset + i))])
            for i, t in enumerate(tokens)]


def _append_in_blocks(processor: OutputProcessor, req: Request, tokens: list[int],
                      block_size: int) -> list[int]:
    """Feed `tokens` as consecutive verification blocks until the request finishes.

    Returns the number kept from each block."""
    kept, start = [], 0
    while start < len(tokens) and not req.is_finished:
        block = tokens[start:start + block_size]
        kept.append(processor.append(req, block, _logprobs(block, start)))
        start += len(block)
    return kept


def _assert_consistent(req: Request, kept_tokens: list[int]) -> None:
    """Token ids and logprobs are trimmed alike (logprob i belongs to token i)."""
    assert req.output_token_ids == kept_tokens
    assert [lp.token_id for lp in req.output_logprobs] == kept_tokens
    assert [lp.logprob for lp in req.output_logprobs] == [-float(i)
                                                          for i in range(len(kept_tokens))]


# ------------------------------------------------------------------ no stop in the block


def test_block_without_stop_is_kept_whole(processor, encode):
    tokens = encode("The capital of France is")
    req = _request()
    assert processor.append(req, tokens, _logprobs(tokens)) == len(tokens)
    assert not req.is_finished
    assert req.finish_reason is None and req.stop_reason is None
    _assert_consistent(req, tokens)


def test_logprobs_not_requested_stay_empty(processor, encode):
    tokens = encode("The capital") + [EOS] + encode(" of")
    req = _request()
    assert processor.append(req, tokens) == 3
    assert req.output_logprobs == []
    assert req.finish_reason == "stop"


# ------------------------------------------------------------------ EOS


@pytest.mark.parametrize("block_size", [1, 3, 100])
def test_eos_mid_block_keeps_tokens_up_to_eos(processor, encode, block_size):
    head = encode("Hello world")
    tokens = head + [EOS] + encode(" and then more text")
    req = _request()
    kept = _append_in_blocks(processor, req, tokens, block_size)
    assert sum(kept) == len(head) + 1
    _assert_consistent(req, head + [EOS])
    assert req.finish_reason == "stop"
    assert req.stop_reason is None
    assert req.text == "Hello world"  # EOS is special: in token_ids, not in the text


def test_eos_first_in_block(processor):
    req = _request()
    assert processor.append(req, [EOS, 504, 3575], _logprobs([EOS, 504, 3575])) == 1
    _assert_consistent(req, [EOS])
    assert req.finish_reason == "stop" and req.text == ""


def test_ignore_eos_keeps_going_past_eos(processor, encode):
    tokens = encode("Hello") + [EOS] + encode(" world") + [EOS] + encode(" again")
    req = _request(ignore_eos=True)
    assert processor.append(req, tokens, _logprobs(tokens)) == len(tokens)
    assert not req.is_finished
    _assert_consistent(req, tokens)


def test_ignore_eos_still_stops_at_max_tokens(processor, encode):
    tokens = [EOS] * 3 + encode(" world")
    req = _request(ignore_eos=True, max_tokens=2)
    assert processor.append(req, tokens, _logprobs(tokens)) == 2
    assert req.finish_reason == "length" and req.stop_reason is None
    _assert_consistent(req, [EOS, EOS])


def test_eos_on_the_last_allowed_token_is_stop_not_length(processor, encode):
    head = encode("Hello world")
    req = _request(max_tokens=len(head) + 1)
    tokens = head + [EOS] + encode(" more")
    assert processor.append(req, tokens, _logprobs(tokens)) == len(head) + 1
    assert req.finish_reason == "stop"


# ------------------------------------------------------------------ stop token ids


@pytest.mark.parametrize("block_size", [1, 2, 100])
def test_stop_token_id_mid_block(processor, encode, block_size):
    tokens = encode("The capital of France is Paris. It is big.")
    stop_id = tokens[3]  # " France"
    req = _request(stop_token_ids=[stop_id])
    kept = _append_in_blocks(processor, req, tokens, block_size)
    assert sum(kept) == 4
    _assert_consistent(req, tokens[:4])  # the stop token is kept, like EOS
    assert req.finish_reason == "stop"
    assert req.stop_reason == stop_id
    assert req.text == "The capital of France"


def test_special_stop_token_id_is_kept_in_ids_not_text(processor, encode):
    tokens = encode("Hello") + [IM_START] + encode(" world")
    req = _request(stop_token_ids=[IM_START])
    assert processor.append(req, tokens, _logprobs(tokens)) == 2
    _assert_consistent(req, tokens[:2])
    assert req.stop_reason == IM_START and req.text == "Hello"


def test_earliest_of_eos_and_stop_token_wins(processor, encode):
    word = encode(" world")
    tokens = encode("Hello") + [EOS] + word
    req = _request(stop_token_ids=word)
    assert processor.append(req, tokens, _logprobs(tokens)) == 2
    assert req.finish_reason == "stop" and req.stop_reason is None  # EOS came first

    tokens = encode("Hello") + word + [EOS]
    req = _request(stop_token_ids=word)
    assert processor.append(req, tokens, _logprobs(tokens)) == 2
    assert req.stop_reason == word[0]


# ------------------------------------------------------------------ stop strings


@pytest.mark.parametrize("block_size", [1, 3, 100])
def test_stop_string_completed_mid_block(processor, encode, block_size):
    tokens = encode("The capital of France is Paris. It is big.")
    paris = tokens.index(encode(" Paris")[0])
    req = _request(stop=["Paris"])
    kept = _append_in_blocks(processor, req, tokens, block_size)
    assert sum(kept) == paris + 1  # the token that completed the stop string is the last kept
    _assert_consistent(req, tokens[:paris + 1])
    assert req.finish_reason == "stop"
    assert req.stop_reason == "Paris"
    assert req.text == "The capital of France is "
    assert "Paris" not in req.text


@pytest.mark.parametrize("block_size", [1, 100])
def test_stop_string_spanning_two_tokens(processor, encode, block_size):
    tokens = encode("Hello world and more")
    assert tokens[:2] == encode("Hello") + encode(" world")
    req = _request(stop=["lo wo"])  # "Hel|lo" ends token 0, " wo|rld" starts token 1
    kept = _append_in_blocks(processor, req, tokens, block_size)
    assert sum(kept) == 2
    _assert_consistent(req, tokens[:2])
    assert req.text == "Hel"
    assert req.stop_reason == "lo wo"


def test_stop_string_spanning_two_blocks(processor, encode):
    hello, world = encode("Hello"), encode(" world and more")
    req = _request(stop=["lo wo"])
    assert processor.append(req, hello, _logprobs(hello)) == len(hello)
    assert not req.is_finished
    assert processor.append(req, world, _logprobs(world, len(hello))) == 1
    _assert_consistent(req, hello + world[:1])
    assert req.text == "Hel"


def test_earliest_completed_stop_string_wins(processor, encode):
    tokens = encode("Hello world and more text")
    # "world" completes at token 1, "more" at token 3: "world" wins though listed second.
    req = _request(stop=["more", "world"])
    assert processor.append(req, tokens, _logprobs(tokens)) == 2
    assert req.stop_reason == "world"
    assert req.text == "Hello "
    _assert_consistent(req, tokens[:2])


def test_stop_strings_completed_by_one_token_cut_at_the_earliest_start(processor, encode):
    tokens = encode("Hello world and more text")
    # Both complete at token 1 (" world"); "o w" starts at 4, "world" at 6.
    req = _request(stop=["world", "o w"])
    assert processor.append(req, tokens, _logprobs(tokens)) == 2
    assert req.stop_reason == "o w"
    assert req.text == "Hell"


def test_stop_string_inside_a_single_token(processor, encode):
    tokens = encode("The capital of France")
    req = _request(stop=["apit"])
    assert processor.append(req, tokens, _logprobs(tokens)) == 2
    assert req.text == "The c"
    _assert_consistent(req, tokens[:2])


def test_eos_before_stop_string_wins(processor, encode):
    tokens = encode("Hello") + [EOS] + encode(" world")
    req = _request(stop=["world"])
    assert processor.append(req, tokens, _logprobs(tokens)) == 2
    assert req.finish_reason == "stop" and req.stop_reason is None
    assert req.text == "Hello"


def test_unmatched_stop_string_then_length_gives_full_text(processor, encode):
    tokens = encode("The capital of France is Paris.")
    req = _request(stop=["Berlin"], max_tokens=4)
    assert processor.append(req, tokens, _logprobs(tokens)) == 4
    assert req.finish_reason == "length" and req.stop_reason is None
    assert req.text == "The capital of France"


@pytest.mark.parametrize("stop", ["🙂", "日本語"])
def test_stop_string_ending_in_a_split_multibyte_character(processor, encode, stop):
    tokens = encode("a" + stop + " b c d")
    req = _request(stop=[stop])
    processor.append(req, tokens, _logprobs(tokens))
    assert req.finish_reason == "stop"
    assert req.text == "a"


# ------------------------------------------------------------------ max_tokens


@pytest.mark.parametrize("first_block", [0, 3, 4])
def test_max_tokens_crossed_inside_a_block(processor, encode, first_block):
    tokens = encode("The capital of France is Paris. It is a big city.")
    req = _request(max_tokens=5)
    if first_block:
        assert processor.append(req, tokens[:first_block],
                                _logprobs(tokens[:first_block])) == first_block
        assert not req.is_finished
    block = tokens[first_block:first_block + 6]  # crosses max_tokens=5
    assert processor.append(req, block, _logprobs(block, first_block)) == 5 - first_block
    assert len(req.output_token_ids) == 5
    _assert_consistent(req, tokens[:5])
    assert req.finish_reason == "length" and req.stop_reason is None
    assert req.text == "The capital of France is"


def test_max_tokens_one(processor, encode):
    tokens = encode("The capital of France")
    req = _request(max_tokens=1)
    assert processor.append(req, tokens, _logprobs(tokens)) == 1
    _assert_consistent(req, tokens[:1])
    assert req.finish_reason == "length" and req.text == "The"


def test_stop_string_on_the_last_allowed_token_is_stop(processor, encode):
    tokens = encode("The capital of France is")
    req = _request(max_tokens=4, stop=["France"])
    assert processor.append(req, tokens, _logprobs(tokens)) == 4
    assert req.finish_reason == "stop" and req.stop_reason == "France"
    assert req.text == "The capital of "


# ------------------------------------------------------------------ context limit


@pytest.mark.parametrize("room", [1, 3])
def test_context_limit_reached_mid_block(tokenizer, encode, room):
    processor = OutputProcessor(tokenizer, {EOS}, max_model_len=len(PROMPT) + room)
    tokens = encode("The capital of France is Paris.")
    req = _request(max_tokens=100)
    assert processor.append(req, tokens, _logprobs(tokens)) == room
    assert req.num_tokens == processor.max_model_len
    _assert_consistent(req, tokens[:room])
    assert req.finish_reason == "length" and req.stop_reason is None
    assert req.text == tokenizer.decode(tokens[:room])


def test_context_limit_across_blocks(tokenizer, encode):
    processor = OutputProcessor(tokenizer, {EOS}, max_model_len=len(PROMPT) + 5)
    tokens = encode("The capital of France is Paris. It is big.")
    req = _request(max_tokens=100)
    assert _append_in_blocks(processor, req, tokens, 3) == [3, 2]
    assert req.num_tokens == len(PROMPT) + 5
    assert req.finish_reason == "length"


def test_without_tokenizer_text_is_empty():
    processor = OutputProcessor(None, {EOS}, MAX_MODEL_LEN)
    req = _request(max_tokens=3)
    assert processor.append(req, [5, 6, EOS, 7]) == 3
    assert req.finish_reason == "stop" and req.text == ""
