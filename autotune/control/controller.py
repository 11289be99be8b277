"""The online controller: per request, pick an arm for its class and load, serve it, measure, learn.

One request's path: `generate` -> `_serve` (alone, or a static batch) -> `decide` (the policy's
arm; OFF where it must be) -> the engine -> `_learn` (its reward from rewards/reward.py, the
estimates of the arms not played from estimates.py) -> the learner (learner.py: the policy's
update, journaled and saved) -> the observation in the store. Requests from concurrent threads
are coalesced (coalesce.py) and served as a continuous batch (continuous.py), which decides again
every `decide_every` rounds and learns each stretch of rounds through `learn_segment`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from autotune.control.classifier import RequestClassifier
from autotune.control.coalesce import Batch, Coalescer
from autotune.control.continuous import ContinuousBatch
from autotune.control.estimates import OtherArms
from autotune.control.learner import Learner
from autotune.control.metrics import GpuMonitor, request_features
from autotune.control.settings import ControllerSettings
from autotune.rewards.costs import CostModel
from autotune.rewards.replay import served_features, verify_owners
from autotune.rewards.reward import RewardModel, cost_key, is_sampled
from autotune.rewards.reward import calibrate as calibrate_costs
from engine import (
    MAX_K,
    OFF,
    Arm,
    BatchSession,
    GenerationMetrics,
    GenerationResult,
    InvalidRequestError,
    RoundControl,
    SamplingParams,
    SpeculativeEngine,
    Streamer,
)
from engine.drafters import capabilities, lookup_of
from engine.feature import Features
from engine.streaming import Cancellable, EndsOnce, end_stream
from policies import Context, Outcome, Policy, PolicyError, make_policy

logger = logging.getLogger(__name__)
SERVED_POLICY = "__served__"  # per key: requests served (how many replays it has had while learning)
COSTS_POLICY = "__costs__"  # per load bucket, greedy or sampled: the measured draft and verify costs (CostModel)
# The controller's own state, not a policy's ("__off_baseline__": a key older stores hold, which
# `inspect` passes over).
INTERNAL_POLICIES = (SERVED_POLICY, COSTS_POLICY, "__off_baseline__")
DEFAULT_KS = (1, 2, 3, 4, 6, 8)
DEFAULT_CLASS = "default"
# The key of a coalesced batch whose requests are of several classes: one arm serves the whole
# batch, so what it learns is the best arm for such a mix at that load, not for any one class.
MIXED_CLASS = "(mixed)"
MAX_CLASS_CHARS = 120  # a label, and "@load5+" after it, fit the store's 128-character key


def default_arms(engine: SpeculativeEngine, ks: tuple[int, ...] = DEFAULT_KS) -> list[Arm]:
    """OFF and every drafter at every K in ks, those drafting from the target's features first:
    a policy that tries its arms in order then plays one on a fresh controller's first request,
    whose replay estimates the others (feature heads are replayed only on request, see
    `AutotuneController`), where a small model first would serve it slowly and teach nothing
    the replay would not have."""
    names = sorted(engine.drafters, key=lambda name: not capabilities(engine.drafters[name]).features)
    return [OFF] + [Arm(name, k) for name in names for k in ks if k <= MAX_K]


def feature_heads(engine: SpeculativeEngine) -> list[str]:
    """The engine's drafters that draft from the target's features on their own (hybrids that
    look up first left out)."""
    return [name for name, drafter in engine.drafters.items()
            if capabilities(drafter).features and lookup_of(drafter) is None]


@dataclass
class PendingRequest:
    """A request checked and classified, waiting to be served (alone, or in a coalesced batch)."""

    ids: list[int]
    request_class: str | None  # None only until the classifier names it
    classified: bool  # the classifier named its class (the caller gave none)
    max_new_tokens: int
    sampling: SamplingParams
    streamer: Streamer | None
    arrived: float  # time.perf_counter() when the call came

    @functools.cached_property
    def features(self) -> dict:
        return request_features(self.ids, self.max_new_tokens, self.sampling)


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


def check_label(request_class: str | None) -> None:
    if request_class is not None and not isinstance(request_class, str):
        raise InvalidRequestError(f"request_class must be a string (or None: classify it), got {request_class!r}")
    if request_class == MIXED_CLASS:
        raise InvalidRequestError(f"{MIXED_CLASS!r} is the controller's key for batches of several classes,"
                                  " not a request class a caller can give")
    if request_class is None:
        return
    if not request_class:
        raise InvalidRequestError("request_class is empty: give a name, or None to have the request classified")
    # Every label is stored (observations, and the policy's key "class@load5+", 128 characters in
    # the store): one the database cannot take would fail every later save of what was learned.
    if len(request_class) > MAX_CLASS_CHARS:
        raise InvalidRequestError(f"request_class is {len(request_class)} characters; at most {MAX_CLASS_CHARS}")
    try:
        request_class.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"request_class {request_class!r} is not valid Unicode text ({exc.reason} at"
                                  f" {exc.start})") from None
    if "\x00" in request_class:
        raise InvalidRequestError(f"request_class {request_class!r} holds a NUL character, which databases refuse")


class AutotuneController:
    """Serves requests through an engine on the arm a policy picks per (request class, load), and
    teaches the policy from each.

    `policy`, `arms`: the policy by name (policies.POLICIES) over these arms (default: OFF and
    every drafter at every K in DEFAULT_KS), or a `Policy`. `store`: where observations and what
    was learned are kept (store.Store), loaded on start. `classifier`: names the class of a
    request given none (else DEFAULT_CLASS). `settings`: how it serves and learns
    (`ControllerSettings`). Keywords that name a setting override `settings`
    (`AutotuneController(engine, max_batch=16)`); the others go to the policy.
    """

    def __init__(
        self,
        engine: SpeculativeEngine,
        store=None,
        policy: str | Policy = "ucb",
        arms: list[Arm] | None = None,
        classifier: RequestClassifier | None = None,
        settings: ControllerSettings | None = None,
        **options,
    ) -> None:
        overrides, policy_kwargs = ControllerSettings.split(options)
        settings = dataclasses.replace(settings or ControllerSettings(), **overrides)
        self.settings = settings
        self.engine = engine
        self.store = store
        arms = arms if arms is not None else default_arms(engine)
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, arms, **policy_kwargs)
        for arm in self.policy.arms:
            self._check_arm(arm)
        self.compile_report = engine.warm_up(self._reachable_arms())  # compiled engines: every graph, up front
        self.classifier = classifier
        self.rewards = RewardModel(min_baseline_steps=settings.min_baseline_steps,
                                   remeasure_off_every=settings.remeasure_off_every,
                                   verify_owners=verify_owners(engine))
        replay_features = len(feature_heads(engine)) > 1 if settings.replay_features is None \
            else settings.replay_features
        self.gpu = GpuMonitor()
        self.policy_lock = threading.Lock()
        self.engine_lock = threading.Lock()
        self.others = OtherArms(engine, self.policy, settings, replay_features, self.policy_lock, self.engine_lock)
        self._dirty: set[str] = set()
        self.learner = Learner(self.policy, store, settings.save_every, self.policy_lock, self._snapshot)
        self.coalescer = Coalescer(self._serve_coalesced, settings.max_batch, settings.batch_wait_ms / 1e3) \
            if settings.max_batch > 1 else None
        self.max_batch, self.decide_every = settings.max_batch, settings.decide_every
        pause_alone = engine.cache_kind != "compiled" if settings.pause_alone is None else settings.pause_alone
        self._pausable = pause_alone and self.coalescer is not None and settings.continuous
        try:
            engine.check_batch_request(1, OFF, 1)
        except InvalidRequestError:  # e.g. linear-attention layers: requests are served one at a time
            self._pausable = False
        # The requests worth having in flight at once: a batch being served and the next one
        # gathering. agenerate's threads, and a server's per client request, are bounded by it.
        self.in_flight = max(4, 2 * settings.max_batch)
        self._threads: ThreadPoolExecutor | None = None  # agenerate's, made on first use
        if store is not None:
            for record in engine.model_records:
                store.register_model(**record)
            self.learner.resume()
            self.others.served = {k: int(v["served"]) for k, v in store.load_policy_states(SERVED_POLICY).items()}
            self.rewards.load_state_dict(store.load_policy_states(COSTS_POLICY))
        self.calibrated = threading.Event()  # the costs are known (or nothing is to be measured)
        self._stopping = threading.Event()
        self._calibration: threading.Thread | None = None
        if not (settings.calibrate and self.policy.learns):
            self.calibrated.set()
        elif settings.calibrate_in_background:
            self._calibration = threading.Thread(target=self._calibrate, name="calibration", daemon=True)
            self._calibration.start()
        else:
            self._calibrate()

    def _calibrate(self) -> None:
        """Measure what OFF and each drafter cost, greedy and sampled, where the store has not
        (`calibrate_costs`); stopped by `close`, what was measured of a kind is dropped."""
        for sampling in (SamplingParams(), SamplingParams(0.7, 0.9, seed=0, coupled=False)):
            key = cost_key("1", not sampling.greedy)
            stored = self.rewards.costs.get(key)
            if stored is not None and stored.relative_verify:
                continue
            measured = calibrate_costs(self.engine, self.others.ks, sampling, self.engine_lock, self._stopping)
            if measured is None:
                return
            with self.policy_lock:
                if stored is None:
                    self.rewards.costs[key] = measured
                else:  # a store from before costs were measured side by side
                    stored.relative_draft, stored.relative_verify = measured.relative_draft, measured.relative_verify
        self.calibrated.set()

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

    # ----- the caller's side ----------------------------------------------------------------
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
            check_label(request_class)
            sampling = self.engine.bad_words_as_ids(_sampling(temperature, top_p, seed, sampling_options))
            ids = self.engine.encode(prompt).tolist()
            if self.coalescer is None:
                return self._serve(self._pending([ids], request_class, max_new_tokens, [sampling], [ends], arrived))[0]
            # a bad request fails here, in its own caller, not in a batch it would have broken up
            self.engine.check_request(len(ids), OFF, max_new_tokens, sampling)
            request = self._pending([ids], request_class, max_new_tokens, [sampling], [ends], arrived)[0]
            return self.coalescer.submit(None if self.settings.mix_classes else request.request_class, request)
        finally:
            end_stream(ends)  # a request that failed before streaming still ends its stream

    async def agenerate(self, prompt: str | list[int], request_class: str | None = None, **kwargs) -> ControlledResult:
        """`generate` (the same keyword arguments) for asyncio servers: the request runs on one of
        the controller's threads, so requests awaited together are coalesced as requests from
        threads are (with `max_batch` > 1). Stream with transformers' `AsyncTextIteratorStreamer`.
        Cancelling the awaiting task (a server whose client disconnected) stops the request at
        its next round, or before it starts if it still waits, as vLLM aborts it: the thread
        would otherwise decode to the end for no one."""
        with self.policy_lock:
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
            if isinstance(prompts, (str, bytes)):
                raise InvalidRequestError("prompts must be a list of prompts, got a single "
                                          f"{type(prompts).__name__}: wrap it as [prompt]")
            if not prompts:
                raise InvalidRequestError("the batch is empty")
            check_label(request_class)
            seeds = seeds if seeds is not None else [None] * len(prompts)
            ends = ends or [None] * len(prompts)
            if len(seeds) != len(prompts) or len(ends) != len(prompts):
                raise InvalidRequestError("seeds and streamers must have one entry per prompt")
            sampling = [self.engine.bad_words_as_ids(_sampling(temperature, top_p, seed, sampling_options))
                        for seed in seeds]
            ids = [self.engine.encode(p).tolist() for p in prompts]
            return self._serve(self._pending(ids, request_class, max_new_tokens, sampling, ends, arrived))
        finally:
            for streamer in ends:
                end_stream(streamer)

    def _pending(self, ids: list[list[int]], request_class: str | None, max_new_tokens: int,
                 sampling: list[SamplingParams], streamers: list, arrived: float) -> list[PendingRequest]:
        """Requests of one class to serve; without a label, the classifier's class for the first."""
        requests = [PendingRequest(one, request_class, request_class is None, max_new_tokens, sp, streamer, arrived)
                    for one, sp, streamer in zip(ids, sampling, streamers, strict=True)]
        if request_class is None:  # features computed once: the policy's context reads them too
            named = self._classify(requests[0].features)
            for request in requests:
                request.request_class = named
        return requests

    def _classify(self, features: dict) -> str:
        return self.classifier.predict_one(features) if self.classifier else DEFAULT_CLASS

    # ----- serving -------------------------------------------------------------------------
    def _serve_coalesced(self, group, batch: Batch) -> list:
        """One batch from the coalescer. If the batch is refused or fails (memory, a model error),
        its requests not yet answered are served alone, each with its own outcome: nothing is
        lost to another request's fault. A request whose stream had begun is not served again
        (its client would see its output twice): it gets the batch's error."""
        requests = list(batch.pending().values())
        try:
            if self.settings.continuous and len(requests) > 1:
                return ContinuousBatch(self, batch).serve()
            return self._serve(requests, batch if self._pausable else None)
        except Exception as exc:
            if batch.size == 1:  # (a paused request's joiners are items too)
                raise
            failure = exc
        outcomes: list = [failure] * batch.size  # one delivered keeps its answer
        for index, request in batch.pending().items():
            if getattr(request.streamer, "started", False):
                continue  # one streamed gets the error
            try:
                outcomes[index] = self._serve([request])[0]
            except Exception as exc:
                outcomes[index] = exc
        return outcomes

    def _serve(self, requests: list[PendingRequest], batch: Batch | None = None) -> list[ControlledResult]:
        """Serve requests together on one arm, and learn from them. `batch`: the coalesced batch of
        this one request; it pauses when requests of its group arrive, and finishes in a
        continuous batch with them."""
        load = len(requests)  # what prices a round; requests waiting for the engine do not change it
        started = time.perf_counter()
        context = Context(self.key([r.request_class for r in requests]), load, requests[0].features)
        context, arm = self.decide(context, fits=lambda arm: all(
            self._drafter_has_room(arm, r, load > 1) for r in requests))
        with self.policy_lock:
            schedule = self.policy.schedule(context, arm) if load == 1 else None
            probes = self.rewards.probes_for(context, arm) if self.policy.learns else 0
        decision_s = time.perf_counter() - started
        with self.engine_lock, self.gpu.measure() as gpu:
            engine_started = time.perf_counter()
            if load == 1:
                one = requests[0]
                pause = (lambda: bool(batch.waiting())) if batch is not None else None
                results = [self.engine.generate(one.ids, arm, one.max_new_tokens, one.sampling, schedule,
                                                one.streamer, RoundControl(pause, probes))]
                served = results[0].metrics
                # a replay of feature heads reads them rather than running the target again
                features = served_features(self.engine.drafters[arm.drafter]) \
                    if self.others.replay_features and not arm.is_off else None
            else:
                together = self.engine.generate_batch([r.ids for r in requests], arm,
                                                      [r.max_new_tokens for r in requests],
                                                      [r.sampling for r in requests], [r.streamer for r in requests],
                                                      control=RoundControl(probe_off=probes))
                results, served = together.results, together.metrics
                features = None
        with self.policy_lock:  # other threads' requests add to these costs
            costs = self.rewards.costs_for(load, any(not r.sampling.greedy for r in requests))
            # Draft costs per K only from a request that kept its K and its drafter throughout.
            costs.observe(arm, served, drafts=schedule is None and not any(r.fell_back for r in results),
                          batch=load > 1)
            reward = self.rewards.request_reward(arm, served, max(r.metrics.new_tokens for r in results) - 1, costs)
        if results[0].rest is not None:
            # The part served alone teaches the policy nothing: its drafter's prefill spread over
            # part of the output would score model drafters low. The batch's segments are learned.
            return ContinuousBatch(self, batch, (results[0].rest, engine_started)).serve()
        learn_started = time.perf_counter()
        estimates = self._learn(context, arm, reward, schedule, requests, results, served, costs, features)
        learn_s = time.perf_counter() - learn_started  # replays, the update and a save that came due
        out = []
        for request, result in zip(requests, results):
            out.append(self.result(request, result, served.tokens_per_s, reward, decision_s, learn_s, load,
                                   (gpu.util, gpu.mem_mb), engine_started, estimates))
        return out

    def result(self, request: PendingRequest, result: GenerationResult, goodput: float, reward: float,
               decision_s: float, learn_s: float, load: int, gpu: tuple[float | None, float | None],
               began: float, estimates: dict[str, float] | None = None) -> ControlledResult:
        """What the caller gets for a request served, recorded in the store."""
        out = ControlledResult(
            result.text, result.tokens, request.request_class, result.arm, result.metrics, goodput, reward,
            decision_s, learn_s, load, *gpu, result.fell_back, result.stream_error, began - request.arrived,
            result.logprobs, result.prompt_logprobs, result.finish_reason, estimates or {})
        if self.store is not None:
            self._record(out, request)
        return out

    # ----- what a continuous batch asks of it (continuous.BatchController) ------------------
    @contextlib.contextmanager
    def serving(self):
        with self.engine_lock, self.gpu.measure() as gpu:
            yield gpu

    def open_batch(self, arm: Arm) -> BatchSession:
        return self.engine.open_batch(arm, self.settings.prefill_chunk, keep_results=False)

    def row_result(self, request: PendingRequest, result: GenerationResult, context: Context, decision_s: float,
                   gpu: tuple[float | None, float | None], began: float) -> ControlledResult:
        with self.policy_lock:
            reward = self.rewards.row_reward(result.arm, result.metrics, context)
        return self.result(request, result, result.metrics.tokens_per_s, reward, decision_s, 0.0, context.load, gpu,
                           began)

    # ----- deciding ------------------------------------------------------------------------
    def decide(self, context: Context, segments: bool = False,
               fits: Callable[[Arm], bool] | None = None) -> tuple[Context, Arm]:
        """The policy's arm for `context`, or OFF where it must be OFF (the one place that overrides
        a policy): a learning policy's rewards are speedups over OFF, so where OFF's cost at this
        load is not known (`RewardModel.knows_off`; for continuous batches' `segments`, OFF's
        rounds), or the costs are still being measured (`calibrated`), nothing could be learned
        true to scale; and an arm whose drafter cannot take the
        requests (`fits` False) would lose them, where OFF serves any request the target takes."""
        with self.policy_lock:
            arm = self.policy.choose(context)
            self._check_arm(arm)
            if arm.is_off:
                return context, arm
            if (self.policy.learns and not (self.calibrated.is_set() and self.rewards.knows_off(context, segments))) \
                    or (fits is not None and not fits(arm)):
                arm = OFF
        return context, arm

    @staticmethod
    def key(classes: list[str]) -> str:
        """The policy's key for requests of these classes served together."""
        return classes[0] if len(set(classes)) == 1 else MIXED_CLASS

    def _drafter_has_room(self, arm: Arm, request: PendingRequest, batched: bool) -> bool:
        """Whether `arm` can serve this request, alone or `batched`: a drafter's context may be
        shorter than the target's, or too short for K drafts past the request's last token. Not
        for a request the target refuses: that one is refused whatever the arm, when served."""
        if arm.is_off:
            return True
        try:
            self.engine.check_request(len(request.ids), OFF, request.max_new_tokens)
        except InvalidRequestError:
            return True  # the target's refusal, raised when it is served
        return self.fits(arm, request, batched)

    def fits(self, arm: Arm, request: PendingRequest, batched: bool = True) -> bool:
        """Whether `request` can be served on `arm` (a drafter's context may be shorter), in a batch
        or alone."""
        check = self.engine.check_batch_request if batched else self.engine.check_request
        try:
            check(len(request.ids), arm, request.max_new_tokens)
        except InvalidRequestError:
            return False
        return True

    # ----- learning ------------------------------------------------------------------------
    def _learn(self, context: Context, arm: Arm, reward: float, schedule, requests: list[PendingRequest],
               results: list[GenerationResult], served: GenerationMetrics, costs: CostModel,
               features: Features | None = None) -> dict[str, float]:
        """Teach the policy this request's (or batch's) reward, with the estimated rewards of the
        arms not played; those estimates. `features`: what a feature head was handed serving it."""
        others = self.others.estimate(context, arm, reward, schedule, requests, results, served, costs, features)
        with self.policy_lock:
            self._update(context, arm,
                         Outcome(served.tokens_per_s, reward, served.acceptance, served.new_tokens, others))
        return {name: estimate for name, (estimate, _) in others.items()}

    def learn_segment(self, arm: Arm, context: Context, done: GenerationMetrics, committed: int, row_rounds: int,
                      fell_back: bool) -> None:
        """Update the policy with how a stretch of a continuous batch's rounds went on `arm`:
        `done`, their counters; `committed`, the tokens they committed; `row_rounds`, live rows
        summed over them. Its reward is `RewardModel.segment_reward`; before an OFF segment ran
        at this load it teaches the policy nothing (a learning policy plays OFF first)."""
        if not done.rounds:
            return
        gain = committed / row_rounds  # tokens per row and round; OFF: 1
        context = Context(context.request_class, max(1, round(row_rounds / done.rounds)), context.features)
        taken = done.total_s - (done.prefill_s - done.draft_prefill_s)
        with self.policy_lock:
            reward = self.rewards.segment_reward(arm, done, gain, context, fell_back)
            if reward is None:
                return
            costs = self.rewards.costs_for(context.load, is_sampled(context))
            siblings = self.others.siblings(done, arm, reward, costs)
            self._update(context, arm, Outcome(gain * row_rounds / taken if taken > 0 else 0.0, reward,
                                               done.acceptance, done.new_tokens, siblings))

    def _update(self, context: Context, arm: Arm, outcome: Outcome) -> None:
        """Teach the policy through the learner (the policy lock held)."""
        self._dirty.add(context.key)
        self.learner.update(context, arm, outcome)

    def _record(self, result: ControlledResult, request: PendingRequest) -> None:
        m = result.metrics
        self.learner.record(
            request_class=result.request_class, arm=str(result.arm),
            prompt_tokens=m.prompt_tokens, new_tokens=m.new_tokens, rounds=m.rounds, probe_rounds=m.probe_rounds,
            probe_s=m.probe_s, drafted=m.drafted,
            accepted=m.accepted, acceptance=m.acceptance, acceptance_per_position=m.acceptance_per_position,
            prefill_s=m.prefill_s, draft_s=m.draft_s, verify_s=m.verify_s, total_s=m.total_s,
            queue_s=result.queue_s, goodput=result.goodput, reward=result.reward, gpu_util=result.gpu_util,
            gpu_mem_mb=result.gpu_mem_mb, load=result.load, temperature=request.sampling.temperature,
            fell_back=result.fell_back, stream_error=result.stream_error, finish_reason=result.finish_reason,
            classified=request.classified,
            features=request.features, engine_identity=self.engine.identity,
        )

    # ----- persistence ---------------------------------------------------------------------
    def _snapshot(self) -> dict:
        """The requests served per key and the cost model since the last snapshot, copied (the
        policy lock held); the policy's own state is saved by its journal's checkpoints."""
        keys = sorted(self._dirty)
        self._dirty.clear()
        return copy.deepcopy({
            SERVED_POLICY: {key: {"served": self.others.served[key]} for key in keys if key in self.others.served},
            COSTS_POLICY: self.rewards.state_dict(),
        })

    def save(self) -> None:
        """Write what was learned now, a checkpoint of the policy through every update journaled;
        raises the store's error if it cannot (kept for the next save)."""
        self.learner.save()

    def close(self) -> None:
        """Let requests in flight from `agenerate` finish, and the batch being served learn from
        its last rounds, then save what was learned and flush every observation to the store; a
        calibration in the background stops (what it measured is dropped)."""
        if self._calibration is not None:
            self._stopping.set()
            self._calibration.join()
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None
        if self.coalescer is not None:
            self.coalescer.idle()
        self.save()  # flushes the observations too

    def __enter__(self) -> AutotuneController:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
