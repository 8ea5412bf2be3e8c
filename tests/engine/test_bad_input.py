"""Errors a user can cause raise a clear exception naming the bad field or value.

SamplingParams and SpeculativeConfig fail at construction (no model needed); prompt checks
use SmolLM2 with a small context; engine options that need a second model use a tiny random
Llama saved with transformers' save_pretrained.
"""

from __future__ import annotations

import pytest

from specmoe import LLM, SamplingParams, SpeculativeConfig

MAX_MODEL_LEN = 16
TINY_VOCAB_SIZE = 512  # SmolLM2 has 49152


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A random 1-layer Llama with vocab_size 512 and no tokenizer files."""
    import torch
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32")


@pytest.fixture(scope="module")
def small_llm(smollm2) -> LLM:
    return LLM("smollm2-135m", dtype="float32", max_model_len=MAX_MODEL_LEN)


# ------------------------------------------------------------------ SamplingParams


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 2.5),
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("top_k", -2),
    ("logprobs", -1),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("num_speculative_tokens", -1),
    # wrong types, non-finite values and integers past int64 (issue 23, D11 and fuzzing)
    ("temperature", True),
    ("temperature", float("inf")),
    ("temperature", "0.5"),
    ("temperature", 1e9),
    ("top_p", float("nan")),
    ("min_p", None),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.5),
    ("max_tokens", True),
    ("logprobs", 2.0),
    ("stop", 5),
    ("stop_token_ids", [True]),
    ("ignore_eos", "false"),
    ("num_speculative_tokens", 10**9),
])
def test_bad_sampling_param_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0), ("min_p", 1.0), ("top_k", -1),
    ("max_tokens", 1), ("logprobs", 0), ("num_speculative_tokens", 0),
    ("temperature", 2), ("seed", 2**63 - 1), ("top_k", 2**70), ("stop", ("a", "b")),
])
def test_boundary_sampling_params_are_accepted(field, value):
    SamplingParams(**{field: value})


def test_single_stop_string_is_wrapped_in_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


def test_null_stop_fields_mean_none():
    # The OpenAI API sends `"stop": null` by default; the server forwards it as None.
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == [] and params.stop_token_ids == []


# ------------------------------------------------------------------ engine options


@pytest.mark.parametrize("spec, field", [
    ({"method": "medusa"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "draft"}, "draft_model"),
    ({"method": "ngram", "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ({"method": "ngram", "policy": "magic"}, "policy='magic'"),
    ({"method": "ngram", "policy": "adaptive", "match_trim": "yes"}, "match_trim='yes'"),
    ({"method": "ngram", "policy": "batch_size_table"}, "batch_size_table=None"),
    ({"method": "ngram", "batch_size_table": {"1-4": 2}}, "policy='static'"),
    ({"method": "ngram", "policy": "batch_size_table", "batch_size_table": {}},
     "batch_size_table={}"),
    ({"method": "ngram", "policy": "batch_size_table", "batch_size_table": {"4-1": 2}},
     "range '4-1'"),
    ({"method": "ngram", "policy": "batch_size_table", "batch_size_table": {"a": 2}},
     "range 'a'"),
    ({"method": "ngram", "policy": "batch_size_table", "batch_size_table": {"0-3": 2}},
     "range '0-3'"),
    ({"method": "ngram", "policy": "batch_size_table", "batch_size_table": {"1-4": -1}},
     "K=-1"),
    ({"method": "ngram", "policy": "batch_size_table", "batch_size_table": {"1-4": 2.5}},
     "K=2.5"),
    ({"method": "ngram", "policy": "batch_size_table",
      "batch_size_table": {"1-4": 2, "4-8": 1}}, "1-4 and 4-8 overlap"),
    ({"method": "ngram", "num_speculative_tokens": 2, "policy": "batch_size_table",
      "batch_size_table": {"1-4": 3}}, "K=3 for batch sizes 1-4"),
])
def test_bad_speculative_config_names_the_field(spec, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**spec)
    with pytest.raises(ValueError, match=field):
        LLM("smollm2-135m", speculative=spec)  # fails before any model is loaded


def test_unknown_speculative_option_is_rejected():
    with pytest.raises(TypeError, match="num_draft_tokens"):
        LLM("smollm2-135m", speculative={"method": "ngram", "num_draft_tokens": 4})


@pytest.mark.parametrize("kwargs, field", [
    ({"dtype": "int8"}, "dtype"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"max_model_len": 10**7}, "max_model_len"),
])
def test_bad_engine_option_names_the_field(tiny_llama_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_llama_dir), **kwargs)


@pytest.mark.parametrize("scheduler, field", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": -4}, "max_num_batched_tokens"),
    ({"block_size": 0}, "block_size"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"kv_cache_memory_bytes": 1.5}, "kv_cache_memory_bytes"),
])
def test_bad_scheduler_option_names_the_field(tiny_llama_dir, scheduler, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_llama_dir), scheduler=scheduler)


def test_request_larger_than_the_kv_cache_is_rejected_and_nothing_leaks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), scheduler={"num_kv_blocks": 2, "block_size": 16})
    with pytest.raises(ValueError, match="KV cache"):  # 20 + 20 > 32 slots
        llm.generate([[3, 4], [5] * 20], SamplingParams(max_tokens=20))
    kv = llm.engine.scheduler.kv_cache
    assert not llm.engine.has_unfinished_requests and kv.num_free_blocks == 2
    out = llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=20))[0]
    assert len(out.token_ids) <= 20  # the engine still serves requests that fit


def test_max_tokens_beyond_the_context_is_capped_not_rejected(tiny_llm):
    out = tiny_llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=10**6,
                                                        ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 128 - 3


@pytest.mark.parametrize("model", ["no-such-model-alias", "/nonexistent/dir/model.gguf"])
def test_unknown_model_raises_file_not_found(model):
    with pytest.raises(FileNotFoundError, match="no-such-model-alias|/nonexistent"):
        LLM(model)


def test_directory_without_config_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_unknown_draft_model_raises_file_not_found(tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match="/nonexistent/draft"):
        LLM(str(tiny_llama_dir),
            speculative={"method": "draft", "draft_model": "/nonexistent/draft",
                         "num_speculative_tokens": 2})


def test_draft_model_with_another_vocabulary_is_rejected(tiny_llama_dir, smollm2):
    with pytest.raises(ValueError, match="vocab") as info:
        LLM("smollm2-135m", dtype="float32",
            speculative={"method": "draft", "draft_model": str(tiny_llama_dir),
                         "num_speculative_tokens": 2})
    assert str(TINY_VOCAB_SIZE) in str(info.value)


# ------------------------------------------------------------------ prompts


@pytest.mark.parametrize("prompt", ["", [[]]], ids=["empty-text", "empty-token-ids"])
def test_empty_prompt_raises(small_llm, prompt):
    with pytest.raises(ValueError, match="prompt"):
        small_llm.generate(prompt, SamplingParams(max_tokens=2))


def test_prompt_longer_than_context_raises(small_llm):
    long_text = "one two three four five six seven eight nine ten " * 4
    assert len(small_llm.tokenizer.encode(long_text, add_special_tokens=False)) > MAX_MODEL_LEN
    with pytest.raises(ValueError, match="max_model_len"):
        small_llm.generate(long_text, SamplingParams(max_tokens=2))


def test_prompt_filling_the_context_exactly_raises(small_llm):
    with pytest.raises(ValueError, match="max_model_len"):
        small_llm.generate([[100] * MAX_MODEL_LEN], SamplingParams(max_tokens=2))


def test_prompt_one_short_of_the_context_generates_one_token(small_llm):
    out = small_llm.generate([[100] * (MAX_MODEL_LEN - 1)],
                             SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_bad_prompt_in_a_batch_fails_before_any_generation(small_llm):
    finished = []
    with pytest.raises(ValueError, match="prompt"):
        small_llm.generate(["hello", ""], SamplingParams(max_tokens=1),
                           on_finish=finished.append)
    assert finished == []


def test_wrong_number_of_sampling_params_raises(small_llm):
    with pytest.raises(ValueError, match="sampling_params"):
        small_llm.generate(["a", "b"], [SamplingParams(max_tokens=1)] * 3)


def test_text_prompt_without_tokenizer_raises(tiny_llm):
    with pytest.raises(ValueError, match="tokenizer"):
        tiny_llm.generate("hello", SamplingParams(max_tokens=1))


def test_stop_strings_without_tokenizer_raise(tiny_llm):
    with pytest.raises(ValueError, match="stop"):
        tiny_llm.generate([[3, 4, 5]], SamplingParams(max_tokens=1, stop=["x"]))


def test_chat_prompt_without_template_raises(tiny_llm):
    with pytest.raises(ValueError, match="chat template"):
        tiny_llm.chat_prompt([{"role": "user", "content": "hi"}])


def test_token_id_prompt_works_without_tokenizer(tiny_llm):
    out = tiny_llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3,
                                                        ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and out.text == ""
    assert all(0 <= t < TINY_VOCAB_SIZE for t in out.token_ids)


@pytest.mark.parametrize("bad_id", [TINY_VOCAB_SIZE, -1])
def test_prompt_token_id_outside_vocab_raises_value_error(tiny_llm, bad_id):
    with pytest.raises(ValueError, match="prompt"):
        tiny_llm.generate([[3, bad_id]], SamplingParams(max_tokens=1))


# ------------------------------------------------------------------ against the loaded model


@pytest.mark.parametrize("params, field", [
    (SamplingParams(temperature=1e-39), "temperature"),  # subnormal: 1/t overflows float32
    (SamplingParams(logprobs=TINY_VOCAB_SIZE + 1), "logprobs"),
    (SamplingParams(stop_token_ids=[TINY_VOCAB_SIZE]), "stop_token_ids"),
])
def test_params_the_model_cannot_serve_raise_before_the_engine(tiny_llm, params, field):
    with pytest.raises(ValueError, match=f"invalid {field}"):
        tiny_llm.make_request([3, 4], params)
    assert not tiny_llm.engine.has_unfinished_requests


def test_smallest_safe_temperature_samples_the_greedy_token(tiny_llm):
    from specmoe.engine.validation import MIN_TEMPERATURE
    greedy = tiny_llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4,
                                                           ignore_eos=True))[0]
    tiny = tiny_llm.generate([[3, 4, 5]], SamplingParams(
        temperature=MIN_TEMPERATURE, max_tokens=4, ignore_eos=True, seed=1))[0]
    assert tiny.token_ids == greedy.token_ids


@pytest.mark.parametrize("value", ["0", "-1", "lots", "nan", "inf"])
def test_bad_kv_cache_space_is_named(monkeypatch, value):
    from specmoe.config import SchedulerConfig
    monkeypatch.setenv("SPECMOE_KV_CACHE_SPACE", value)
    with pytest.raises(ValueError, match=f"invalid SPECMOE_KV_CACHE_SPACE='{value}'"):
        SchedulerConfig()


def test_kv_cache_space_sets_the_default_budget(monkeypatch):
    from specmoe.config import SchedulerConfig
    monkeypatch.setenv("SPECMOE_KV_CACHE_SPACE", "0.5")
    assert SchedulerConfig().kv_cache_memory_bytes == 1 << 29
    monkeypatch.delenv("SPECMOE_KV_CACHE_SPACE")
    assert SchedulerConfig().kv_cache_memory_bytes == 1 << 30
    assert SchedulerConfig(kv_cache_memory_bytes=4096).kv_cache_memory_bytes == 4096


def test_a_kv_cache_beyond_the_memory_is_refused_before_allocating():
    """bench throughput --concurrency 1e8 and advise --batch-sizes 1e9 asked for KV caches
    of 40-50 TB and died in the allocator; the cache says what it needs instead."""
    from specmoe import LLM
    with pytest.raises(ValueError, match=r"a KV cache of 3000000000 blocks of 16 tokens .*"
                                         r"GiB needed, .* GiB available on this machine"):
        LLM("tiny-moe", dtype="float32", scheduler={"num_kv_blocks": 3_000_000_000})
