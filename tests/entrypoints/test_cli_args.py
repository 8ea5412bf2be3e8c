"""Comma-list options parse to typed lists (defaults included) and a bad item is an argparse
error naming the value, not a traceback."""

from __future__ import annotations

import pytest

from specmoe.entrypoints.args import comma_list
from specmoe.entrypoints.cli import build_parser


def test_comma_list_types_and_blanks():
    assert comma_list(int)("1, 2,,4 ") == [1, 2, 4]
    assert comma_list(float)("0,0.7") == [0.0, 0.7]
    assert comma_list()("") == []


@pytest.mark.parametrize("argv,field,expected", [
    (["bench", "spec"], "ks", [1, 2, 3, 4, 5, 6, 8]),
    (["bench", "spec", "--ks", "4,8", "--temperatures", "0"], "ks", [4, 8]),
    (["bench", "spec", "--peers", "llama-cpp"], "peers", ["llama-cpp"]),
    (["bench", "throughput", "--concurrency", "1,16"], "concurrency", [1, 16]),
    (["study", "--batch-sizes", "1,8"], "batch_sizes", [1, 8]),
])
def test_options_parse_to_lists(argv, field, expected):
    assert getattr(build_parser().parse_args(argv), field) == expected


@pytest.mark.parametrize("argv", [["bench", "spec", "--ks", "2,x"],
                                  ["bench", "throughput", "--concurrency", "1,a"],
                                  ["bench", "spec", "--temperatures", "hot"]])
def test_bad_item_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert "invalid list" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"], ["demo"]])
def test_model_commands_default_to_the_auto_dtype(command):
    assert build_parser().parse_args(command).dtype == "auto"


def test_auto_dtype_is_bf16_only_where_the_native_kernels_run(monkeypatch):
    from specmoe import kernels
    from specmoe.loader.model_loader import resolve_dtype
    assert resolve_dtype("float32", None) == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert resolve_dtype("auto", "cuda") == "float32"
    expected = "bfloat16" if kernels.kernel_unavailable_reason() is None else "float32"
    assert resolve_dtype("auto", "cpu") == expected
    monkeypatch.setattr(kernels.gemv, "_enabled", False)
    assert resolve_dtype("auto", "cpu") == "float32"


@pytest.mark.parametrize("flags,match", [
    (["-k", "8"], "--num-speculative-tokens needs --draft"),
    (["--speculative-policy", "adaptive"], "--speculative-policy needs --draft"),
    (["--prompt-lookup-max", "5"], "--prompt-lookup-max needs --draft"),
    (["--draft", "ngram", "--speculative-policy", "static",
      "--speculative-batch-size-table", '{"1-4": 2}'], "contradicts --speculative-policy static"),
    (["--draft", "ngram", "--speculative-policy", "adaptive",
      "--speculative-batch-size-table", '{"1-4": 2}'], "contradicts --speculative-policy adap"),
])
def test_contradictory_speculation_flags_are_refused_before_loading(flags, match, capsys):
    """Refused by the CLI with one line (exit 2) before any model is read: the model named
    does not exist, so reaching the load would give another error."""
    from specmoe.entrypoints.cli import main
    for command in (["generate", "--prompt", "x"], ["serve"]):
        assert main(command + ["--model", "/no/such/model"] + flags) == 2
        err = capsys.readouterr().err
        assert match in err and "/no/such/model" not in err


@pytest.mark.parametrize("flags,policy,k", [
    ([], None, None), (["--draft", "ngram"], "static", 4),
    (["--draft", "ngram", "--speculative-batch-size-table", '{"1-4": 2}'], "batch_size_table", 4),
    (["--draft", "ngram", "--speculative-policy", "batch_size_table",
      "--speculative-batch-size-table", '{"1-4": 2}', "-k", "3"], "batch_size_table", 3),
])
def test_speculation_flags_take_their_defaults(flags, policy, k):
    from specmoe.entrypoints.args import speculative_from_args
    spec = speculative_from_args(build_parser().parse_args(["serve"] + flags))
    assert (spec and spec["policy"], spec and spec["num_speculative_tokens"]) == (policy, k)


@pytest.mark.parametrize("draft, fields", [
    ("ngram", {"method": "ngram"}),
    ("self:experts=2", {"method": "self", "self_draft_experts": 2}),
    ("qwen2.5-coder-0.5b", {"method": "draft", "draft_model": "qwen2.5-coder-0.5b"}),
])
def test_draft_flag_names_the_proposer(draft, fields):
    from specmoe.entrypoints.args import speculative_from_args
    spec = speculative_from_args(build_parser().parse_args(["serve", "--draft", draft]))
    assert {key: spec.get(key) for key in fields} == fields


def test_a_bad_self_draft_flag_is_refused_before_loading(capsys):
    from specmoe.entrypoints.cli import main
    assert main(["generate", "--prompt", "x", "--model", "/no/such/model",
                 "--draft", "self:layers=0-3"]) == 2
    assert "a self-draft is self:experts=K" in capsys.readouterr().err
