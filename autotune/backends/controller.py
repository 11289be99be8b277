"""The controller over a backend: per request, pick an arm for its class and load, serve it on the
backend, learn from what the backend says happened.

A backend reached over HTTP cannot replay a request on the arms not played, nor price them with a
cost model (autotune/control/controller.py does both for this project's own engine), so a policy learns
here from the requests it serves alone. A request's reward is its decode rate (output tokens
after the first per second of decoding, prefill left out: speculation does not change it) over
OFF's at the same load, OFF's being the median of the last OFF requests (one slow or fast moment
moves a median little), and never more than its accepted drafts allow: every decode forward of
the target commits at least one token that was not drafted, so a request that decoded n tokens
after its first with a accepted took at least n - a forwards, and ran at most n / (n - a) times
OFF's rate if a verify costs at least an OFF step. Where the backend sets K per request
(`Backend.variable_k`), a request also estimates its drafter's other Ks (costs.py), which the
policy takes at a quarter of a measured reward.

A backend that fails (down, too slow, an error) on a speculative arm: the request is served again
on OFF, and the arm's drafter is passed over for `cooldown_s`; the failed attempt teaches the
policy nothing. If OFF fails too, the caller gets the backend's error.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from autotune.backends.base import Backend, BackendError, BackendRequest, BackendResponse, TokenSink
from autotune.backends.costs import BackendCosts
from autotune.control.controller import DEFAULT_CLASS, check_label
from autotune.control.learner import Learner
from autotune.control.metrics import request_features
from engine import OFF, Arm, InvalidRequestError, SamplingParams
from policies import Context, Outcome, Policy, make_policy

logger = logging.getLogger(__name__)
COSTS_POLICY = "__backend_costs__"  # OFF's decode rates and round-time fits (costs.py)


def bounded_speedup(rate: float, off_rate: float, response: BackendResponse) -> float:
    """`rate` over OFF's, capped at what the response's accepted drafts allow (module docstring)."""
    speedup = rate / off_rate
    decoded = response.new_tokens - 1
    accepted = min(response.accepted or 0, decoded)
    if decoded > accepted:
        speedup = min(speedup, decoded / (decoded - accepted))
    return speedup


@dataclass
class BackendResult:
    text: str
    tokens: list[int]
    request_class: str
    arm: Arm  # the arm that served it (OFF after a fallback)
    response: BackendResponse
    reward: float | None  # what the policy learned; None: it learned nothing from this request
    load: int
    classified: bool = False  # its class was the classifier's (the caller gave none)
    fell_back: bool = False
    error: str | None = None  # why the chosen arm failed, when it fell back
    decision_s: float = 0.0
    features: dict = field(default_factory=dict)


class BackendController:
    """Serves requests on `backend` on the arm a policy picks per (request class, load), and
    teaches the policy from each. `policy`, `arms` (default: the backend's), `**policy_kwargs`:
    as in AutotuneController; `tokenizer`: a Hugging Face tokenizer, for text prompts and
    output (the backend is sent token ids); `store`: observations and what was learned, saved
    every `save_every` updates and on close, resumed on start."""

    def __init__(self, backend: Backend, store=None, policy: str | Policy = "ucb", arms: list[Arm] | None = None,
                 tokenizer=None, classifier=None, save_every: int = 25, cooldown_s: float = 30.0,
                 **policy_kwargs) -> None:
        self.backend = backend
        self.store = store
        served = set(backend.arms())
        arms = arms if arms is not None else backend.arms()
        if missing := [str(a) for a in arms if a not in served]:
            raise ValueError(f"{backend.name} cannot serve arm(s) {missing}; it serves: {[str(a) for a in served]}")
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, arms, **policy_kwargs)
        self.tokenizer = tokenizer
        self.classifier = classifier
        self.cooldown_s = cooldown_s
        self.costs = BackendCosts()
        self._ks: dict[str, list[int]] = {}  # drafter whose K is a request field -> its Ks among the arms
        for arm in self.policy.arms:
            if not arm.is_off and arm.drafter in backend.variable_k:
                self._ks.setdefault(arm.drafter, []).append(arm.k)
        self.lock = threading.Lock()
        self._in_flight = 0
        self._down: dict[str, float] = {}  # drafter -> passed over until this time.monotonic()
        self.learner = Learner(self.policy, store, save_every, self.lock, self._snapshot)
        if store is not None:
            self.learner.resume()
            self.costs.load_state_dict(store.load_policy_states(COSTS_POLICY))

    def generate(self, prompt: str | list[int], request_class: str | None = None, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 on_tokens: TokenSink | None = None) -> BackendResult:
        """Serve one request on the arm the policy picks for its class and the load; learn from it.
        `on_tokens` gets the output's token ids as they arrive, where the backend streams them."""
        check_label(request_class)  # the store keeps every label: one it cannot take would fail its saves
        ids = self._ids(prompt)
        sampling = SamplingParams(temperature, top_p, seed)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        features = request_features(ids, max_new_tokens, sampling)
        request = BackendRequest(ids, max_new_tokens, temperature, top_p, seed)
        started = time.perf_counter()
        with self.lock:
            self._in_flight += 1
            load = self._in_flight
            classified = request_class is None
            request_class = request_class or (self.classifier.predict_one(features) if self.classifier
                                              else DEFAULT_CLASS)
            context = Context(request_class, load, features)
            arm = self._decide(context)
        decision_s = time.perf_counter() - started
        try:
            response, served, error = self._serve(request, arm, on_tokens)
        finally:
            with self.lock:
                self._in_flight -= 1
        reward = None if error else self._learn(context, served, response)
        text = response.text if self.tokenizer is None or not response.tokens else \
            self.tokenizer.decode(response.tokens, skip_special_tokens=True)
        result = BackendResult(text, response.tokens, request_class, served, response, reward, load,
                               classified, error is not None, error, decision_s, features)
        self._record(result, temperature)
        return result

    def _ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"a text prompt needs a tokenizer: give BackendController a tokenizer,"
                                          f" or send token ids to {self.backend.name}")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise InvalidRequestError("prompt must be text or a non-empty list of token ids (ints >= 0)")
        return prompt

    def _decide(self, context: Context) -> Arm:
        """The policy's arm, or OFF where it must be: OFF's rate at this load is not known yet (a
        learning policy's rewards are relative to it), or the arm's drafter failed lately."""
        arm = self.policy.choose(context)
        if arm.is_off:
            return arm
        if self.policy.learns and self.costs.off_rate(context.load) is None:
            return OFF
        if self._down.get(arm.drafter, 0.0) > time.monotonic():
            return OFF
        return arm

    def _serve(self, request: BackendRequest, arm: Arm,
               on_tokens: TokenSink | None) -> tuple[BackendResponse, Arm, str | None]:
        """The response, the arm that served it, and the error that sent it to OFF (or None). A
        request whose output had begun to stream is not served again (its caller would see the
        start twice): it gets the error."""
        streamed = []

        def sink(tokens: list[int]) -> None:
            streamed.append(True)
            on_tokens(tokens)

        try:
            return self.backend.serve(request, arm, sink if on_tokens else None), arm, None
        except BackendError as exc:
            if arm.is_off:
                raise
            with self.lock:
                self._down[arm.drafter] = time.monotonic() + self.cooldown_s
            if streamed:
                raise
            logger.warning("%s failed on %s, serving the request on OFF: %s", self.backend.name, arm, exc)
            return self.backend.serve(request, OFF, on_tokens), OFF, str(exc)

    def _learn(self, context: Context, arm: Arm, response: BackendResponse) -> float | None:
        rate = response.decode_rate
        if rate is None:  # one token: nothing decoded after the first, nothing to learn
            return None
        with self.lock:
            if arm.is_off:
                self.costs.add_off(context.load, rate)
            off_rate = self.costs.off_rate(context.load)
            if off_rate is None:
                return None
            # OFF's own reward is not capped: it is the reference the others are measured against,
            # and capped at 1 its noise would count only downwards.
            reward = rate / off_rate if arm.is_off else bounded_speedup(rate, off_rate, response)
            siblings = {} if arm.is_off or arm.drafter not in self._ks else \
                self.costs.siblings(arm.drafter, arm.k, self._ks[arm.drafter], context.load, reward, response)
            self.learner.update(context, arm, Outcome(rate, reward, response.acceptance, response.new_tokens, siblings))
        return reward

    def _snapshot(self) -> dict:
        return {COSTS_POLICY: self.costs.state_dict()}

    def _record(self, result: BackendResult, temperature: float) -> None:
        r = result.response
        self.learner.record(
            request_class=result.request_class, arm=str(result.arm),
            prompt_tokens=r.prompt_tokens, new_tokens=r.new_tokens, drafted=r.drafted or 0,
            accepted=r.accepted or 0, acceptance=r.acceptance, prefill_s=r.prefill_s, total_s=r.total_s,
            queue_s=result.decision_s, goodput=r.decode_rate or 0.0, reward=result.reward, load=result.load,
            temperature=temperature, fell_back=result.fell_back, finish_reason=r.finish_reason,
            classified=result.classified, features=result.features, engine_identity=self.backend.name)

    def save(self) -> None:
        """Write what was learned now; raises the store's error if it cannot."""
        self.learner.save()

    def close(self) -> None:
        self.save()

    def __enter__(self) -> BackendController:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
