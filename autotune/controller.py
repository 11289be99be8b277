"""The online controller: per request, pick an arm for its class, serve it, measure, learn.

Reward is the request's speedup over OFF on the same request: the time OFF would have
taken for the same prompt and output (the target's prefill of this request plus one OFF
decode step per output token, the step cost inferred from this request's own verifies at its
load, see `_reward`) over the time it took; it can never exceed the tokens the request
committed per round. Comparing each request with itself keeps prompt and output length out
of the reward's noise. Requests also score every other arm by replaying the output
(counterfactual.py; exact when greedy, in expectation when sampled): a key's first request,
then only within a small share of the serving time (a replay costs a teacher-forced forward
per model, plus one of the target when sampled, so replaying every request would cost more
than it teaches once the class has settled; a new class already starts from what the other
classes learned). Costs are measured before the first request (`_calibrate`), so no request
has to be served OFF to price the others. What the policy learned is saved to the store
every `save_every` requests and on close, and loaded again on start, so a restarted
controller resumes without re-exploring. With `max_batch` > 1, single requests from
concurrent threads are served together in batches (coalesce.py), of every class waiting
unless `mix_classes=False`, which requests arriving later join between rounds (continuous
batching; the policy decides again every `decide_every` rounds) and which hand each request
back as soon as it is done.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from autotune.classifier import RequestClassifier
from autotune.coalesce import Batch, Coalescer
from autotune.counterfactual import CostModel, arm_rewards, hybrid_parts
from autotune.metrics import GpuMonitor, request_features, sibling_rewards
from engine import (
    MAX_K,
    OFF,
    Arm,
    BatchRequest,
    GenerationMetrics,
    InvalidRequestError,
    SamplingParams,
    SpeculativeEngine,
    Streamer,
)
from engine.streaming import Cancellable, EndsOnce, end_stream
from policies import LOAD_BUCKETS, Context, Outcome, Policy, PolicyError, load_bucket, make_policy

logger = logging.getLogger(__name__)
SERVED_POLICY = "__served__"  # per key: requests served (how many replays it has had while learning)
COSTS_POLICY = "__costs__"  # per load bucket, greedy or sampled: the measured draft and verify costs (CostModel)
# The controller's own state, not a policy's; "__off_baseline__" is in stores saved by earlier versions.
INTERNAL_POLICIES = (SERVED_POLICY, COSTS_POLICY, "__off_baseline__")
DEFAULT_KS = (1, 2, 3, 4, 6, 8)
DEFAULT_CLASS = "default"
CALIBRATION_PROMPT = 256  # tokens of the prompt `_calibrate` serves each arm kind on, at most
# What `_calibrate` serves, through the engine's tokenizer: text a model continues as it would a
# request's, so drafts are kept about as often (on random token ids every sampled draft was
# rejected, and rejection's extra work priced sampled rounds 1.4x what requests measured).
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
CALIBRATION_TOKENS = 17  # tokens it decodes per arm: 16 OFF steps, min_baseline_steps by default
# The key of a coalesced batch whose requests are of several classes: one arm serves the whole
# batch, so what it learns is the best arm for such a mix at that load, not for any one class.
MIXED_CLASS = "(mixed)"


def cost_key(bucket: str, sampled: bool) -> str:
    """Where the costs of requests at this load bucket are kept: a sampled round costs more than a
    greedy one (drafts sampled under top-p 1.42x, verifies 1.17x on the demo family), and priced
    as a greedy one's, every replay of a greedy request on a cost model fed sampled ones fell short."""
    return bucket + (" sampled" if sampled else "")


def _sampled(context: Context) -> bool:
    return context.features.get("temperature", 0.0) > 0


def default_arms(engine: SpeculativeEngine, ks: tuple[int, ...] = DEFAULT_KS) -> list[Arm]:
    """OFF and every drafter at every K in ks."""
    return [OFF] + [Arm(name, k) for name in engine.drafters for k in ks if k <= MAX_K]


@dataclass
class ControlledResult:
    text: str | None
    tokens: list[int]
    request_class: str
    arm: Arm
    metrics: GenerationMetrics
    # The batch's, as the policy learned them; a request handed back from a coalesced batch
    # before the batch was done: its own (its tokens/s, its OFF time over its time).
    goodput: float
    reward: float
    decision_s: float
    learn_s: float  # after serving it: scoring other arms on this request (replays), the update, a save
    load: int  # rows served together in each forward pass: 1 alone, the batch size in a batch
    gpu_util: float | None
    gpu_mem_mb: float | None
    fell_back: bool
    stream_error: str | None = None  # the request's streamer raised: the output stops there
    # From the call until the engine began on it: waiting for a batch to form, for the engine, and
    # the decision (also in decision_s). metrics.total_s is the engine's time alone.
    queue_s: float = 0.0
    logprobs: list[dict[int, float]] | None = None  # per output token, when asked for (SamplingParams.logprobs)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (SamplingParams.prompt_logprobs)
    finish_reason: str | None = None  # "stop", "length" or "abort" (GenerationResult.finish_reason)
    # What the policy was told the arms not played would have scored on this request (replayed, or
    # from its per-position acceptance): {arm: reward}; empty when it was told nothing more.
    estimates: dict[str, float] = field(default_factory=dict)


