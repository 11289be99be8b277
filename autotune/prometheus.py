"""What a server has served, as counters in Prometheus' text format (`GET /metrics`).

vLLM's server exposes its speculative decoding counters the same way, so a dashboard can
follow acceptance and throughput; here they are split by request class and by the arm the
controller chose, which is what an operator of this controller wants to watch: which arm each
class is on, how much of what it drafts is kept, and how long requests take. Plain text, no
client library: a few counters are all it takes.
"""

from __future__ import annotations

import threading
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
    "fallbacks_total": ("Requests whose speculation failed and OFF finished.", ("request_class", "arm")),
    "request_seconds_total": ("Engine seconds of requests served.", ("request_class", "arm")),
    "queue_seconds_total": ("Seconds requests waited before the engine began on them.", ("request_class",)),
    "request_errors_total": ("Requests that failed while served.", ("error",)),
}


class ServedCounters:
    """Counters over served requests; `observe` and `fail` from any thread, `render` for a scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))

    def observe(self, result: ControlledResult) -> None:
        m, cls, arm = result.metrics, result.request_class, str(result.arm)
        with self._lock:
            v = self._values
            v["requests_total"][cls, arm, str(result.finish_reason)] += 1
            v["prompt_tokens_total"][(cls,)] += m.prompt_tokens
            v["cached_prompt_tokens_total"][(cls,)] += m.cached_prompt_tokens
            v["generation_tokens_total"][cls, arm] += m.new_tokens
            v["draft_tokens_total"][cls, arm] += m.drafted
            v["accepted_tokens_total"][cls, arm] += m.accepted
            v["fallbacks_total"][cls, arm] += result.fell_back
            v["request_seconds_total"][cls, arm] += m.total_s
            v["queue_seconds_total"][(cls,)] += result.queue_s

    def fail(self, error: Exception) -> None:
        with self._lock:
            self._values["request_errors_total"][(type(error).__name__,)] += 1

    def render(self) -> str:
        lines = []
        with self._lock:
            for name, (doc, labels) in COUNTERS.items():
                lines += [f"# HELP {PREFIX}_{name} {doc}", f"# TYPE {PREFIX}_{name} counter"]
                for key, value in sorted(self._values[name].items()):
                    tags = ",".join(f'{label}="{_escape(part)}"' for label, part in zip(labels, key))
                    lines.append(f"{PREFIX}_{name}{{{tags}}} {_number(value)}")
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
