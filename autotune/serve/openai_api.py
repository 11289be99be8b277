"""OpenAI's completion and chat completion bodies as pydantic models, checked into requests for
the controller, and its results written back in OpenAI's shapes. No HTTP here (that is server.py).

Fields, both endpoints: `max_tokens`, `temperature` (default 1), `top_p`, `n`, `stop`, `seed`,
`presence_penalty`, `frequency_penalty`, `logit_bias`, `stream`,
`stream_options.include_usage`, `user`, `model`; vLLM's extra sampling fields (`top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `allowed_token_ids`, `bad_words`); and
this project's `request_class`. Completions: `prompt` (text, token ids or a list of either),
`logprobs` N, `echo`, `max_tokens` 16 by default (OpenAI's; 0 with `echo` and `logprobs` scores
the prompt alone, as evaluation harnesses ask for log-likelihoods). Chat: `messages` through the
tokenizer's chat template, `logprobs` true with `top_logprobs` N, `max_completion_tokens`,
and by default as many tokens as the context leaves (vLLM's). With a `seed`, choice j of a
prompt draws from `seed + j`, so choice 0 is the output the request gets with `n` = 1. A
stream carries logprobs too, each chunk those of the tokens behind its text (not the prompt's
with echo). Other fields are ignored with a debug log, as vLLM does; every refusal names the
field (`BadRequest.from_validation`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from autotune.control.controller import ControlledResult
from engine.sampling import SEED_RANGE

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's, for completions
MAX_LOGPROBS = 20  # OpenAI's
MAX_N = 128  # OpenAI's bound on choices per prompt
VLLM_FIELDS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
               "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "bad_words")


class BadRequest(Exception):
    """A request refused: HTTP `status`, OpenAI's error body naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.param, self.status = param, status

    @classmethod
    def from_validation(cls, errors: list[dict]) -> BadRequest:
        """The first of pydantic's errors (`ValidationError.errors()`, or FastAPI's, whose
        locations start with "body") as a refusal naming its field: "n: Input should be less
        than or equal to 128, got 300"."""
        error = errors[0]
        loc = [str(part) for part in error["loc"] if part != "body"]
        if error["type"] == "json_invalid":
            return cls(f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}")
        if not loc and error["type"] in ("model_type", "model_attributes_type", "dict_type"):
            if isinstance(error.get("input"), bytes):  # sent as another type (curl -d: a form), so not parsed
                return cls("the body must be a JSON object, sent with `Content-Type: application/json`")
            return cls("the body must be a JSON object")
        where = ".".join(loc)
        if error["type"] == "missing" and not loc:  # a POST with no body at all
            return cls("the body is required: a JSON object")
        if error["type"] == "missing":
            return cls(f"{where} is required", loc[0])
        if error["type"] == "value_error":  # this module's own words, which begin with the field they refuse
            message = error["msg"].removeprefix("Value error, ")
            first = message.split(" ", 1)[0]
            return cls(message, loc[0] if loc else first if first in _FIELDS else None)
        shown = repr(error.get("input"))  # pydantic's words: say which field and what it got
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return cls(f"{where}: {error['msg']}, got {shown}", loc[0])

    def body(self) -> dict:
        kind = ("authentication_error" if self.status == HTTPStatus.UNAUTHORIZED else "invalid_request_error"
                if self.status < 500 else "internal_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": int(self.status)}}


def refused(exc: Exception, chat: bool) -> BadRequest:
    """An engine-side refusal as a 400 naming the request field it is about: the engine's
    messages begin with the field they refuse ("top_k must be ...", "min_tokens (3) exceeds
    ..."), in the library's spelling, which the API's replaces (max_new_tokens: max_tokens; a
    prompt: a chat's messages)."""
    found = re.match(r"(?:the )?([a-z_]+)", str(exc))
    word = found.group(1) if found else ""
    param = {"max_new_tokens": "max_tokens", "prompt": "messages" if chat else "prompt"}.get(word, word)
    return BadRequest(str(exc), param if param in _FIELDS else None)


