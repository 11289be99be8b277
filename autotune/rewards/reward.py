"""Rewards the controller learns from: speedups over OFF on the very work that was served.

A request's reward is the time OFF would have taken for the same prompt and output over the
time the arm took. OFF's time is the target's prefill plus one OFF step per output token after
the first (`off_seconds`, the one formula), and the OFF step is the one the request's own
verifies imply at its load (`CostModel.off_step_during`): a moment when the machine runs slow
slows both sides alike, and comparing each request with itself keeps prompt and output length
out of the reward's noise. No verify is priced below a step, so a reward never exceeds the
tokens its rounds committed per verify.

`RewardModel` holds the measured costs, per load bucket and greedy or sampled (`cost_key`), and
says when they can price a reward at all (`knows_off`); `calibrate` measures them before the
first request, so no request has to be served OFF to price the others. Switched on
(PROBE_FIRST, PROBE_EVERY), a drafter's first requests, then one in PROBE_EVERY, serve a few
rounds OFF among their own to measure what its verifies cost in OFF steps at the moment
(`probes_for`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading

from autotune.rewards.costs import CostModel
from autotune.rewards.replay import hybrid_parts, verify_owners
from engine import MAX_K, OFF, Arm, GenerationMetrics, SamplingParams, SpeculativeEngine
from engine.drafters import model_drafter_of
from policies import LOAD_BUCKETS, Context, load_bucket

logger = logging.getLogger(__name__)

CALIBRATION_PROMPT = 256  # tokens of the prompt `calibrate` serves each arm kind on, at most
# What `calibrate` serves, through the engine's tokenizer: text a model continues as it would a
# request's, so drafts are kept about as often as on requests.
CALIBRATION_TEXT = '''def read_config(path, defaults=None):
    """Read a key = value file into a dict, with the defaults for keys it does not set."""
    config = dict(defaults or {})
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if "=" not in line:
                raise ValueError(f"{path}:{number}: expected key = value, got {line!r}")
            key, value = (part.strip() for part in line.split("=", 1))
            if value.lower() in ("true", "false"):
                value = value.lower() == "true"
            elif value.isdigit():
                value = int(value)
            config[key] = value
    return config


def write_config(path, config):
    """Write a dict as a key = value file, one key a line, in sorted order."""
    with open(path, "w", encoding="utf-8") as handle:
        for key in sorted(config):
            value = config[key]
            if isinstance(value, bool):
                value = "true" if value else "false"
            handle.write(f"{key} = {value}\\n")


def merge_configs(*configs):
    """The configs merged left to right: a later one's keys win."""
    merged = {}
    for config in configs:
        merged.update(config)
    return merged
