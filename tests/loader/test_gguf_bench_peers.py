"""`specmoe bench peers` on small GGUF files: fresh processes per engine, the JSON and
Markdown reports, the active bytes of a MoE shape, llama.cpp's rows where it is installed,
and clear errors for bad input."""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_gguf_blocks import _DENSE_TYPES, _MOE_TYPES, _dense_shapes, _moe_shapes, _write

from specmoe.analysis.gguf_peers import PeersBenchConfig, active_bytes_per_token
from specmoe.entrypoints.cli import main
from specmoe.kernels import gguf_gemm
from specmoe.loader.gguf_header import GGUFHeader

FAST = ["--reps", "2", "--context", "16", "--max-t", "3", "--decode-tokens", "2"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if gguf_gemm.kernel() is None:
        pytest.skip(f"GGUF block kernel unavailable: {gguf_gemm._lazy.unavailable}")
    d = tmp_path_factory.mktemp("peers")
    return {"dense": _write(d / "qwen2.gguf", "qwen2", _dense_shapes(), _DENSE_TYPES),
            "moe": _write(d / "qwen2moe.gguf", "qwen2moe", _moe_shapes(), _MOE_TYPES)}


def test_specmoe_alone_writes_both_reports(files, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["bench", "peers", "--model", str(files["moe"]), "--peers", "", *FAST,
                 "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert [r["engine"] for r in result["runs"]] == ["specmoe", "specmoe"]
    assert all("error" not in r for r in result["runs"])
    s = result["summary"]["specmoe"]
    assert s["runs"] == 2 and set(s["tt_ratio"]) == {"1", "2", "3"}
    assert s["tt_ratio"]["1"] == 1.0 and s["decode_tok_s"] > 0 and s["prefill_tok_s"] > 0
    assert all(0 < v <= 3 for v in s["unique_experts"].values())  # 3 experts in the file
    report = (out / "report.md").read_text()
    assert "| specmoe |" in report and "Distinct experts per layer" in report
    assert "report.md" in capsys.readouterr().out


def test_active_bytes_count_top_k_of_the_experts_and_one_embedding_row(files):
    header = GGUFHeader(files["moe"])
    sizes = {t.name: t.n_bytes for t in header.tensors}
    used = header.get_field("qwen2moe.expert_used_count").contents()
    experts = header.get_field("qwen2moe.expert_count").contents()
    embd = next(t for t in header.tensors if t.name == "token_embd.weight")
    expected = sum(n * used // experts if "_exps." in name else n
                   for name, n in sizes.items() if name != "token_embd.weight")
    expected += embd.n_bytes // int(embd.shape[1])
    assert active_bytes_per_token(files["moe"]) == expected < sum(sizes.values())


def test_llama_cpp_rows_where_installed(tmp_path):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (make peers)")
    from specmoe.loader.aliases import resolve_model_path
    model = resolve_model_path("smollm2-135m")  # llama.cpp needs a real vocabulary
    out = tmp_path / "report"
    assert main(["bench", "peers", "--model", str(model), *FAST, "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert [r["engine"] for r in result["runs"]] == ["specmoe", "llama-cpp", "llama-cpp",
                                                     "specmoe"]  # reversed every other rep
    assert result["summary"]["llama-cpp"]["runs"] == 2


def test_bad_input_is_named(files, tmp_path):
    with pytest.raises(ValueError, match="needs a .gguf file"):
        PeersBenchConfig(model=str(tmp_path))
    with pytest.raises(ValueError, match="invalid peers"):
        PeersBenchConfig(model=str(files["dense"]), peers=["vllm"])
    with pytest.raises(ValueError, match="invalid max_t=0"):
        PeersBenchConfig(model=str(files["dense"]), max_t=0)
    assert main(["bench", "peers", "--model", str(tmp_path / "x.gguf")]) == 2
