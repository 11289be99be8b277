"""The measured costs that price an arm's rounds: draft seconds per round by K per drafter, and
verify seconds by the tokens verified, each the median of recent requests, with a
least-squares line for the widths not measured yet.
"""

from __future__ import annotations

from engine import Arm

# Extra verify cost per drafted token, as a share of a 1-token step, until two widths are measured.
VERIFY_SLOPE_PRIOR = 0.04


OFF_ROUNDS = "off"  # who drafted a verify's tokens when no one did
NO_MODEL = "(no model)"  # whose verifies price those of every drafter that runs no model (`verify_owners`)
WINDOW = 32  # requests each cost is the median of: a burst shorter than half of them moves no estimate
# A request's figure counts its rounds up to this many: one round's time says less than ten's, but
# past a few dozen a figure is as precise as the moment it was taken, and a long request must not
# outvote several short ones.
ROUNDS_COUNTED = 16


def _median(observations: list[list[float]]) -> float:
    """The median of [value, weight, ...] observations, each counted `weight` times up to
    ROUNDS_COUNTED (a request's seconds per round, by its rounds)."""
    ordered = sorted(observations)
    half = sum(min(o[1], ROUNDS_COUNTED) for o in ordered) / 2
    seen = 0.0
    for i, (value, weight, *_) in enumerate(ordered):
        seen += min(weight, ROUNDS_COUNTED)
        if seen > half + 1e-9:
            return value
        if abs(seen - half) <= 1e-9:  # exactly half below: between this value and the next
            return (value + ordered[i + 1][0]) / 2 if i + 1 < len(ordered) else value
    return ordered[-1][0]


