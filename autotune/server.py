"""An OpenAI-compatible HTTP server in front of the controller: `autotune serve`.

Clients written for vLLM, SGLang or OpenAI's API send `POST /v1/completions` or
`/v1/chat/completions` (fields: openai_api.py) and get the controller's output, with the arm
and request class it chose in each choice's `autotune` field (vLLM's `/tokenize` and
`/detokenize` show the token ids those endpoints serve). Each HTTP request is handled on
a thread of its own and each of its choices (its prompts times `n`) is one
`controller.generate` call, on a few threads of its own too (at most the controller's
`in_flight`), so choices and requests that arrive together are batched by the controller's
coalescer (`max_batch`). Anything refused (an
unknown field, a value of the wrong type, an empty prompt, one longer than the context, ...)
gets OpenAI's error body naming the problem before anything is decoded or streamed.
Standard library only (http.server): nothing new to install and nothing in the decode loop.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import queue
import re
import selectors
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from autotune.controller import AutotuneController, ControlledResult
from autotune.inspect_store import policy_table
from autotune.openai_api import (
    ApiRequest,
    BadRequest,
    chunk_choice,
    chunk_logprobs,
    envelope,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
    prompt_text,
    refused,
    response_choice,
    usage,
)
from autotune.prometheus import RequestClock, ServedCounters
from engine import OFF, InvalidRequestError, SamplingParams
from store import StoreError

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 << 20  # a body is read whole before it is checked
_TAIL = re.compile(r"[\s\ufffd]+$")  # what a later token can still change: whitespace, a half character


class HangUpWatcher:
    """One thread that waits on the connections of every client waiting for its answer and,
    when one hangs up, calls what its handler gave (which stops its requests at their next
    round, as vLLM aborts the requests of a client that disconnects). One thread, not each
    handler polling its own connection: at every 50 ms, 1,024 waiting clients made 20,000
    wake-ups a second, and a probe's decode loop ran at 0.4x. A connection is watched with epoll
    (`selectors`), which, unlike `select`, takes any descriptor."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def watch(self, connection: socket.socket, hung_up: Callable[[], None]) -> None:
        with self._lock:
            self._selector.register(connection, selectors.EVENT_READ, hung_up)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hang-up-watcher", daemon=True)
                self._thread.start()

    def unwatch(self, connection: socket.socket) -> None:
        with self._lock:
            try:
                self._selector.unregister(connection)
            except (KeyError, ValueError):  # told already (`_run` lets go of it), or closed
                pass

    def close(self) -> None:
        """Stop watching (within a second) and let go of the selector."""
        self._closed.set()
        with self._lock:
            if self._thread is None:
                self._selector.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            for key, _ in self._selector.select(timeout=1.0):
                try:  # readable: its end (gone), or more bytes (a next request: still there)
                    gone = not key.fileobj.recv(1, socket.MSG_PEEK)
                except OSError:  # reset, or closed meanwhile
                    gone = True
                self.unwatch(key.fileobj)  # either way, or it would stay readable
                if gone:
                    key.data()
        self._selector.close()


