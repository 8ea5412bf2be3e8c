"""Adaptive speculation (`SpeculativeConfig.policy = "adaptive"`): K per request and step
from measured acceptance and step times (docs/adaptive.md). `policy` holds the engine's
side; `estimators`, `solve` and `exploration` its three parts; `settings` its knobs."""

from specmoe.spec_decode.adaptive.estimators import AcceptanceTracker
from specmoe.spec_decode.adaptive.exploration import IdleLease, shadow_drafts, within_budget
from specmoe.spec_decode.adaptive.policy import AdaptivePolicy
from specmoe.spec_decode.adaptive.settings import AdaptiveSettings

__all__ = ["AcceptanceTracker", "AdaptivePolicy", "AdaptiveSettings", "IdleLease",
           "shadow_drafts", "within_budget"]
