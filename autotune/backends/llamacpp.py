"""The llama.cpp backend: requests served by `llama-server` processes, the arm set per request.

llama.cpp fixes a server's drafter when it starts (a draft model, or an n-gram lookup) and lets a
request set how far it drafts (`speculative.n_max`, `n_min`, `p_min`; server releases 0.3.23 and
older, see llamacpp_build.py). So a drafter is chosen by routing among servers started with
different ones, and K and OFF by the request's fields:
- OFF: the server started without a drafter;
- `NAME:K` with a draft model: its server, `speculative.n_max` = K, `n_min` 0 and `p_min` 0 (K
  drafts every round, as this project's arms draft, unless `p_min` is set: llama.cpp's own
  default of 0.75 stops a draft at the first token the draft model is unsure of);
- `ngram:K`: a server started with `--spec-type ngram-simple` and an m-gram of K (its K is the
  server's: llama.cpp drafts a whole m-gram or nothing, and only where the text repeats with a
  period longer than the lookup).
Each response's `timings` say what happened: `predicted_ms` over `predicted_n` tokens (the
decode), `prompt_ms`, `draft_n` and `draft_n_accepted`.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from autotune.backends.base import BackendError, BackendRequest, BackendResponse, TokenSink
from engine import OFF, Arm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaServerSpec:
    """One `llama-server` of `model`: without a drafter (`name` "off"), with a draft model (`name`:
    the drafter's name in arms), or an n-gram lookup drafting `ngram_k` tokens (`name` "ngram")."""

    name: str
    model: Path
    draft_model: Path | None = None
    ngram_k: int | None = None
    ngram_n: int = 3  # an n-gram server's lookup: the last n tokens (as this engine's n-gram drafter)
    threads: int | None = None
    context: int = 1024
    draft_max: int = 16  # the most a request may ask for (its n_max is capped by it)

    def args(self, binary: Path, port: int) -> list[str]:
        args = [str(binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
                "-c", str(self.context), "-np", "1", "--no-webui", "--log-disable"]
        if self.threads:
            args += ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.draft_model is not None:
            args += ["-md", str(self.draft_model), "--spec-draft-n-max", str(self.draft_max),
                     "--spec-draft-n-min", "0", "-cd", str(self.context)]
            if self.threads:
                args += ["-td", str(self.threads), "-tbd", str(self.threads)]
        elif self.ngram_k is not None:
            args += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(self.ngram_n),
                     "--spec-ngram-simple-size-m", str(self.ngram_k)]
        return args


class LlamaServer:
    """A `llama-server` process on a free port of 127.0.0.1, ready once /health answers 200."""

    def __init__(self, binary: Path, spec: LlamaServerSpec, start_timeout_s: float = 60.0) -> None:
        self.spec = spec
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+", errors="replace")  # a file: a pipe nobody reads would fill and stall it
        self.process = subprocess.Popen(spec.args(binary, self.port), stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                out = self.log.read()[-3000:]
                self.log.close()
                raise BackendError(f"llama-server {self.spec.name!r} exited ({self.process.returncode}) while"
                                   f" starting:\n{out}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise BackendError(f"llama-server {self.spec.name!r} at {self.url} not ready in {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


NGRAM = "ngram"  # the drafter name of llama.cpp's n-gram lookup servers in arms


@dataclass
class LlamaCppBackend:
    """Serves arms on llama-server processes: `urls` ({name: URL}) holds "off", the server without
    a drafter, and one per draft model (served at each K of `ks`); `ngram_urls` ({K: URL}) the
    n-gram servers, arm `ngram:K`. Greedy and sampled requests follow the target's distribution:
    llama.cpp's extra samplers (top-k 40, min-p 0.05 by default) are turned off."""

    urls: dict[str, str]
    ngram_urls: dict[int, str] = field(default_factory=dict)
    ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    p_min: float = 0.0
    cache_prompt: bool = True  # llama.cpp's prompt cache: a prompt that starts as the last one prefills the rest
    timeout_s: float = 120.0
    name: str = "llama.cpp"

    def __post_init__(self) -> None:
        if "off" not in self.urls:
            raise ValueError(f"llama.cpp backend: no server for OFF (a server named 'off' without a drafter)"
                             f" among {sorted(self.urls)}")
        if NGRAM in self.urls:
            raise ValueError(f"{NGRAM!r} names the n-gram servers (ngram_urls), not a draft model")
        self._client = httpx.Client(timeout=self.timeout_s)
        self.variable_k = frozenset(name for name in self.urls if name != "off")

    @classmethod
    def start(cls, binary: Path, specs: list[LlamaServerSpec], **settings) -> tuple[LlamaCppBackend, list[LlamaServer]]:
        """Start a server per spec and a backend over them; stop the servers when done."""
        servers: list[LlamaServer] = []
        try:
            for spec in specs:
                servers.append(LlamaServer(binary, spec))
        except BaseException:
            for server in servers:
                server.stop()
            raise
        backend = cls({s.spec.name: s.url for s in servers if s.spec.ngram_k is None},
                      {s.spec.ngram_k: s.url for s in servers if s.spec.ngram_k is not None}, **settings)
        return backend, servers

    def arms(self) -> list[Arm]:
        drafters = [name for name in self.urls if name != "off"]
        return [OFF, *(Arm(name, k) for name in drafters for k in self.ks),
                *(Arm(NGRAM, k) for k in self.ngram_urls)]

    def url(self, arm: Arm) -> str:
        if arm.drafter == NGRAM:
            url = self.ngram_urls.get(arm.k)
        else:
            url = self.urls.get("off" if arm.is_off else arm.drafter)
        if url is None:
            raise BackendError(f"llama.cpp backend has no server for arm {arm};"
                               f" it serves {[str(a) for a in self.arms()]}")
        return url

    def body(self, request: BackendRequest, arm: Arm) -> dict:
        """The /completion request for `request` on `arm`."""
        body = {"prompt": request.prompt, "n_predict": request.max_new_tokens, "temperature": request.temperature,
                "top_p": request.top_p, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
                "cache_prompt": self.cache_prompt, "return_tokens": True}
        if request.seed is not None:
            body["seed"] = request.seed
        if not arm.is_off and arm.drafter != NGRAM:
            body.update({"speculative.n_max": arm.k, "speculative.n_min": 0, "speculative.p_min": self.p_min})
        return body

    def serve(self, request: BackendRequest, arm: Arm, on_tokens: TokenSink | None = None) -> BackendResponse:
        """`request` on `arm`; with `on_tokens`, streamed: each event's tokens handed over as they come."""
        url = self.url(arm)
        body = {**self.body(request, arm), "stream": on_tokens is not None}
        started = time.perf_counter()
        try:
            with self._client.stream("POST", url + "/completion", json=body) as answer:
                if answer.status_code != 200:
                    raise _server_error(arm, url, answer.status_code, answer.read()[:500].decode(errors="replace"))
                out = _streamed(answer, on_tokens) if on_tokens is not None else json.loads(answer.read())
                if "error" in out:  # a stream that fails part way ends with an error event
                    raise _server_error(arm, url, out["error"].get("code"), json.dumps(out["error"]))
        except httpx.TimeoutException:
            raise BackendError(f"llama.cpp server for {arm} at {url}: no answer in {self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise BackendError(f"llama.cpp server for {arm} at {url}: {type(exc).__name__}: {exc}") from None
        total_s = time.perf_counter() - started
        timings = out.get("timings", {})
        speculative = not arm.is_off
        tokens = list(out.get("tokens", []))
        # The tokens delivered, not `tokens_predicted`: with a draft model, a round whose accepted
        # drafts cross n_predict counts them all but sends only those before it (seen: 60-63 of 64).
        return BackendResponse(
            tokens=tokens, text=out.get("content", ""),
            prompt_tokens=int(out.get("tokens_evaluated", len(request.prompt))), new_tokens=len(tokens),
            prefill_s=timings.get("prompt_ms", 0.0) / 1e3, decode_s=timings.get("predicted_ms", 0.0) / 1e3,
            total_s=total_s, finish_reason="length" if out.get("stop_type") == "limit" else "stop",
            drafted=int(timings.get("draft_n", 0)) if speculative else 0,
            accepted=int(timings.get("draft_n_accepted", 0)) if speculative else 0)

    def forget(self) -> None:
        """Leave no request's tokens in the draft-model servers: each keeps the last request's
        tokens in its drafter and, when a prompt repeats, proposes its old output as drafts
        (nearly all accepted), which would favour whichever arm serves a prompt second in a
        benchmark where arms take turns on the same prompts."""
        unrelated = BackendRequest([1] * 8, 4)
        for name in self.variable_k:
            self.serve(unrelated, Arm(name, 2))

    def close(self) -> None:
        self._client.close()


def _server_error(arm: Arm, url: str, status: int | None, detail: str) -> BackendError:
    # llama-server parses every output as a chat message, and its parser fails on text that is not
    # valid UTF-8 (a byte-level token cut off by n_predict, or sampled alone): ggml-org/llama.cpp#27543.
    if "Failed to parse input" in detail:
        detail = f"its output is not valid UTF-8, which llama-server cannot return (llama.cpp#27543): {detail}"
    return BackendError(f"llama.cpp server for {arm} at {url} answered {status}: {detail}")


def _streamed(answer: httpx.Response, on_tokens: TokenSink) -> dict:
    """A streamed /completion read to its end: the last event (timings, stop type) with the
    content and tokens of every event, each event's tokens handed to `on_tokens` on arrival; or
    the error event that ended it."""
    text, tokens, last = [], [], {}
    for line in answer.iter_lines():
        if not line.startswith("data: "):
            continue
        last = json.loads(line[6:])
        if "error" in last:
            return last
        text.append(last.get("content", ""))
        if fresh := last.get("tokens"):
            tokens += fresh
            on_tokens(fresh)
    return {**last, "content": "".join(text), "tokens": tokens}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def family_servers(gguf: dict[str, Path], drafters: tuple[str, ...] = ("distilled", "small", "medium"),
                   ngram_ks: tuple[int, ...] = (2, 4, 8), threads: int | None = None) -> list[LlamaServerSpec]:
    """The servers for a family converted to GGUF ({name: path}, "target" among them): OFF, each
    of `drafters` as a draft model, and an n-gram server per K of `ngram_ks`."""
    target = gguf["target"]
    return [LlamaServerSpec("off", target, threads=threads),
            *(LlamaServerSpec(name, target, gguf[name], threads=threads) for name in drafters),
            *(LlamaServerSpec(NGRAM, target, ngram_k=k, threads=threads) for k in ngram_ks)]
