"""Carved MoEs that `specmoe models install NAME` makes: the source models, the carve
settings, and the SHA-256 of the `model.safetensors` the recipe gave when it was recorded.

A carve is seeded and resumable, but its float32 arithmetic goes through the CPU's matmul
kernels: the same machine class gives the same bits, another (AVX-512 vs AVX2, another
oneDNN) may not. So the install reports whether the output matches the recorded hash; a
mismatch is a warning (the model works, its quality figures in docs/results are those of
the recorded carve), not an error.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from specmoe.carve.carve import CarveSettings, carve
from specmoe.carve.train import TrainSettings
from specmoe.loader import model_store
from specmoe.loader.aliases import CARVED


@dataclass(frozen=True)
class Recipe:
    """alias: the carved model's alias (`specmoe.loader.aliases.CARVED`); install: the
    model_store names to install first; source: the dense alias carved; sha256: of the
    recorded output's model.safetensors (None: not recorded); recorded_on: the machine."""

    alias: str
    install: tuple[str, ...]
    source: str
    settings: CarveSettings
    sha256: str | None
    recorded_on: str


RECIPES: dict[str, Recipe] = {
    "qwen2.5-coder-moe": Recipe(
        alias="qwen2.5-coder-1.5b-moe", install=("qwen2.5-coder",),
        source="qwen2.5-coder-1.5b",
        settings=CarveSettings(num_experts=48, top_k=16, shared_experts=16,
                               calibration_windows=64, train=TrainSettings(steps=200)),
        sha256="6e93e3c8739ff6fbf26d7aa701980975444335bf2fe53aee201b2322e68be92c",
        recorded_on="2026-12-03, 2-core Intel Xeon (AVX-512 BF16, AMX), torch 2.13.0 CPU"),
}


@dataclass
class RecipeResult:
    path: Path
    sha256: str
    matches_record: bool | None  # None: nothing recorded


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def install_recipe(name: str, progress: bool = True) -> RecipeResult:
    """Install the recipe's sources, carve (or resume) into the cache directory, hash.

    Raises:
        ValueError: an unknown recipe.
        ModelInstallError: a source failed to install.
    """
    if name not in RECIPES:
        raise ValueError(f"unknown carve recipe {name!r}: choose one of {sorted(RECIPES)}")
    recipe = RECIPES[name]
    model_store.install(list(recipe.install), progress=progress)
    out = model_store.cache_dir() / CARVED[recipe.alias].directory
    carve(recipe.source, out, recipe.settings, progress=progress, eval_windows_per_file=4)
    sha = file_sha256(out / "model.safetensors")
    return RecipeResult(out, sha, None if recipe.sha256 is None else sha == recipe.sha256)
