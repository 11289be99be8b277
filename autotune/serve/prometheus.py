"""What a server has served, for Prometheus (`GET /metrics`), through prometheus_client.

Two families side by side. vLLM's names (`vllm:num_requests_running`,
`vllm:time_to_first_token_seconds`, `vllm:spec_decode_num_accepted_tokens`, ..., labelled
`model_name`), so the dashboards, alerts and autoscalers written for vLLM read this server
as they read vLLM. And the controller's own `autotune_*` series, split by request class and by
the arm the controller chose, which is what an operator of this controller wants to watch:
which arm each class is on, how much of what it drafts is kept, how long requests take.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from autotune.control.controller import ControlledResult

OTHER_CLASSES = "__other__"  # the label of request classes past a server's `max_classes`
# vLLM's bucket bounds (seconds) for its histograms of the same names
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0)
_FIRST_TOKEN = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
_PER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0)
CLASS, ARM = ("request_class",), ("request_class", "arm")
# No `*_created` series (a timestamp per counter and histogram per label set): noise to a scrape,
# and twice the lines per class; vLLM's scrapes have none either.
disable_created_metrics()


class RequestClock:
    """When a request was handed to the controller and when its output tokens came: its
    streamer calls `prompt` when its prompt is put, and `tick` when output tokens are."""

    def __init__(self) -> None:
        self.since = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def prompt(self) -> None:
        """It is being served, again if its batch failed and it is served alone: the output
        that counts starts over (a first attempt's tokens must not stand as its first token)."""
        self.first_token_at = self.last_token_at = None

    def tick(self) -> None:
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now


class ServedMetrics:
    """The series of one server (a registry of its own, so servers in one process do not mix):
    `begin`, `end`, `observe` and `fail` from any thread, `render` for a scrape. A request in
    flight is known by its `RequestClock`, which its streamer advances."""

    def __init__(self, model_name: str = "spec-autotune", max_classes: int = 100) -> None:
        # Past `max_classes` distinct request classes, the others' series are summed as
        # OTHER_CLASSES: 10,091 labels once grew a scrape to 70 MB.
        self.max_classes, self.model_name = max_classes, model_name
        self._classes: set[str] = set()
        self._in_flight: set[RequestClock] = set()
        self._lock = threading.Lock()
        self.registry = r = CollectorRegistry(auto_describe=True)
        model = ("model_name",)

        def vllm(kind, name: str, doc: str, labels: tuple[str, ...] = (), **kw):
            return kind(f"vllm:{name}", doc, model + labels, registry=r, **kw)

        running = vllm(Gauge, "num_requests_running", "Requests being served that have their first output token.")
        waiting = vllm(Gauge, "num_requests_waiting", "Requests waiting for their first output token (queued or"
                                                      " prefilling).")
        running.labels(model_name).set_function(lambda: self._count_in_flight(started=True))
        waiting.labels(model_name).set_function(lambda: self._count_in_flight(started=False))
        self.success = vllm(Counter, "request_success", "Requests served, by how they ended.", ("finished_reason",))
        self.prompt_tokens = vllm(Counter, "prompt_tokens", "Prompt tokens of requests served.")
        self.generation_tokens = vllm(Counter, "generation_tokens", "Output tokens.")
        self.prefix_queries = vllm(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = vllm(Counter, "prefix_cache_hits", "Of them, found there (not prefilled).")
        self.drafts = vllm(Counter, "spec_decode_num_drafts", "Rounds that drafted.")
        self.draft_tokens = vllm(Counter, "spec_decode_num_draft_tokens", "Tokens the drafter proposed.")
        self.accepted_tokens = vllm(Counter, "spec_decode_num_accepted_tokens", "Drafted tokens the target kept.")
        self.accepted_per_pos = vllm(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                     "Drafted tokens kept, by their position in the draft (0: first).", ("position",))
        self.ttft = vllm(Histogram, "time_to_first_token_seconds", "From arrival to the first output token.",
                         buckets=_FIRST_TOKEN)
        self.e2e = vllm(Histogram, "e2e_request_latency_seconds", "From arrival to the last output token.",
                        buckets=_LATENCY)
        self.queue = vllm(Histogram, "request_queue_time_seconds", "From arrival until the engine began on it.",
                          buckets=_LATENCY)
        self.tpot = vllm(Histogram, "time_per_output_token_seconds", "Time after the first output token, per later"
                                                                     " token.", buckets=_PER_TOKEN)

        def own(kind, name: str, doc: str, labels: tuple[str, ...], **kw):
            return kind(f"autotune_{name}", doc, labels, registry=r, **kw)

        self.requests = own(Counter, "requests", "Requests served, by how they ended.", (*ARM, "finish_reason"))
        self.class_prompt_tokens = own(Counter, "prompt_tokens", "Prompt tokens of requests served.", CLASS)
        self.class_cached_tokens = own(Counter, "cached_prompt_tokens", "Of them, taken from earlier prompts' kept"
                                                                        " keys and values, not prefilled.", CLASS)
        self.arm_generation_tokens = own(Counter, "generation_tokens", "Output tokens.", ARM)
        self.arm_draft_tokens = own(Counter, "draft_tokens", "Tokens the drafter proposed.", ARM)
        self.arm_accepted_tokens = own(Counter, "accepted_tokens", "Drafted tokens the target kept.", ARM)
        self.arm_draft_per_pos = own(Counter, "draft_tokens_per_position", "Tokens drafted at each position of a"
                                     " round's draft (0: first).", (*ARM, "position"))
        self.arm_accepted_per_pos = own(Counter, "accepted_tokens_per_position", "Of them, kept by the target.",
                                        (*ARM, "position"))
        self.fallbacks = own(Counter, "fallbacks", "Requests whose speculation failed and OFF finished.", ARM)
        self.request_seconds = own(Counter, "request_seconds", "Engine seconds of requests served.", ARM)
        self.errors = own(Counter, "request_errors", "Requests that failed while served.", ("error",))
        self.class_ttft = own(Histogram, "time_to_first_token_seconds", "From arrival to the first output token.",
                              CLASS, buckets=_FIRST_TOKEN)
        self.class_e2e = own(Histogram, "e2e_request_latency_seconds", "From arrival to the last output token.",
                             CLASS, buckets=_LATENCY)
        self.class_queue = own(Histogram, "request_queue_time_seconds", "From arrival until the engine began on"
                                                                        " it.", CLASS, buckets=_LATENCY)
        self.arm_tpot = own(Histogram, "request_time_per_output_token_seconds", "A request's time after its first"
                            " output token, per later token.", ARM, buckets=_PER_TOKEN)

    def begin(self, clock: RequestClock) -> None:
        with self._lock:
            self._in_flight.add(clock)

    def end(self, clock: RequestClock) -> None:
        with self._lock:
            self._in_flight.discard(clock)

    def _count_in_flight(self, started: bool) -> int:
        with self._lock:
            return sum((clock.first_token_at is not None) == started for clock in self._in_flight)

    def observe(self, result: ControlledResult, clock: RequestClock | None = None) -> None:
        """Count a request served; with its clock, also its latencies (from the clock's start,
        which is when the server handed it to the controller)."""
        m, arm, name = result.metrics, str(result.arm), self.model_name
        with self._lock:
            cls = self._label(result.request_class)
        self.success.labels(name, str(result.finish_reason)).inc()
        self.requests.labels(cls, arm, str(result.finish_reason)).inc()
        self.prompt_tokens.labels(name).inc(m.prompt_tokens)
        self.class_prompt_tokens.labels(cls).inc(m.prompt_tokens)
        self.prefix_queries.labels(name).inc(m.prompt_tokens)
        self.prefix_hits.labels(name).inc(m.cached_prompt_tokens)
        self.class_cached_tokens.labels(cls).inc(m.cached_prompt_tokens)
        self.generation_tokens.labels(name).inc(m.new_tokens)
        self.arm_generation_tokens.labels(cls, arm).inc(m.new_tokens)
        if m.drafted:
            self.drafts.labels(name).inc(m.draft_rounds)
            self.draft_tokens.labels(name).inc(m.drafted)
            self.accepted_tokens.labels(name).inc(m.accepted)
            self.arm_draft_tokens.labels(cls, arm).inc(m.drafted)
            self.arm_accepted_tokens.labels(cls, arm).inc(m.accepted)
        for position, (drafted, accepted) in enumerate(zip(m.drafted_per_position, m.accepted_per_position)):
            if drafted:
                self.accepted_per_pos.labels(name, str(position)).inc(accepted)
                self.arm_draft_per_pos.labels(cls, arm, str(position)).inc(drafted)
                self.arm_accepted_per_pos.labels(cls, arm, str(position)).inc(accepted)
        self.fallbacks.labels(cls, arm).inc(result.fell_back)
        self.request_seconds.labels(cls, arm).inc(m.total_s)
        self.queue.labels(name).observe(result.queue_s)
        self.class_queue.labels(cls).observe(result.queue_s)
        if clock is not None and clock.first_token_at is not None:
            first, last = clock.first_token_at - clock.since, clock.last_token_at - clock.since
            self.ttft.labels(name).observe(first)
            self.class_ttft.labels(cls).observe(first)
            self.e2e.labels(name).observe(last)
            self.class_e2e.labels(cls).observe(last)
            if m.new_tokens > 1:
                self.tpot.labels(name).observe((last - first) / (m.new_tokens - 1))
                self.arm_tpot.labels(cls, arm).observe((last - first) / (m.new_tokens - 1))

    def _label(self, request_class: str) -> str:
        if request_class in self._classes or len(self._classes) < self.max_classes:
            self._classes.add(request_class)
            return request_class
        return OTHER_CLASSES

    def fail(self, error: Exception) -> None:
        self.errors.labels(type(error).__name__).inc()

    def render(self) -> bytes:
        """The scrape, in Prometheus' text format."""
        return generate_latest(self.registry)
