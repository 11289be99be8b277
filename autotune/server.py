"""An OpenAI-compatible HTTP server in front of the controller: `autotune serve`.

Clients written for vLLM, SGLang or OpenAI's API send `POST /v1/completions` and get the
controller's output, with the arm and request class it chose in each choice's `autotune`
field. Each HTTP request is handled on a thread of its own and each of its choices (its
prompts times `n`) is one `controller.generate` call, on a thread of its own too, so choices
and requests that arrive together are batched by the controller's coalescer (`max_batch`).
Standard library only (http.server): nothing new to install and nothing in the decode loop.

Fields are OpenAI's legacy completions (`prompt` as text, token ids or a list of either,
`max_tokens` (default 16), `temperature` (default 1), `top_p`, `n`, `stop`, `seed`,
`logprobs`, `echo`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `stream`,
`stream_options.include_usage`, `user`), vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `allowed_token_ids`, `bad_words`) and this
project's `request_class`. With a `seed`, choice j of a prompt draws from `seed + j`, so choice
0 is the request's output with `n` = 1. An unknown field, a value of the wrong type and
anything the engine refuses (an empty prompt, one longer than the context, ...) get a 400 with
OpenAI's error body naming the problem, before anything is decoded or streamed.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from autotune.controller import AutotuneController, ControlledResult
from engine import OFF, InvalidRequestError, SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's
OPENAI_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "echo",
                 "presence_penalty", "frequency_penalty", "logit_bias", "stream", "stream_options", "user", "best_of",
                 "suffix")
VLLM_FIELDS = {"top_k": int, "min_p": (int, float), "repetition_penalty": (int, float), "min_tokens": int,
               "ignore_eos": bool, "stop_token_ids": list, "include_stop_str_in_output": bool,
               "skip_special_tokens": bool, "allowed_token_ids": list, "bad_words": (str, list)}
FIELDS = (*OPENAI_FIELDS, *VLLM_FIELDS, "request_class")
_TAIL = re.compile(r"[\s\ufffd]+$")  # what a later token can still change: whitespace, a half character


class BadRequest(Exception):
    """A request the server refuses: HTTP `status` with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class Completion:
    """A /v1/completions body, checked. `options`: the controller's keyword arguments."""

    prompts: tuple[str | tuple[int, ...], ...]
    n: int = 1
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None
    request_class: str | None = None
    options: dict = field(default_factory=dict)

    def choices(self) -> list[tuple[int, str | tuple[int, ...], int | None]]:
        """(prompt index, prompt, seed) per choice, in the response's order."""
        return [(i, prompt, None if self.seed is None else self.seed + j)
                for i, prompt in enumerate(self.prompts) for j in range(self.n)]


