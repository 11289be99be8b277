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
