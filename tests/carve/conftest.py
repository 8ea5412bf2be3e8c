"""A trained carve of the bundled tiny-moe-draft, shared by the carve tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from carve_sources import DRAFT, FAST

from specmoe.carve.carve import CarveSettings, carve
from specmoe.carve.train import TrainSettings


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """tiny-moe-draft carved into 4 shared + 12 routed experts, top-4, trained briefly."""
    out = tmp_path_factory.mktemp("carved")
    settings = CarveSettings(num_experts=12, top_k=4, shared_experts=4, dtype="float32",
                             train=TrainSettings(steps=30, batch=128), **FAST)
    reports = carve(DRAFT, out, settings, progress=False)
    assert [r.layer for r in reports] == [0, 1]
    assert all(r.error_after < r.error_before for r in reports)
    return out