def _get(body: dict, name: str, kinds: type | tuple[type, ...], default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise BadRequest(f"{name} must be {_kind_names(kinds)}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise BadRequest(f"{name} must be {_kind_names(kinds)}, got {value!r}", name)
    return value


def _kind_names(kinds) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object"}
    return " or ".join(names[k] for k in (kinds if isinstance(kinds, tuple) else (kinds,)))


def _prompts(value) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four prompt forms: text, token ids, a list of texts, a list of token id lists."""
    def ids(items) -> tuple[int, ...]:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise BadRequest("prompt must be a string, a list of token ids, or a list of either", "prompt")
        return tuple(items)

    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise BadRequest("prompt is required: a string, a list of token ids, or a non-empty list of either", "prompt")
    if all(isinstance(p, str) for p in value):
        return tuple(value)
    if all(isinstance(p, list) for p in value):
        return tuple(ids(p) for p in value)
    return (ids(value),)


def parse_completion(body) -> Completion:
    """Check a /v1/completions body; every refusal names the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if unknown := sorted(set(body) - set(FIELDS)):
        raise BadRequest(f"unknown field(s) {unknown}; this server takes: {sorted(FIELDS)}", unknown[0])
    if "prompt" not in body:
        raise BadRequest("prompt is required", "prompt")
    if body.get("suffix") is not None:
        raise BadRequest("suffix is not supported (no fill-in-the-middle)", "suffix")
    n = _get(body, "n", int, 1)
    if n < 1:
        raise BadRequest(f"n must be >= 1, got {n}", "n")
    best_of = _get(body, "best_of", int, n)
    if best_of != n:
        raise BadRequest(f"best_of other than n is not supported (as in vLLM V1), got {best_of} with n={n}", "best_of")
    stop = _get(body, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    logprobs = _get(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise BadRequest(f"logprobs must be in 0..20, got {logprobs}", "logprobs")
    echo = _get(body, "echo", bool, False)
    stream = _get(body, "stream", bool, False)
    if stream and logprobs is not None:
        raise BadRequest("logprobs are not streamed: ask for them without stream", "logprobs")
    max_tokens = _get(body, "max_tokens", int, DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    options = {"stop": stop, "presence_penalty": _get(body, "presence_penalty", (int, float), 0.0),
               "frequency_penalty": _get(body, "frequency_penalty", (int, float), 0.0)}
    if logprobs is not None:
        options["logprobs"] = logprobs
        if echo:
            options["prompt_logprobs"] = logprobs
    bias = _get(body, "logit_bias", dict, {})
    try:
        options["logit_bias"] = {int(token): float(value) for token, value in bias.items()}
    except (TypeError, ValueError):
        raise BadRequest("logit_bias must map token ids to numbers", "logit_bias") from None
    for name, kinds in VLLM_FIELDS.items():
        if body.get(name) is not None:
            options[name] = _get(body, name, kinds)
    stream_options = _get(body, "stream_options", dict, {})
    return Completion(
        prompts=_prompts(body["prompt"]), n=n, max_tokens=max_tokens,
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)),
        seed=_get(body, "seed", int), stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)), echo=echo, logprobs=logprobs,
        request_class=_get(body, "request_class", str), options=options,
    )


class CompletionServer(ThreadingHTTPServer):
    """`/v1/completions`, `/v1/models` and `/health` over `controller`, as `model_name`."""

    daemon_threads = True

    def __init__(self, controller: AutotuneController, address: tuple[str, int] = ("127.0.0.1", 8000),
                 model_name: str = "spec-autotune", verbose: bool = False) -> None:
        if controller.engine.tokenizer is None:
            raise ValueError("the server needs the engine's tokenizer (text in, text out)")
        self.controller, self.model_name, self.verbose = controller, model_name, verbose
        self.created = int(time.time())
        super().__init__(address, _Handler)

    def check(self, completion: Completion) -> None:
        """Refuse now what the controller would refuse once decoding, so that a streamed request
        gets its 400 too (the controller checks again)."""
        engine = self.controller.engine
        options = {k: v for k, v in completion.options.items() if k != "bad_words"}
        sampling = SamplingParams(completion.temperature, completion.top_p, completion.seed, **options)
        for prompt in completion.prompts:
            engine.check_request(engine.encode(list(prompt) if isinstance(prompt, tuple) else prompt).numel(), OFF,
                                 completion.max_tokens, sampling)

    def serve_choice(self, completion: Completion, prompt, seed: int | None, streamer=None) -> ControlledResult:
        return self.controller.generate(list(prompt) if isinstance(prompt, tuple) else prompt,
                                        completion.request_class, completion.max_tokens, completion.temperature,
                                        completion.top_p, seed, streamer, **completion.options)

    def choice(self, index: int, completion: Completion, prompt, result: ControlledResult) -> dict:
        """One choice of the response, as OpenAI's completions write it, with the controller's
        own account of it under `autotune`."""
        tokenizer = self.controller.engine.tokenizer
        prompt_ids = list(prompt) if isinstance(prompt, tuple) else tokenizer(prompt, add_special_tokens=False)[
            "input_ids"]
        text = result.text
        logprobs = None
        if completion.echo:
            text = self.prompt_text(prompt) + text
        if completion.logprobs is not None:
            ids, entries = result.tokens, result.logprobs
            if completion.echo:
                ids, entries = prompt_ids + ids, result.prompt_logprobs + entries
            logprobs = _openai_logprobs(tokenizer, ids, entries)
        m = result.metrics
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason,
                "autotune": {"request_class": result.request_class, "arm": str(result.arm),
                             "acceptance": m.acceptance, "mean_accepted_length": m.mean_accepted_length,
                             "reward": result.reward, "load": result.load, "fell_back": result.fell_back}}

    def prompt_text(self, prompt) -> str:
        return self.controller.engine.tokenizer.decode(list(prompt)) if isinstance(prompt, tuple) else prompt

    def envelope(self, request_id: str, choices: list[dict]) -> dict:
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices}


