"""An OpenAI-compatible server in front of the controller: `autotune serve`, on FastAPI and uvicorn.

Clients written for vLLM, SGLang or OpenAI's API send `POST /v1/completions` or
`/v1/chat/completions` (bodies: openai_api.py's pydantic models) and get the controller's
output, with the arm and request class it chose in each choice's `autotune` field (vLLM's
`/tokenize` and `/detokenize` show the token ids those endpoints serve). Each choice (a
prompt times `n`) is one `controller.agenerate` call, at most the controller's `in_flight` of
one HTTP request at a time, so choices and requests that arrive together are batched by the
controller's coalescer (`max_batch`); a client that disconnects has its requests stopped at
their next round, as vLLM aborts them. Anything refused gets OpenAI's error body naming the
field before anything is decoded or streamed. `/metrics` has vLLM's series and the
controller's own (prometheus.py).

Bounded (`ServerLimits`): a body's size is checked before it is read, and it must arrive in
time; a connection must send its request's head in time; past `max_connections` the idlest
connection is closed to let a new one in; past `max_requests` requests in flight, a 503.
The event loop runs below the engine's worker in CPU priority (`loop_nice`), so the work
connections make (a flood of connects, a wave of closes) yields to a request's decoding.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import gc
import hmac
import json
import logging
import os
import re
import resource
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11
import torch
import uvicorn
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvloop import Loop as UVLoop
except ImportError:  # on Windows, where uvloop is not a dependency and uvicorn runs asyncio's loop
    UVLoop = ()

from autotune.control.coalesce import Coalescer
from autotune.control.controller import AutotuneController, ControlledResult
from autotune.control.inspect_store import policy_table
from autotune.serve.openai_api import (
    ApiRequest,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chunk_choice,
    chunk_logprobs,
    envelope,
    prompt_text,
    refused,
    response_choice,
    usage,
)
from autotune.serve.prometheus import RequestClock, ServedMetrics
from engine import OFF, InvalidRequestError, SamplingParams
from store import StoreError

logger = logging.getLogger(__name__)
_TAIL = re.compile(r"[\s\ufffd]+$")  # what a later token can still change: whitespace, a half character
POLICY_PAGE = 100  # rows of /v1/autotune/policy at most per call: its cost grows with the keys shown


# Connections a server holds at most whatever its descriptor limit: holding an idle connection
# costs little and no CPU, while closing one to a client that reopens it costs an accept, a close
# and the garbage collector's time.
MAX_CONNECTIONS = 65_536
SPARE_DESCRIPTORS = 256  # for the store, the model files, the engine's threads


def raise_descriptor_limit() -> None:
    """The process's soft limit on open descriptors raised to what the connection cap needs, up to
    the hard limit (as Go's runtime and nginx's `worker_rlimit_nofile` do): a soft limit of 1,024
    would cap a server at 768 connections, and past its cap the server closes its idlest
    connection for each new one, which a flood of reconnecting clients turns into a storm."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_CONNECTIONS + SPARE_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(hard, wanted),
                                                    hard))


def freeze_startup_heap() -> None:
    """Everything alive once the server is built (modules, tokenizer, model, controller) moved
    where the garbage collector no longer walks it, as vLLM's `freeze_gc_heap` does after its
    engine starts: a full collection otherwise walks that whole heap, a pause every request in
    flight waits out. Objects made later are collected as before."""
    gc.collect()  # what is garbage now would never be collected once frozen
    gc.freeze()


def run_below_the_engine(nice: int) -> None:
    """This thread (the event loop's) `nice` steps below its priority now, where the OS sets
    priority per thread (Linux; elsewhere it would take the engine's threads down with it). On a
    core it shares with the engine's worker, the loop's work for connections then waits for the
    engine instead of taking half the core from it. Threads the loop starts
    later (a request's, a tokenizer's) take its priority; the engine's worker, started before,
    does not. Nice ranks threads within their scheduling group: with Linux's autogroup, a
    session, so the loop yields to processes of other sessions no more than the server does."""
    if nice and sys.platform == "linux":
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))


