"""The small things a new user meets first: a version, `-k 0`, `--model` on every command,
defaults in the help, one-line errors for a CUDA device torch cannot use, what `models list`
says of a model that is not installed, default output folders that never overwrite, and no
tokenizer length warning for the engine's own limit."""

from __future__ import annotations

from importlib.metadata import version

import pytest

import specmoe
from specmoe.entrypoints.args import fresh_out_dir
from specmoe.entrypoints.cli import build_parser, main


def test_version_flag_and_attribute(capsys):
    assert specmoe.__version__ == version("specmoe")
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"specmoe {specmoe.__version__}"


def test_k_zero_turns_speculation_off():
    from specmoe.entrypoints.args import speculative_from_args
    assert speculative_from_args(build_parser().parse_args(
        ["generate", "--prompt", "x", "--draft", "ngram", "-k", "0"])) is None


def test_bench_spec_takes_model_like_every_command():
    assert build_parser().parse_args(["bench", "spec", "--model", "m"]).target == "m"
    assert build_parser().parse_args(["bench", "spec", "--target", "m"]).target == "m"


def test_help_shows_defaults_and_every_models_command(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 128)" in out and "0 is greedy (default: 0.0)" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "install, list, carve, synth and card models" in out


@pytest.mark.skipif(__import__("torch").version.cuda is not None, reason="a CUDA build")
def test_cuda_device_on_a_cpu_only_torch_is_one_line(capsys):
    assert main(["generate", "--model", "tiny-moe", "--device", "cuda", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CPU-only build" in err and "Traceback" not in err


def test_models_list_says_how_to_install_what_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["models", "list"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if " no " in r]
    assert rows, "every cache-installed model is missing from an empty cache"
    for row in rows:
        assert "not installed: specmoe models install " in row and "0.0 MB" not in row
    assert any("specmoe models install qwen2.5-coder-moe" in r for r in rows)


def test_default_output_folders_never_overwrite(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    first = fresh_out_dir("bench-moe")
    first.mkdir(parents=True)
    second = fresh_out_dir("bench-moe")
    assert second != first and not second.exists()


def test_a_prompt_longer_than_the_tokenizers_max_length_gives_no_warning(capfd):
    from specmoe import LLM
    llm = LLM("tiny-moe", dtype="float32")
    text = "word " * (llm.tokenizer.model_max_length + 10)  # 512 for tiny-moe's
    capfd.readouterr()
    with pytest.raises(ValueError, match="leave no room to generate within max_model_len"):
        llm.make_request(text)  # the engine's own limit, in its own words
    assert "Token indices sequence length" not in capfd.readouterr().err


@pytest.mark.parametrize("stream", [True, False])
def test_generate_streams_the_text_of_plain_generation_and_shows_the_load(stream, capsys):
    """Streamed or not, the text printed is what `LLM.generate` returns (a stop string in
    the middle: the streamed text holds back what may start one, then stops before it);
    stderr names the weights loaded with their count."""
    from specmoe import LLM, SamplingParams
    args = ["generate", "--model", "tiny-moe", "--dtype", "float32", "--draft",
            "tiny-moe-draft", "--prompt", "The history of", "--max-tokens", "40",
            "--stop", "States, the"] + ([] if stream else ["--no-stream"])
    assert main(args) == 0
    out, err = capsys.readouterr()
    want = LLM("tiny-moe", dtype="float32").generate(
        "The history of", SamplingParams(temperature=0, max_tokens=40, stop=["States, the"]))[0]
    assert want.finish_reason == "stop"
    assert out == want.text + "\n"
    assert "specmoe: loading tiny-moe: 422 tensors" in err


def test_stream_generate_writes_as_tokens_are_accepted():
    from specmoe import LLM, SamplingParams
    from specmoe.entrypoints.cli import stream_generate

    class Chunks(list):
        def write(self, text):
            self.append(text)

        def flush(self):
            pass
    llm = LLM("tiny-moe", dtype="float32")
    chunks = Chunks()
    out = stream_generate(llm, "The history of", SamplingParams(temperature=0, max_tokens=24),
                          chunks)
    assert len(chunks) > 5 and "".join(chunks) == out.text
    assert not llm.engine.has_unfinished_requests
