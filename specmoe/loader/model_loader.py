"""Loading a model (HuggingFace directory or GGUF file) onto a device in a dtype."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specmoe import kernels
from specmoe.config import QUANTIZATION_METHODS, ArchConfig, ModelConfig
from specmoe.kernels import panel_prefetch_tune
from specmoe.kernels.build import cpu_reason
from specmoe.kernels.gguf_gemm import NATIVE_TYPES
from specmoe.layers.linear import packed_copies, prepack_weights
from specmoe.layers.moe.backends import moe_blocks, resolve_moe_backend, set_moe_backend
from specmoe.layers.quantization import quantize_model
from specmoe.loader.aliases import resolve_model_path
from specmoe.loader.gguf_blocks import BlockStash, NoBlocks
from specmoe.loader.hf_dir import iter_safetensors, read_hf_config
from specmoe.loader.weights import load_weights
from specmoe.models.decoder import DecoderModel
from specmoe.models.registry import family_for
from specmoe.utils import hugepages, memory, progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to run, with what is needed to build its tokenizer.

    Attributes:
        model: the module, in eval mode, on `device`.
        arch: its architecture.
        path: where it was loaded from.
        max_model_len: context limit in tokens.
    """

    model: DecoderModel
    arch: ArchConfig
    path: Path
    device: torch.device
    dtype: torch.dtype
    max_model_len: int

    def load_tokenizer(self):
        """The model's tokenizer (transformers), from tokenizer files or GGUF metadata.

        Raises:
            TokenizerMissing, ValueError: as `load_tokenizer`.
        """
        return load_tokenizer(self.path)


class TokenizerMissing(ValueError):
    """The model carries no tokenizer (a directory without tokenizer files, a GGUF file
    whose metadata transformers cannot build one from): prompts must be token ids."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: Path):
    """The tokenizer (transformers) of the model at `path`: a GGUF file's metadata or a
    directory's tokenizer files.

    Raises:
        TokenizerMissing: the model has no tokenizer (see the class).
        ValueError: the directory has tokenizer files that do not load (a corrupt
            tokenizer.json), naming the directory and the library's error.
    """
    from transformers import AutoTokenizer
    if path.is_file():
        from specmoe.loader.gguf_file import load_gguf_tokenizer
        try:
            return load_gguf_tokenizer(path)
        except ValueError as exc:
            raise TokenizerMissing(str(exc)) from exc
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerMissing(f"no tokenizer files in {path} (one of {TOKENIZER_FILES})")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for bad files
        raise ValueError(f"the tokenizer files in {path} do not load: "
                         f"{type(exc).__name__}: {exc}") from None


def resolve_device(device: str | None) -> torch.device:
    """`device` as a torch.device (None: CUDA when present, else the CPU).

    Raises:
        ValueError: a name torch does not know, e.g. "tpu", or a CUDA device where torch
            has no CUDA or sees no such GPU.
    """
    resolved = _parse_device(device)
    if device is not None and resolved.type == "cuda":
        _check_cuda(device, resolved)
    return resolved


def _parse_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"invalid device={device!r}: use cpu, cuda or cuda:N") from exc


def _check_cuda(name: str, device: torch.device) -> None:
    if torch.version.cuda is None:
        raise ValueError(f"invalid device={name!r}: this torch ({torch.__version__}) is a "
                         "CPU-only build; install a CUDA build of torch or use --device cpu")
    count = torch.cuda.device_count()
    if (device.index or 0) >= count:
        raise ValueError(f"invalid device={name!r}: torch sees {count} CUDA device(s)")


def resolve_dtype(dtype: str, device: str | None) -> str:
    """`dtype`, or for "auto" the fastest lossless choice on `device`: "bfloat16" on a CPU
    where the native bf16 kernels run (they decode several times faster than float32, and
    their batch-invariant sums keep greedy speculative output equal to plain decoding),
    "float32" everywhere else (CUDA's bf16 GEMMs change their summation order with the
    batch shape, so only float32 keeps that equality there)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if _native_bf16(_parse_device(device), torch.bfloat16) else "float32"


def load_model(config: ModelConfig, on_weights=None) -> LoadedModel:
    """Build and load the model `config.model` names, unit by unit (`_load_unit_by_unit`:
    never whole at full precision). `on_weights(model)`, if given, runs once all the
    checkpoint's weights are in, before quantisation and packing (expert parallelism drops
    the experts other ranks hold there); the model is then whole at full precision once.

    Raises:
        FileNotFoundError: bad path or alias.
        ValueError: unsupported architecture, a config value out of range, weights that
            would not fit in the memory available, missing/extra weights, bad
            max_model_len.
    """
    path = resolve_model_path(config.model)
    keep = _kept_block_types(config, path, on_weights)
    hf_config, tensors = open_checkpoint(path, DTYPES[config.dtype], keep)
    family, arch = parse_arch(path, hf_config)
    max_len = _max_model_len(config, arch)
    device, dtype = resolve_device(config.device), DTYPES[config.dtype]
    check_weights_fit(path, arch, dtype, device, config.quantization)
    with default_dtype(dtype), device:
        model = DecoderModel(arch, max_len)
    report = progress.current()
    tensors = report.items(_to_device(tensors, device), f"loading {path.name}",
                           size=lambda item: item[1].nbytes)
    if on_weights is None:
        _load_unit_by_unit(model, tensors, family, arch, config, device, dtype)
        return LoadedModel(model, arch, path, device, dtype, max_len)
    load_weights(model, tensors, family.WEIGHT_RULES, arch.tie_word_embeddings)
    on_weights(model)
    if config.quantization is not None:
        with report.phase(f"quantising the weights to {config.quantization}"):
            quantize_model(model, config.quantization)
    prepare_for_inference(model, device, dtype, config.moe_backend)
    return LoadedModel(model, arch, path, device, dtype, max_len)