def _openai_logprobs(tokenizer, ids: list[int], entries: list[dict[int, float] | None]) -> dict:
    """OpenAI's legacy logprobs object: each token's text, log-probability (None for the first
    prompt token), the likeliest tokens' and its offset in the text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, entry in zip(ids, entries):
        text = tokenizer.decode([token])
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry[token])
        out["top_logprobs"].append(None if entry is None else {tokenizer.decode([t]): lp for t, lp in entry.items()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _usage(results: list[ControlledResult], completion: Completion) -> dict:
    prompt_tokens = sum(r.metrics.prompt_tokens for r in results[::completion.n])  # each prompt once
    completion_tokens = sum(len(r.tokens) for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TextDeltas:
    """A streamer (engine/streaming.py) that turns one choice's tokens into text deltas on
    `events`, holding back what a later token can still change: the tail that could begin a
    stop string (cut from the final text), trailing whitespace (a tokenizer's clean-up may drop
    it) and a half-decoded character. The rest comes from the result's text, which is final.
    It raises once `gone` is set (the client went away), which stops its request."""

    def __init__(self, index: int, events: queue.Queue, gone: threading.Event, tokenizer,
                 sampling: dict) -> None:
        self.index, self.events, self.gone, self.tokenizer = index, events, gone, tokenizer
        self.stops = () if sampling.get("include_stop_str_in_output") else sampling.get("stop", ())
        self.skip_special = sampling.get("skip_special_tokens", True)
        self.tokens: list[int] | None = None  # None until the prompt's put
        self.sent = ""

    def put(self, value: torch.Tensor) -> None:
        if self.gone.is_set():
            raise ConnectionResetError("the client went away")
        if self.tokens is None:  # the first put is the prompt (transformers' streamer protocol)
            self.tokens = []
            return
        self.tokens += value.reshape(-1).tolist()
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special)
        safe = len(_TAIL.sub("", text))
        if self.stops:
            found = [text.find(s) for s in self.stops if s in text]
            safe = min(safe, min(found) if found else len(text) - max(map(len, self.stops)) + 1)
        if safe > len(self.sent):
            self.events.put(("text", self.index, text[len(self.sent):safe]))
            self.sent = text[:safe]

    def end(self) -> None:
        pass

    def rest(self, final: str) -> str:
        """What the client has not got of the final text."""
        return final[len(self.sent):] if final.startswith(self.sent) else ""


class _Handler(BaseHTTPRequestHandler):
    server: CompletionServer
    server_version = "spec-autotune"

    def log_message(self, format: str, *args) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._json({"status": "ok"})
        if self.path == "/v1/models":
            return self._json({"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                           "created": self.server.created,
                                                           "owned_by": "spec-autotune"}]})
        self._error(BadRequest(f"no route GET {self.path}", status=HTTPStatus.NOT_FOUND))

    def do_POST(self) -> None:
        try:
            if self.path != "/v1/completions":
                raise BadRequest(f"no route POST {self.path}; this server has /v1/completions",
                                 status=HTTPStatus.NOT_FOUND)
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadRequest(f"the body is not valid JSON: {exc}") from None
            completion = parse_completion(body)
            model = body.get("model")
            if model is not None and model != self.server.model_name:
                raise BadRequest(f"the model {model!r} does not exist; this server has {self.server.model_name!r}",
                                 "model", HTTPStatus.NOT_FOUND)
            self.server.check(completion)
        except BadRequest as exc:
            return self._error(exc)
        except InvalidRequestError as exc:
            return self._error(BadRequest(str(exc)))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if completion.stream:
            return self._stream(request_id, completion)
        try:
            results = self._serve_all(completion)
        except InvalidRequestError as exc:
            return self._error(BadRequest(str(exc)))
        except Exception as exc:
            return self._error(BadRequest(f"{type(exc).__name__}: {exc}", status=HTTPStatus.INTERNAL_SERVER_ERROR))
        choices = [self.server.choice(i, completion, prompt, r)
                   for i, ((_, prompt, _), r) in enumerate(zip(completion.choices(), results))]
        self._json({**self.server.envelope(request_id, choices), "usage": _usage(results, completion)})

    def _serve_all(self, completion: Completion) -> list[ControlledResult]:
        """Every choice, each a request to the controller on a thread of its own."""
        rows = completion.choices()
        if len(rows) == 1:
            return [self.server.serve_choice(completion, rows[0][1], rows[0][2])]
        results: list = [None] * len(rows)

        def serve(i: int) -> None:
            try:
                results[i] = self.server.serve_choice(completion, rows[i][1], rows[i][2])
            except Exception as exc:
                results[i] = exc

        _run_threads(serve, len(rows))
        if failed := next((r for r in results if isinstance(r, Exception)), None):
            raise failed
        return results

    def _stream(self, request_id: str, completion: Completion) -> None:
        """Server-sent events as OpenAI's stream: a chunk per text delta, each choice's last with
        its finish_reason, the usage if asked for, then `data: [DONE]`."""
        rows = completion.choices()
        events: queue.Queue = queue.Queue()
        gone = threading.Event()
        tokenizer = self.server.controller.engine.tokenizer
        deltas = [TextDeltas(i, events, gone, tokenizer, completion.options) for i in range(len(rows))]

        def serve(i: int) -> None:
            try:
                events.put(("done", i, self.server.serve_choice(completion, rows[i][1], rows[i][2], deltas[i])))
            except Exception as exc:
                events.put(("failed", i, exc))

        workers = [threading.Thread(target=serve, args=(i,), daemon=True) for i in range(len(rows))]
        for worker in workers:
            worker.start()
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        results: dict[int, ControlledResult] = {}
        try:
            if completion.echo:
                for i, (_, prompt, _) in enumerate(rows):
                    self._event(self.server.envelope(request_id, [_delta(i, self.server.prompt_text(prompt))]))
            for _ in range(len(rows)):
                kind, i, payload = events.get()
                while kind == "text":
                    self._event(self.server.envelope(request_id, [_delta(i, payload)]))
                    kind, i, payload = events.get()
                if kind == "failed":
                    status = 400 if isinstance(payload, InvalidRequestError) else 500
                    self._event({"error": {"message": f"{type(payload).__name__}: {payload}", "type":
                                           "invalid_request_error" if status == 400 else "internal_error",
                                           "param": None, "code": status}})
                    continue
                results[i] = payload
                self._event(self.server.envelope(request_id, [_delta(i, deltas[i].rest(payload.text),
                                                                     payload.finish_reason)]))
            if completion.include_usage and len(results) == len(rows):
                ordered = [results[i] for i in range(len(rows))]
                self._event({**self.server.envelope(request_id, []), "usage": _usage(ordered, completion)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:  # the client went away: its requests stop at their next round
            gone.set()

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, payload: dict, status: HTTPStatus = HTTPStatus.OK) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: BadRequest) -> None:
        kind = "invalid_request_error" if exc.status < 500 else "internal_error"
        self._json({"error": {"message": str(exc), "type": kind, "param": exc.param, "code": int(exc.status)}},
                   exc.status)


def _delta(index: int, text: str, finish_reason: str | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _run_threads(work, count: int) -> None:
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
