"""What every other arm would have done on a request just served.

Under greedy decoding a draft token is kept exactly when it equals the target's next token,
and the output does not depend on the arm. So once a request is served, how many tokens any
drafter would have had accepted from any position follows from the output alone: a model
drafter's greedy prediction at every position comes from one teacher-forced forward over
prompt + output (its drafts stay right exactly while those predictions match), a feature
head's from the target's features over the same sequence (those handed to a head while the
request was served, where one served it; else one target forward) and its K steps
from every position at once (`FeatureHead.chains`: a head's later drafts read its own
predicted features, not the target's, so each step is its own), and n-gram lookup is a scan.
Replaying the decode loop over those run lengths gives each arm's rounds and drafted tokens;
the measured costs (draft seconds per token per drafter, verify seconds
per round by step length) turn them into time. The result is a paired estimate of every
arm's reward on the same request, so the bandit compares arms without the noise of
comparing different prompts (per-request rewards spread by about +-30 % across prompts).

Sampled requests get the same replay in expectation. Rejection sampling keeps a draft from a
distribution q where the target samples from p with probability sum_x min(p(x), q(x)) (a
point-mass draft x: p(x)), so one more teacher-forced forward, of the target, gives the
acceptance probability at every output position, and a round is expected to advance by the
sum of the products of those probabilities along its drafts. The probabilities are taken
along the output actually sampled rather than along each arm's own drafts, so this is an
approximation (a test bounds its error); greedy is the special case where every probability
is 0 or 1 and the replay is exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from autotune.metrics import kept_survival
from engine import Arm, ModelDrafter, NGramDrafter, SamplingParams, SpeculativeEngine
from engine.drafters import capabilities, lookup_of, model_drafter_of
from engine.feature import FeatureDrafter, Features, feature_head_of
from engine.sampling import adjust_logits, probabilities

VERIFY_SLOPE_PRIOR = 0.04  # extra verify cost per drafted token, as a share of a 1-token step (CPU, demo family)


OFF_ROUNDS = "off"  # who drafted a verify's tokens when no one did
NO_MODEL = "(no model)"  # whose verifies price those of every drafter that runs no model (`verify_owners`)
WINDOW = 32  # requests each cost is the median of: a burst shorter than half of them moves no estimate
# A request's figure counts its rounds up to this many: one round's time says less than ten's, but
# past a few dozen a figure is as precise as the moment it was taken, and a long request must not
# outvote several short ones. Counted whole, one cold first OFF request (63 rounds, 1.3x the step
# of the requests after it) outweighed calibration's three runs, and every reward after it read
# 1.2-1.3x the speedup measured beside it until OFF was measured again.
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
    request, not a running mean: on a shared machine one request can run 40x slower than the
    next (torch's threads oversubscribed), and a discounted mean kept such an outlier for a
    hundred requests, so a slow first OFF request made every later speculative reward look up
    to 2.4x what its tokens per round allowed. Costs are relative where a reward uses them (see
    `off_step_during`), and a verify of several tokens is never priced below a 1-token step,
    so a reward can never exceed the tokens its rounds committed per verify.

    A draft round costs more than K times a later step: its first step finds the drafter's
    weights evicted from the CPU caches by the target's verify (demo family: 1.19 ms, against
    0.62-0.85 ms for the later steps of the round), so a round is priced as measured at its K,
    else by a line in its tokens through the Ks measured.

    Rewards and replays price rounds in OFF steps, and a ratio of two medians taken at different
    moments is as wrong as the machine's speed moved between them: OFF's step was measured at
    calibration and the drafters' verifies on later requests, and a controller's rewards came
    out 0.9x or 1.24x the speedups measured beside them by whether the machine ran fast or slow
    while it calibrated. So the costs in OFF steps are taken side by side: OFF and each drafter
    on the same prompt within seconds (`rewards.calibrate`), then OFF steps served among a
    request's own rounds (`probe_off`: the machine's step moves by a quarter within tenths of a
    second, and a drafter's verifies over OFF runs beside them varied twice as much from one
    request to the next as over OFF rounds among them). Requests without such steps never move
    them; without any (a load no calibration ran at, an older store) the ratio of the medians
    stands in.
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
        # evicted from the CPU caches (a 1-token one costs 1.1-1.6x an OFF step on the demo family),
        # one after a lookup does not. Priced alike, a 1-token verify among drafting rounds made
        # every wider verify look cheap and rewards 22 % too high, and a hybrid's verifies after
        # lookups made a model drafter's look cheap (its rewards 11 % too high).
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
        """Seconds for the drafter to take in a prompt (on long prompts in a batch of 16, a third
        of the target's own prefill with the demo family); 0 before it was measured.

        A line in the prompt's tokens (a forward's fixed cost, then a cost per token), fitted by
        Theil-Sen (the median slope over pairs of requests, so one slow request does not tilt
        it): priced per token at the median, long prompts' prefill cost 1.4x what they took and
        short ones' too little, and rewards of model drafters fell 11 % short on long prompts."""
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

        The machine's speed moves by +-25 % from one request to the next (the demo family's OFF
        steps: 6.5-13.5 ms per request at load 1, whatever the prompt), so an OFF step measured
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
    finished: one 2-token verify of 3 rows' tail priced at a fifth of a 7-token one of 16 made
    every K=6 batch estimate K=1 at twice its reward (chat at 1.96x OFF, measured 0.93x), and
    the policy played the arms those estimates named."""
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
    than one query), 26 % of a step on the demo family against ~5 % per extra token, so a line
    through it would price large K at twice their cost until they had been played.
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


def target_probabilities(engine: SpeculativeEngine, sequence: list[int], start: int,
                         sampling: SamplingParams) -> torch.Tensor:
    """[len(sequence) - start, V]: the distribution each output token from `start` on was sampled
    from, min_tokens included (the output begins one token before `start`)."""
    hold = engine.stopping(sampling, start - 1).hold
    return probabilities(_teacher_forced_logits(engine.target, sequence, start, sampling, hold), sampling)


def _teacher_forced_logits(model, sequence: list[int], start: int, sampling: SamplingParams | None,
                           hold: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
    """Logits whose row j predicts sequence[start + j], from one forward over the whole sequence,
    with the request's edits as the engine and its drafters apply them (the output begins one
    token before `start`)."""
    ids = torch.tensor([sequence], device=model.device)
    with torch.inference_mode():
        logits = model(ids, use_cache=False, logits_to_keep=len(sequence) - start + 1).logits[0, :-1]
        if sampling is None:
            return logits
        return adjust_logits(logits, sequence[:start], sequence[start:], start - 1, sampling, hold)


def model_chains(drafter: ModelDrafter, sequence: list[int], start: int, k: int,
                 target: torch.Tensor | None, sampling: SamplingParams | None,
                 memo: dict | None = None) -> list[list[float]]:
    """For each position t >= start: the acceptance probability of each of k drafts from there.

    `target` None means greedy: a draft is kept exactly when the drafter's argmax is the output.
    `memo` (one per sequence) keeps each model's acceptances, so drafters that run the same model
    (a model drafter and a hybrid of it) pay for one forward.
    """
    memo = memo if memo is not None else {}
    if drafter.model not in memo:
        logits = _teacher_forced_logits(drafter.model, sequence, start, sampling)
        if target is None:
            accept = (logits.argmax(-1) == torch.tensor(sequence[start:], device=logits.device)).float()
        else:
            accept = torch.minimum(target, probabilities(logits, sampling)).sum(-1)
        memo[drafter.model] = accept.tolist()
    accept = memo[drafter.model]
    return [accept[j:j + k] for j in range(len(accept))]


def ngram_chains(drafter: NGramDrafter, sequence: list[int], start: int, k: int,
                 target: torch.Tensor | None) -> tuple[list[list[float]], list[int]]:
    """For each position t >= start: acceptance probabilities of the (up to k) tokens proposed, and how many.

    A draft that differs from the output leaves the path the target's distributions were
    taken on, so the chain stops there (its own probability still counts when sampled).
    """
    chains, proposed = [], []
    for t in range(start, len(sequence)):
        draft, _ = drafter.propose(sequence[:t], k, None, None)
        chain = []
        for i, token in enumerate(draft[: len(sequence) - t]):
            matches = token == sequence[t + i]
            chain.append(float(matches) if target is None else float(target[t - start + i, token]))
            if not matches:
                break
        chains.append(chain)
        proposed.append(len(draft))
    return chains, proposed


def target_features(model, sequence: list[int], memo: dict) -> Features:
    """The target's features over the sequence (its last hidden states, what it hands a feature
    head while serving): those the request served handed over where `memo` holds them (under
    "features"), else from one forward over the sequence, kept in `memo`."""
    if "features" not in memo:
        with torch.inference_mode():
            out = model(torch.tensor([sequence], device=model.device), use_cache=False, output_hidden_states=True,
                        logits_to_keep=1)
        memo["features"] = Features(0, out.hidden_states[-1][0])
    return memo["features"]


def feature_chains(drafter: FeatureDrafter, target_model, sequence: list[int], start: int, k: int,
                   target: torch.Tensor | None, sampling: SamplingParams | None,
                   memo: dict | None = None) -> list[list[float]] | None:
    """For each position t >= start: the acceptance probability of each of k drafts of a feature
    head's round from there (`FeatureDrafter.replay_logits`: greedy, exactly the head's rounds);
    None where the request edits its logits (the head's drafts then see edits along their own
    drafts, which this replay does not apply)."""
    if sampling is not None and sampling.adjusts_logits:
        return None
    memo = {} if memo is None else memo
    if ("head", drafter, k) in memo:  # a hybrid drafting with the same head
        return memo["head", drafter, k]
    with torch.inference_mode():
        features = target_features(target_model, sequence, memo)
        if target is None:  # [k, R]: draft j of the round from start + r drafts sequence[start + r + j]
            accept = drafter.replay_kept(features, sequence, start, k)
            rounds = accept.shape[1]
        else:
            logits = drafter.replay_logits(features, sequence, start, k)  # [k, R, V]
            rounds = logits.shape[1]
            offsets = torch.arange(rounds, device=logits.device)[None] + torch.arange(k, device=logits.device)[:, None]
            accept = torch.minimum(target[offsets.clamp(max=rounds - 1)], probabilities(logits, sampling)).sum(-1)
    accept = accept.tolist()
    memo["head", drafter, k] = [[accept[j][r] for j in range(min(k, rounds - r))] for r in range(rounds)]
    return memo["head", drafter, k]


def expected_accepted(chain: list[float], k: int) -> float:
    """Drafts kept in a round of k drafts: each is kept only if every earlier one was."""
    kept, alive = 0.0, 1.0
    for accept in chain[:k]:
        alive *= accept
        kept += alive
    return kept


def replay(chains: list[list[float]], proposed: list[int] | None, k: int, max_new_tokens: int) -> list[int]:
    """Tokens drafted in each round of a request replayed at constant K (the engine's own loop)."""
    return [drafted for _, drafted in replay_rounds(chains, proposed, k, max_new_tokens)]


def replay_rounds(chains: list[list[float]], proposed: list[int] | None, k: int,
                  max_new_tokens: int) -> list[tuple[int, int]]:
    """(position of `chains` it starts at, tokens drafted) of each round of a request replayed at
    constant K (the engine's own loop).

    Position 0 of `chains` is the first output position a round starts at (the token after the
    prefill's), i.e. output index 1. A sampled replay advances by expected, fractional amounts.
    """
    rounds = []
    committed = 1.0  # output tokens after prefill
    # The round starts at output index int(committed). Probabilities that should sum to 1 are
    # float32 and fall short by up to ~3e-7 per draft, so a run of certain drafts can total a
    # hair under a whole token; the tolerance covers thousands of drafts of that.
    while (j := int(committed + 1e-3) - 1) < len(chains):
        k_round = max(0, min(k, max_new_tokens - j - 2, proposed[j] if proposed is not None else k))
        rounds.append((j, k_round))
        committed += expected_accepted(chains[j], k_round) + 1
    return rounds


def batch_rounds(per_row: list[list[int]]) -> list[int]:
    """Tokens drafted per round by a batch whose rows alone would draft `per_row`: each round
    drafts as far as its longest row, and the batch lasts until its slowest row is done."""
    return [max(r[j] for r in per_row if j < len(r)) for j in range(max(map(len, per_row)))]


def drafter_chains(drafter, sequence: list[int], start: int, k: int, target: torch.Tensor | None,
                   sampling: SamplingParams | None, memo: dict | None = None, target_model=None
                   ) -> tuple[list[list[float]], list[int] | None, list[bool] | None] | None:
    """(chains, tokens proposed, drafted by lookup) from every position for a drafter made of a
    lookup, a model drafter or a feature head (drafting for `target_model`), or a lookup and one
    of the others (proposed None: always k; by lookup None: no drafter behind its lookup); None
    where it cannot be replayed. A drafter with both drafts by lookup wherever lookup proposes,
    else by the other. `memo`: see `model_chains`."""
    lookup, model, head = lookup_of(drafter), model_drafter_of(drafter), feature_head_of(drafter)
    if model is not None:
        inner = model_chains(model, sequence, start, k, target, sampling, memo)
    elif head is not None and target_model is not None:
        inner = feature_chains(head, target_model, sequence, start, k, target, sampling, memo)
        if inner is None:
            return None
    else:
        return (*ngram_chains(lookup, sequence, start, k, target), None) if lookup is not None else None
    if lookup is None:
        return inner, None, None
    looked_up, proposed = ngram_chains(lookup, sequence, start, k, target)
    return ([a if n else b for a, n, b in zip(looked_up, proposed, inner)],
            [n or k for n in proposed], [n > 0 for n in proposed])


def kept_chain(metrics, k: int, depth: int) -> list[float] | None:
    """A request's drafts kept per position as a chain of `depth` acceptance probabilities: the
    chance that draft i is kept once every earlier one was, from its rounds at constant K = `k`
    (`accepted_per_position` over every round, drafted that far or not), the fall past K
    extended geometrically as `sibling_rewards` does; None if its first drafts were never kept."""
    survival = kept_survival(metrics, k)
    if survival is None:
        return None
    chain = [survival[0]] + [b / a if a > 0 else 0.0 for a, b in zip(survival, survival[1:])]
    return chain + [chain[-1]] * (depth - len(chain))


def hybrid_rounds(chain: list[float], proposed: list[int], looked_up: list[list[float]], k: int,
                  max_new_tokens: int) -> list[tuple[int, bool]]:
    """(tokens drafted, by lookup) of each round of a hybrid at constant K whose lookup proposes
    `proposed[j]` tokens from output position j (kept as `looked_up[j]` says: `ngram_chains`) and
    whose inner drafter's drafts are kept as `chain` says (`kept_chain`) wherever it proposes none."""
    chains = [looked_up[j] if n else chain for j, n in enumerate(proposed)]
    return [(drafted, proposed[j] > 0)
            for j, drafted in replay_rounds(chains, [n or k for n in proposed], k, max_new_tokens)]


def hybrid_estimates(engine: SpeculativeEngine, arm: Arm, metrics, reward: float, prompt: list[int],
                     output: list[int], max_new_tokens: int, costs: CostModel, ks: dict[str, list[int]],
                     exact_weight: float = 0.5, extrapolated_weight: float = 0.25) -> dict[str, tuple[float, float]]:
    """Estimated rewards {arm: (reward, weight)} of the hybrids that chain a lookup before the
    drafter of `arm` (`ks`: the K values of each drafter among the policy's arms), from one
    greedy request that drafter served alone at constant K, without a forward: where the
    hybrid's lookup proposes, its drafts are kept exactly as the output says (a scan of it);
    everywhere else its inner drafter drafts, kept as often per position as in this request
    (`kept_chain`). Both arms' rounds are priced with the same measured costs and the hybrid's
    time scaled by what this request's own rounds took over their price, so the estimate moves
    with the served arm's reward. Without it a policy that found a feature head fast learned its
    hybrid only by playing it: ucb on the many-classes stream played `feature:4` in 90 of 104
    requests while `ngram+feature:4` served the same requests 1.04x faster. Ks above the served
    one extrapolate its chain: less weight."""
    hybrids = {name: hybrid_ks for name, hybrid_ks in ks.items()
               if name != arm.drafter and lookup_of(engine.drafters[name]) is not None
               and draft_cost_owner(engine, name) == arm.drafter}
    if arm.is_off or not hybrids or lookup_of(engine.drafters[arm.drafter]) is not None or len(output) < 2:
        return {}
    depth = max(max(hybrid_ks) for hybrid_ks in hybrids.values())
    chain = kept_chain(metrics, arm.k, depth)
    if chain is None:
        return {}

    # Every K's rounds ask for the same few costs: a median each
    draft_cost, verify_cost = functools.cache(costs.draft_cost), functools.cache(costs.verify_cost)

    def seconds(rounds: list[tuple[int, bool]], who: str, lookup: str | None) -> float | None:
        """The rounds' price: a lookup's draft (next to nothing where its drafter has not run), the
        played drafter's, and a verify after `who`'s drafts."""
        total = 0.0
        for drafted, by_lookup in rounds:
            if by_lookup:
                draft = (draft_cost(lookup, drafted) if lookup else None) or 0.0
            else:
                draft = draft_cost(arm.drafter, drafted) if drafted else 0.0
            verify = verify_cost(drafted + 1, who)
            if draft is None or verify is None:
                return None
            total += draft + verify
        return total

    positions = len(output) - 1
    served = seconds(hybrid_rounds(chain, [0] * positions, [[]] * positions, arm.k, max_new_tokens), arm.drafter,
                     None)
    if not served:
        return {}
    scale = (metrics.draft_s + metrics.verify_s) / served
    sequence, start = prompt + output, len(prompt) + 1
    estimates = {}
    for name, hybrid_ks in hybrids.items():
        looked_up, proposed = ngram_chains(lookup_of(engine.drafters[name]), sequence, start, depth, None)
        lookup, _ = hybrid_parts(engine, name)
        for k in hybrid_ks:
            hybrid = seconds(hybrid_rounds(chain, proposed, looked_up, k, max_new_tokens), name, lookup)
            if hybrid is not None:
                estimate = reward * (metrics.prefill_s + scale * served) / (metrics.prefill_s + scale * hybrid)
                estimates[f"{name}:{k}"] = (estimate, exact_weight if k <= arm.k else extrapolated_weight)
    return estimates


def served_features(drafter) -> Features | None:
    """The target's features the last request `drafter` served handed its feature head, a copy;
    None for a drafter without one."""
    head = feature_head_of(drafter)
    return head.served() if head is not None else None


def replayable(drafter) -> bool:
    """The replay can estimate `drafter`: it declares so (lookups, model drafters, feature heads, chains of them)."""
    return capabilities(drafter).replay


def hybrid_parts(engine: SpeculativeEngine, name: str) -> tuple[str | None, str] | None:
    """The engine's drafters that run what drafter `name` runs when it chains a lookup and another
    drafter: (an n-gram drafter or None, the drafter that is its inner one or runs its model,
    `draft_cost_owner`); None if `name` does not chain or no such drafter is in the engine."""
    inner = draft_cost_owner(engine, name)
    if inner == name:
        return None
    lookup = next((n for n, d in engine.drafters.items() if lookup_of(d) is not None and model_drafter_of(d) is None
                   and getattr(d, "inner", None) is None), None)
    return lookup, inner


def verify_owners(engine: SpeculativeEngine) -> dict[str, str]:
    """Whose verify costs price each of the engine's drafters': its own for a drafter that runs a
    model (its drafts evict the target's weights from the CPU caches: a 1-token verify after them
    costs 1.1-1.6x an OFF step on the demo family), NO_MODEL for the others (lookups, feature
    heads, layer skips, hybrids of them), whose verifies find the target as OFF's do. Each from
    its own table, priced from a few of calibration's rounds, four calibrations put the rewards
    of one set of ngram+feature:8 requests at 0.89-1.12x the speedups measured beside them
    (pooled: 0.92-0.99), and one controller priced the head's and its hybrid's 9-token verify
    at 1.32 and 2.34 OFF steps."""
    return {name: name if model_drafter_of(drafter) is not None else NO_MODEL
            for name, drafter in engine.drafters.items()}


def draft_cost_owner(engine: SpeculativeEngine, name: str) -> str:
    """The engine's drafter whose draft rounds cost what drafter `name`'s cost as K changes: for a
    lookup chained before an inner drafter, the drafter that is that inner one or runs its model
    (lookup rounds cost next to nothing at any K, so the hybrid's own cost per round is the share
    of its rounds that the inner drafter drafted, which depends on the text: calibrated on
    copy-heavy code it priced a hybrid's K = 8 round below its K = 6 one); else `name`."""
    drafter = engine.drafters.get(name)
    inner = getattr(drafter, "inner", None)
    if lookup_of(drafter) is None or inner is None:
        return name
    model = model_drafter_of(inner)
    for other, candidate in engine.drafters.items():
        if other != name and lookup_of(candidate) is None and (
                candidate is inner or (model is not None and getattr(model_drafter_of(candidate), "model", None)
                                       is model.model)):
            return other
    return name


def replay_arm(engine: SpeculativeEngine, arm: Arm, prompt: list[int], output: list[int], max_new_tokens: int,
               sampling: SamplingParams | None = None, features: Features | None = None) -> list[int]:
    """Tokens drafted per round had `arm` served this request (one entry per round; expected if
    sampled); `features`: see `arm_rewards`."""
    sequence, start = prompt + output, len(prompt) + 1
    target = None if sampling is None or sampling.greedy else target_probabilities(engine, sequence, start, sampling)
    chains, proposed, _ = drafter_chains(engine.drafters[arm.drafter], sequence, start, arm.k, target, sampling,
                                         {} if features is None else {"features": features}, engine.target)
    return replay(chains, proposed, arm.k, max_new_tokens)


def arm_rewards(engine: SpeculativeEngine, arms: list[Arm], costs: CostModel,
                requests: list[tuple[list[int], list[int], int]], prefill_s: float,
                off_step_s: float, sampling: SamplingParams | list[SamplingParams] | None = None,
                features: Features | None = None, replay_rows: int | None = None) -> dict[str, float]:
    """Estimated reward (OFF time / arm time) of each arm whose costs are known.

    `requests` holds (prompt, output, max_new_tokens) of one request, or of every request of a
    batch served together: a batch's round drafts as many tokens as its longest row does and
    lasts until its slowest row is done, at the costs measured at the batch's load. `prefill_s`
    is the target's prefill, which every arm pays; a drafter's own is priced from `costs`.
    `sampling`: one for every request, or one per request (a batch may mix greedy and sampled).
    `features`: the target's features a feature head was handed while the one request was
    served (`served_features`), which feature heads then replay from without a target forward.
    `replay_rows`: replay only the first this many requests of a batch (the caller puts first
    those that decide how long it lasts), all of them still counting in its OFF rounds and
    prompt tokens.

    A hybrid's rounds of one request are priced by who drafted them, at the costs of the
    engine's n-gram drafter and of the model drafter that runs its model (`hybrid_parts`): its
    own cost per round is an average over the requests it served, whose share of lookup rounds
    differs from this one's (copy-heavy code: most; chat: few), and priced so its replays were
    16 % short of its measured speedup.
    """
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(requests)
    kept = [i for i, r in enumerate(requests) if len(r[1]) >= 2]
    requests, samplings = [requests[i] for i in kept], [samplings[i] for i in kept]
    if not requests:
        return {}
    off_rounds = max(len(output) for _, output, _ in requests) - 1
    prompt_tokens = sum(len(prompt) for prompt, _, _ in requests)
    if replay_rows is not None:
        requests, samplings = requests[:replay_rows], samplings[:replay_rows]
    off_time = prefill_s + off_rounds * off_step_s

    @functools.cache
    def draft_cost(drafter: str, k: int) -> float | None:
        """Seconds of a round, in this request's OFF steps where measured beside OFF (see CostModel)."""
        relative = costs.relative_draft_cost(drafter, k)
        return relative * off_step_s if relative is not None else costs.draft_cost(drafter, k)

    parts = {a.drafter: hybrid_parts(engine, a.drafter) for a in arms if not a.is_off}
    parts = {name: p for name, p in parts.items() if p is not None and draft_cost(p[1], 1) is not None
             and len(requests) == 1 and replayable(engine.drafters[name])}

    def priced(arm: Arm) -> bool:
        return arm.is_off or arm.drafter in parts or draft_cost(arm.drafter, arm.k) is not None

    known = [a for a in arms if priced(a)]  # others never served
    longest = {}  # drafter -> its largest K: shorter K replay the same chains
    for arm in known:
        if not arm.is_off and replayable(engine.drafters.get(arm.drafter)):
            longest[arm.drafter] = max(longest.get(arm.drafter, 0), arm.k)
    sequences = [prompt + output for prompt, output, _ in requests]
    starts = [len(prompt) + 1 for prompt, _, _ in requests]
    targets = [target_probabilities(engine, sequence, start, sp) if sp is not None and not sp.greedy and longest
               else None for sequence, start, sp in zip(sequences, starts, samplings)]
    memos = [{} for _ in sequences]  # per sequence: each model's acceptances, computed once
    if features is not None and len(requests) == 1 and features.by_position.shape[0] >= len(sequences[0]) - 1:
        memos[0]["features"] = features
    chain_table = {name: [drafter_chains(engine.drafters[name], sequence, start, k, target, sp, memo, engine.target)
                          for sequence, start, target, sp, memo in zip(sequences, starts, targets, samplings, memos)]
                   for name, k in longest.items()}
    chain_table = {name: rows for name, rows in chain_table.items() if all(row is not None for row in rows)}
    # In 1-token steps, as the played arm's reward prices them: never below one (the same few widths each round)
    verify_steps = functools.cache(costs.relative_verify_cost)  # (tokens, drafter)
    estimates = {}
    for arm in known:
        if arm.is_off:
            rounds, draft = [(0, None)] * off_rounds, 0.0  # (tokens drafted, by which drafter)
        elif arm.drafter in parts and arm.drafter in chain_table:
            (lookup, model), (chains, proposed, looked_up) = parts[arm.drafter], chain_table[arm.drafter][0]
            rounds = [(k, lookup if looked_up[j] else model) for j, k in replay_rounds(chains, proposed, arm.k,
                                                                                         requests[0][2])]
            draft = sum(draft_cost(who, k) or 0.0 for k, who in rounds if k and who is not None)
            draft += (costs.draft_prefill_cost(arm.drafter, prompt_tokens)
                      or costs.draft_prefill_cost(model, prompt_tokens))
        elif arm.drafter in chain_table:
            per_row = [replay(chains, proposed, arm.k, max_new)
                       for (chains, proposed, _), (_, _, max_new) in zip(chain_table[arm.drafter], requests)]
            rounds = [(k, arm.drafter) for k in batch_rounds(per_row)]
            draft = (sum(draft_cost(arm.drafter, k) for k, _ in rounds if k)
                     + costs.draft_prefill_cost(arm.drafter, prompt_tokens))
        else:
            continue
        verify = [verify_steps(k + 1, who if k else None) for k, who in rounds]
        if any(v is None for v in verify):
            continue
        estimates[str(arm)] = off_time / (prefill_s + draft + sum(v * off_step_s for v in verify))
    return estimates
