"""The controller's settings, in one place, each refused by name when out of range."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ControllerSettings:
    """How an `AutotuneController` serves and learns (docs/decisions.md says why each default).

    - `save_every`: what was learned is saved every this many policy updates, and on close.
    - `min_baseline_steps`, `remeasure_off_every`: see rewards.reward.RewardModel.
    - `counterfactual_requests`, `counterfactual_budget`, `counterfactual_weight`: a key's first
      requests score every other arm by replay; after that replays run only while they stay
      within `counterfactual_budget` of the key's serving time; the policy weighs a replayed
      estimate at `counterfactual_weight` of a measured reward.
    - `replay_features`: replay feature heads and their hybrids too; None: when the engine has
      more than one feature head.
    - `max_batch` > 1: requests waiting at the same moment are served as one batch (after at most
      `batch_wait_ms`), of any classes unless `mix_classes` is False.
    - `continuous`: requests arriving while a batch decodes join it between rounds, and the
      policy decides again every `decide_every` rounds; False: static batches.
    - `prefill_chunk`: tokens of joiners' prefill per round (chunked prefill; None: in one go).
    - `pause_alone`: a request served alone pauses when another arrives and finishes in a
      continuous batch with it; None: except on a compiled engine.
    - `calibrate`: measure OFF and every drafter before the first request, so that no request
      has to be served OFF to price the others; `calibrate_in_background`: while requests are
      served instead, each OFF until the costs are known (a server's first start answers at once).
    """

    save_every: int = 25
    min_baseline_steps: int = 16
    remeasure_off_every: int = 64
    counterfactual_requests: int = 1
    counterfactual_budget: float = 0.01
    counterfactual_weight: float = 1.0
    replay_features: bool | None = None
    max_batch: int = 1
    batch_wait_ms: float = 2.0
    mix_classes: bool = True
    continuous: bool = True
    decide_every: int = 32
    pause_alone: bool | None = None
    prefill_chunk: int | None = 2048
    calibrate: bool = True
    calibrate_in_background: bool = False

    def __post_init__(self) -> None:
        # Several would otherwise be taken silently (a negative wait) or fail only later, on
        # another thread (a fractional max_batch in the coalescer's, leaving its callers waiting).
        for name, low in [("max_batch", 1), ("decide_every", 1), ("save_every", 1), ("min_baseline_steps", 0),
                          ("remeasure_off_every", 1), ("counterfactual_requests", 0)]:
            value = getattr(self, name)
            if not _whole(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.prefill_chunk is not None and (not _whole(self.prefill_chunk) or self.prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive number of tokens or None, not {self.prefill_chunk!r}")
        for name, ok, what in [("batch_wait_ms", lambda v: 0 <= v < math.inf, ">= 0 (finite)"),
                               ("counterfactual_budget", lambda v: v >= 0, ">= 0"),
                               ("counterfactual_weight", lambda v: 0 <= v <= 1, "in [0, 1]")]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"{name} must be a number {what}, got {value!r}")

    @classmethod
    def split(cls, options: dict) -> tuple[dict, dict]:
        """`options` as (those that name a setting, the rest)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return ({k: v for k, v in options.items() if k in names}, {k: v for k, v in options.items() if k not in names})


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
