"""The policy protocol: choose(context) -> arm; update(context, arm, outcome).

Policies keep their learned state per key (request class and load bucket) as plain
JSON-able dicts, so the store can persist them and a restarted controller resumes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from engine import OFF, Arm, KSchedule

LOAD_BUCKETS = ("1", "2-4", "5+")


def load_bucket(load: int) -> str:
    """Buckets of rows decoded together: in a large batch the K extra verify tokens per row are no
    longer nearly free, so the best arm alone differs from the best under load."""
    if load <= 1:
        return "1"
    return "2-4" if load <= 4 else "5+"


@dataclass(frozen=True)
class Context:
    request_class: str
    load: int = 1
    features: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.request_class}@load{load_bucket(self.load)}"


@dataclass(frozen=True)
class Outcome:
    goodput: float  # output tokens per second of the whole request
    reward: float  # goodput relative to the class's OFF baseline (1.0 = as fast as OFF)
    acceptance: float | None = None
    new_tokens: int = 0
    # Estimated rewards of sibling arms (same drafter, other K) from this request's per-position
    # acceptance and costs: {arm: (reward, weight)}; bandits take them as partial observations.
    siblings: dict = field(default_factory=dict)


class PolicyError(ValueError):
    """A policy was misconfigured or asked for something the engine cannot do."""


class Policy(ABC):
    name: str = "policy"
    learns: bool = False  # learning policies get rewards relative to a measured OFF baseline

    def __init__(self, arms: list[Arm]) -> None:
        if not arms:
            raise PolicyError("a policy needs at least one arm")
        self.arms = list(dict.fromkeys(arms))
        if OFF not in self.arms:
            self.arms.insert(0, OFF)  # OFF is always an arm

    @abstractmethod
    def choose(self, context: Context) -> Arm: ...

    def update(self, context: Context, arm: Arm, outcome: Outcome) -> None:
        """Learn from one served request; stateless policies ignore it."""

    def worth_replaying(self, context: Context) -> list[Arm]:
        """The arms whose replayed estimates on a request of `context` could change a decision:
        every arm unless the policy knows some cannot be best there."""
        return list(self.arms)

    def schedule(self, context: Context, arm: Arm) -> KSchedule | None:
        """How K moves inside the request; None keeps the arm's K."""
        return None

    def set_prior(self, request_class: str, priors: dict[str, tuple[float, float]]) -> None:
        """Seed a class with {arm: (mean reward, pseudo-count)}, e.g. from an offline study."""

    def state_dict(self) -> dict[str, dict]:
        """{key: JSON-able state}; empty for stateless policies."""
        return {}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        """Replace what was learned with `state` (as `state_dict` gave it)."""
