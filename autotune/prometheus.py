"""What a server has served, in Prometheus' text format (`GET /metrics`).

vLLM's server exposes its speculative decoding counters and latency histograms the same way,
so a dashboard can follow acceptance, throughput and tail latency; here they are split by
request class and by the arm the controller chose, which is what an operator of this
controller wants to watch: which arm each class is on, how much of what it drafts is kept,
and how long requests take and wait (sums alone give means; a p99 needs the histograms).
Plain text, no client library: counters, histograms and two gauges are all it takes.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import defaultdict

from autotune.controller import ControlledResult

PREFIX = "autotune"
# name -> (help, labels); every series is a counter, summed over the requests it has seen.
COUNTERS = {
    "requests_total": ("Requests served, by how they ended.", ("request_class", "arm", "finish_reason")),
    "prompt_tokens_total": ("Prompt tokens of requests served.", ("request_class",)),
    "cached_prompt_tokens_total": ("Of them, taken from earlier prompts' kept keys and values, not prefilled.",
                                   ("request_class",)),
    "generation_tokens_total": ("Output tokens.", ("request_class", "arm")),
    "draft_tokens_total": ("Tokens the drafter proposed.", ("request_class", "arm")),
    "accepted_tokens_total": ("Drafted tokens the target kept.", ("request_class", "arm")),
    "draft_tokens_per_position_total": ("Tokens drafted at each position of a round's draft (0: first).",
                                        ("request_class", "arm", "position")),
    "accepted_tokens_per_position_total": ("Of them, kept by the target (vLLM's accepted tokens per position).",
                                           ("request_class", "arm", "position")),
    "fallbacks_total": ("Requests whose speculation failed and OFF finished.", ("request_class", "arm")),
    "request_seconds_total": ("Engine seconds of requests served.", ("request_class", "arm")),
    "queue_seconds_total": ("Seconds requests waited before the engine began on them.", ("request_class",)),
    "request_errors_total": ("Requests that failed while served.", ("error",)),
}
# vLLM's bucket bounds (seconds) for its histograms of the same names
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0)
_FIRST_TOKEN = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
_PER_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0)
# name -> (help, labels, bucket bounds); one observation per request served
HISTOGRAMS = {
    "time_to_first_token_seconds": ("From the request's arrival to its first output token.", ("request_class",),
                                    _FIRST_TOKEN),
    "e2e_request_latency_seconds": ("From the request's arrival to its last output token.", ("request_class",),
                                    _LATENCY),
    "request_queue_time_seconds": ("From the request's arrival until the engine began on it.", ("request_class",),
                                   _LATENCY),
    "request_time_per_output_token_seconds": ("A request's time after its first output token, per later token.",
                                              ("request_class", "arm"), _PER_TOKEN),
}
GAUGES = {
    "requests_running": "Requests being served that have their first output token.",
    "requests_waiting": "Requests being served that wait for their first output token (queued or prefilling).",
}


OTHER_CLASSES = "__other__"  # the label of request classes past a server's `max_classes`


class ServedCounters:
    """Counters and histograms over served requests, and the requests in flight: `begin`, `end`,
    `observe` and `fail` from any thread, `render` for a scrape. A request in flight is known
    by its `RequestClock`, which its streamer advances."""

    def __init__(self, max_classes: int = 100) -> None:
        # Past `max_classes` distinct request classes, the others' series are summed as
        # OTHER_CLASSES: 10,091 labels once grew a scrape to 70 MB.
        self.max_classes = max_classes
        self._classes: set[str] = set()
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
        # name -> labels -> [count per bucket (not cumulative), sum, count]
        self._histograms: dict[str, dict[tuple[str, ...], list]] = defaultdict(dict)
        self._in_flight: set[RequestClock] = set()

    def begin(self, clock: RequestClock) -> None:
        with self._lock:
            self._in_flight.add(clock)

    def end(self, clock: RequestClock) -> None:
        with self._lock:
            self._in_flight.discard(clock)

    def observe(self, result: ControlledResult, clock: RequestClock | None = None) -> None:
        """Count a request served; with its clock, also its latencies (from the clock's start,
        which is when the server handed it to the controller)."""
        m, arm = result.metrics, str(result.arm)
        with self._lock:
            cls = self._label(result.request_class)
            v = self._values
            v["requests_total"][cls, arm, str(result.finish_reason)] += 1
            v["prompt_tokens_total"][(cls,)] += m.prompt_tokens
            v["cached_prompt_tokens_total"][(cls,)] += m.cached_prompt_tokens
            v["generation_tokens_total"][cls, arm] += m.new_tokens
            v["draft_tokens_total"][cls, arm] += m.drafted
            v["accepted_tokens_total"][cls, arm] += m.accepted
            for position, (drafted, accepted) in enumerate(zip(m.drafted_per_position, m.accepted_per_position)):
                if drafted:
                    v["draft_tokens_per_position_total"][cls, arm, str(position)] += drafted
                    v["accepted_tokens_per_position_total"][cls, arm, str(position)] += accepted
            v["fallbacks_total"][cls, arm] += result.fell_back
            v["request_seconds_total"][cls, arm] += m.total_s
            v["queue_seconds_total"][(cls,)] += result.queue_s
            self._add("request_queue_time_seconds", (cls,), result.queue_s)
            if clock is not None and clock.first_token_at is not None:
                first, last = clock.first_token_at - clock.since, clock.last_token_at - clock.since
                self._add("time_to_first_token_seconds", (cls,), first)
                self._add("e2e_request_latency_seconds", (cls,), last)
                if m.new_tokens > 1:
                    self._add("request_time_per_output_token_seconds", (cls, arm), (last - first) / (m.new_tokens - 1))

    def _label(self, request_class: str) -> str:
        if request_class in self._classes or len(self._classes) < self.max_classes:
            self._classes.add(request_class)
            return request_class
        return OTHER_CLASSES

    def fail(self, error: Exception) -> None:
        with self._lock:
            self._values["request_errors_total"][(type(error).__name__,)] += 1

    def _add(self, name: str, labels: tuple[str, ...], value: float) -> None:
        bounds = HISTOGRAMS[name][2]
        row = self._histograms[name].setdefault(labels, [[0] * (len(bounds) + 1), 0.0, 0])
        row[0][bisect.bisect_left(bounds, value)] += 1  # the first bucket whose bound is >= value
        row[1] += value
        row[2] += 1

    def render(self) -> str:
        lines = []
        with self._lock:
            for name, (doc, labels) in COUNTERS.items():
                lines += [f"# HELP {PREFIX}_{name} {doc}", f"# TYPE {PREFIX}_{name} counter"]
                for key, value in sorted(self._values[name].items()):
                    lines.append(f"{PREFIX}_{name}{{{_tags(labels, key)}}} {_number(value)}")
            for name, (doc, labels, bounds) in HISTOGRAMS.items():
                lines += [f"# HELP {PREFIX}_{name} {doc}", f"# TYPE {PREFIX}_{name} histogram"]
                for key, (counts, total, count) in sorted(self._histograms[name].items()):
                    tags = _tags(labels, key)
                    for bound, seen in zip([*map(repr, bounds), "+Inf"], itertools.accumulate(counts)):
                        lines.append(f'{PREFIX}_{name}_bucket{{{tags},le="{bound}"}} {seen}')
                    lines += [f"{PREFIX}_{name}_sum{{{tags}}} {_number(total)}",
                              f"{PREFIX}_{name}_count{{{tags}}} {count}"]
            running = sum(clock.first_token_at is not None for clock in self._in_flight)
            for name, value in (("requests_running", running), ("requests_waiting", len(self._in_flight) - running)):
                lines += [f"# HELP {PREFIX}_{name} {GAUGES[name]}", f"# TYPE {PREFIX}_{name} gauge",
                          f"{PREFIX}_{name} {value}"]
        return "\n".join(lines) + "\n"


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


def _tags(labels: tuple[str, ...], key: tuple[str, ...]) -> str:
    return ",".join(f'{label}="{_escape(part)}"' for label, part in zip(labels, key))


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
