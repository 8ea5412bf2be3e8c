"""Kernel switches in the engine configuration (`KernelConfig`): each engine applies the
switches it sets around its loading and its steps and puts the process-wide ones back, so two
engines in one process differ; a config that sets nothing leaves the process's switches to
rule, as the environment variables and setters did."""

from __future__ import annotations

import pytest

from specmoe import LLM, SamplingParams
from specmoe.config import KernelConfig
from specmoe.kernels import gemv, gemv_int4
from specmoe.models import fused_layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _switches() -> tuple[bool, bool, bool]:
    return gemv.is_enabled(), fused_layers.is_enabled(), gemv_int4.is_batch_invariant()


def _seen_in_steps(llm: LLM) -> list[tuple[bool, bool, bool]]:
    """The process-wide switches as each of `llm`'s forwards saw them."""
    seen, execute = [], llm.target.execute
    llm.target.execute = lambda *a, **kw: seen.append(_switches()) or execute(*a, **kw)
    try:
        llm.generate([[5, 17, 42, 99]], SamplingParams(temperature=0, max_tokens=3))
    finally:
        del llm.target.execute
    return seen


def test_two_engines_in_one_process_run_with_their_own_switches():
    before = _switches()
    off = LLM("tiny-moe", kernels={"cpu_kernels": False, "fused_layers": False,
                                   "int4_batch_invariant": True})
    default = LLM("tiny-moe")
    assert _switches() == before  # loading put them back too
    assert set(_seen_in_steps(off)) == {(False, False, True)}
    assert set(_seen_in_steps(default)) == {before}
    assert set(_seen_in_steps(off.with_speculative({"method": "ngram"}))) == {
        (False, False, True)}  # a derived engine keeps its parent's config
    assert _switches() == before


def test_a_config_that_sets_nothing_follows_the_process_setting():
    llm = LLM("tiny-moe")
    was = fused_layers.is_enabled()
    fused_layers.set_enabled(not was)
    try:
        assert {s[1] for s in _seen_in_steps(llm)} == {not was}
    finally:
        fused_layers.set_enabled(was)


@pytest.mark.parametrize("field", ["cpu_kernels", "fused_layers", "int4_batch_invariant",
                                   "one_row_prefetch", "fixed_threads"])
def test_a_switch_that_is_not_a_bool_is_refused(field):
    with pytest.raises(ValueError, match=f"invalid kernels {field}='yes'"):
        KernelConfig(**{field: "yes"})
