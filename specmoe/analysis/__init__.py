"""Measurement: routing analysis, verification cost, the cost model and the MoE x speculative decoding study."""
