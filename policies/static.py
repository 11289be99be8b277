"""Policies that do not learn: one fixed arm, OFF, and transformers' adaptive-K heuristic."""

from __future__ import annotations

from engine import OFF, Arm, HeuristicK, KSchedule
from policies.base import Context, Policy


class StaticPolicy(Policy):
    name = "static"

    def __init__(self, arms: list[Arm], arm: Arm | str) -> None:
        arm = Arm.of(arm)
        super().__init__([*arms, arm])
        self.arm = arm

    def choose(self, context: Context) -> Arm:
        return self.arm


class OffPolicy(StaticPolicy):
    name = "off"

    def __init__(self, arms: list[Arm]) -> None:
        super().__init__(arms, OFF)


class HeuristicPolicy(StaticPolicy):
    """transformers' assisted generation: start at K, +2 after a full accept, -1 otherwise."""

    name = "heuristic"

    def schedule(self, context: Context, arm: Arm) -> KSchedule | None:
        return None if arm.is_off else HeuristicK()