@dataclass(frozen=True)
class ApiRequest:
    """A checked body. `max_tokens` None: as many as the context leaves; 0: the prompt scored,
    nothing generated (completions with echo). `logprobs`: how many of
    the likeliest tokens to show per token (None: no logprobs). `add_special_tokens`: whether
    a text prompt gets the tokenizer's (a BOS; vLLM's: yes for completions, no for a chat,
    whose template writes them). `return_token_ids` (vLLM's): the prompt's and the output's token
    ids go with the text. `options`: the controller's other keyword arguments."""

    prompts: tuple[str | tuple[int, ...], ...]
    chat: bool = False
    n: int = 1
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True
    request_class: str | None = None
    return_token_ids: bool = False
    options: dict = field(default_factory=dict)

    @property
    def decoded_tokens(self) -> int | None:
        """What the controller decodes: scoring a prompt decodes one token, which is dropped."""
        return None if self.max_tokens is None else max(self.max_tokens, 1)

    def choices(self) -> list[tuple[str | tuple[int, ...], int | None]]:
        """(prompt, seed) per choice, in the response's order."""
        return [(prompt, None if self.seed is None else self.seed + j)
                for prompt in self.prompts for j in range(self.n)]


# Fields asking for what this server does not serve (tool calls, structured output): ignored, the
# answer would not be what was asked, so they are refused unless their value asks for nothing.
UNSERVED = {
    "tools": lambda v: not v, "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"), "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
                    lambda v: v is None),
}


class _Strict(BaseModel):
    """Typed strictly (no "3" for 3, no true for 1); other fields kept aside (`model_extra`)."""

    model_config = ConfigDict(extra="allow", strict=True)


def _integral(value: Any) -> Any:
    """`value` with every float that has no fraction made an int, in lists and objects too."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


class OpenAIBody(_Strict):
    """A body's known fields; other fields are ignored with a debug log, as vLLM does: clients
    send their own (the OpenAI SDK's `store`, `metadata`; vLLM's `priority`, `chat_template_kwargs`)."""

    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, body: Any) -> Any:
        """3.0 is 3, an integer as JSON Schema counts it; the whole body at once, nested parts
        (messages, stream options) included, so that they are not walked again."""
        return _integral(body)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unserved(cls, body: Any) -> Any:
        if isinstance(body, dict):
            for name, asks_nothing in UNSERVED.items():
                if name in body and not asks_nothing(body[name]):
                    raise ValueError(f"{name} is not served: this server makes no tool calls and no structured"
                                     " output (a logits_processor does grammars through the library)")
        return body

    @model_validator(mode="after")
    def _log_ignored(self) -> OpenAIBody:
        if ignored := sorted(set(self.model_extra or ()) - set(UNSERVED)):
            logger.debug("ignored field(s) %s; this endpoint takes %s", ignored, sorted(type(self).model_fields))
        return self

    @classmethod
    def parse(cls, body: Any):
        """`body` checked, or the BadRequest naming the field refused."""
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise BadRequest.from_validation(exc.errors()) from None


TokenId = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]  # a stop string or a bad word: never empty


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingBody(OpenAIBody):
    """The fields both generating endpoints share."""

    # Bounds as the engine's `SamplingParams` checks them, so that the schema states them
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_class: str | None = None
    add_special_tokens: bool | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    bad_words: Text | list[Text] | None = None
    return_token_ids: bool = False  # the prompt's and the output's token ids beside the text

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and not all(key.lstrip("-").isdigit() for key in value):
            raise ValueError("logit_bias must map token ids to numbers")
        return value

    @model_validator(mode="after")
    def _seed_per_choice(self) -> SamplingBody:
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1] - (self.n - 1):
            raise ValueError(f"seed must be a 64-bit signed int (choice j draws from seed + j), got {self.seed}"
                             f" with n={self.n}")
        return self

    def request(self, prompts: tuple, max_tokens: int | None, logprobs: int | None, chat: bool,
                echo: bool = False) -> ApiRequest:
        """The checked request: what pydantic cannot check field by field, and the controller's
        keyword arguments."""
        if max_tokens == 0 and (not echo or self.stream):  # a chat's is at least 1 (its fields' bounds)
            raise BadRequest("max_tokens 0 scores a prompt: a completion with echo, not streamed", "max_tokens")
        if self.stream and echo and logprobs is not None:
            raise BadRequest("the prompt's logprobs (echo with logprobs) are not streamed: ask for them without"
                             " stream", "logprobs")
        stop = self.stop or ()
        options = {"stop": (stop,) if isinstance(stop, str) else tuple(stop),
                   "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                   "logit_bias": {int(token): bias for token, bias in (self.logit_bias or {}).items()}}
        if logprobs is not None:
            options["logprobs"] = logprobs
            if echo:
                options["prompt_logprobs"] = logprobs
        options |= {name: getattr(self, name) for name in VLLM_FIELDS if getattr(self, name) is not None}
        return ApiRequest(
            prompts=prompts, chat=chat, n=self.n, max_tokens=max_tokens, temperature=self.temperature,
            top_p=self.top_p, seed=self.seed, stream=self.stream,
            include_usage=self.stream_options is not None and self.stream_options.include_usage, echo=echo,
            logprobs=logprobs, add_special_tokens=not chat if self.add_special_tokens is None
            else self.add_special_tokens, request_class=self.request_class,
            return_token_ids=self.return_token_ids, options=options,
        )


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four prompt forms: text, token ids, a list of texts, a list of token id lists."""
    def ids(items) -> tuple[int, ...]:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise ValueError("prompt must be a string, a list of token ids, or a list of either")
        return tuple(items)

    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise ValueError("prompt is required: a string, a list of token ids, or a non-empty list of either")
    if all(isinstance(p, str) for p in value):
        return tuple(value)
    if all(isinstance(p, list) for p in value):
        return tuple(ids(p) for p in value)
    return (ids(value),)


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_TEXT = {"type": "string", "minLength": 1}  # the engine refuses an empty prompt


