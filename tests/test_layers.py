"""The layer rules of docs/architecture.md hold: `lint-imports` (import-linter, contracts in
.importlinter) passes on the package, fails on a copy of it with one rule broken, and every
module of the package sits in a layer of the layers contract."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / ".importlinter"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    """lint-imports on the `specmoe` package found first from `cwd` (it puts cwd at the head
    of sys.path), with the repository's contracts; wide lines so contract names stay whole."""
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} not found: install the test extra (pip install -e '.[test]')")
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(CONFIG)], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"})


def _contract_names() -> dict[str, str]:
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    prefix = "importlinter:contract:"
    return {s[len(prefix):]: parser[s]["name"] for s in parser.sections()
            if s.startswith(prefix)}


def test_imports_keep_the_layer_rules():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in _contract_names().values():
        assert f"{name} KEPT" in result.stdout, result.stdout


# (file, line appended, contract that must break)
VIOLATIONS = [
    ("engine/scheduler.py", "import torch", "scheduling-no-torch"),
    ("engine/block_pool.py", "from specmoe.worker import kv_cache", "scheduling-no-torch"),
    ("config.py", "import torch", "contracts-no-torch"),
    ("sample/ops.py", "from specmoe.spec_decode import proposer", "sample-not-spec-decode"),
    ("models/registry.py", "def _lazy():\n    from specmoe.loader import weights", "layers"),
    ("worker/model_runner.py", "from specmoe.spec_decode import proposer", "layers"),
    ("kernels/gemv.py", "from specmoe.engine import scheduler", "layers"),
    ("analysis/study_findings.py", "def _lazy():\n    from specmoe.analysis import study_report",
     "no-cycles"),
]


@pytest.mark.parametrize(("path", "line", "contract"), VIOLATIONS,
                         ids=[f"{p}:{c}" for p, _, c in VIOLATIONS])
def test_a_broken_rule_fails(tmp_path: Path, path: str, line: str, contract: str):
    """The check is real: the same contracts on a copy of the package with one deliberate
    violation (function-level imports included) report that contract broken."""
    shutil.copytree(REPO / "specmoe", tmp_path / "specmoe", ignore=_not_python)
    target = tmp_path / "specmoe" / path
    target.write_text(target.read_text() + f"\n\n{line}  # deliberate violation\n")
    result = _lint(tmp_path)
    name = _contract_names()[contract]
    assert result.returncode != 0, result.stdout + result.stderr
    assert f"{name} BROKEN" in result.stdout, result.stdout


def _not_python(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__"
            or (not n.endswith(".py") and not Path(folder, n).is_dir())]


def test_every_module_is_in_a_layer():
    """A new package or top-level module is placed in the layers contract, not left outside
    it unchecked (`specmoe` itself and the `engine` folder, whose modules are placed one by
    one, excepted)."""
    parser = configparser.ConfigParser()
    parser.read(CONFIG)
    raw = parser["importlinter:contract:layers"]["layers"]
    placed = {m.strip() for line in raw.splitlines() for part in line.split("|")
              for m in part.split(":") if m.strip()}
    package = REPO / "specmoe"
    unplaced = []
    for file in sorted(package.rglob("*.py")):
        parts = file.relative_to(REPO).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module in ("specmoe", "specmoe.engine"):
            continue
        if not any(module == p or module.startswith(p + ".") for p in placed):
            unplaced.append(module)
    assert not unplaced, f"modules in no layer of .importlinter: {unplaced}"
