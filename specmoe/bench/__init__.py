"""Benchmarks and the peers they compare against (L7)."""