def _sampling(temperature: float, top_p: float, seed: int | None, options: dict) -> SamplingParams:
    """A call's SamplingParams; an option it does not know is refused by name."""
    known = {f.name for f in dataclasses.fields(SamplingParams)} - {"temperature", "top_p", "seed"}
    if unknown := sorted(set(options) - known):
        raise InvalidRequestError(f"unknown sampling option(s) {unknown}; the others it takes: {sorted(known)}")
    return SamplingParams(temperature, top_p, seed, **options)


def _check_label(request_class: str | None) -> None:
    if request_class is not None and not isinstance(request_class, str):
        raise InvalidRequestError(f"request_class must be a string (or None: classify it), got {request_class!r}")
    if request_class == MIXED_CLASS:
        raise InvalidRequestError(f"{MIXED_CLASS!r} is the controller's key for batches of several classes,"
                                  " not a request class a caller can give")


def _check_settings(max_batch: int, decide_every: int, save_every: int, min_baseline_steps: int,
                    remeasure_off_every: int,
                    counterfactual_requests: int, batch_wait_ms: float, counterfactual_budget: float,
                    counterfactual_weight: float, prefill_chunk: int | None) -> None:
    """Refuse a controller setting out of its range by name: several would otherwise be taken
    silently (a negative wait) or fail only later, on another thread (save_every=0 at the
    first save, a fractional max_batch in the coalescer's thread, leaving its callers waiting)."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for name, value, low in [("max_batch", max_batch, 1), ("decide_every", decide_every, 1),
                             ("save_every", save_every, 1), ("min_baseline_steps", min_baseline_steps, 0),
                             ("remeasure_off_every", remeasure_off_every, 1),
                             ("counterfactual_requests", counterfactual_requests, 0)]:
        if not whole(value) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if prefill_chunk is not None and (not whole(prefill_chunk) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be a positive number of tokens or None, not {prefill_chunk!r}")
    for name, value, ok, what in [("batch_wait_ms", batch_wait_ms, lambda v: 0 <= v < math.inf, ">= 0 (finite)"),
                                  ("counterfactual_budget", counterfactual_budget, lambda v: v >= 0, ">= 0"),
                                  ("counterfactual_weight", counterfactual_weight, lambda v: 0 <= v <= 1, "in [0, 1]")]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ValueError(f"{name} must be a number {what}, got {value!r}")


class AutotuneController:
    def __init__(
        self,
        engine: SpeculativeEngine,
        store=None,
        policy: str | Policy = "ucb",
        arms: list[Arm] | None = None,
        classifier: RequestClassifier | None = None,
        save_every: int = 25,
        min_baseline_steps: int = 16,
        remeasure_off_every: int = 64,
        counterfactual_requests: int = 1,
        counterfactual_budget: float = 0.01,
        counterfactual_weight: float = 0.5,
        max_batch: int = 1,
        batch_wait_ms: float = 2.0,
        mix_classes: bool = True,
        continuous: bool = True,
        decide_every: int = 32,
        pause_alone: bool | None = None,
        prefill_chunk: int | None = 2048,
        calibrate: bool = True,
        **policy_kwargs,
    ) -> None:
        _check_settings(max_batch=max_batch, decide_every=decide_every, save_every=save_every,
                        min_baseline_steps=min_baseline_steps, remeasure_off_every=remeasure_off_every,
                        counterfactual_requests=counterfactual_requests,
                        batch_wait_ms=batch_wait_ms, counterfactual_budget=counterfactual_budget,
                        counterfactual_weight=counterfactual_weight, prefill_chunk=prefill_chunk)
        self.engine = engine
        self.store = store
        arms = arms if arms is not None else default_arms(engine)
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, arms, **policy_kwargs)
        for arm in self.policy.arms:
            self._check_arm(arm)
        self._ks: dict[str, list[int]] = {}  # drafter -> the K values among the policy's arms
        for arm in self.policy.arms:
            if not arm.is_off:
                self._ks.setdefault(arm.drafter, []).append(arm.k)
        self.compile_report = engine.warm_up(self._reachable_arms())  # compiled engines: every graph, up front
        self.classifier = classifier
        self.save_every = save_every
        # Rewards are speedups over OFF, priced from what an OFF step costs at the request's load:
        # a learning policy plays OFF at a load until this many OFF steps ran there (any class),
        # and again once every `remeasure_off_every` requests there: every reward and replay is
        # scaled by that step, and a policy that has left OFF would otherwise price them for good
        # by OFF steps measured at another moment of the machine (rewards 0.90-1.17x the speedups
        # measured beside them, by the moment each controller measured OFF).
        self.min_baseline_steps = min_baseline_steps
        self.remeasure_off_every = remeasure_off_every
        # Requests also score every other arm (see counterfactual.py): a key's first
        # `counterfactual_requests` requests, while the policy is still learning; after that only
        # while replays, this one included (priced at the key's last replay), stay within
        # `counterfactual_budget` of the key's serving time since, so arms not played stay known
        # at a bounded cost whatever a replay costs on this engine (a 16-row burst: 150 ms greedy,
        # 570 ms sampled, against 0.6-1.0 s to serve it OFF on the demo family).
        self.counterfactual_requests = counterfactual_requests
        self.counterfactual_budget = counterfactual_budget
        self.counterfactual_weight = counterfactual_weight
        self.costs: dict[str, CostModel] = {}  # cost_key -> measured draft and verify costs
        self._served: dict[str, int] = {}  # key -> requests served (a batch counts each)
        self._replay_share: dict[str, list[float]] = {}  # key -> [serving s, replay s] after learning, last replay s
        self.gpu = GpuMonitor()
        self._policy_lock = threading.Lock()
        self._engine_lock = threading.Lock()
        self._updates = 0
        self._dirty: set[str] = set()
        # Single requests waiting at the same moment become one batch: of any classes (keyed as
        # MIXED_CLASS when they differ), or with mix_classes=False one batch per class.
        self._coalescer = Coalescer(self._serve_coalesced, max_batch, batch_wait_ms / 1e3) if max_batch > 1 else None
        self.mix_classes = mix_classes
        # Continuous batching (_serve_continuous): requests arriving while a batch decodes join it
        # between rounds, and the policy decides again every `decide_every` rounds of it.
        # continuous=False: static batches, each decided once and decoded to its last row.
        self.continuous = continuous
        self.decide_every = decide_every
        # Requests joining a continuous batch are prefilled at most `prefill_chunk` tokens a round
        # (BatchSession: chunked prefill, on as in vLLM, whose API server's default budget is
        # 2048 too), so a burst of long prompts does not stall the rows decoding for its whole
        # prefill; None: in one go. On the demo family (1024-token context) on the CPU 2048
        # chunks only joins of several long prompts (bursts of 16 clients: 1.01-1.05x the
        # tokens/s of one go); 512 took the rows' p99 gap under 900-token joins from 109-134
        # to 72-88 ms, but spread bursts of short prompts over more rounds (their p99 gap 20-31
        # -> 55-59 ms, 0.93-0.99x the tokens/s; `autotune bench chunked`).
        self.prefill_chunk = prefill_chunk
        # pause_alone: a request served alone pauses when another arrives and finishes in a
        # continuous batch with it (the one-request path takes no joiners). By default not on a
        # compiled engine: its batches run eagerly, and a compiled one-request step is several
        # times faster than an eager one on a GPU (OFF 4.98x generate() on an H100).
        if pause_alone is None:
            pause_alone = engine.cache_kind != "compiled"
        self._pausable = pause_alone and self._coalescer is not None and continuous
        try:
            engine.check_batch_request(1, OFF, 1)
        except InvalidRequestError:  # e.g. linear-attention layers: requests are served one at a time
            self._pausable = False
        # The requests worth having in flight at once: a batch being served and the next one
        # gathering. agenerate's threads, and a server's per client request, are bounded by it.
        self.in_flight = max(4, 2 * max_batch)
        self._threads: ThreadPoolExecutor | None = None  # agenerate's, made on first use
        if store is not None:
            for record in engine.model_records:
                store.register_model(**record)
            self.policy.load_state_dict(store.load_policy_states(self.policy.name))
            self._served = {k: int(v["served"]) for k, v in store.load_policy_states(SERVED_POLICY).items()}
            self.costs = {bucket: CostModel.from_state(state)
                          for bucket, state in store.load_policy_states(COSTS_POLICY).items()}
        if calibrate and self.policy.learns:
            for sampling in (SamplingParams(), SamplingParams(0.7, 0.9, seed=0)):
                key = cost_key("1", not sampling.greedy)
                if key not in self.costs:
                    self.costs[key] = self._calibrate(sampling)

    def _calibrate(self, sampling: SamplingParams) -> CostModel:
        """What OFF's steps and each drafter's rounds cost alone, measured before the first request
        on CALIBRATION_TEXT (random token ids without a tokenizer; each drafter at the smallest and
        largest K among the arms, CALIBRATION_TOKENS each), so that the first request needs no OFF baseline,
        every arm can be replayed from it, and no drafter is priced from one K played (a K=1 round
        times K overpriced a drafter's longer rounds by a third, and kept it from being played).
        Requests replace these figures as they come (each cost is a median over requests, by rounds).
        A drafter's prefill is not priced from here: it is learned when the drafter is played."""
        costs = CostModel()
        length = CALIBRATION_PROMPT if self.engine.max_length is None else \
            max(1, min(CALIBRATION_PROMPT, self.engine.max_length - CALIBRATION_TOKENS - MAX_K - 1))
        if self.engine.tokenizer is not None:
            prompt = self.engine.encode(CALIBRATION_TEXT).tolist()[:length]
        else:
            rng = random.Random(0)
            prompt = [rng.randrange(self.engine.vocab_size) for _ in range(length)]
        # OFF three times: every reward is scaled by its step. A hybrid is replayed from its parts' costs.
        arms = [OFF] * 3 + [Arm(drafter, k) for drafter, ks in self._ks.items() for k in sorted({min(ks), max(ks)})
                            if hybrid_parts(self.engine, drafter) is None]
        # A process's first forwards run slower (allocations, lazy loads), and a slow OFF step would
        # price every verify low and every reward high: each arm runs a few steps unrecorded first.
        warm_up = list(dict.fromkeys(arms))
        for i, arm in enumerate([*warm_up, *arms]):
            recorded = i >= len(warm_up)
            try:
                with self._engine_lock:
                    metrics = self.engine.generate(prompt, arm, CALIBRATION_TOKENS if recorded else 4, sampling).metrics
            except Exception as exc:  # an arm that cannot be measured here is learned as it is played
                logger.info("calibration of %s skipped: %s", arm, exc)
                continue
            if recorded:
                costs.observe(arm, dataclasses.replace(metrics, draft_prefill_s=0.0))
        return costs

    def _reachable_arms(self) -> list[Arm]:
        """The policy's arms, plus the largest K a schedule that moves K inside a request can reach."""
        arms = list(self.policy.arms)
        for arm in self.policy.arms:
            schedule = None if arm.is_off else self.policy.schedule(Context("warm-up"), arm)
            k_max = getattr(schedule, "k_max", arm.k)
            if k_max > arm.k:
                arms.append(Arm(arm.drafter, k_max))
        return arms

    def _check_arm(self, arm: Arm) -> None:
        if not arm.is_off and arm.drafter not in self.engine.drafters:
            raise PolicyError(
                f"policy {self.policy.name!r} chose arm {arm} but the engine has no drafter {arm.drafter!r};"
                f" it has: {sorted(self.engine.drafters)}"
            )

    # ----- serving ------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[int],
        request_class: str | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        streamer: Streamer | None = None,
        **sampling_options,
    ) -> ControlledResult:
        """Serve one request on the arm the policy picks for its class; learn from it.

        With `max_batch` > 1 it may be served in a batch with requests from other threads that
        wait at the same moment (of any class, or of its own with `mix_classes=False`); its
        output is the one it gets alone either way. `streamer` (transformers' `TextStreamer`,
        `TextIteratorStreamer`, ...) gets the output round by round and is ended when the
        request is done or fails. `sampling_options`: the other fields of `SamplingParams`, by
        vLLM's names (`top_k`, `min_p`, `stop`, `stop_token_ids`, `include_stop_str_in_output`,
        `ignore_eos`, `skip_special_tokens`, `min_tokens`, `logprobs`, `prompt_logprobs`,
        `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `logit_bias`,
        `allowed_token_ids`, `bad_words`, `bad_words_ids`), and generate()'s `logits_processor`
        and `stopping_criteria`.
        """
        arrived = time.perf_counter()
        ends = EndsOnce(streamer) if streamer is not None else None
        try:
            _check_label(request_class)
            sampling = self.engine.bad_words_as_ids(_sampling(temperature, top_p, seed, sampling_options))
            if self._coalescer is None:
                return self._serve([prompt], [request_class], [max_new_tokens], [sampling], [ends], [arrived])[0]
            ids = self.engine.encode(prompt).tolist()  # a bad request fails here, in its own caller,
            self.engine.check_request(len(ids), OFF, max_new_tokens, sampling)  # not in a batch it would have broken up
            classified = request_class is None
            if classified:
                request_class = self._classify(request_features(ids, max_new_tokens, sampling))
            group = None if self.mix_classes else request_class
            return self._coalescer.submit(group, (ids, request_class, classified, max_new_tokens, sampling, ends,
                                                  arrived))
        finally:
            end_stream(ends)  # a request that failed before streaming still ends its stream

    async def agenerate(self, prompt: str | list[int], request_class: str | None = None, **kwargs) -> ControlledResult:
        """`generate` (the same keyword arguments) for asyncio servers: the request runs on one of
        the controller's threads, so requests awaited together are coalesced as requests from
        threads are (with `max_batch` > 1). Stream with transformers' `AsyncTextIteratorStreamer`.
        Cancelling the awaiting task (a server whose client disconnected) stops the request at
        its next round, or before it starts if it still waits, as vLLM aborts it: the thread
        would otherwise decode to the end for no one."""
        with self._policy_lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(self.in_flight, thread_name_prefix="autotune")
        cancelled = threading.Event()
        kwargs["streamer"] = Cancellable(kwargs.get("streamer"), cancelled)
        call = functools.partial(self.generate, prompt, request_class, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, call)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def generate_batch(
        self,
        prompts: list[str | list[int]],
        request_class: str | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seeds: list[int | None] | None = None,
        streamers: list[Streamer | None] | None = None,
        **sampling_options,
    ) -> list[ControlledResult]:
        """Serve requests of one class together, one forward pass per round, on one arm.

        The batch is the load: the policy chooses for (class, load bucket of the batch size),
        since extra verify tokens cost more in a large batch. K stays constant inside a batch (a
        policy's K schedule applies to single requests only). Every result carries the batch's
        goodput and reward, which is what the policy learned from. `streamers`: one per prompt
        (or None), and `sampling_options`, as in `generate`.
        """
        arrived = time.perf_counter()
        ends = [EndsOnce(s) if s is not None else None for s in streamers or []]
        try:
            if not prompts:
                raise InvalidRequestError("the batch is empty")
            _check_label(request_class)
            seeds = seeds if seeds is not None else [None] * len(prompts)
            ends = ends or [None] * len(prompts)
            if len(seeds) != len(prompts) or len(ends) != len(prompts):
                raise InvalidRequestError("seeds and streamers must have one entry per prompt")
            count = len(prompts)
            sampling = [self.engine.bad_words_as_ids(_sampling(temperature, top_p, seed, sampling_options))
                        for seed in seeds]
            return self._serve(prompts, [request_class] * count, [max_new_tokens] * count, sampling, ends,
                               [arrived] * count)
        finally:
            for streamer in ends:
                end_stream(streamer)

    def _serve_coalesced(self, group, batch: Batch) -> list:
        """One batch from the coalescer. If the batch is refused or fails (memory, a model error),
        its requests not yet answered are served alone, each with its own outcome: nothing is
        lost to another request's fault. A request whose stream had begun is not served again
        (its client would see its output twice): it gets the batch's error."""
        items = list(batch.pending().values())
        ids, classes, classified, limits, sampling, streamers, arrived = (list(column) for column in zip(*items))
        try:
            if self.continuous and len(items) > 1:
                return self._serve_continuous(batch)
            return self._serve(ids, classes, limits, sampling, streamers, arrived, classified,
                               batch if self._pausable else None)
        except Exception as exc:
            if batch.size == 1:  # (a paused request's joiners are items too)
                raise
            failure = exc
        outcomes: list = [failure] * batch.size  # one delivered keeps its answer
        for index, (one, cls, was_classified, limit, sp, streamer, since) in batch.pending().items():
            if getattr(streamer, "started", False):
                continue  # one streamed gets the error
            try:
                outcomes[index] = self._serve([one], [cls], [limit], [sp], [streamer], [since], [was_classified])[0]
            except Exception as exc:
                outcomes[index] = exc
        return outcomes

    def _classify(self, features: dict) -> str:
        return self.classifier.predict_one(features) if self.classifier else DEFAULT_CLASS

    def _serve(self, prompts, classes: list[str | None], limits, sampling: list[SamplingParams], streamers, arrived,
               classified: list[bool] | None = None, batch: Batch | None = None) -> list[ControlledResult]:
        """Serve requests together on one arm. `classes[0]` None (no label from the caller): the
        classifier's class for the first request stands for all of them. `batch`: the coalesced
        batch of this one request; it pauses when requests of its group arrive, and finishes in
        a continuous batch with them (`_serve_continuous`)."""
        ids = [self.engine.encode(p).tolist() for p in prompts]
        features = [request_features(i, limit, sp) for i, limit, sp in zip(ids, limits, sampling)]
        load = len(ids)  # what prices a round; requests waiting for the engine do not change it
        started = time.perf_counter()
        if classes[0] is None:
            classes, classified = [self._classify(features[0])] * load, [True] * load
        classified = classified or [False] * load
        context = Context(self._key(classes), load, features[0])
        context, arm = self._decide(context, fits=lambda arm: all(
            self._drafter_has_room(arm, i, limit, len(ids) > 1) for i, limit in zip(ids, limits)))
        with self._policy_lock:
            schedule = self.policy.schedule(context, arm) if len(ids) == 1 else None
        decision_s = time.perf_counter() - started
        with self._engine_lock, self.gpu.measure() as gpu:
            engine_started = time.perf_counter()
            if len(ids) == 1:
                pause = (lambda: bool(batch.waiting())) if batch is not None else None
                results = [self.engine.generate(ids[0], arm, limits[0], sampling[0], schedule, streamers[0], pause)]
                served = results[0].metrics
            else:
                together = self.engine.generate_batch(ids, arm, limits, sampling, streamers)
                results, served = together.results, together.metrics
        goodput = served.tokens_per_s
        with self._policy_lock:
            key = cost_key(load_bucket(context.load), any(not sp.greedy for sp in sampling))
            costs = self.costs.setdefault(key, CostModel())
            # Draft costs per K only from a request that kept its K and its drafter throughout.
            costs.observe(arm, served, drafts=schedule is None and not any(r.fell_back for r in results))
            # under the lock: other threads' requests add to these costs
            reward = self._reward(arm, served, max(r.metrics.new_tokens for r in results) - 1, costs)
        if results[0].rest is not None:
            # The part served alone teaches the policy nothing: its drafter's prefill spread over
            # part of the output would score model drafters low. The batch's segments are learned.
            return self._serve_continuous(batch, (results[0].rest, engine_started))
        learn_started = time.perf_counter()
        siblings = self._other_arms(context, arm, reward, schedule, results, served, ids, limits, sampling, costs)
        with self._policy_lock:
            self.policy.update(context, arm, Outcome(goodput, reward, served.acceptance, served.new_tokens,
                                                     siblings))
            self._dirty.add(context.key)
            self._updates += 1
            self._save_periodically()
        learn_s = time.perf_counter() - learn_started  # replays, the update and a save that came due
        out = []
        for result, cls, labelled, feats, sp, since in zip(results, classes, classified, features, sampling, arrived):
            out.append(ControlledResult(
                result.text, result.tokens, cls, arm, result.metrics, goodput, reward, decision_s,
                learn_s, load, gpu.util, gpu.mem_mb, result.fell_back, result.stream_error, engine_started - since,
                result.logprobs, result.prompt_logprobs, result.finish_reason,
                {name: estimate for name, (estimate, _) in siblings.items()},
            ))
            if self.store is not None:
                self._record(out[-1], labelled, feats, sp)
        return out

    def _serve_continuous(self, batch: Batch, resumed: tuple[BatchRequest, float] | None = None
                          ) -> list[ControlledResult]:
        """A coalesced batch kept going (continuous batching): requests that arrive join it between
        rounds, each is handed back as soon as it is done, and every `decide_every` rounds the
        policy learns how those rounds went (`_learn_segment`) and picks the arm for the next
        ones, so no batch drains for a decision. Replays price whole requests, so segments are
        not replayed. `resumed`: the batch's one request was paused for requests that arrived
        (its rest, and when the engine began on it); the arm is decided for all of them, and
        they join at once."""
        # Per session row until it is served (the session may never drain, so nothing is kept
        # past that): (class, classified, features, sampling, arrived, began), and its item's
        # index in `batch`. Every item's outcome is delivered as it comes (`batch.deliver`).
        requests: dict[int, tuple] = {}
        tickets: dict[int, int] = {}
        with self._engine_lock, self.gpu.measure() as gpu:

            def take(start: int, items: list, rest: BatchRequest | None = None, began: float | None = None) -> None:
                """Prefill `items`, the batch's items from `start` on, into the session."""
                began = began if began is not None else time.perf_counter()
                added = session.add([rest] if rest is not None else [
                    BatchRequest(one, limit, sp, streamer) for one, _, _, limit, sp, streamer, _ in items])
                for t, (i, (one, cls, was_classified, limit, sp, _, since)) in enumerate(zip(added, items, strict=True),
                                                                                         start):
                    requests[i] = (cls, was_classified, request_features(one, limit, sp), sp, since, began)
                    tickets[i] = t

            def take_apart(start: int, items: list, exc: Exception) -> None:
                """`take(start, items)` raised `exc` (memory, a model error): each of several is
                taken alone, and one that fails alone gets its error in its own caller while the
                batch goes on."""
                if len(items) == 1:
                    batch.deliver(start, exc)
                    return
                for t, item in enumerate(items, start):
                    try:
                        take(t, [item])
                    except Exception as alone:
                        take_apart(t, [item], alone)

            first = list(batch.pending().values())
            started = time.perf_counter()
            coming = batch.waiting()[:self._coalescer.max_batch - 1] if resumed is not None else []
            classes = [cls for _, cls, *_ in first + coming]
            features = request_features(first[0][0], first[0][3], first[0][4])
            # the paused request goes on in this batch whatever the arm: one that cannot take it is not played
            fits = functools.partial(self._fits, item=first[0]) if resumed is not None else None
            context, arm = self._decide(Context(self._key(classes), len(classes), features), segments=True, fits=fits)
            session = self.engine.open_batch(arm, self.prefill_chunk, keep_results=False)
            try:
                take(0, first, *resumed or ())
            except InvalidRequestError:  # refused before any decoding: see _serve_coalesced
                raise
            except Exception as exc:
                take_apart(0, first, exc)
            segment = self._segment(context, session, time.perf_counter() - started)
            while True:
                room = self._coalescer.max_batch - session.live_rows - session.prefilling
                if room > 0 and (joining := batch.join(room, functools.partial(self._fits, session.arm))):
                    start = batch.size - len(joining)
                    try:
                        take(start, joining)
                    except Exception as exc:
                        take_apart(start, joining, exc)
                for i, result in session.finished():
                    cls, labelled, feats, sp, since, began = requests.pop(i)
                    with self._policy_lock:
                        off_s, taken_s = self._row_times(result.arm, result.metrics,
                                                         self._costs_of(segment["context"]))
                    served = ControlledResult(
                        result.text, result.tokens, cls, result.arm, result.metrics, result.metrics.tokens_per_s,
                        off_s / taken_s if taken_s > 0 else 1.0, segment["decision_s"], 0.0, segment["context"].load,
                        *gpu.so_far(), result.fell_back, result.stream_error, began - since, result.logprobs,
                        result.prompt_logprobs, result.finish_reason)
                    if self.store is not None:
                        self._record(served, labelled, feats, sp)
                    batch.deliver(tickets.pop(i), served)
                for i, exc in session.failed():  # its prefill failed alone (chunked): the batch goes on
                    requests.pop(i)
                    batch.deliver(tickets.pop(i), exc)
                if not session.live_rows and not session.prefilling:
                    break
                if session.live_rows and session.metrics.rounds - segment["totals"].rounds >= self.decide_every:
                    self._learn_segment(segment, session)
                    started = time.perf_counter()
                    live = [requests[i] for i in session.live]
                    context, arm = self._decide(Context(self._key([r[0] for r in live]), len(live), live[0][2]),
                                                segments=True)
                    if arm != session.arm:
                        try:
                            session.switch(arm)
                        except InvalidRequestError:  # a live row too long for that drafter: keep the arm
                            pass
                    segment = self._segment(context, session, time.perf_counter() - started)
                session.step()
            self._learn_segment(segment, session)
            session.close()
        return []  # every outcome was delivered as it came

    def _decide(self, context: Context, segments: bool = False,
                fits: Callable[[Arm], bool] | None = None) -> tuple[Context, Arm]:
        """The policy's arm for `context`, or OFF where it must be OFF (the one place that overrides
        a policy): a learning policy's rewards are speedups over OFF, so at a load where OFF's
        step (and, for continuous batches' `segments`, OFF's rounds) has not been measured yet,
        or not for `remeasure_off_every` requests, nothing could be learned true to scale; and
        an arm whose drafter cannot take the requests (`fits` False) would lose them, where OFF
        serves any request the target takes."""
        with self._policy_lock:
            arm = self.policy.choose(context)
            self._check_arm(arm)
            if arm.is_off:
                return context, arm
            if segments:  # priced by OFF segments at this load or the nearest (see _learn_segment)
                priced = self._off_decode_factor(context) is not None
            else:
                costs = self._costs_of(context)
                priced = (costs is not None and costs.off_rounds() >= self.min_baseline_steps
                          and costs.since_off < self.remeasure_off_every)
            if (self.policy.learns and not priced) or (fits is not None and not fits(arm)):
                arm = OFF
        return context, arm

    def _costs_of(self, context: Context) -> CostModel | None:
        """The measured costs of requests like `context`'s (its load, greedy or sampled)."""
        return self.costs.get(cost_key(load_bucket(context.load), _sampled(context)))

    def _off_decode_factor(self, context: Context) -> float | None:
        """Engine seconds per verify second of OFF rounds in continuous batches at the context's
        load bucket, else at the nearest bucket where OFF segments ran (rows drift between
        buckets during a segment, so a decision's bucket may not be the one its segment is
        learned in), of requests sampled as its first or else the others; None before any ran
        (called holding the policy lock)."""
        here = LOAD_BUCKETS.index(load_bucket(context.load))
        for other in sorted(LOAD_BUCKETS, key=lambda b: abs(LOAD_BUCKETS.index(b) - here)):
            for sampled in (_sampled(context), not _sampled(context)):
                costs = self.costs.get(cost_key(other, sampled))
                if costs is not None and (factor := costs.off_decode_factor()) is not None:
                    return factor
        return None

    @staticmethod
    def _segment(context: Context, session, decision_s: float) -> dict:
        """Where a segment of a continuous batch starts: the decision, and the batch's counters."""
        return {"context": context, "decision_s": decision_s, "totals": session.totals(),
                "committed": session.committed, "row_rounds": session.row_rounds}

    def _learn_segment(self, segment: dict, session) -> None:
        """Update the policy with how the rounds since `segment` went on the session's arm.

        The reward is the segment's tokens per second over OFF's at the same load: the tokens
        its rounds committed per live row and round (OFF: one), times what an OFF round costs,
        over the segment's engine time. That time is everything but the target's prefills of
        requests joining (any arm pays those): drafts, verifies, drafters' prefills, and the
        copies of the caches as rows join and leave, which a speculative batch makes more of
        (its rows finish at different rounds; OFF's joined together finish together). Counting
        drafts and verifies only, segments of speculative arms scored 1.1-1.45 on the demo
        family where their batches measured 0.95-1.04x OFF's tokens/s. An OFF round costs the OFF
        step that the segment's own verifies imply (the machine's speed of the moment, see
        CostModel.off_step_during), times the engine seconds OFF rounds take per second of their
        verify (measured on OFF segments at this load). Before any OFF segment ran, that ratio is
        unknown and the segment teaches the policy nothing (a learning policy plays OFF first).
        """
        done = session.totals().minus(segment["totals"])
        if not done.rounds:
            return
        arm, context = session.arm, segment["context"]
        rows = session.row_rounds - segment["row_rounds"]
        gain = (session.committed - segment["committed"]) / rows  # tokens per row and round; OFF: 1
        context = Context(context.request_class, max(1, round(rows / done.rounds)), context.features)
        taken = done.total_s - (done.prefill_s - done.draft_prefill_s)
        with self._policy_lock:
            costs = self.costs.setdefault(cost_key(load_bucket(context.load), _sampled(context)), CostModel())
            # a drafter's prefill here covers whole contexts, not prompts: it prices no prompt token
            costs.observe(arm, dataclasses.replace(done, draft_prefill_s=0.0), drafts=not session.fell_back)
            if arm.is_off:
                costs.observe_off_decode(taken, done.verify_s)
            step = costs.off_step_during(done, arm.drafter)
            factor = self._off_decode_factor(context)
            if factor is None or step is None:
                return
            reward = gain * done.rounds * step * factor / taken if taken > 0 else 1.0
            siblings = sibling_rewards(done, arm, reward, self._ks.get(arm.drafter, ()),
                                       functools.partial(costs.draft_cost, arm.drafter))
            self.policy.update(context, arm, Outcome(gain * rows / taken if taken > 0 else 0.0, reward,
                                                     done.acceptance, done.new_tokens, siblings))
            self._dirty.add(context.key)
            self._updates += 1
            self._save_periodically()

    @staticmethod
    def _key(classes: list[str]) -> str:
        return classes[0] if len(set(classes)) == 1 else MIXED_CLASS

    def _drafter_has_room(self, arm: Arm, ids: list[int], limit: int, batched: bool) -> bool:
        """Whether `arm` can serve this request, alone or `batched`: a drafter's context may be
        shorter than the target's, or too short for K drafts past the request's last token. Not
        for a request the target refuses: that one is refused whatever the arm, when served."""
        if arm.is_off:
            return True
        try:
            self.engine.check_request(len(ids), OFF, limit)
        except InvalidRequestError:
            return True  # the target's refusal, raised when it is served
        try:
            (self.engine.check_batch_request if batched else self.engine.check_request)(len(ids), arm, limit)
        except InvalidRequestError:
            return False
        return True

    def _fits(self, arm: Arm, item: tuple) -> bool:
        """Whether a waiting request can join a batch on `arm` (a drafter's context may be shorter)."""
        ids, _, _, limit, *_ = item
        try:
            self.engine.check_batch_request(len(ids), arm, limit)
        except InvalidRequestError:
            return False
        return True

    @staticmethod
    def _row_times(arm: Arm, metrics: GenerationMetrics, costs: CostModel | None) -> tuple[float, float]:
        """(seconds OFF would have taken, seconds taken) for one request of a continuous batch, its
        own work only: its prefill and the rounds it was in (called holding the policy lock).
        Both 0 before any OFF step cost is known."""
        step = costs.off_step_during(metrics, arm.drafter) if costs is not None else None
        if step is None:
            return 0.0, 0.0
        off_s = metrics.prefill_s - metrics.draft_prefill_s + max(metrics.new_tokens - 1, 0) * step
        return off_s, metrics.prefill_s + metrics.draft_s + metrics.verify_s

    def _other_arms(self, context, arm, reward, schedule, results, served, ids, limits,
                    sampling: list[SamplingParams], costs: CostModel) -> dict:
        """Estimated rewards of the arms not played: {arm: (reward, weight)} for the policy."""
        if schedule is not None or any(r.fell_back for r in results) or not self.policy.learns:
            return {}
        key = context.key
        with self._policy_lock:
            before = self._served.get(key, 0)
            self._served[key] = before + len(results)
            # This request's own OFF step, as its reward's: the target's steps slow down with the
            # context (long prompts) and the machine's moment, and priced at the median step
            # every replay of a long prompt fell 12-17 % short of the speedup measured beside it.
            off_step = costs.off_step_during(served, arm.drafter) or costs.off_step()
            learning = before < self.counterfactual_requests
            share = self._replay_share.setdefault(key, [0.0, 0.0, 0.0])
            if not learning:
                share[0] += served.total_s
            replay = learning or share[1] + share[2] <= self.counterfactual_budget * share[0]
            if replay:  # other threads' requests go on adding to the costs while this one replays
                costs = copy.deepcopy(costs)
        if replay and off_step is not None:
            requests = [(p, r.tokens, limit) for p, r, limit in zip(ids, results, limits)]
            started = time.perf_counter()
            with self._engine_lock:
                estimates = arm_rewards(self.engine, self.policy.arms, costs, requests,
                                        served.prefill_s - served.draft_prefill_s, off_step, sampling)
            with self._policy_lock:
                share[2] = time.perf_counter() - started
                if not learning:
                    share[1] += share[2]
            estimates.pop(str(arm), None)  # the arm played has its measured reward
            return {a: (r, self.counterfactual_weight) for a, r in estimates.items()}
        return sibling_rewards(served, arm, reward, self._ks.get(arm.drafter, ()),
                               functools.partial(costs.draft_cost, arm.drafter))

    @staticmethod
    def _reward(arm: Arm, metrics: GenerationMetrics, off_steps: int, costs: CostModel) -> float:
        """Speedup over OFF on this very request: (target's prefill + output steps x OFF step) / time taken.

        The OFF step is the one `costs` (this load's) infers from the request's own verifies, so
        a moment when the machine runs slow slows both sides alike, and since no verify is priced
        below a step (`CostModel.relative_verify_cost`), the reward never exceeds the tokens the
        request committed per round. An OFF request scores about 1.0; 1.0 before any OFF step ran at this
        load. A batch's OFF steps are its longest output's (`off_steps`), each step decoding
        every row. The drafter's prefill is the arm's cost, not OFF's.
        """
        step = costs.off_step_during(metrics, arm.drafter)
        if step is None or metrics.total_s <= 0:
            return 1.0
        off_s = metrics.prefill_s - metrics.draft_prefill_s + max(off_steps, 0) * step
        return off_s / metrics.total_s

    def _record(self, result: ControlledResult, classified: bool, features: dict, sampling: SamplingParams) -> None:
        m = result.metrics
        self.store.record(
            request_class=result.request_class, arm=str(result.arm), policy=self.policy.name,
            prompt_tokens=m.prompt_tokens, new_tokens=m.new_tokens, rounds=m.rounds, drafted=m.drafted,
            accepted=m.accepted, acceptance=m.acceptance, acceptance_per_position=m.acceptance_per_position,
            prefill_s=m.prefill_s, draft_s=m.draft_s, verify_s=m.verify_s, total_s=m.total_s,
            queue_s=result.queue_s, goodput=result.goodput, reward=result.reward, gpu_util=result.gpu_util,
            gpu_mem_mb=result.gpu_mem_mb, load=result.load, temperature=sampling.temperature,
            fell_back=result.fell_back, stream_error=result.stream_error, finish_reason=result.finish_reason,
            classified=classified,
            features=features, engine_identity=self.engine.identity,
        )

    # ----- persistence --------------------------------------------------------------------
    def _save_periodically(self) -> None:
        """Every `save_every` updates (the policy lock held), save what was learned. A store that
        cannot take it now (locked past its timeout, a database server gone) must not fail the
        request whose update came due: its keys stay dirty, so the next save or `close` writes
        them, and the failure is logged."""
        if self.store is None or self._updates % self.save_every:
            return
        try:
            self._save_locked()
        except Exception as exc:
            logger.warning("the policy state could not be saved (kept, saved again later): %s", exc)

    def _save_locked(self) -> None:
        state = self.policy.state_dict()
        keys = sorted(self._dirty | {key for key in state if "@" not in key})  # policy-wide: e.g. contextual's history
        self.store.save_policy_states({
            self.policy.name: {key: state[key] for key in keys if key in state},
            SERVED_POLICY: {key: {"served": self._served[key]} for key in keys if key in self._served},
            COSTS_POLICY: {bucket: costs.state_dict() for bucket, costs in self.costs.items()},
        })
        self._dirty.clear()

    def save(self) -> None:
        if self.store is not None:
            with self._policy_lock:
                self._save_locked()

    def close(self) -> None:
        """Let requests in flight from `agenerate` finish, and the batch being served learn from
        its last rounds, then save what was learned and flush every observation to the store."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
        if self._coalescer is not None:
            self._coalescer.idle()
        if self.store is not None:
            self.save()
            self.store.flush()

    def __enter__(self) -> AutotuneController:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

