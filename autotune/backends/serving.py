"""`autotune serve --backend ...`: the OpenAI-compatible server (autotune/serve/server.py) in front of a
BackendController, as it is in front of AutotuneController.

The server asks its controller for an `engine` (the tokenizer, request checks) and for
`agenerate`, whose result it turns into a response and /metrics. Here both come from the
backend controller: prompts are tokenized here and sent as token ids; a request the backend
cannot honour (stop strings, penalties, logprobs, ...: only temperature, top-p, seed and
max_tokens reach the engine) is refused by name; a streamed request gets its tokens as the
backend streams them (llama.cpp always; a routing backend's replicas where they send token ids).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

import torch

from autotune.backends.controller import BackendController, BackendResult
from autotune.control.controller import ControlledResult
from engine import Arm, GenerationMetrics, InvalidRequestError, SamplingParams

DEFAULTS = SamplingParams()
PROMPT_CHARS_PER_TOKEN = 64  # a text longer than this times the context is refused before tokenizing


class BackendRequests:
    """The request checks and tokenizing the server expects of an engine, for a backend served
    through a tokenizer of its model and a context of `max_length` tokens."""

    def __init__(self, tokenizer, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.vocab_size = len(tokenizer)

    def check_prompt_text(self, text: str) -> None:
        if len(text) > PROMPT_CHARS_PER_TOKEN * self.max_length:
            raise InvalidRequestError(f"the prompt is {len(text)} characters, far more than the model's context of"
                                      f" {self.max_length} tokens holds")

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> torch.Tensor:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequestError(f"the prompt is not valid Unicode text ({exc.reason} at character"
                                          f" {exc.start})") from None
            self.check_prompt_text(prompt)
            ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"] if prompt else []
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if bad := [t for t in ids if not 0 <= t < self.vocab_size]:
            raise InvalidRequestError(f"prompt token ids out of the vocabulary (size {self.vocab_size}): {bad[:5]}")
        return torch.tensor(ids)

    def bad_words_as_ids(self, sampling: SamplingParams) -> SamplingParams:
        return sampling  # refused in check_request, with the other options a backend does not take

    def check_request(self, prompt_len: int, arm: Arm, max_new_tokens: int,
                      sampling: SamplingParams | None = None) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if prompt_len + max_new_tokens > self.max_length:
            raise InvalidRequestError(f"the prompt ({prompt_len} tokens) and max_tokens ({max_new_tokens}) pass the"
                                      f" model's context of {self.max_length} tokens")
        if sampling is not None and (unsupported := unsupported_options(sampling)):
            raise InvalidRequestError(f"{', '.join(unsupported)}: not supported when serving on a backend (it is"
                                      " sent temperature, top_p, seed and max_tokens only)")


def unsupported_options(sampling: SamplingParams) -> list[str]:
    """The options of `sampling` set away from their defaults, other than the three a backend takes."""
    taken = {"temperature", "top_p", "seed"}
    return [name for name in sampling.__dataclass_fields__
            if name not in taken and getattr(sampling, name) != getattr(DEFAULTS, name)]


class ServedBackend:
    """What the server needs of a controller, over `controller` (a BackendController); the
    store and policy are the controller's."""

    def __init__(self, controller: BackendController, max_length: int, in_flight: int = 8) -> None:
        if controller.tokenizer is None:
            raise ValueError("serving a backend needs its model's tokenizer (BackendController(tokenizer=...))")
        self.controller = controller
        self.engine = BackendRequests(controller.tokenizer, max_length)
        self.store, self.policy = controller.store, controller.policy
        self.in_flight = in_flight
        self._threads = ThreadPoolExecutor(in_flight, thread_name_prefix="autotune-backend")

    async def agenerate(self, prompt: list[int], request_class: str | None = None, max_new_tokens: int = 64,
                        temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, streamer=None,
                        **options) -> ControlledResult:
        """`options` were checked when the server admitted the request (`check_request`): none is set."""

        def on_tokens(tokens: list[int]) -> None:  # on the controller's thread, as the engine's streamers are
            streamer.put(torch.tensor(tokens))

        call = functools.partial(self.controller.generate, prompt, request_class, max_new_tokens, temperature,
                                 top_p, seed, on_tokens if streamer is not None else None)
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._threads, call)
        finally:
            if streamer is not None:
                streamer.end()
        return controlled(result)

    def save(self) -> None:
        self.controller.save()

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self.controller.close()


def controlled(result: BackendResult) -> ControlledResult:
    """A backend's result in the form the server reports (usage, /metrics)."""
    r = result.response
    metrics = GenerationMetrics(prompt_tokens=r.prompt_tokens, new_tokens=r.new_tokens, drafted=r.drafted or 0,
                                accepted=r.accepted or 0, prefill_s=r.prefill_s, total_s=r.total_s,
                                rounds=max(r.new_tokens - 1 - (r.accepted or 0), 0))
    metrics.draft_rounds = metrics.rounds if r.drafted else 0  # a backend drafts every round it can
    finish = "length" if r.finish_reason == "length" else "stop"
    return ControlledResult(result.text, result.tokens, result.request_class, result.arm, metrics,
                            r.decode_rate or 0.0, result.reward if result.reward is not None else 0.0,
                            result.decision_s, 0.0, result.load, None, None, result.fell_back,
                            queue_s=result.decision_s, finish_reason=finish)