class CompletionRequest(SamplingBody):
    """A /v1/completions body."""

    # what `_served_forms` and `request` check, in the schema
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
         "then": {"properties": {"echo": {"const": True}, "stream": {"const": False}}, "required": ["echo"]}},
        {"if": {"properties": {"best_of": {"const": 1}}, "required": ["best_of"]},
         "then": {"properties": {"n": {"const": 1}}}}]})

    prompt: Any = Field(json_schema_extra={"anyOf": [  # what `_prompts` takes, for the schema
        _TEXT, {"type": "array", "items": _TEXT, "minItems": 1}, _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]})
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # not served but as the 1 LangChain sends (with n 1), nor is suffix (`_served_forms`)
    best_of: int | None = Field(None, json_schema_extra={"anyOf": [{"type": "null"}, {"const": 1}]})
    suffix: str | None = Field(None, json_schema_extra={"anyOf": [{"type": "null"}]})

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_forms(cls, value: Any) -> tuple:
        if value is None:
            raise ValueError("prompt is required")
        return _prompts(value)

    @model_validator(mode="after")
    def _served_forms(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix is not supported (no fill-in-the-middle)")
        if self.best_of is not None and (self.best_of, self.n) != (1, 1):
            raise ValueError(f"best_of is not supported (as in vLLM V1) but as 1 with n 1, got {self.best_of}"
                             f" with n={self.n}")
        return self

    def checked(self) -> ApiRequest:
        return self.request(self.prompt, self.max_tokens, self.logprobs, chat=False, echo=self.echo)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A chat turn with text content: a string, OpenAI's list of text parts (joined), or null
    (an assistant turn that made a tool call, in an agent's history: empty)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's roles
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatTemplated(OpenAIBody):
    """Messages that become one prompt through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True

    def prompt(self, tokenizer) -> str:
        """The messages through the tokenizer's chat template, the assistant's turn opened
        unless `add_generation_prompt` is false."""
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template: send a prompt to /v1/completions",
                             "messages")
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=self.add_generation_prompt,
                                                 tokenize=False)
        except Exception as exc:  # the template's own check (e.g. roles that must alternate)
            raise BadRequest(f"the chat template refused these messages: {exc}", "messages") from None


class ChatCompletionRequest(ChatTemplated, SamplingBody):
    """A /v1/chat/completions body: by default as many tokens as the context leaves (vLLM's)."""

    # `_top_needs_logprobs` in the schema
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}})

    max_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def checked(self, tokenizer) -> ApiRequest:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.request((self.prompt(tokenizer),), max_tokens, logprobs, chat=True)


class TokenizeRequest(OpenAIBody):
    """vLLM's /tokenize body: a `prompt`, or `messages` through the chat template; the
    tokenizer's special tokens added by default as the completion endpoints add them."""

    # one of the two (`_one_of`), in the schema
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
        {"properties": {"messages": {"type": "array"}}, "required": ["messages"]}]})

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either a prompt or messages")
        return self

    def text(self, tokenizer) -> str:
        if self.messages is None:
            return self.prompt
        return ChatTemplated(messages=self.messages, add_generation_prompt=self.add_generation_prompt).prompt(tokenizer)

    @property
    def special_tokens(self) -> bool:
        return self.messages is None if self.add_special_tokens is None else self.add_special_tokens