class CompletionServer(ThreadingHTTPServer):
    """`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/tokenize`, `/detokenize`,
    `/metrics`, `/health` and what the controller learned (`/v1/autotune/policy`) over
    `controller`, as `model_name`."""

    daemon_threads = True
    # Connections the kernel may hold before they are accepted (uvicorn's default). With
    # socketserver's 5, clients connecting together were reset: 19 of 1920 requests from 32
    # clients in six probes.
    request_queue_size = 2048

    def __init__(self, controller: AutotuneController, address: tuple[str, int] = ("127.0.0.1", 8000),
                 model_name: str = "spec-autotune", verbose: bool = False, api_key: str | None = None,
                 max_metric_classes: int = 100) -> None:
        if controller.engine.tokenizer is None:
            raise ValueError("the server needs the engine's tokenizer (text in, text out)")
        self.controller, self.model_name, self.verbose = controller, model_name, verbose
        self.api_key = api_key  # vLLM's --api-key: every route but /health then needs `Authorization: Bearer <key>`
        self.tokenizer = controller.engine.tokenizer
        self.created = int(time.time())
        self.counters = ServedCounters(max_metric_classes)
        self.hang_ups = HangUpWatcher()
        super().__init__(address, _Handler)

    def server_close(self) -> None:
        self.hang_ups.close()
        super().server_close()

    def admit(self, request: ApiRequest) -> tuple[ApiRequest, list[list[int]]]:
        """The request with its length settled, and its prompts' token ids, or the refusal the
        controller would give once decoding (so that a streamed request gets its 400 too)."""
        engine = self.controller.engine
        ids = [engine.encode(list(p) if isinstance(p, tuple) else p, request.add_special_tokens).tolist()
               for p in request.prompts]
        if request.max_tokens is None:  # a chat's default: what the context leaves
            if engine.max_length is None:
                raise BadRequest("max_tokens is required: the model states no context length", "max_tokens")
            if (left := engine.max_length - len(ids[0])) < 1:
                raise BadRequest(f"the prompt ({len(ids[0])} tokens) fills the model's context of"
                                 f" {engine.max_length} tokens", "messages")
            request = dataclasses.replace(request, max_tokens=left)
        sampling = engine.bad_words_as_ids(SamplingParams(request.temperature, request.top_p, request.seed,
                                                          **request.options))
        for one in ids:
            engine.check_request(len(one), OFF, request.decoded_tokens, sampling)
        return request, ids

    def serve(self, request: ApiRequest, ids: list[int], seed: int | None, watch: ClientWatch) -> ControlledResult:
        """One choice, from its prompt's token ids (`admit` encoded them: no second encoding);
        `watch`, its streamer, times it for the metrics."""
        self.counters.begin(watch.clock)
        try:
            result = self.controller.generate(ids, request.request_class, request.decoded_tokens,
                                              request.temperature, request.top_p, seed, watch, **request.options)
        except Exception as exc:
            self.counters.fail(exc)
            raise
        finally:
            self.counters.end(watch.clock)
        self.counters.observe(result, watch.clock)
        return result


class ClientWatch:
    """The streamer of a choice whose client waits for the whole response: it shows nothing,
    and raises once `gone` is set (the client hung up), which stops its request at its next
    round, as vLLM aborts the requests of a client that disconnects. Showing nothing, a request
    it watches can still be served again alone if its batch fails (`EndsOnce.started`)."""

    shows_output = False

    def __init__(self, gone: threading.Event) -> None:
        self.gone = gone
        self.clock = RequestClock()  # when its output came, for the metrics' latencies

    def put(self, value: torch.Tensor) -> None:
        if self.gone.is_set():
            raise ConnectionResetError("the client went away")
        if value.dim() == 2:  # the prompt, [1, prompt_len] (transformers' streamer protocol)
            self.clock.prompt()
        else:
            self.clock.tick()

    def end(self) -> None:
        pass


class TokenEvents(ClientWatch):
    """A streamer (engine/streaming.py) that hands a choice's committed tokens, and their
    log-probabilities if it asked for them, to the thread answering its client, which turns
    them into text (`TextDeltas`): the engine's thread, which decodes for the whole batch, only
    queues them. It raises once `gone` is set (the client went away), which stops its request."""

    shows_output = True

    def __init__(self, index: int, events: queue.Queue, gone: threading.Event) -> None:
        super().__init__(gone)
        self.index, self.events = index, events
        self.entries: list[dict[int, float]] = []  # those of the tokens the next put brings

    def put_logprobs(self, entries: list[dict[int, float]]) -> None:
        self.entries = entries

    def put(self, value: torch.Tensor) -> None:
        super().put(value)
        if value.dim() == 2:  # the prompt
            return
        self.events.put(("tokens", self.index, (value.reshape(-1).tolist(), self.entries)))
        self.entries = []


class TextDeltas:
    """A choice's output tokens as text deltas, holding back what a later token can still
    change: the tail that could begin a stop string (cut from the final text), trailing
    whitespace (a tokenizer's clean-up may drop it) and a half-decoded character. The rest
    comes from the result's text, which is final."""

    def __init__(self, tokenizer, options: dict) -> None:
        self.tokenizer = tokenizer
        self.stops = () if options.get("include_stop_str_in_output") else options.get("stop", ())
        self.skip_special = options.get("skip_special_tokens", True)
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, tokens: list[int]) -> str:
        """The text that `tokens`, appended, let the client have now ("" for none yet)."""
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special)
        safe = len(_TAIL.sub("", text))
        if self.stops:
            found = [text.find(s) for s in self.stops if s in text]
            safe = min(safe, min(found) if found else len(text) - max(map(len, self.stops)) + 1)
        if safe <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):safe], text[:safe]
        return delta

    def rest(self, final: str) -> str:
        """What the client has not got of the final text."""
        return final[len(self.sent):] if final.startswith(self.sent) else ""


