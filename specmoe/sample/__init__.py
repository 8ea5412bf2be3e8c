"""Sampling layer (L5): sampling ops and the lossless rejection sampler.

Never imports `specmoe.spec_decode` (proposers depend on this layer, not the reverse).
"""

from specmoe.sample.ops import (RandomDraws, SamplingTensors, compute_logprobs, compute_probs,
                                draw_exponentials, draw_random, exponential_race,
                                sample_from_probs)
from specmoe.sample.rejection_sampler import RejectionOutput, rejection_sample

__all__ = [
    "RandomDraws",
    "RejectionOutput",
    "SamplingTensors",
    "compute_logprobs",
    "compute_probs",
    "draw_exponentials",
    "draw_random",
    "exponential_race",
    "rejection_sample",
    "sample_from_probs",
]