class CostModel:
    """Measured costs at one load bucket: seconds of a draft round per drafter and K, of a verify
    round per width and drafter, of a drafter's prefill by prompt tokens.

    Each cost is the median over the last `window` requests that measured it, one observation a
    request, not a running mean, so that one request slowed by other work moves no cost. Costs are
    relative where a reward uses them (see `off_step_during`), and a verify of several tokens is
    never priced below a 1-token step, so a reward can never exceed the tokens its rounds committed
    per verify.

    A draft round costs more than K times a later step: its first step finds the drafter's
    weights evicted from the CPU caches by the target's verify, so a round is priced as measured at its K,
    else by a line in its tokens through the Ks measured.

    Rewards and replays price rounds in OFF steps, and a ratio of two medians taken at different
    moments is as wrong as the machine's speed moved between them. So the costs in OFF steps are
    taken side by side: OFF and each drafter on the same prompt within seconds
    (`reward.calibrate`), then OFF steps served among a request's own rounds (`probe_off`: the
    machine's step moves within tenths of a second). Requests without such steps never move them;
    without any (a load no calibration ran at, an older store) the ratio of the medians stands in.
    """

    def __init__(self, window: int = WINDOW, verify_owners: dict[str, str] | None = None) -> None:
        self.window = window
        self.verify_owners = verify_owners or {}  # drafter -> whose verify costs price its (`verify_owners`)
        # drafter -> K -> [[s per round, rounds, steps per round]], a request each
        self.draft: dict[str, dict[int, list[list[float]]]] = {}
        # who drafted (OFF_ROUNDS: no one) -> tokens per verify -> [[s per round, rounds]], a request each
        self.verify: dict[str, dict[int, list[list[float]]]] = {}
        self.prefill: dict[str, list[list[float]]] = {}  # drafter -> [[seconds, prompt tokens]], a request each
        self.off_decode: list[list[float]] = []  # OFF in continuous batches: [[engine s per verify s, verify s]]
        self.since_off = 0  # requests observed since the last one that measured OFF's step
        # In OFF steps, measured side by side with OFF's (`observe_side_by_side`): drafter -> K ->
        # [[steps per round, rounds, draft steps per round]]; who drafted -> tokens per verify -> [[steps, rounds]]
        self.relative_draft: dict[str, dict[int, list[list[float]]]] = {}
        self.relative_verify: dict[str, dict[int, list[list[float]]]] = {}
        # drafter -> [requests that measured OFF's step among their rounds (`probe_off`), requests since the last]
        self.probed: dict[str, list[int]] = {}

    def _add(self, observations: list, value) -> None:
        observations.append(value)
        del observations[:-self.window]

    def observe(self, arm: Arm, metrics, drafts: bool = True, batch: bool = False) -> None:
        """Add a request's measured costs; `drafts` False: its verifies only (K moved inside it);
        `batch`: a static batch's, whose verifies are priced at its own width only (`_verifies`)."""
        if not metrics.rounds:
            return
        self.since_off = self.since_off + 1 if metrics.drafted and not metrics.probe_rounds else 0
        if metrics.drafted:
            self._observe_probes(arm, metrics, drafts, batch)
        if metrics.draft_steps and metrics.draft_rounds and drafts:
            row = self.draft.setdefault(arm.drafter, {}).setdefault(arm.k, [])
            self._add(row, [metrics.draft_s / metrics.draft_rounds, metrics.draft_rounds,
                            metrics.draft_steps / metrics.draft_rounds])
        if metrics.draft_prefill_s > 0 and metrics.prompt_tokens:
            self._add(self.prefill.setdefault(arm.drafter, []), [metrics.draft_prefill_s, metrics.prompt_tokens])
        # Verifies are kept per drafter: one that follows a model's drafts finds the target's weights
        # evicted from the CPU caches, one after a lookup does not.
        table = self.verify.setdefault(self._verifier(arm.drafter) if metrics.drafted else OFF_ROUNDS, {})
        for width, (seconds, rounds) in _verifies(metrics, batch):  # as fed: n-gram rounds vary
            if not (width == 1 and metrics.drafted):
                self._add(table.setdefault(width, []), [seconds / rounds, rounds])

    def _observe_probes(self, arm: Arm, metrics, drafts: bool, batch: bool) -> None:
        """A speculative request's OFF steps served among its rounds (`probe_off`) price its rounds
        in OFF steps side by side, and are OFF's step of the moment."""
        taken = self.probed.setdefault(arm.drafter, [0, 0])
        if not metrics.probe_rounds:
            taken[1] += 1
            return
        taken[0], taken[1] = taken[0] + 1, 0
        self._add(self.verify.setdefault(OFF_ROUNDS, {}).setdefault(1, []), [metrics.probe_step, metrics.probe_rounds])
        self.observe_side_by_side(arm, metrics.without_probes(), metrics.probe_step, drafts, batch)

    def probes_due(self, drafter: str, first: int, every: int) -> bool:
        """Whether a request on `drafter` should measure OFF's step among its rounds: each of its
        `first` requests, then one in `every` (0: none)."""
        taken, since = self.probed.get(drafter, (0, 0))
        return taken < first or 0 < every <= since + 1

    def observe_side_by_side(self, arm: Arm, metrics, off_step: float, drafts: bool = True,
                             batch: bool = False) -> None:
        """Add the draft and verify costs of a request served on `arm` beside OFF steps measured
        with it (`off_step` seconds: OFF runs on the same prompt, or OFF rounds among its own), in
        those steps; `drafts` False: its verifies only (K moved inside it); `batch`: see `observe`."""
        if not metrics.drafted or off_step <= 0:
            return
        if metrics.draft_steps and metrics.draft_rounds and drafts:
            self._add(self.relative_draft.setdefault(arm.drafter, {}).setdefault(arm.k, []),
                      [metrics.draft_s / metrics.draft_rounds / off_step, metrics.draft_rounds,
                       metrics.draft_steps / metrics.draft_rounds])
        for width, (seconds, rounds) in _verifies(metrics, batch):
            if width > 1:
                table = self.relative_verify.setdefault(self._verifier(arm.drafter), {})
                self._add(table.setdefault(width, []), [seconds / rounds / off_step, rounds])

    def observe_off_decode(self, seconds: float, verify_s: float) -> None:
        """Add OFF rounds of a continuous batch: all their engine seconds (rows joining and
        leaving copy the caches, the controller works between rounds) and those spent verifying."""
        if verify_s > 0:
            self._add(self.off_decode, [seconds / verify_s, verify_s])

    def off_decode_factor(self) -> float | None:
        """Engine seconds an OFF round of a continuous batch takes per second of its verify; None before one ran."""
        return _median(self.off_decode) if self.off_decode else None

    def state_dict(self) -> dict:
        return {"window": self.window, "draft": self.draft, "verify": self.verify, "prefill": self.prefill,
                "off_decode": self.off_decode, "since_off": self.since_off, "relative_draft": self.relative_draft,
                "relative_verify": self.relative_verify, "probed": self.probed}

    @classmethod
    def from_state(cls, state: dict, verify_owners: dict[str, str] | None = None) -> CostModel:
        """The inverse of `state_dict` after a JSON round trip (which turns K and widths into
        strings). A state saved as discounted sums (before costs were medians) starts each cost
        from one observation, its mean."""
        costs = cls(int(state.get("window", WINDOW)), verify_owners)
        if "window" not in state:
            costs.draft = {d: {int(k): [[s / n, n, steps / n]] for k, (s, n, steps) in rows.items() if n > 0}
                           for d, rows in state["draft"].items()}
            costs.verify = {OFF_ROUNDS: {int(w): [[s / n, n]] for w, (s, n) in state["verify"].items() if n > 0}}
            costs.prefill = {d: [[s / t, 1.0]] for d, (s, t) in state["prefill"].items() if t > 0}
            seconds, verify_s = state.get("off_decode", (0.0, 0.0))
            costs.off_decode = [[seconds / verify_s, verify_s]] if verify_s > 0 else []
            return costs
        costs.draft = {d: {int(k): [list(o) for o in obs] for k, obs in rows.items()}
                       for d, rows in state["draft"].items()}
        costs.verify = {who: {int(w): [list(o) for o in obs] for w, obs in table.items()}
                        for who, table in state["verify"].items()}
        costs.prefill = {d: [list(o) for o in obs] for d, obs in state["prefill"].items()}
        costs.off_decode = [list(o) for o in state["off_decode"]]
        costs.since_off = int(state.get("since_off", 0))
        costs.relative_draft = {d: {int(k): [list(o) for o in obs] for k, obs in rows.items()}
                                for d, rows in state.get("relative_draft", {}).items()}
        costs.relative_verify = {who: {int(w): [list(o) for o in obs] for w, obs in table.items()}
                                 for who, table in state.get("relative_verify", {}).items()}
        costs.probed = {d: [int(n) for n in counts] for d, counts in state.get("probed", {}).items()}
        for tables in (costs.verify, costs.relative_verify):  # a store from before drafters shared tables
            for who in [who for who in tables if costs._verifier(who) != who]:
                merged = tables.setdefault(costs._verifier(who), {})
                for width, observations in tables.pop(who).items():
                    merged.setdefault(width, []).extend(observations)
        return costs

    def draft_prefill_cost(self, drafter: str, prompt_tokens: int) -> float:
        """Seconds for the drafter to take in a prompt; 0 before it was measured.

        A line in the prompt's tokens (a forward's fixed cost, then a cost per token), fitted by
        Theil-Sen (the median slope over pairs of requests, so one slow request does not tilt
        it), since a forward's fixed cost makes a cost per token wrong at both ends."""
        observations = self.prefill.get(drafter)
        if not observations:
            return 0.0
        slopes = [[(s2 - s1) / (t2 - t1), 1.0] for i, (s1, t1) in enumerate(observations)
                  for s2, t2 in observations[i + 1:] if t2 != t1]
        if not slopes:  # prompts of one length: per token
            return _median([[s / t, 1.0] for s, t in observations]) * prompt_tokens
        slope = max(0.0, _median(slopes))
        intercept = max(0.0, _median([[s - slope * t, 1.0] for s, t in observations]))
        return intercept + slope * prompt_tokens

    def off_rounds(self) -> float:
        """1-token rounds behind the OFF step's estimate (the window's)."""
        return sum(rounds for _, rounds in self.verify.get(OFF_ROUNDS, {}).get(1, []))

    def off_step(self) -> float | None:
        """Seconds of a measured 1-token step (an OFF round) at this load; None before one ran."""
        observations = self.verify.get(OFF_ROUNDS, {}).get(1)
        return _median(observations) if observations else None

    def relative_verify_cost(self, tokens: int, drafter: str | None = None) -> float | None:
        """A verify of `tokens` after `drafter`'s drafts in 1-token steps, never below 1 (None before
        a 1-token step ran): as measured side by side with OFF's step, else the ratio of their
        medians. Whatever the noise in either estimate, a wider verify does at least a step's work."""
        one = self.off_step()
        if one is None:
            return None
        if self.relative_verify:
            if tokens == 1:
                return 1.0
            # None only where no width was measured side by side: then as without any
            if (relative := _verify_line(self.relative_verify, tokens, self._verifier(drafter))) is not None:
                return max(1.0, relative)
        cost = self.verify_cost(tokens, drafter)
        return None if cost is None else max(1.0, cost / one)

    def relative_draft_cost(self, drafter: str, k: int) -> float | None:
        """A round of k drafts by `drafter` in 1-token steps, as measured side by side with OFF's
        (`draft_cost`'s line through the Ks measured so); None where it was not."""
        rows = self.relative_draft.get(drafter)
        return _draft_line(rows, k) if rows else None

    def off_step_during(self, metrics, drafter: str | None = None) -> float | None:
        """What an OFF step would have cost while this request ran.

        The machine's speed moves from one request to the next, so an OFF step measured
        on other requests says little about this one. The request's own verifies do: their
        seconds, over what its verify widths cost in 1-token steps at this load after `drafter`'s
        drafts, are its 1-token step. None until a 1-token step has run at this load.
        """
        relative = 0.0
        for width, (_, rounds) in metrics.verify_by_width.items():
            if rounds:
                steps = self.relative_verify_cost(width, drafter)
                if steps is None:
                    return None
                relative += rounds * steps
        return metrics.verify_s / relative if relative > 0 else None

    def draft_cost(self, drafter: str, k: int) -> float | None:
        """Seconds of a round drafting k tokens: measured at K = k if that arm has run, else the
        least-squares line through each K's measured (tokens per round, seconds per round), else
        (one K measured) k times its cost per token. Measured first, as for verifies: the cost per
        step falls along a round (the caches warm up), so a line is only an interpolation."""
        return _draft_line(self.draft.get(drafter, {}), k)

    def verify_cost(self, tokens: int, drafter: str | None = None) -> float | None:
        """Seconds of a verify of `tokens` after `drafter`'s drafts (None: OFF's, or any drafter's):
        measured after that drafter's, else after any drafter's, else a least-squares line through
        those measured (`_verify_line`)."""
        return _verify_line(self.verify, tokens, self._verifier(drafter) if drafter is not None else OFF_ROUNDS)

    def _verifier(self, drafter: str | None) -> str | None:
        """Whose verify costs price `drafter`'s."""
        return self.verify_owners.get(drafter, drafter)


