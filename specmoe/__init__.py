"""specmoe: speculative decoding on Mixture-of-Experts language models."""

from specmoe.config import SpeculativeConfig
from specmoe.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "__version__"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("specmoe")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


__version__ = _version()


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from specmoe.engine.llm_engine import LLM
        return LLM
    raise AttributeError(name)