class DetokenizeRequest(OpenAIBody):
    """vLLM's /detokenize body: token ids."""

    tokens: list[int]


def envelope(request: ApiRequest, request_id: str, model: str, created: int, choices: list[dict],
             chunk: bool = False) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if request.chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}


def response_choice(index: int, request: ApiRequest, prompt, prompt_ids: list[int], result: ControlledResult,
                    tokenizer) -> dict:
    """One choice of a whole response, with the controller's account of it under `autotune`."""
    m = result.metrics
    own = {"request_class": result.request_class, "arm": str(result.arm), "acceptance": m.acceptance,
           "mean_accepted_length": m.mean_accepted_length, "reward": result.reward, "load": result.load,
           "fell_back": result.fell_back}
    if request.chat:
        logprobs = None if request.logprobs is None else _chat_logprobs(tokenizer, result.tokens, result.logprobs,
                                                                        request.logprobs)
        ids = {"token_ids": result.tokens} if request.return_token_ids else {}  # the prompt's: the response's
        return {"index": index, "message": {"role": "assistant", "content": result.text}, "logprobs": logprobs,
                "finish_reason": result.finish_reason, **ids, "autotune": own}
    text, ids, entries = result.text, result.tokens, result.logprobs
    finish_reason = result.finish_reason
    if request.max_tokens == 0:  # the prompt scored: the token decoded with it is not part of the answer
        text, ids, entries, finish_reason = "", [], [], "length"
    if request.echo:
        text = prompt_text(prompt, tokenizer) + text
        ids, entries = prompt_ids + ids, (result.prompt_logprobs or []) + (entries or [])
    logprobs = None if request.logprobs is None else _completion_logprobs(tokenizer, ids, entries)
    returned = {"prompt_token_ids": prompt_ids, "token_ids": ids} if request.return_token_ids else {}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, **returned,
            "autotune": own}


def chunk_choice(index: int, request: ApiRequest, text: str, finish_reason: str | None = None,
                 first: bool = False, logprobs: dict | None = None, token_ids: dict | None = None) -> dict:
    """One choice of a streamed chunk: a text delta (a chat's first opens the assistant's turn),
    with the `logprobs` of the tokens behind it (`chunk_logprobs`) and their `token_ids` fields
    (vLLM's `return_token_ids`)."""
    if not request.chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                **(token_ids or {})}
    delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            **(token_ids or {})}


def chunk_logprobs(request: ApiRequest, tokenizer, ids: list[int], entries: list[dict[int, float]],
                   text_offset: int) -> dict:
    """A streamed chunk's logprobs for its tokens `ids`, in the response's own shape, so the
    chunks' objects, joined, are the whole response's (completions: `text_offset` counts on from
    the tokens streamed before)."""
    if request.chat:
        return _chat_logprobs(tokenizer, ids, entries, request.logprobs)
    return _completion_logprobs(tokenizer, ids, entries, text_offset)


def prompt_text(prompt, tokenizer) -> str:
    return tokenizer.decode(list(prompt)) if isinstance(prompt, tuple) else prompt


def usage(results: list[ControlledResult], request: ApiRequest) -> dict:
    prompt_tokens = sum(r.metrics.prompt_tokens for r in results[::request.n])  # each prompt once
    completion_tokens = 0 if request.max_tokens == 0 else sum(len(r.tokens) for r in results)
    cached = sum(r.metrics.cached_prompt_tokens for r in results[::request.n])  # OpenAI's: kept prefixes
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _completion_logprobs(tokenizer, ids: list[int], entries: list[dict[int, float] | None], offset: int = 0) -> dict:
    """The legacy object: each token's text, log-probability (None for the first prompt token),
    the likeliest tokens' and its offset in the text (the first's: `offset`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(ids, entries):
        text = tokenizer.decode([token])
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry[token])
        out["top_logprobs"].append(None if entry is None else {tokenizer.decode([t]): lp for t, lp in entry.items()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_logprobs(tokenizer, ids: list[int], entries: list[dict[int, float]], top: int) -> dict:
    """The chat object: per token its text, bytes, log-probability and the `top` likeliest."""
    def token(t: int, logprob: float) -> dict:
        text = tokenizer.decode([t])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**token(t, entry[t]), "top_logprobs": [token(u, lp) for u, lp in
                                                               sorted(entry.items(), key=lambda kv: -kv[1])[:top]]}
                        for t, entry in zip(ids, entries)]}


_FIELDS = {*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields, *UNSERVED}
