"""Compile the C kernels at first use and load them with ctypes.

The shared object is built with `gcc -O3 -march=native -fopenmp -shared -fPIC` into
`$SPECMOE_KERNEL_DIR` (default `~/.cache/specmoe/kernels`) under a name hashed from the
source, every header of this folder (whichever the source includes), the flags, the compiler
version, this CPU's feature flags and the torch version, so an edit (of a shared header too),
another compiler or another machine sharing the folder gets its own build. It is
written to a temporary name and renamed, so concurrent processes never load a half-written
file.

torch is imported first: its wheel loads its own `libgomp.so.1`, and the kernel's reference
to that soname then resolves to the same OpenMP runtime (one thread pool, no
oversubscription).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from specmoe.utils import progress

KERNEL_DIR_ENV = "SPECMOE_KERNEL_DIR"
DEFAULT_KERNEL_DIR = "~/.cache/specmoe/kernels"
CFLAGS = ("-O3", "-march=native", "-std=c11", "-fopenmp", "-shared", "-fPIC")
SOURCE_DIR = Path(__file__).resolve().parent


class KernelBuildError(RuntimeError):
    """The compiler is missing or rejected the source (message holds its output)."""


class UnsupportedCPU(KernelBuildError):
    """This machine lacks an instruction set the kernel needs: the plain-torch path is the
    expected one here, not a fault."""


def kernel_dir() -> Path:
    """The cache folder: `$SPECMOE_KERNEL_DIR`, else `~/.cache/specmoe/kernels`."""
    return Path(os.environ.get(KERNEL_DIR_ENV) or DEFAULT_KERNEL_DIR).expanduser()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_reason(required_flags: tuple[str, ...]) -> str | None:
    """Why this machine cannot run a kernel needing `required_flags` (not Linux on x86-64,
    or /proc/cpuinfo lacks a flag), or None (also when the flags cannot be read: the
    compiler decides then)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64, not {sys.platform}/{platform.machine()}"
    flags = _cpu_flags().split()
    if not flags:
        return None
    missing = [f for f in required_flags if f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else None


def _compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0] if out.stdout else ""


def build(source: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Path of the shared object for `source` (a .c file in this package), compiling it if
    the cache has none.

    Raises:
        KernelBuildError: gcc (or `$CC`) is missing, fails or times out.
    """
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise KernelBuildError(f"no C compiler: {os.environ.get('CC', 'gcc')!r} not on PATH")
    src = SOURCE_DIR / source
    flags = CFLAGS + tuple(extra_flags)
    headers = [h.read_text() for h in sorted(SOURCE_DIR.glob("*.h"))]  # included by sources
    key = hashlib.sha256("\0".join([src.read_text(), *headers, " ".join(flags),
                                     _compiler_version(cc), _cpu_flags(),
                                     torch.__version__]).encode())
    out = kernel_dir() / f"{src.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with progress.current().phase(f"building native kernel {src.name} (once per machine)"):
            res = subprocess.run([cc, *flags, "-o", tmp, str(src)], capture_output=True,
                                 text=True, timeout=300)
        if res.returncode != 0:
            raise KernelBuildError(f"{cc} failed on {src.name}: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    except subprocess.TimeoutExpired as exc:
        raise KernelBuildError(f"{cc} timed out on {src.name}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(source: str, extra_flags: tuple[str, ...] = (),
         cpu_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (if needed) and load `source`, first checking that this CPU has `cpu_flags`
    (see `cpu_reason`). Raises KernelBuildError (the CPU, the compiler or the build) or
    OSError (loading)."""
    reason = cpu_reason(cpu_flags) if cpu_flags else None
    if reason is not None:
        raise UnsupportedCPU(reason)
    return ctypes.CDLL(str(build(source, extra_flags)))


class LazyKernel:
    """A kernel built and loaded at first use, once: `get()` returns the loaded function, or
    None when it cannot be had (the reason is logged once as a warning and kept in
    `unavailable`; as info only where the CPU lacks the instructions).

    Args:
        loader: builds and loads the kernel; raises KernelBuildError or OSError.
        what: what the kernel is and what runs instead, for the warning.
    """

    def __init__(self, loader, what: str) -> None:
        self.loader = loader
        self.what = what
        self.kernel = None
        self.unavailable: str | None = None

    def unavailable_reason(self) -> str | None:
        """None when the kernel is built and loaded (building it now if needed), else why
        not."""
        self.get()
        return self.unavailable

    def get(self):
        if self.kernel is None and self.unavailable is None:
            try:
                self.kernel = self.loader()
            except (KernelBuildError, OSError) as exc:
                self.unavailable = str(exc)
                # A CPU without the instructions is expected (info); a failed build is not.
                level = logging.INFO if isinstance(exc, UnsupportedCPU) else logging.WARNING
                logging.getLogger(__name__).log(level, "specmoe %s: %s", self.what,
                                                self.unavailable)
        return self.kernel