def _descriptor_budget() -> int:
    """Connections a server may hold: what the process's descriptor limit leaves, at most MAX_CONNECTIONS."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, min(MAX_CONNECTIONS, (soft if soft != resource.RLIM_INFINITY else 1 << 20) - SPARE_DESCRIPTORS))


@dataclass(frozen=True)
class ServerLimits:
    """What one client can hold of the server. A connection that has not sent its request's
    head (line and headers) within `head_timeout_s` of opening, or of its last answer, is
    closed (a slow or idle client); a body must arrive within `body_timeout_s` and be at most
    `max_body_bytes` (checked before it is read when its length is stated); past
    `max_connections` open connections the one idle longest is closed; past `max_requests`
    requests in flight, new ones get a 503. With no read deadline and a thread per
    connection, 20,000 idle connections once hung the hand-written server for good."""

    max_body_bytes: int = 8 << 20  # 8 MiB: dozens of prompts filling a 32k context; a 30 MB prompt is never read
    head_timeout_s: float = 60.0  # nginx's client_header_timeout, Node's headersTimeout
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0  # uvicorn's: an idle kept-alive connection is closed after it
    max_connections: int = 0  # 0: what the descriptor limit leaves (_descriptor_budget)
    max_requests: int = 4096
    graceful_shutdown_s: float = 10.0  # a stop waits this long for requests in flight

    def connections(self) -> int:
        return self.max_connections or _descriptor_budget()


class WaitingConnections:
    """One server's connections waiting for a request's head, oldest first, each closed at its
    deadline (`limits.head_timeout_s` after it opened, or after its last answer) by one timer for
    them all. Keyed by transport, which a connection keeps when its first bytes hand it from
    `NewConnection` to `BoundedH11Protocol`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadlines: collections.OrderedDict[asyncio.Transport, float] = collections.OrderedDict()
        self.timer: asyncio.TimerHandle | None = None

    def add(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.deadlines[transport] = deadline = loop.time() + self.timeout_s
        if self.timer is None:
            self.timer = loop.call_at(deadline, self._close_expired, loop)

    def discard(self, transport: asyncio.Transport) -> None:
        self.deadlines.pop(transport, None)

    def close_oldest(self) -> bool:
        """The connection waiting longest closed to make room; False when none is waiting."""
        if not self.deadlines:
            return False
        transport, _ = self.deadlines.popitem(last=False)
        transport.close()
        return True

    def _close_expired(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        now = loop.time()
        while self.deadlines:
            transport, deadline = next(iter(self.deadlines.items()))
            if deadline > now:
                self.timer = loop.call_at(deadline, self._close_expired, loop)
                return
            del self.deadlines[transport]
            transport.close()


class NewConnection(asyncio.Protocol):
    """A connection that has sent nothing yet, held as this one small object (and the loop's
    transport). uvicorn's protocol and h11's state, with a timer, were about nineteen objects a
    connection that every full garbage collection walks, pausing every request in flight. They
    are made when the first bytes come.
    Past the server's connection cap (`cap`) the connection waiting longest is closed to let this
    one in. `cap`, `waiting` and `protocol` are set per server by `bounded_protocol`."""

    __slots__ = ("config", "server_state", "app_state", "loop", "transport")
    cap: int  # limits.connections(), read once per server: not a getrlimit call per connection
    waiting: WaitingConnections
    protocol: type[BoundedH11Protocol]
    closing = False  # set when the server stops: a connection accepted after is closed at once

    def __init__(self, config: uvicorn.Config, server_state, app_state: dict,
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.config, self.server_state, self.app_state = config, server_state, app_state
        self.loop = _loop or asyncio.get_event_loop()

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not isinstance(self.loop, UVLoop):  # uvloop turns Nagle's algorithm off on every TCP transport
            # asyncio's does only for sockets whose proto says TCP, and a socket accepted from
            # socket.create_server's says 0: on a kept-alive connection the body then waited for
            # the client's delayed ACK of the head, and a stream's chunks too.
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.closing or (len(self.server_state.connections) >= self.cap and not self.waiting.close_oldest()):
            transport.close()  # the server is stopping, or every connection is serving a request
            return
        self.server_state.connections.add(self)  # counted against the cap; closed by uvicorn's stop
        self.waiting.add(transport, self.loop)

    def data_received(self, data: bytes) -> None:
        self.server_state.connections.discard(self)
        protocol = self.protocol(config=self.config, server_state=self.server_state, app_state=self.app_state,
                                 _loop=self.loop)
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        protocol.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        self.waiting.discard(self.transport)

    def shutdown(self) -> None:
        """uvicorn's stop: nothing is being served here."""
        self.transport.close()


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, under the head deadline of `NewConnection.waiting`: uvicorn
    arms no timer before a request's head, and a client sending its head a byte at a time
    disarms the keep-alive timer with each byte; each held a connection (a descriptor) for as
    long as it liked."""

    waiting: WaitingConnections

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # a request's head came
            self.waiting.discard(self.transport)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # which begins a request pipelined behind it, if one is
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.waiting.add(self.transport, self.loop)

    def connection_lost(self, exc) -> None:
        self.waiting.discard(self.transport)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 could not read (a malformed line or header) refused as OpenAI's JSON error."""
        body = json.dumps(BadRequest(msg).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()


def bounded_protocol(limits: ServerLimits) -> type[NewConnection]:
    """The protocol class of one server (its own limits, its own waiting connections)."""
    waiting = WaitingConnections(limits.head_timeout_s)
    protocol = type("BoundedH11Protocol", (BoundedH11Protocol,), {"waiting": waiting})
    return type("NewConnection", (NewConnection,), {"__slots__": (), "cap": limits.connections(),
                                                    "waiting": waiting, "protocol": protocol})


class RequestBudget:
    """ASGI middleware: past `max_requests` requests in flight, a 503; a body over
    `max_body_bytes`, a 413 (before it is read when its length is stated, or as a chunked one
    grows past it); a body that has not arrived within `body_timeout_s`, a 408. (FastAPI's own
    `max_body_size` answers in plain text, whatever the app's error handlers say.)"""

    def __init__(self, app, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limits.max_requests:
            busy = BadRequest(f"the server has {self.in_flight} requests in flight, its limit; retry later",
                              status=HTTPStatus.SERVICE_UNAVAILABLE)
            return await _error(busy)(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")  # h11 lets only digits through
        if length is not None and int(length) > self.limits.max_body_bytes:  # refused unread, as JSON
            too_long = BadRequest(f"the body is {int(length)} bytes; this server takes at most"
                                  f" {self.limits.max_body_bytes}", status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            return await JSONResponse(too_long.body(), too_long.status, headers={"Connection": "close"})(
                scope, receive, send)
        deadline, body_done, received = time.monotonic() + self.limits.body_timeout_s, False, 0

        async def receive_in_time():
            nonlocal body_done, received
            if body_done:  # what comes after the body: only the client's going away
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise HTTPException(HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive within"
                                    f" {self.limits.body_timeout_s:g} s") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > self.limits.max_body_bytes:
                raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)  # worded by the app's handler
            return message

        self.in_flight += 1
        try:
            await self.app(scope, receive_in_time, send)
        finally:
            self.in_flight -= 1


class ChoiceClock:
    """The streamer of a choice whose client waits for the whole response: it shows nothing
    (so a request it watches can still be served again alone if its batch fails,
    `EndsOnce.started`) and times the choice's output for the metrics."""

    shows_output = False

    def __init__(self) -> None:
        self.clock = RequestClock()

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 2:  # the prompt, [1, prompt_len] (transformers' streamer protocol)
            self.clock.prompt()
        else:
            self.clock.tick()

    def end(self) -> None:
        pass


class TokenEvents(ChoiceClock):
    """A streamer (engine/streaming.py) that hands a choice's committed tokens, and their
    log-probabilities if it asked for them, to the event loop answering its client (`post`
    is thread-safe), which turns them into text (`TextDeltas`): the engine's thread, which
    decodes for the whole batch, only posts them."""

    shows_output = True

    def __init__(self, index: int, post) -> None:
        super().__init__()
        self.index, self.post = index, post
        self.entries: list[dict[int, float]] = []  # those of the tokens the next put brings

    def put_logprobs(self, entries: list[dict[int, float]]) -> None:
        self.entries = entries

    def put(self, value: torch.Tensor) -> None:
        super().put(value)
        if value.dim() == 2:  # the prompt
            return
        self.post(("tokens", self.index, (value.reshape(-1).tolist(), self.entries)))
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

    def rest_so_far(self) -> str:
        """What the client has not got of the text decoded so far, for a choice cut before its end."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special)
        found = [text.find(s) for s in self.stops if s in text]
        return self.rest(text[:min(found)] if found else text)


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


class TokenIdDeltas:
    """vLLM's `return_token_ids` in a stream: a choice's output token ids that no chunk has
    carried go out with its next chunk, and its prompt's ids with its first."""

    def __init__(self, request: ApiRequest, prompt_ids: list[int]) -> None:
        self.on = request.return_token_ids
        self.ids: list[int] = []
        self.prompt_ids: list[int] | None = prompt_ids

    def add(self, ids: list[int]) -> None:
        if self.on:
            self.ids += ids

    def take(self) -> dict:
        """The next chunk's fields ({} unless asked for)."""
        if not self.on:
            return {}
        fields = {"token_ids": self.ids}
        if self.prompt_ids is not None:
            fields["prompt_token_ids"], self.prompt_ids = self.prompt_ids, None
        self.ids = []
        return fields


STOP_MARGIN_S = 0.5  # a stop cuts requests this long before its grace ends, for their last bytes to go


def _stopping() -> BadRequest:
    return BadRequest("the server is stopping: send the request to another replica, or retry later",
                      status=HTTPStatus.SERVICE_UNAVAILABLE)


class CompletionService:
    """What the routes do, over `controller`, served as `model_name`."""

    def __init__(self, controller: AutotuneController, model_name: str, max_metric_classes: int = 100) -> None:
        if controller.engine.tokenizer is None:
            raise ValueError("the server needs the engine's tokenizer (text in, text out)")
        self.controller, self.model_name = controller, model_name
        self.tokenizer = controller.engine.tokenizer
        self.created = int(time.time())
        self.metrics = ServedMetrics(model_name, max_metric_classes)
        self.stopping = False
        self.cut = asyncio.Event()  # set at the end of a stop's grace: requests still running end there

    def stop(self, grace_s: float) -> None:
        """The server begins to stop (on its loop): new requests are refused from now, and those
        still running `grace_s` from now are cut, a stream with a last chunk whose finish_reason
        is "abort" (vLLM's) and `[DONE]`, a whole response with a 503. Cut a little before the
        grace ends, so that each response is sent before uvicorn cancels what is left."""
        self.stopping = True
        asyncio.get_running_loop().call_later(max(0.0, grace_s - STOP_MARGIN_S), self.cut.set)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise BadRequest(f"the model {model!r} does not exist; this server has {self.model_name!r}", "model",
                             HTTPStatus.NOT_FOUND)

    def admit(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[ApiRequest, list[list[int]]]:
        """The request checked with its length settled, and its prompts' token ids, or the
        refusal the controller would give once decoding (so that a streamed request gets its
        400 too). Runs on a worker thread: templating and tokenizing are CPU work."""
        self.check_model(body.model)
        chat = isinstance(body, ChatCompletionRequest)
        request = body.checked(self.tokenizer) if chat else body.checked()
        engine = self.controller.engine
        try:
            ids = [engine.encode(list(p) if isinstance(p, tuple) else p, request.add_special_tokens).tolist()
                   for p in request.prompts]
            max_tokens = request.max_tokens
            if max_tokens is None:  # a chat's default: what the context leaves
                if engine.max_length is None:
                    raise BadRequest("max_tokens is required: the model states no context length", "max_tokens")
                if (max_tokens := engine.max_length - len(ids[0])) < 1:
                    raise BadRequest(f"the prompt ({len(ids[0])} tokens) fills the model's context of"
                                     f" {engine.max_length} tokens", "messages")
            request = dataclasses.replace(request, max_tokens=max_tokens)
            sampling = engine.bad_words_as_ids(SamplingParams(request.temperature, request.top_p, request.seed,
                                                              **request.options))
            for one in ids:
                engine.check_request(len(one), OFF, request.decoded_tokens, sampling)
        except InvalidRequestError as exc:
            raise refused(exc, chat) from None
        return request, ids

    async def serve(self, request: ApiRequest, ids: list[int], seed: int | None, watch: ChoiceClock
                    ) -> ControlledResult:
        """One choice, from its prompt's token ids; `watch`, its streamer, times it."""
        self.metrics.begin(watch.clock)
        try:
            result = await self.controller.agenerate(
                ids, request.request_class, max_new_tokens=request.decoded_tokens, temperature=request.temperature,
                top_p=request.top_p, seed=seed, streamer=watch, **request.options)
        except Exception as exc:  # not its cancelling (a client gone): CancelledError is no Exception
            self.metrics.fail(exc)
            raise
        finally:
            self.metrics.end(watch.clock)
        self.metrics.observe(result, watch.clock)
        return result

    def each_choice(self, request: ApiRequest, ids: list[list[int]], streamer) -> list[asyncio.Task]:
        """A task per choice, at most the controller's `in_flight` of them served at once (a
        body of 20,000 prompts must not put all of them ahead of other clients' requests)."""
        gate = asyncio.Semaphore(self.controller.in_flight)

        async def one(i: int, seed: int | None) -> ControlledResult:
            async with gate:
                return await self.serve(request, ids[i // request.n], seed, streamer(i))

        return [asyncio.ensure_future(one(i, seed)) for i, (_, seed) in enumerate(request.choices())]

    async def complete(self, http: Request, request: ApiRequest, ids: list[list[int]]) -> Response:
        """The whole response, once every choice is served; nothing (and every choice stopped)
        if the client goes away first."""
        tasks = self.each_choice(request, ids, lambda i: ChoiceClock())
        served = asyncio.ensure_future(asyncio.gather(*tasks))
        gone = asyncio.ensure_future(_disconnected(http))
        cut = asyncio.ensure_future(self.cut.wait())
        try:
            await asyncio.wait({served, gone, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            cut.cancel()
            for task in tasks:  # the client left, a choice failed, or the server stops: the others stop too
                task.cancel()
            # its outcome read, so that a gather of cancelled choices is not logged as an error
            served.add_done_callback(lambda gathered: gathered.cancelled() or gathered.exception())
        if not served.done() and self.cut.is_set():
            return _error(BadRequest("the server stopped before this request finished: its grace ran out",
                                     status=HTTPStatus.SERVICE_UNAVAILABLE))
        if not served.done():
            return Response(status_code=499)  # nginx's "client closed request": no one reads it
        results = served.result()
        choices = [response_choice(i, request, prompt, ids[i // request.n], result, self.tokenizer)
                   for i, ((prompt, _), result) in enumerate(zip(request.choices(), results))]
        whole = envelope(request, _request_id(request), self.model_name, int(time.time()), choices)
        if request.chat and request.return_token_ids:
            whole["prompt_token_ids"] = ids[0]
        return JSONResponse({**whole, "usage": usage(results, request)})

    async def stream(self, request: ApiRequest, ids: list[list[int]]) -> AsyncIterator[str]:
        """Server-sent events as OpenAI streams them: a chunk per text delta, each choice's last
        with its finish_reason, the usage if asked for, then `data: [DONE]`. Starlette cancels
        this generator when the client goes away, and the choices stop with it; a stop's grace
        ending (`stop`) ends the choices still running with finish_reason "abort"."""
        rows = request.choices()
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def post(event) -> None:  # from the engine's thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        def reported(i: int, task: asyncio.Task) -> None:  # a choice's end, after the tokens it posted
            if task.cancelled():
                return
            error = task.exception()
            events.put_nowait(("failed", i, error) if error else ("done", i, task.result()))

        async def cut() -> None:
            await self.cut.wait()
            events.put_nowait(("cut", -1, None))

        tasks = self.each_choice(request, ids, lambda i: TokenEvents(i, post))
        for i, task in enumerate(tasks):
            task.add_done_callback(functools.partial(reported, i))
        tasks.append(asyncio.ensure_future(cut()))
        request_id, created = _request_id(request), int(time.time())  # one `created` for every chunk

        def chunk(choices: list[dict]) -> str:
            head = envelope(request, request_id, self.model_name, created, choices, chunk=True)
            if request.chat and "prompt_token_ids" in choices[0]:  # vLLM's chat sends them on the chunk
                head["prompt_token_ids"] = choices[0].pop("prompt_token_ids")
            return _event(head)
        texts = [TextDeltas(self.tokenizer, request.options) for _ in rows]
        logprobs = [LogprobDeltas(request, self.tokenizer) for _ in rows]
        token_ids = [TokenIdDeltas(request, ids[i // request.n]) for i in range(len(rows))]
        results: dict[int, ControlledResult | None] = {}
        try:
            for i, (prompt, _) in enumerate(rows):
                if request.chat or request.echo:  # a chat's turn opens; an echo starts with the prompt
                    text = prompt_text(prompt, self.tokenizer) if request.echo else ""
                    yield chunk([chunk_choice(i, request, text, first=True, token_ids=token_ids[i].take())])
            while len(results) < len(rows):
                kind, i, payload = await events.get()
                if kind == "tokens":
                    tokens, entries = payload
                    logprobs[i].add(tokens, entries)
                    token_ids[i].add(tokens)
                    if delta := texts[i].add(tokens):
                        yield chunk([chunk_choice(i, request, delta, logprobs=logprobs[i].take(),
                                                  token_ids=token_ids[i].take())])
                elif kind == "cut":
                    for i in sorted(set(range(len(rows))) - set(results)):
                        results[i] = None
                        yield chunk([chunk_choice(i, request, texts[i].rest_so_far(), "abort",
                                                  logprobs=logprobs[i].take(), token_ids=token_ids[i].take())])
                elif kind == "done":
                    results[i] = payload
                    last = chunk_choice(i, request, texts[i].rest(payload.text), payload.finish_reason,
                                        logprobs=logprobs[i].take(), token_ids=token_ids[i].take())
                    yield chunk([last])
                else:
                    results[i] = None
                    yield _event(_failure(payload, request.chat).body())
            if request.include_usage and None not in results.values():
                served = [results[i] for i in range(len(rows))]
                head = envelope(request, request_id, self.model_name, created, [], chunk=True)
                yield _event({**head, "usage": usage(served, request)})
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()

    def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt's or a chat's token ids, as the completion endpoints encode them."""
        self.check_model(body.model)
        text = body.text(self.tokenizer)
        try:
            self.controller.engine.check_prompt_text(text)
        except InvalidRequestError as exc:
            raise refused(exc, body.messages is not None) from None
        ids = self.tokenizer(text, add_special_tokens=body.special_tokens)["input_ids"]
        return {"count": len(ids), "max_model_len": self.controller.engine.max_length, "tokens": ids,
                "token_strs": self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    def policy(self, offset: int, limit: int) -> dict:
        """What the controller has learned so far, per class and load, as `autotune inspect
        --json` shows it from the store (saved and flushed first, so it is up to date)."""
        controller = self.controller
        if controller.store is None:
            raise BadRequest("this server keeps no store, so it has no learned policy to show",
                             status=HTTPStatus.NOT_FOUND)
        try:
            controller.save()
        except StoreError as exc:  # what the database refused: told, and the table still shown
            logger.warning("%s", exc)
        policy = controller.policy.name
        return {"policy": policy, "offset": offset, "limit": limit,
                "classes": policy_table(controller.store, policy, offset, limit)}


def _request_id(request: ApiRequest) -> str:
    return f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _failure(exc: Exception, chat: bool) -> BadRequest:
    if isinstance(exc, InvalidRequestError):
        return refused(exc, chat)
    return BadRequest(f"{type(exc).__name__}: {exc}", status=HTTPStatus.INTERNAL_SERVER_ERROR)


async def _disconnected(http: Request) -> None:
    """Returns when the client goes away (after its body, uvicorn's next message is that)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _error(refusal: BadRequest) -> JSONResponse:
    return JSONResponse(refusal.body(), refusal.status)


_REFUSAL = {"description": "Refused: OpenAI's error body, naming the problem and the field",
            "content": {"application/json": {"schema": {"type": "object", "properties": {"error": {
                "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                 "param": {"type": ["string", "null"]},
                                                 "code": {"type": "integer"}}}}}}}}


# A generating route's 200: JSON, or with `stream` server-sent events, each a chunk's JSON or [DONE]
_STREAMED = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}}}


def _refusal(why: str) -> dict:
    return {**_REFUSAL, "description": why}


# What routes refuse besides a body's validation, by the route's method and path
_MODEL_UNKNOWN = _refusal("Not found: the body's `model` is not this server's")
_OTHER_REFUSALS = {
    ("post", ""): {"404": _MODEL_UNKNOWN, "413": _refusal("The body is larger than the server takes"),
                   "503": _refusal("The server is stopping, or has as many requests in flight as it takes")},
    ("get", "/v1/models/{model_id}"): {"404": _refusal("Not found: no model by that id")},
    ("get", "/v1/autotune/policy"): {"404": _refusal("Not found: the server keeps no store")},
}


def _openapi_with_refusals(app: FastAPI, vocab_size: int) -> dict:
    """FastAPI's schema with what the server sends documented: its 422 validation responses as
    a 400 in OpenAI's error body (`BadRequest`), every other refusal a route can send, and the
    token ids it takes bounded by the vocabulary, so that schema-driven clients are not misled."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path, operations in schema["paths"].items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = _REFUSAL
                for key in ((method, ""), (method, path)):
                    responses.update(_OTHER_REFUSALS.get(key, {}))
        components = schema.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        if "DetokenizeRequest" in components:
            components["DetokenizeRequest"]["properties"]["tokens"]["items"] = {
                "type": "integer", "minimum": 0, "maximum": vocab_size - 1}
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(controller: AutotuneController, model_name: str = "spec-autotune", api_key: str | None = None,
               max_metric_classes: int = 100, limits: ServerLimits = ServerLimits(),
               allowed_origins: tuple[str, ...] = ("*",)) -> FastAPI:
    """The FastAPI application over `controller`. `api_key` (vLLM's --api-key): every route but
    /health then needs `Authorization: Bearer <key>`, compared in constant time (tokenizing and
    the metrics cost the server too). CORS for `allowed_origins` (vLLM's default: any)."""
    service = CompletionService(controller, model_name, max_metric_classes)

    def authorized(http: Request) -> None:
        # As bytes: compare_digest refuses str with non-ASCII characters
        sent = http.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        if api_key is not None and http.url.path != "/health" and not hmac.compare_digest(
                sent, f"Bearer {api_key}".encode()):
            raise BadRequest("a valid API key is required: send `Authorization: Bearer <key>`",
                             status=HTTPStatus.UNAUTHORIZED)

    # strict_content_type off: a body sent without a Content-Type (curl -d, raw sockets) is read as
    # JSON, as before; CORS (any origin by default) already lets any page post to it.
    app = FastAPI(title="spec-autotune", dependencies=[Depends(authorized)], strict_content_type=False,
                  docs_url=None, redoc_url=None)
    app.state.service = service
    app.openapi = functools.partial(_openapi_with_refusals, app, controller.engine.vocab_size)
    app.add_middleware(RequestBudget, limits=limits)
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                       allow_headers=["*"])

    @app.exception_handler(BadRequest)
    async def bad_request(http: Request, exc: BadRequest) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(http: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(BadRequest.from_validation(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def http_error(http: Request, exc: HTTPException) -> JSONResponse:
        message = {404: f"no route {http.method} {http.url.path}",
                   413: f"the body grew past the limit: this server takes at most {limits.max_body_bytes} bytes"}
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            message[400] = "the body is not JSON text in UTF-8"  # FastAPI's words for bytes it cannot decode
        return JSONResponse(BadRequest(message.get(exc.status_code, str(exc.detail)),
                                       status=HTTPStatus(exc.status_code)).body(), exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def refused_by_engine(http: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error(refused(exc, chat=http.url.path.endswith("/chat/completions")))

    @app.exception_handler(Exception)
    async def failed(http: Request, exc: Exception) -> JSONResponse:  # the client gets an answer whatever failed
        return _error(_failure(exc, chat=False))

    async def generate(http: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        request, ids = await run_in_threadpool(service.admit, body)
        if request.stream:
            return StreamingResponse(service.stream(request, ids), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await service.complete(http, request, ids)

    @app.post("/v1/completions", responses=_STREAMED)
    async def completions(http: Request, body: CompletionRequest) -> Response:
        return await generate(http, body)

    @app.post("/v1/chat/completions", responses=_STREAMED)
    async def chat_completions(http: Request, body: ChatCompletionRequest) -> Response:
        return await generate(http, body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        return await run_in_threadpool(service.tokenize, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        service.check_model(body.model)
        vocab = controller.engine.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise BadRequest(f"token ids out of the vocabulary (0..{vocab - 1}): {bad[:5]}", "tokens")
        return {"prompt": service.tokenizer.decode(body.tokens)}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": service.created, "owned_by": "spec-autotune",
                "max_model_len": controller.engine.max_length}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        """One model, as the OpenAI SDK's `models.retrieve(id)` asks; an id this server lacks is a 404."""
        service.check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    # Prometheus' text format, so documented: schema-driven clients would otherwise expect JSON
    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/autotune/policy")
    async def policy(offset: int = Query(0, ge=0), limit: int = Query(POLICY_PAGE, ge=1, le=POLICY_PAGE)) -> dict:
        """A page of `limit` rows (at most POLICY_PAGE, the default) from `offset`."""
        return await run_in_threadpool(service.policy, offset, limit)

    return app


class _StoppingServer(uvicorn.Server):
    """uvicorn's server, whose stop also closes connections accepted while it stops: under a flood
    of connections, some accepted in the same batch as the stop were made after uvicorn had told
    the open ones to close, and it waited out its whole grace for them."""

    on_stop: Callable[[float], None] | None = None  # told the grace as the stop begins (`CompletionService.stop`)

    async def shutdown(self, sockets=None) -> None:
        self.config.http_protocol_class.closing = True
        if self.on_stop is not None:
            self.on_stop(self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets)


class CompletionServer:
    """`create_app`'s application served by uvicorn at `address` (port 0: any free one, then
    `server_port`), within `limits`. `serve_forever()` in the main thread stops on SIGINT or
    SIGTERM (requests in flight get `limits.graceful_shutdown_s`); `start()` serves from a
    thread of its own until `shutdown()`. While it serves, the controller's batches are served
    by one worker started at the serving thread's priority and the event loop runs `loop_nice`
    steps below it (`run_below_the_engine`; 0: level with it; a controller without batches,
    `max_batch` 1, decodes on the loop's threads, and its loop stays level)."""

    def __init__(self, controller: AutotuneController, address: tuple[str, int] = ("127.0.0.1", 8000),
                 model_name: str = "spec-autotune", verbose: bool = False, api_key: str | None = None,
                 max_metric_classes: int = 100, limits: ServerLimits = ServerLimits(),
                 allowed_origins: tuple[str, ...] = ("*",), loop_nice: int = 19) -> None:
        if not 0 <= loop_nice <= 19:
            raise ValueError(f"loop_nice must be 0-19 (a nice increment), got {loop_nice}")
        self.app = create_app(controller, model_name, api_key, max_metric_classes, limits, allowed_origins)
        self.loop_nice = loop_nice
        # None with max_batch 1 (no coalescer): requests then decode on threads the loop starts,
        # which would drop with it, so the loop stays level
        self.engine_worker: Coalescer | None = getattr(controller, "coalescer", None)
        self.socket = socket.create_server(address, backlog=2048)  # uvicorn's backlog; socketserver's 5 reset clients
        self.server_port = self.socket.getsockname()[1]
        # uvicorn's loop "auto": uvloop's (a dependency but on Windows), which accepts and times connections in C
        config = uvicorn.Config(self.app, http=bounded_protocol(limits), timeout_keep_alive=int(limits.keep_alive_s),
                                timeout_graceful_shutdown=limits.graceful_shutdown_s,
                                log_level="info" if verbose else "warning", access_log=verbose)
        self.uvicorn = _StoppingServer(config)
        self.uvicorn.on_stop = self.app.state.service.stop
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        if self.engine_worker is not None:
            self.engine_worker.keep_worker()  # started here, before this thread's priority drops
            run_below_the_engine(self.loop_nice)
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            if self.engine_worker is not None:
                self.engine_worker.release_worker()

    def start(self) -> CompletionServer:
        self._thread = threading.Thread(target=self.serve_forever, name="uvicorn", daemon=True)
        self._thread.start()
        while not self.uvicorn.started and self._thread.is_alive():
            time.sleep(0.01)
        return self

    def shutdown(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self.socket.close()