class LogprobDeltas:
    """A choice's streamed tokens whose log-probabilities the client has not had yet: they go
    out with the next chunk that carries text, or with the last, so every token's go out once
    and in order, whatever text is held back."""

    def __init__(self, request: ApiRequest, tokenizer) -> None:
        self.request, self.tokenizer = request, tokenizer
        self.ids: list[int] = []
        self.entries: list[dict[int, float]] = []
        self.text_offset = 0  # the legacy object's offset of the next token

    def add(self, ids: list[int], entries: list[dict[int, float]]) -> None:
        if self.request.logprobs is not None:
            self.ids += ids
            self.entries += entries

    def take(self) -> dict | None:
        """The chunk's logprobs object (None where none were asked for)."""
        if self.request.logprobs is None:
            return None
        out = chunk_logprobs(self.request, self.tokenizer, self.ids, self.entries, self.text_offset)
        if not self.request.chat:
            self.text_offset += sum(map(len, out["tokens"]))
        self.ids, self.entries = [], []
        return out


POLICY_PAGE = 100  # rows of /v1/autotune/policy at most per call: its cost grows with the keys shown


def _page(query: str) -> tuple[int, int]:
    """`offset` and `limit` of a /v1/autotune/policy query string, refused by name when bad."""
    fields = urllib.parse.parse_qs(query)
    unknown = sorted(set(fields) - {"offset", "limit"})
    if unknown:
        raise BadRequest(f"unknown query parameter(s) {unknown}; this route takes offset and limit")
    values = {}
    for name, default, low, high in (("offset", 0, 0, None), ("limit", POLICY_PAGE, 1, POLICY_PAGE)):
        text = fields.get(name, [str(default)])[-1]
        if not text.isdigit() or int(text) < low or (high is not None and int(text) > high):
            bound = f"an int from {low}" + (f" to {high}" if high is not None else "")
            raise BadRequest(f"{name} must be {bound}, got {text!r}", name)
        values[name] = int(text)
    return values["offset"], values["limit"]


