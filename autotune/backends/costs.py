"""What a backend's responses teach about arms not played: OFF's decode rate, and for a drafter
whose K is a request field, how a round's time grows with K.

Terms, per request decoded on a drafter at K (n output tokens, a drafts accepted):
- rounds: target forwards while decoding, n - 1 - a (each round commits its accepted drafts and
  one token of the target's own; the first output token comes from the prefill);
- accepted per round m = a / rounds; with a per-draft acceptance p the same at each position,
  m = p (1 - p^K) / (1 - p), which gives p;
- tokens per round at K': T(K') = (1 - p^(K'+1)) / (1 - p);
- a round's time: decode_s / rounds, fitted as base + per_draft * K over the drafter's requests
  at every K seen (least squares; none until two Ks have been seen).
A sibling (same drafter, K') is then estimated at the measured reward times
[T(K') / time(K')] / [T(K) / time(K)]: the model supplies only how the rate moves with K, the
request itself its level.
"""

from __future__ import annotations

import statistics
from collections import deque

from autotune.backends.base import BackendResponse
from policies import load_bucket


def acceptance_per_draft(accepted_per_round: float, k: int) -> float:
    """p with p (1 - p^k) / (1 - p) = accepted_per_round (bisection; k drafts a round)."""
    target = min(max(accepted_per_round, 0.0), k * 0.999)
    low, high = 0.0, 0.9999
    for _ in range(40):
        p = (low + high) / 2
        if p * (1 - p ** k) / (1 - p) < target:
            low = p
        else:
            high = p
    return (low + high) / 2


def tokens_per_round(p: float, k: int) -> float:
    return (1 - p ** (k + 1)) / (1 - p)


class RoundFit:
    """Least squares of a round's time on K: sums of (1, K, K^2, t, K t) over requests."""

    def __init__(self, sums: list[float] | None = None) -> None:
        self.sums = list(sums) if sums else [0.0] * 5

    def add(self, k: int, seconds: float) -> None:
        for i, value in enumerate((1.0, k, k * k, seconds, k * seconds)):
            self.sums[i] += value

    def line(self) -> tuple[float, float] | None:
        """(base, per_draft) seconds, or None while K has not varied or the fit is not physical."""
        n, sk, skk, st, skt = self.sums
        spread = n * skk - sk * sk
        if n < 2 or spread <= 1e-9 * max(n * skk, 1.0):
            return None
        per_draft = (n * skt - sk * st) / spread
        base = (st - per_draft * sk) / n
        if base <= 0 or per_draft < 0:
            return None
        return base, per_draft


class BackendCosts:
    """OFF's decode rate per load bucket (the median of its last `window` requests: one slow or
    fast moment moves it little), and a round-time fit per drafter and load bucket."""

    def __init__(self, window: int = 16) -> None:
        self.window = window
        self.off: dict[str, deque[float]] = {}
        self.rounds: dict[str, RoundFit] = {}

    def add_off(self, load: int, rate: float) -> None:
        self.off.setdefault(load_bucket(load), deque(maxlen=self.window)).append(rate)

    def off_rate(self, load: int) -> float | None:
        rates = self.off.get(load_bucket(load))
        return statistics.median(rates) if rates else None

    def siblings(self, drafter: str, k: int, ks: list[int], load: int, reward: float,
                 response: BackendResponse, weight: float = 0.25) -> dict[str, tuple[float, float]]:
        """Fit this request's rounds, then estimate `drafter` at each other K of `ks`:
        {"drafter:K'": (reward, weight)} (module docstring); {} where nothing can be said."""
        rounds = response.new_tokens - 1 - (response.accepted or 0)
        if rounds < 1 or response.accepted is None or response.decode_s <= 0:
            return {}
        fit = self.rounds.setdefault(f"{drafter}@{load_bucket(load)}", RoundFit())
        fit.add(k, response.decode_s / rounds)
        line = fit.line()
        if line is None:
            return {}
        base, per_draft = line
        p = acceptance_per_draft(response.accepted / rounds, k)

        def rate(kk: int) -> float:
            return tokens_per_round(p, kk) / (base + per_draft * kk)

        return {f"{drafter}:{other}": (reward * rate(other) / rate(k), weight) for other in ks if other != k}

    def state_dict(self) -> dict[str, dict]:
        return {**{f"off@{b}": {"rates": list(r)} for b, r in self.off.items()},
                **{key: {"sums": fit.sums} for key, fit in self.rounds.items()}}

    def load_state_dict(self, states: dict[str, dict]) -> None:
        for key, state in states.items():
            if key.startswith("off@"):
                self.off[key[4:]] = deque(state["rates"], maxlen=self.window)
            else:
                self.rounds[key] = RoundFit(state["sums"])
