"""The routing backend: OpenAI-compatible replicas (vLLM, SGLang, `autotune serve`), each launched
with one speculative configuration, one of them without; the arm picks the replica.

vLLM and SGLang fix speculation when a server starts (`--speculative-config`), so an arm is a
replica. What a request did is read from the outside:
- its times from the streamed response (`/v1/completions`, `stream: true`): the first chunk
  with text ends its prefill, the last ends its decode; its output tokens from the usage the
  last chunk carries (`stream_options.include_usage`), its token ids where the server sends
  them (vLLM's `return_token_ids`; only then are they handed on as they arrive);
- its drafted and accepted tokens from the replica's Prometheus counters
  (`vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total`),
  read before and after it: only when no other request of this backend was on that replica
  meanwhile (the counters are the replica's, not the request's); otherwise None.
A replica that does not answer within `timeout_s` (no byte for that long, or the whole answer
not done by then) or answers with an error raises BackendError naming it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from autotune.backends.base import BackendError, BackendRequest, BackendResponse, TokenSink
from engine import Arm

DRAFTED = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


@dataclass(frozen=True)
class Replica:
    arm: Arm  # the speculative configuration the replica was launched with (OFF: none)
    url: str  # its base address, e.g. http://10.0.0.5:8000
    model: str  # the model name it serves (`--served-model-name`)


class RoutingBackend:
    """Serves an arm on the replica launched with it."""

    name = "replicas"
    variable_k = frozenset()  # K is fixed per replica

    def __init__(self, replicas: list[Replica], timeout_s: float = 120.0, api_key: str | None = None,
                 read_metrics: bool = True) -> None:
        by_arm: dict[Arm, Replica] = {}
        for replica in replicas:
            if replica.arm in by_arm:
                raise ValueError(f"two replicas for arm {replica.arm}: {by_arm[replica.arm].url} and {replica.url}")
            by_arm[replica.arm] = replica
        if not any(arm.is_off for arm in by_arm):
            raise ValueError("the routing backend needs a replica without speculation (arm off)")
        self.replicas = by_arm
        self.timeout_s = timeout_s
        self.read_metrics = read_metrics
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout_s, headers=headers)
        self._lock = threading.Lock()
        self._busy: dict[Arm, int] = {arm: 0 for arm in by_arm}  # this backend's requests on each replica now
        self._started: dict[Arm, int] = {arm: 0 for arm in by_arm}  # and since it began

    def arms(self) -> list[Arm]:
        return list(self.replicas)

    def serve(self, request: BackendRequest, arm: Arm, on_tokens: TokenSink | None = None) -> BackendResponse:
        replica = self.replicas.get(arm)
        if replica is None:
            raise BackendError(f"no replica serves arm {arm}; the replicas: {[str(a) for a in self.replicas]}")
        with self._lock:
            self._busy[arm] += 1
            self._started[arm] += 1
            alone, started = self._busy[arm] == 1, self._started[arm]
        try:
            before = self._counters(replica) if alone and not arm.is_off else None
            response = self._complete(replica, request, on_tokens)
            if arm.is_off:
                return replace(response, drafted=0, accepted=0)
            after = self._counters(replica) if before is not None else None
            with self._lock:
                alone_throughout = self._started[arm] == started  # none began on it meanwhile
            if after is not None and alone_throughout:
                return replace(response, drafted=int(after[0] - before[0]), accepted=int(after[1] - before[1]))
            return response
        finally:
            with self._lock:
                self._busy[arm] -= 1

    def _complete(self, replica: Replica, request: BackendRequest, on_tokens: TokenSink | None) -> BackendResponse:
        body = {"model": replica.model, "prompt": request.prompt, "max_tokens": request.max_new_tokens,
                "temperature": request.temperature, "top_p": request.top_p, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        if request.seed is not None:
            body["seed"] = request.seed
        where = f"replica {replica.arm} at {replica.url}"
        started = time.perf_counter()
        deadline = started + self.timeout_s
        first = last = None
        text, tokens, usage, finish = [], [], None, "stop"
        try:
            with self._client.stream("POST", replica.url + "/v1/completions", json=body) as answer:
                if answer.status_code != 200:
                    raise BackendError(f"{where} answered {answer.status_code}: {answer.read()[:500]!r}")
                for line in answer.iter_lines():
                    now = time.perf_counter()
                    if now > deadline:
                        raise BackendError(f"{where}: not done in {self.timeout_s:g} s")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise BackendError(f"{where} failed mid-stream: {chunk['error']}")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices", []):
                        if choice.get("text"):
                            first = first if first is not None else now
                            last = now
                            text.append(choice["text"])
                        if fresh := choice.get("token_ids"):
                            tokens += fresh
                            if on_tokens is not None:
                                on_tokens(fresh)
                        finish = choice.get("finish_reason") or finish
        except httpx.TimeoutException:
            raise BackendError(f"{where}: no answer in {self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise BackendError(f"{where}: {type(exc).__name__}: {exc}") from None
        total_s = time.perf_counter() - started
        if usage is None:
            raise BackendError(f"{where} sent no usage (stream_options.include_usage): is it OpenAI-compatible?")
        first = first if first is not None else started + total_s
        return BackendResponse(
            tokens=tokens, text="".join(text), prompt_tokens=int(usage.get("prompt_tokens", len(request.prompt))),
            new_tokens=int(usage.get("completion_tokens", 0)), prefill_s=first - started,
            decode_s=(last or first) - first, total_s=total_s, finish_reason=finish)

    def _counters(self, replica: Replica) -> tuple[float, float] | None:
        """The replica's drafted and accepted totals for its model; None where it has none."""
        if not self.read_metrics:
            return None
        try:
            answer = self._client.get(replica.url + "/metrics", timeout=min(self.timeout_s, 5.0))
        except httpx.HTTPError:
            return None
        if answer.status_code != 200:
            return None
        totals = {DRAFTED: None, ACCEPTED: None}
        for family in text_string_to_metric_families(answer.text):
            if family.name in totals:
                totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total")
                                          and s.labels.get("model_name", replica.model) == replica.model)
        if None in totals.values():
            return None
        return totals[DRAFTED], totals[ACCEPTED]

    def close(self) -> None:
        self._client.close()