class _Handler(BaseHTTPRequestHandler):
    server: CompletionServer
    server_version = "spec-autotune"

    def log_message(self, format: str, *args) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _authorized(self) -> bool:
        """Every route but /health needs the server's key when it has one (tokenizing and the
        metrics cost the server too); the answer is sent if not."""
        key = self.server.api_key
        # As bytes: compare_digest refuses str with non-ASCII characters (a TypeError, the
        # connection closed with no answer).
        sent = self.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if key is None or self.path == "/health" or hmac.compare_digest(sent, f"Bearer {key}".encode()):
            return True
        refused = BadRequest("a valid API key is required: send `Authorization: Bearer <key>`",
                             status=HTTPStatus.UNAUTHORIZED)
        self._json(refused.body(), refused.status)
        return False

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/health":
            return self._json({"status": "ok"})
        if self.path == "/metrics":
            return self._send(self.server.counters.render().encode(), "text/plain; version=0.0.4")
        if self.path == "/v1/autotune/policy" or self.path.startswith("/v1/autotune/policy?"):
            return self._policy()
        if self.path == "/v1/models":
            model = {"id": self.server.model_name, "object": "model", "created": self.server.created,
                     "owned_by": "spec-autotune", "max_model_len": self.server.controller.engine.max_length}
            return self._json({"object": "list", "data": [model]})
        self._json(BadRequest(f"no route GET {self.path}", status=HTTPStatus.NOT_FOUND).body(), HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        if not self._authorized():
            return
        try:
            if self.path in ("/tokenize", "/detokenize"):
                return self._json(self._tokens(self._body()))
            request, ids = self._read()
        except BadRequest as exc:
            return self._json(exc.body(), exc.status)
        except Exception as exc:  # the tokenizer's own failure: the client still gets an answer
            failure = BadRequest(f"{type(exc).__name__}: {exc}", status=HTTPStatus.INTERNAL_SERVER_ERROR)
            return self._json(failure.body(), failure.status)
        prefix = "chatcmpl" if request.chat else "cmpl"
        self.request_id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        if request.stream:
            return self._stream(request, ids)
        gone = threading.Event()
        try:
            results = self._serve_all(request, ids, gone)
            if gone.is_set():  # no one to answer; its requests stopped at their next round
                return
            choices = [response_choice(i, request, prompt, ids[i // request.n], result, self.server.tokenizer)
                       for i, ((prompt, _), result) in enumerate(zip(request.choices(), results))]
        except InvalidRequestError as exc:
            return self._json(refused(exc, request.chat).body(), HTTPStatus.BAD_REQUEST)
        except Exception as exc:  # the client gets an answer whatever failed
            failure = BadRequest(f"{type(exc).__name__}: {exc}", status=HTTPStatus.INTERNAL_SERVER_ERROR)
            return self._json(failure.body(), failure.status)
        self._json({**self._envelope(request, choices), "usage": usage(results, request)})

    def _policy(self) -> None:
        """What the controller has learned so far, per class and load, as `autotune inspect
        --json` shows it from the store (saved and flushed first, so it is up to date), a page of
        `?limit=` rows (at most POLICY_PAGE, the default) from `&offset=`."""
        controller = self.server.controller
        if controller.store is None:
            missing = BadRequest("this server keeps no store, so it has no learned policy to show",
                                 status=HTTPStatus.NOT_FOUND)
            return self._json(missing.body(), missing.status)
        try:
            controller.save()
        except StoreError as exc:  # what the database refused: told, and the table still shown
            logger.warning("%s", exc)
        try:
            offset, limit = _page(urllib.parse.urlsplit(self.path).query)
        except BadRequest as exc:
            return self._json(exc.body(), exc.status)
        policy = controller.policy.name
        self._json({"policy": policy, "offset": offset, "limit": limit,
                    "classes": policy_table(controller.store, policy, offset, limit)})

    def _read(self) -> tuple[ApiRequest, list[list[int]]]:
        parsers = {"/v1/completions": parse_completion,
                   "/v1/chat/completions": lambda body: parse_chat(body, self.server.tokenizer)}
        if self.path not in parsers:
            routes = sorted([*parsers, "/tokenize", "/detokenize"])
            raise BadRequest(f"no route POST {self.path}; this server has {routes}", status=HTTPStatus.NOT_FOUND)
        body = self._body()
        request = parsers[self.path](body)
        self._check_model(body)
        try:
            return self.server.admit(request)
        except InvalidRequestError as exc:
            raise refused(exc, request.chat) from None

    def _tokens(self, body) -> dict:
        """vLLM's /tokenize (a prompt's or a chat's token ids, as the completion endpoints
        encode them) and /detokenize (token ids' text)."""
        tokenizer = self.server.tokenizer
        if self.path == "/detokenize":
            ids = parse_detokenize(body, self.server.controller.engine.vocab_size)
            self._check_model(body)
            return {"prompt": tokenizer.decode(ids)}
        text, special, strings = parse_tokenize(body, tokenizer)
        self._check_model(body)
        try:
            self.server.controller.engine.check_prompt_text(text)
        except InvalidRequestError as exc:
            raise refused(exc, "messages" in body) from None
        ids = tokenizer(text, add_special_tokens=special)["input_ids"]
        return {"count": len(ids), "max_model_len": self.server.controller.engine.max_length, "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids) if strings else None}

    def _check_model(self, body: dict) -> None:
        if (model := body.get("model")) is not None and model != self.server.model_name:
            raise BadRequest(f"the model {model!r} does not exist; this server has {self.server.model_name!r}",
                             "model", HTTPStatus.NOT_FOUND)

    def _body(self):
        """The request's JSON body, refused if too large, of no stated length or not JSON."""
        length = self.headers.get("Content-Length", "0")
        if not (length.isascii() and length.isdigit()):  # "²".isdigit() is True, and int() refuses it
            raise BadRequest(f"Content-Length must be a number of bytes, got {length!r}")
        if int(length) > MAX_BODY_BYTES:
            raise BadRequest(f"the body is {length} bytes; this server takes at most {MAX_BODY_BYTES}",
                             status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        try:
            return json.loads(self.rfile.read(int(length)) or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}") from None

    def _serve_all(self, request: ApiRequest, ids: list[list[int]], gone: threading.Event) -> list[ControlledResult]:
        """Every choice, each a request to the controller, while the server's `hang_ups` watches
        the client: `gone` is set, and the requests stop, if it hangs up."""
        rows = request.choices()
        results: list = [None] * len(rows)

        def serve(i: int) -> None:
            try:
                results[i] = self.server.serve(request, ids[i // request.n], rows[i][1], ClientWatch(gone))
            except Exception as exc:
                results[i] = exc

        self.server.hang_ups.watch(self.connection, gone.set)
        try:
            for thread in self._each_choice(len(rows), serve, gone):
                thread.join()
        finally:
            self.server.hang_ups.unwatch(self.connection)
        if failed := next((r for r in results if isinstance(r, Exception)), None):
            raise failed
        return results

    def _each_choice(self, count: int, serve: Callable[[int], None], gone: threading.Event) -> list[threading.Thread]:
        """Serve choices 0 to count - 1, `serve(i)` each, on at most the controller's `in_flight`
        threads, each taking the next choice when its last is done, and none once `gone` is set
        (the client left). A thread per choice had a body of 20,000 prompts run 15,000 threads,
        and put all of them in the queue ahead of other clients' requests."""
        choices = iter(range(count))
        lock = threading.Lock()

        def work() -> None:
            while not gone.is_set():
                with lock:
                    i = next(choices, None)
                if i is None:
                    return
                serve(i)

        threads = [threading.Thread(target=work, daemon=True)
                   for _ in range(min(count, self.server.controller.in_flight))]
        for thread in threads:
            thread.start()
        return threads

    def _stream(self, request: ApiRequest, ids: list[list[int]]) -> None:
        """Server-sent events as OpenAI streams them: a chunk per text delta, each choice's last
        with its finish_reason, the usage if asked for, then `data: [DONE]`."""
        rows = request.choices()
        events: queue.Queue = queue.Queue()
        gone = threading.Event()
        texts = [TextDeltas(self.server.tokenizer, request.options) for _ in rows]
        logprobs = [LogprobDeltas(request, self.server.tokenizer) for _ in rows]

        def serve(i: int) -> None:
            try:
                result = self.server.serve(request, ids[i // request.n], rows[i][1], TokenEvents(i, events, gone))
                events.put(("done", i, result))
            except Exception as exc:
                events.put(("failed", i, exc))

        def hung_up() -> None:
            gone.set()
            events.put(("gone", -1, None))  # nothing may come for it to write, and find the client gone

        self.server.hang_ups.watch(self.connection, hung_up)
        self._each_choice(len(rows), serve, gone)
        results: dict[int, ControlledResult] = {}
        try:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            for i, (prompt, _) in enumerate(rows):
                if request.chat or request.echo:  # a chat's turn opens; an echo starts with the prompt
                    text = prompt_text(prompt, self.server.tokenizer) if request.echo else ""
                    self._event(self._envelope(request, [chunk_choice(i, request, text, first=True)], chunk=True))
            while len(results) < len(rows):
                kind, i, payload = events.get()
                if kind == "gone":
                    raise ConnectionResetError("the client went away")
                if kind == "tokens":
                    tokens, entries = payload
                    logprobs[i].add(tokens, entries)
                    if delta := texts[i].add(tokens):
                        chunk = chunk_choice(i, request, delta, logprobs=logprobs[i].take())
                        self._event(self._envelope(request, [chunk], chunk=True))
                elif kind == "done":
                    results[i] = payload
                    last = chunk_choice(i, request, texts[i].rest(payload.text), payload.finish_reason,
                                        logprobs=logprobs[i].take())
                    self._event(self._envelope(request, [last], chunk=True))
                else:
                    if isinstance(payload, InvalidRequestError):
                        self._event(refused(payload, request.chat).body())
                    else:
                        self._event(BadRequest(f"{type(payload).__name__}: {payload}",
                                               status=HTTPStatus.INTERNAL_SERVER_ERROR).body())
                    results[i] = None
            served = [results[i] for i in range(len(rows))]
            if request.include_usage and None not in served:
                self._event({**self._envelope(request, [], chunk=True), "usage": usage(served, request)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:  # the client went away: its requests stop at their next round
            gone.set()
        finally:
            self.server.hang_ups.unwatch(self.connection)

    def _envelope(self, request: ApiRequest, choices: list[dict], chunk: bool = False) -> dict:
        return envelope(request, self.request_id, self.server.model_name, self.created, choices, chunk)

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, an unsupported method) as
        OpenAI's JSON error body, not an HTML page."""
        refused = BadRequest(message or HTTPStatus(code).phrase, status=HTTPStatus(code))
        self.close_connection = True
        self._json(refused.body(), refused.status)

    def _json(self, payload: dict, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(json.dumps(payload).encode(), "application/json", status)

    def _send(self, data: bytes, content_type: str, status: HTTPStatus = HTTPStatus.OK) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except ConnectionError:  # the client left before its answer: there is no one to tell
            self.close_connection = True