def _verifies(metrics, batch: bool) -> list[tuple[int, list[float]]]:
    """(width, [seconds, rounds]) of the verifies a request's costs are learned from: all of
    them, but of a static batch only those at its most frequent width. A batch's other widths
    come from its last rounds, where rows near their token limit draft fewer and most rows have
    finished, and priced from those a batch's small Ks looked far cheaper than they are."""
    widths = [(width, row) for width, row in metrics.verify_by_width.items() if row[1]]
    if batch and widths:
        return [max(widths, key=lambda item: item[1][1])]
    return widths


def _draft_line(rows: dict[int, list[list[float]]], k: int) -> float | None:
    """A round of k drafts from `rows` (K -> [[cost per round, rounds, steps per round]]): see
    `CostModel.draft_cost`."""
    if rows.get(k):
        return _median(rows[k])
    points = [(_median([[steps, n] for _, n, steps in obs]), _median(obs)) for obs in rows.values() if obs]
    if not points:
        return None
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    per_step = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread > 1e-9 else -1.0
    per_round = mean_y - per_step * mean_x
    if per_step < 0 or per_round < 0:  # one K, or noise: the mean cost per token
        return mean_y / mean_x * k
    return per_round + per_step * k


def _verify_line(tables: dict[str, dict[int, list[list[float]]]], tokens: int, who: str | None) -> float | None:
    """A verify of `tokens` after `who`'s drafts from `tables` (who -> tokens -> [[cost, rounds]]):
    as measured after `who`'s, else after anyone's, else a least-squares line through those.

    The line for a multi-token verify goes through multi-token verifies only: a 1-token step
    skips work that every longer one pays once (eager attention builds a causal mask for more
    than one query), so a line through it would price large K far above their cost until played.
    """
    own = tables.get(who, {})
    if own.get(tokens):  # the common case, on every request's path: no other width needed
        return _median(own[tokens])
    pooled: dict[int, list] = {}
    for table in tables.values():
        for width, obs in table.items():
            pooled.setdefault(width, []).extend(obs)
    points = {t: _median(own.get(t) or obs) for t, obs in pooled.items() if obs}
    if tokens in points:
        return points[tokens]
    if tokens > 1:
        points = {t: v for t, v in points.items() if t > 1} or points
    if not points:
        return None
    if len(points) == 1:
        (t0, v0), = points.items()
        return v0 * (1 + VERIFY_SLOPE_PRIOR * (tokens - t0))
    ts, vs = list(points), list(points.values())
    mean_t, mean_v = sum(ts) / len(ts), sum(vs) / len(vs)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(ts, vs)) / sum((t - mean_t) ** 2 for t in ts)
    return max(mean_v + slope * (tokens - mean_t), min(vs))