def _load_unit_by_unit(model: DecoderModel, tensors, family, arch: ArchConfig,
                       config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Load the checkpoint into `model`, finishing each unit (the embedding, every decoder
    layer, the final norm, the LM head) as soon as its last weight is in: quantised
    (`config.quantization`) and packed for the native kernels right then, its dense
    weights dropped. The parameters are allocated but untouched until their tensor arrives,
    so the model never exists whole at full precision: memory peaks near the final weights
    plus one unit, as the checkpoint groups a layer's tensors (HF shards and GGUF files
    do). The result is what `quantize_model` then `prepare_for_inference` give."""
    backend = begin_inference(model, device, dtype, config.moe_backend)
    stash = BlockStash(model, dtype) if config.quantization == "gguf" else NoBlocks()

    def finish(unit: torch.nn.Module) -> None:
        stash.adopt(unit)
        if config.quantization in QUANTIZATION_METHODS:
            quantize_model(unit, config.quantization)
        pack_for_kernels(unit, device)
        memory.release_free_memory()  # the unit's dense weights, freed just now
    units = UnitTracker(model, finish)
    load_weights(model, tensors, family.WEIGHT_RULES, arch.tie_word_embeddings,
                 on_param_loaded=units.param_loaded, take_blocks=stash.take)
    units.finish_rest()
    end_inference(model, device, backend)


class UnitTracker:
    """Calls `finish(unit)` once per top-level unit of `model` (each direct child, each
    element of a ModuleList child): when the last of its parameters is loaded
    (`param_loaded(name)`, names as `model.named_parameters()` gives them), or in
    `finish_rest` for units with no parameter of their own (a tied LM head)."""

    def __init__(self, model: torch.nn.Module, finish) -> None:
        self.finish = finish
        self.units = list(_units(model))
        self.left = [{f"{prefix}.{n}" for n, _ in unit.named_parameters()}
                     for prefix, unit in self.units]
        self.owner = {name: i for i, names in enumerate(self.left) for name in names}
        self.done: set[int] = set()

    def param_loaded(self, name: str) -> None:
        i = self.owner[name]
        self.left[i].discard(name)
        if not self.left[i]:
            self._finish(i)

    def finish_rest(self) -> None:
        for i in range(len(self.units)):
            if i not in self.done:
                self._finish(i)

    def _finish(self, i: int) -> None:
        self.done.add(i)
        self.finish(self.units[i][1])


def _units(model: torch.nn.Module):
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            yield from ((f"{name}.{i}", sub) for i, sub in enumerate(child))
        else:
            yield name, child


def _kept_block_types(config: ModelConfig, path: Path, on_weights) -> frozenset:
    """The GGUF types whose blocks the load keeps (`quantization="gguf"`): those with a
    native kernel; none otherwise.

    Raises:
        ValueError: "gguf" for a checkpoint that is not a .gguf file, on a device other
            than the CPU, or with expert parallelism (`on_weights`).
    """
    if config.quantization != "gguf":
        return frozenset()
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"quantization='gguf' keeps a .gguf file's blocks; {path} is not "
                         "one (use int8/int4 for a HuggingFace checkpoint)")
    if resolve_device(config.device).type != "cpu":
        raise ValueError(f"quantization='gguf' runs on the CPU, not {config.device}")
    if on_weights is not None:
        raise ValueError("quantization='gguf' does not combine with expert parallelism yet")
    return NATIVE_TYPES


def parse_arch(path: Path, hf_config: dict):
    """(family, ArchConfig) of the checkpoint at `path`.

    Raises:
        ValueError: an unsupported architecture, or a setting that is missing or out of
            range (a size that is not an int >= 1, an epsilon that is NaN, ...), naming
            `path`.
    """
    try:
        family = family_for(hf_config)
        return family, family.parse_config(hf_config)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def read_arch(config: ModelConfig) -> ArchConfig:
    """The architecture of the checkpoint `config.model` names, from its config.json or
    GGUF metadata alone (no weight is read): for checks made before loading.

    Raises:
        FileNotFoundError, ValueError: as `load_model`.
    """
    path = resolve_model_path(config.model)
    hf_config, _ = open_checkpoint(path, DTYPES[config.dtype])
    return parse_arch(path, hf_config)[1]


# Bytes a quantised weight keeps per parameter: int8 one byte (and a scale per row), int4
# half a byte and a bf16 scale and zero per group of 32.
QUANTIZED_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / 32}


def final_weight_bytes(arch: ArchConfig, dtype: torch.dtype, quantization: str | None) -> float:
    """Bytes the loaded weights hold (`ArchConfig.num_params`): the embedding in `dtype`,
    every other weight in `dtype` or at `quantization`'s `QUANTIZED_BYTES` (the load never
    holds more than one unit at full precision beside them)."""
    embedding = arch.vocab_size * arch.hidden_size
    rest = QUANTIZED_BYTES.get(quantization, dtype.itemsize) * (arch.num_params - embedding)
    return embedding * dtype.itemsize + rest


def check_weights_fit(path: Path, arch: ArchConfig, dtype: torch.dtype, device: torch.device,
                      quantization: str | None = None) -> None:
    """Raise ValueError when the loaded weights (`final_weight_bytes`) would not fit in the
    memory `device` has free (host memory on the CPU), before any is allocated."""
    need = (path.stat().st_size if quantization == "gguf"
            else final_weight_bytes(arch, dtype, quantization))
    available = None
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    elif device.type != "cpu":
        return
    memory.check_fits(need, f"the weights of {path} ({arch.num_params:.3g} parameters in "
                            f"{quantization or str(dtype).removeprefix('torch.')})", available)


def prepare_for_inference(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                          moe_backend: str = "auto", keep_dense: bool = False) -> None:
    """What every model gets between its weights and its first forward: eval mode without
    autograd, its MoE blocks' expert backend (`moe_backend`, "auto" as
    `resolve_moe_backend`), and on CPU the native kernels' packed copies in place of the
    dense weights (beside them with `keep_dense`, so the MoE backend can still be switched
    to one that reads them), on 2 MiB pages, and whether one-row passes prefetch, timed on
    those copies (once per process: `kernels.panel_prefetch_tune`). Synthetic models (the
    study's presets) take the same steps, so they are timed on the paths a loaded model
    runs; `load_model` takes them unit by unit (`begin_inference`, `pack_for_kernels` per
    unit, `end_inference`).

    Raises:
        ValueError: an unknown `moe_backend`.
    """
    backend = begin_inference(model, device, dtype, moe_backend)
    with progress.current().phase("preparing the weights for the CPU kernels"):
        pack_for_kernels(model, device, keep_dense)
    end_inference(model, device, backend)


def begin_inference(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                    moe_backend: str = "auto") -> str | None:
    """Eval mode without autograd, and the MoE blocks' expert backend, chosen before any
    packing (only "fused" and "grouped" read packed experts); returns the backend (None
    for a dense model).

    Raises:
        ValueError: an unknown `moe_backend`.
    """
    model.eval().requires_grad_(False)
    if not moe_blocks(model):
        return None
    backend = resolve_moe_backend(moe_backend, device, _native_bf16(device, dtype))
    set_moe_backend(model, backend)
    return backend


def pack_for_kernels(module: torch.nn.Module, device: torch.device,
                     keep_dense: bool = False) -> None:
    """On CPU, the native kernels' packed copies of `module`'s weights, the dense ones
    dropped unless `keep_dense`."""
    if device.type == "cpu":
        prepack_weights(module, release_dense=not keep_dense)


def end_inference(model: torch.nn.Module, device: torch.device, backend: str | None) -> None:
    """After packing: the backend set again (quantised experts replaced the ones it was set
    on), the CPU weights moved to 2 MiB pages and the one-row prefetch timed."""
    if backend is not None:
        set_moe_backend(model, backend)
    if device.type == "cpu":
        hugepages.rehome_module(model)  # decoding streams the weights: 2 MiB pages
        panel_prefetch_tune.tune(packed_copies(model))


def _native_bf16(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the native bf16 decode kernels run for weights of `dtype` on `device` (a CPU
    without the required instructions is checked first: no kernel build, no warning)."""
    return (device.type == "cpu" and dtype is torch.bfloat16 and kernels.is_enabled()
            and cpu_reason(kernels.REQUIRED_CPU_FLAGS) is None
            and kernels.kernel_unavailable_reason() is None)


def open_checkpoint(path: Path, dtype: torch.dtype, keep_types: frozenset = frozenset()):
    """(HF config dict, iterator of (HF tensor name, tensor in `dtype`)) of a HuggingFace
    directory or a GGUF file (whose matrices of `keep_types` come as `GGUFTensor`s).

    Raises:
        ValueError: `path` is neither.
    """
    if path.is_dir():
        return read_hf_config(path), iter_safetensors(path, dtype)
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is neither a HuggingFace model directory nor a .gguf file")
    from specmoe.loader.gguf_file import GGUFCheckpoint
    ckpt = GGUFCheckpoint(path)
    return ckpt.hf_config, ckpt.iter_tensors(dtype, keep_types)


def _max_model_len(config: ModelConfig, arch: ArchConfig) -> int:
    limit = arch.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                         f"max_position_embeddings={limit}")
    return config.max_model_len


def _to_device(tensors: Iterator[tuple[str, torch.Tensor]], device: torch.device):
    for name, t in tensors:
        yield name, t.to(device)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Context in which new tensors (and module parameters) default to `dtype`."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
