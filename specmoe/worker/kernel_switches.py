"""An engine's `KernelConfig` applied around its loading and its steps: each switch it sets
(a bool, not None) replaces the native kernels' process-wide one (`kernels.gemv`,
`kernels.gemv_int4`, `kernels.panel_prefetch`, `models.fused_layers`) on entry and is put
back on exit, so two engines in one process (`LLM.with_speculative`, an A/B benchmark) may
differ. Engines of one process run one at a time (`LLM.with_speculative`'s contract)."""

from __future__ import annotations

from specmoe.config import KernelConfig
from specmoe.kernels import gemv, gemv_int4, panel_prefetch
from specmoe.models import fused_layers

# per switch: (KernelConfig field, read the process-wide value, set it)
_SWITCHES = (
    ("cpu_kernels", gemv.is_enabled, gemv.set_enabled),
    ("fused_layers", fused_layers.is_enabled, fused_layers.set_enabled),
    ("int4_batch_invariant", gemv_int4.is_batch_invariant, gemv_int4.set_batch_invariant),
    ("one_row_prefetch", lambda: panel_prefetch.state()["on"],  # its source stays
     lambda on: panel_prefetch.set_enabled(on, panel_prefetch.state()["source"])),
)


class KernelSwitches:
    """A reusable context manager (one per engine; not re-entrant): a no-op for a config
    that sets nothing.

    Args:
        config: the engine's kernel behaviours.
    """

    def __init__(self, config: KernelConfig) -> None:
        self._switches = [(getattr(config, name), get, put) for name, get, put in _SWITCHES
                          if getattr(config, name) is not None]
        self._saved: list[bool] = []

    def __enter__(self) -> None:
        self._saved = [get() for _, get, _ in self._switches]
        for value, get, put in self._switches:
            if get() != value:
                put(value)

    def __exit__(self, *exc) -> None:
        for saved, (_, get, put) in zip(self._saved, self._switches):
            if get() != saved:
                put(saved)
