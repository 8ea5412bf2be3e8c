"""specmoe: speculative decoding on Mixture-of-Experts language models."""

from specmoe.config import SpeculativeConfig
from specmoe.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from specmoe.engine.llm_engine import LLM
        return LLM
    raise AttributeError(name)