'''
# Tokens it decodes per drafter's run: more were no closer to the speedups measured beside them.
CALIBRATION_TOKENS = 33
CALIBRATION_OFF_TOKENS = 17
# OFF rounds a request runs among its own while its drafter's costs in OFF steps are learned
# (`RewardModel.probes_for`). Off by default: they cost more than they taught on the
# many-classes bench.
PROBE_ROUNDS = 2
PROBE_FIRST = 0
PROBE_EVERY = 0  # 0: none after the first
# OFF rounds every batch on a drafter runs among its own, for the same reason and always: no
# calibration prices a batch's rounds true to scale (rows of other prompts pad each step
# differently), and two rounds are a small share of a batch's.
BATCH_PROBE_ROUNDS = 2


def cost_key(bucket: str, sampled: bool) -> str:
    """Where the costs of requests at this load bucket are kept: a sampled round costs more than a
    greedy one, and priced as a greedy one's, every replay of a greedy request fell short."""
    return bucket + (" sampled" if sampled else "")


def is_sampled(context: Context) -> bool:
    return context.features.get("temperature", 0.0) > 0


def off_seconds(metrics: GenerationMetrics, off_steps: int, step: float) -> float:
    """What OFF would have taken for this work: the target's prefill (a drafter's prefill is its
    arm's cost, not OFF's) and `off_steps` steps of `step` seconds."""
    return metrics.prefill_s - metrics.draft_prefill_s + max(off_steps, 0) * step


class RewardModel:
    """The measured costs, and the rewards they price.

    A learning policy plays OFF at a load until `min_baseline_steps` OFF steps ran there (any
    class), and again once `remeasure_off_every` requests there measured no OFF step (neither
    served OFF nor running OFF rounds among their own, which `probes_for` asks of the request
    before that one, so that alone it does not come to pass): every reward and replay
    is scaled by that step, and a policy that has left OFF would otherwise price them for good
    by OFF steps measured at another moment of the machine. A static batch needs
    neither: it measures OFF's step among its own rounds.
    """

    def __init__(self, costs: dict[str, CostModel] | None = None, min_baseline_steps: int = 16,
                 remeasure_off_every: int = 64, verify_owners: dict[str, str] | None = None) -> None:
        self.costs = costs if costs is not None else {}  # cost_key -> measured draft and verify costs
        self.verify_owners = verify_owners  # see counterfactual.verify_owners
        self.min_baseline_steps = min_baseline_steps
        self.remeasure_off_every = remeasure_off_every

    def probes_for(self, context: Context, arm: Arm) -> int:
        """OFF rounds a request served alone, or a static batch, on `arm` should run among its own
        (`probe_off`): a batch BATCH_PROBE_ROUNDS; alone PROBE_ROUNDS on each of a drafter's first
        PROBE_FIRST requests at a load, then on one in PROBE_EVERY (none when both are 0, the
        default), and on the request that would otherwise be the last before OFF's step must be
        measured again (`knows_off`): a few OFF rounds cost far less than a whole request served
        OFF; none on OFF."""
        if arm.is_off:
            return 0
        if context.load > 1:
            return BATCH_PROBE_ROUNDS
        costs = self.costs_of(context)
        if costs is not None and costs.since_off >= self.remeasure_off_every - 1:
            return PROBE_ROUNDS
        if not (PROBE_FIRST or PROBE_EVERY):
            return 0
        due = costs is None or costs.probes_due(arm.drafter, PROBE_FIRST, PROBE_EVERY)
        return PROBE_ROUNDS if due else 0

    def costs_for(self, load: int, sampled: bool) -> CostModel:
        """The costs of requests at this load, greedy or sampled (made empty if none yet)."""
        return self.costs.setdefault(cost_key(load_bucket(load), sampled), CostModel(verify_owners=self.verify_owners))

    def costs_of(self, context: Context) -> CostModel | None:
        """The measured costs of requests like `context`'s (its load, greedy or sampled), if any."""
        return self.costs.get(cost_key(load_bucket(context.load), is_sampled(context)))

    def knows_off(self, context: Context, segments: bool = False) -> bool:
        """Whether rewards at the context's load can be priced true to scale: OFF's step measured
        there recently enough (for continuous batches' `segments`, OFF's rounds at this load or
        the nearest, see `segment_reward`)."""
        if segments:
            return self.off_decode_factor(context) is not None
        if context.load > 1 and BATCH_PROBE_ROUNDS:
            return True  # a static batch measures OFF's step among its own rounds (`probes_for`)
        costs = self.costs_of(context)
        return (costs is not None and costs.off_rounds() >= self.min_baseline_steps
                and costs.since_off < self.remeasure_off_every)

    def off_decode_factor(self, context: Context) -> float | None:
        """Engine seconds per verify second of OFF rounds in continuous batches at the context's
        load bucket, else at the nearest bucket where OFF segments ran (rows drift between
        buckets during a segment, so a decision's bucket may not be the one its segment is
        learned in), of requests sampled as its first or else the others; None before any ran."""
        here = LOAD_BUCKETS.index(load_bucket(context.load))
        for other in sorted(LOAD_BUCKETS, key=lambda b: abs(LOAD_BUCKETS.index(b) - here)):
            for sampled in (is_sampled(context), not is_sampled(context)):
                costs = self.costs.get(cost_key(other, sampled))
                if costs is not None and (factor := costs.off_decode_factor()) is not None:
                    return factor
        return None

    @staticmethod
    def request_reward(arm: Arm, metrics: GenerationMetrics, off_steps: int, costs: CostModel) -> float:
        """Speedup over OFF of a request (or a batch served together) on `arm`: `off_seconds` over
        the time it took. A batch's OFF steps are its longest output's (`off_steps`), each step
        decoding every row. An OFF request scores about 1.0; 1.0 before any OFF step ran at its load.
        OFF rounds served among the arm's (`probe_off`) are left out of both."""
        off_steps -= metrics.probe_rounds
        metrics = metrics.without_probes()
        step = costs.off_step_during(metrics, arm.drafter)
        if step is None or metrics.total_s <= 0:
            return 1.0
        return off_seconds(metrics, off_steps, step) / metrics.total_s

    def row_reward(self, arm: Arm, metrics: GenerationMetrics, context: Context) -> float:
        """The speedup of one request of a continuous batch, its own work only: its prefill and the
        rounds it was in; 1.0 before any OFF step cost is known."""
        costs = self.costs_of(context)
        step = costs.off_step_during(metrics, arm.drafter) if costs is not None else None
        taken = metrics.prefill_s + metrics.draft_s + metrics.verify_s
        if step is None or taken <= 0:
            return 1.0
        return off_seconds(metrics, metrics.new_tokens - 1, step) / taken

    def segment_reward(self, arm: Arm, done: GenerationMetrics, gain: float, context: Context,
                       fell_back: bool) -> float | None:
        """Learn the costs of a continuous batch's rounds on `arm` (`done`: their counters; `gain`:
        the tokens they committed per live row and round, OFF's 1), and their reward: their tokens
        per second over OFF's at the same load; None before an OFF segment ran.

        The segment's time is everything but the target's prefills of requests joining (any arm
        pays those): drafts, verifies, drafters' prefills, and the copies of the caches as rows
        join and leave, which a speculative batch makes more of (its rows finish at different
        rounds; OFF's joined together finish together), so counting drafts and verifies alone
        would score speculative segments high. An OFF round costs the OFF step that the segment's
        own verifies imply, times the engine seconds OFF rounds take per second of their verify
        (measured on OFF segments, `off_decode_factor`).
        """
        taken = done.total_s - (done.prefill_s - done.draft_prefill_s)
        costs = self.costs_for(context.load, is_sampled(context))
        # a drafter's prefill here covers whole contexts, not prompts: it prices no prompt token
        costs.observe(arm, dataclasses.replace(done, draft_prefill_s=0.0), drafts=not fell_back)
        if arm.is_off:
            costs.observe_off_decode(taken, done.verify_s)
        step = costs.off_step_during(done, arm.drafter)
        factor = self.off_decode_factor(context)
        if factor is None or step is None:
            return None
        return gain * done.rounds * step * factor / taken if taken > 0 else 1.0

    def state_dict(self) -> dict:
        return {key: costs.state_dict() for key, costs in self.costs.items()}

    def load_state_dict(self, state: dict) -> None:
        self.costs = {key: CostModel.from_state(s, self.verify_owners) for key, s in state.items()}


# Two calibration runs of a drafter whose seconds per round over the OFF step beside them differ
# by more than this factor disagree, and a third run decides. On the committed family, quiet, a
# quarter of the drafters' pairs of runs did (15-16 of 60), under bursts of 8x slower forwards
# 24-26: runs of 33 tokens are short, and the machine's speed moves within them.
CALIBRATION_AGREEMENT = 1.2


def _disagree(first: tuple[GenerationMetrics, float], second: tuple[GenerationMetrics, float]) -> bool:
    """Whether two (metrics, OFF step beside them) runs of one arm price its rounds too far apart."""
    (a, a_step), (b, b_step) = first, second
    a_relative = (a.draft_s + a.verify_s) / a.rounds / a_step
    b_relative = (b.draft_s + b.verify_s) / b.rounds / b_step
    return max(a_relative, b_relative) > CALIBRATION_AGREEMENT * min(a_relative, b_relative)


def calibrate(engine: SpeculativeEngine, ks: dict[str, list[int]], sampling: SamplingParams,
              engine_lock: threading.Lock, stop: threading.Event | None = None) -> CostModel | None:
    """What OFF's steps and each drafter's rounds cost alone, measured before the first request
    on CALIBRATION_TEXT (random token ids without a tokenizer; each drafter of `ks` at every K of
    it, CALIBRATION_TOKENS each), so that the first request needs no OFF baseline, every arm can
    be replayed from it, and no drafter is priced from one K played (its longer rounds cost
    more than K of its shortest). It runs once: the costs are kept in the store.
    Its draft and verify costs in OFF steps, measured side by side, price every reward and
    replay after it until requests' OFF rounds among their own outvote them
    (CostModel.observe_side_by_side, `RewardModel.probes_for`); the costs in seconds are
    replaced by requests' as they come (each a median over requests, by rounds). A drafter's
    prefill is not priced from here: it is learned when the drafter is played. None if `stop` is
    set before it ends (a server stopping while it calibrates in the background)."""
    costs = CostModel(verify_owners=verify_owners(engine))
    length = CALIBRATION_PROMPT if engine.max_length is None else \
        max(1, min(CALIBRATION_PROMPT, engine.max_length - CALIBRATION_TOKENS - MAX_K - 1))
    if engine.tokenizer is not None:
        prompt = engine.encode(CALIBRATION_TEXT).tolist()[:length]
    else:
        rng = random.Random(0)
        prompt = [rng.randrange(engine.vocab_size) for _ in range(length)]
    # Each drafter's run between two of OFF, every reward being scaled by OFF's step: the machine's
    # speed moves within seconds. A
    # hybrid of a model drafter is replayed from its parts' costs; one of a feature head is run too
    # (it is rewarded, when played, by its own verifies' costs in OFF steps).
    drafters = [Arm(drafter, k) for drafter, drafter_ks in ks.items()
                if hybrid_parts(engine, drafter) is None or model_drafter_of(engine.drafters[drafter]) is None
                for k in sorted(set(drafter_ks))]

    def run(arm: Arm, recorded: bool = True) -> GenerationMetrics | None:
        tokens = (CALIBRATION_OFF_TOKENS if arm.is_off else CALIBRATION_TOKENS) if recorded else 4
        if stop is not None and stop.is_set():
            return None
        try:
            with engine_lock:
                metrics = engine.generate(prompt, arm, tokens, sampling).metrics
        except Exception as exc:  # an arm that cannot be measured here is learned as it is played
            logger.info("calibration of %s skipped: %s", arm, exc)
            return None
        if recorded:
            costs.observe(arm, dataclasses.replace(metrics, draft_prefill_s=0.0))
        return metrics

    def side_by_side(arms: list[Arm]) -> dict[Arm, tuple[GenerationMetrics, float]]:
        """Each of `arms` run between two OFF runs: its metrics and the OFF step beside it (their mean)."""
        measured, before = {}, run(OFF)
        for arm in arms:
            metrics, after = run(arm), run(OFF)
            beside = [m.verify_s / m.rounds for m in (before, after) if m is not None and m.rounds]
            if metrics is not None and metrics.rounds and beside and min(beside) > 0:
                measured[arm] = (metrics, sum(beside) / len(beside))
            before = after
        return measured

    # A process's first forwards run slower (allocations, lazy loads), and a slow OFF step would
    # price every verify low and every reward high: each arm runs a few steps unrecorded first.
    for arm in [OFF, *drafters]:
        run(arm, recorded=False)
    # One slow moment (other work taking the cores) throws off the run it hits, either way, and its
    # price would stand behind every reward after it. So each drafter runs twice, the second pass in
    # reverse order, and a third time where the two disagree; a cost is the median of its runs
    # (CostModel's).
    passes = [side_by_side(drafters), side_by_side(drafters[::-1])]
    apart = [arm for arm in drafters if arm in passes[0] and arm in passes[1]
             and _disagree(passes[0][arm], passes[1][arm])]
    if apart:
        logger.info("calibration: %s measured a third time (two runs %.0f %% or more apart)",
                    ", ".join(map(str, apart)), 100 * (CALIBRATION_AGREEMENT - 1))
        passes.append(side_by_side(apart))
    if stop is not None and stop.is_set():
        return None
    for measured in passes:
        for arm, (metrics, off_step) in measured.items():
            costs.observe_side_by_side(arm, metrics, off_step)
    return costs
