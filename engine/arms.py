"""An arm is what the controller chooses per request: a drafter and K, or OFF."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError

MIN_K = 1
MAX_K = 16


@dataclass(frozen=True, order=True)
class Arm:
    """`drafter=None` means OFF: plain autoregressive decoding on the same code path."""

    drafter: str | None = None
    k: int = 0

    def __post_init__(self) -> None:
        if not (self.drafter is None or isinstance(self.drafter, str)) or isinstance(self.k, bool) or \
                not isinstance(self.k, int):
            raise InvalidRequestError(f"an arm is a drafter's name and an int K, got {self.drafter!r} and {self.k!r}")
        if self.drafter is None:
            if self.k != 0:
                raise InvalidRequestError(f"the OFF arm takes no K (got k={self.k})")
        elif not (MIN_K <= self.k <= MAX_K):
            raise InvalidRequestError(
                f"K must be in {MIN_K}..{MAX_K} for drafter {self.drafter!r}, got {self.k}"
            )

    @property
    def is_off(self) -> bool:
        return self.drafter is None

    def __str__(self) -> str:
        return "off" if self.drafter is None else f"{self.drafter}:{self.k}"

    @classmethod
    def of(cls, arm: Arm | str) -> Arm:
        """An arm as callers name one: an `Arm`, or its text (`parse`)."""
        if isinstance(arm, Arm):
            return arm
        if isinstance(arm, str):
            return cls.parse(arm)
        raise InvalidRequestError(f"an arm must be an Arm or a string 'off' or 'DRAFTER:K', got {arm!r}")

    @classmethod
    def parse(cls, text: str) -> Arm:
        """Parse `off` or `DRAFTER:K` (e.g. `small:4`, `ngram:3`)."""
        text = text.strip()
        if text.lower() == "off":
            return OFF
        name, sep, k = text.rpartition(":")
        if not sep or not name or not k.isdigit():
            raise InvalidRequestError(f"cannot parse arm {text!r}: expected 'off' or 'DRAFTER:K'")
        return cls(name, int(k))


OFF = Arm()
