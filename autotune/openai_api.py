"""OpenAI's completion and chat completion bodies: checked into requests for the controller,
and its results written back in OpenAI's shapes. No HTTP here (that is server.py).

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
with echo). Every refusal names the field.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from http import HTTPStatus

from autotune.controller import ControlledResult
from engine.sampling import SEED_RANGE

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's, for completions
MAX_LOGPROBS = 20  # OpenAI's
MAX_N = 128  # OpenAI's bound on choices per prompt
VLLM_FIELDS = {"top_k": int, "min_p": (int, float), "repetition_penalty": (int, float), "min_tokens": int,
               "ignore_eos": bool, "stop_token_ids": list, "include_stop_str_in_output": bool,
               "skip_special_tokens": bool, "allowed_token_ids": list, "bad_words": (str, list)}
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                 "frequency_penalty", "logit_bias", "stream", "stream_options", "user", "request_class", *VLLM_FIELDS)
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt", "logprobs", "echo", "best_of", "suffix", "add_special_tokens")
CHAT_FIELDS = (*COMMON_FIELDS, "messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_special_tokens",
               "add_generation_prompt")
TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs")


class BadRequest(Exception):
    """A request refused: HTTP `status`, OpenAI's error body naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.param, self.status = param, status

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
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    return BadRequest(str(exc), param if param in known else None)


@dataclass(frozen=True)
class ApiRequest:
    """A checked body. `max_tokens` None: as many as the context leaves; 0: the prompt scored,
    nothing generated (completions with echo). `logprobs`: how many of
    the likeliest tokens to show per token (None: no logprobs). `add_special_tokens`: whether
    a text prompt gets the tokenizer's (a BOS; vLLM's: yes for completions, no for a chat,
    whose template writes them). `options`: the controller's other keyword arguments."""

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
    options: dict = field(default_factory=dict)

    @property
    def decoded_tokens(self) -> int | None:
        """What the controller decodes: scoring a prompt decodes one token, which is dropped."""
        return None if self.max_tokens is None else max(self.max_tokens, 1)

    def choices(self) -> list[tuple[str | tuple[int, ...], int | None]]:
        """(prompt, seed) per choice, in the response's order."""
        return [(prompt, None if self.seed is None else self.seed + j)
                for prompt in self.prompts for j in range(self.n)]


def _kinds(kinds) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _get(body: dict, name: str, kinds, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _kinds(kinds)):
        names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
                 dict: "an object"}
        raise BadRequest(f"{name} must be {' or '.join(names[k] for k in _kinds(kinds))}, got {value!r}", name)
    return value


# Fields asking for what this server does not serve (tool calls, structured output): ignored, the
# answer would not be what was asked, so they are refused unless their value asks for nothing.
UNSERVED = {
    "tools": lambda v: not v, "functions": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none"), "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
                    lambda v: v is None),
}


def _check_fields(body, known: tuple[str, ...]) -> None:
    """Other fields are ignored with a debug log, as vLLM does: clients send their own (the OpenAI
    SDK's `store`, `metadata`; vLLM's `priority`, `chat_template_kwargs`)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for name, asks_nothing in UNSERVED.items():
        if name in body and not asks_nothing(body[name]):
            raise BadRequest(f"{name} is not served: this server makes no tool calls and no structured output"
                             " (a logits_processor does grammars through the library)", name)
    if ignored := sorted(set(body) - set(known) - set(UNSERVED)):
        logger.debug("ignored field(s) %s; this endpoint takes %s", ignored, sorted(known))


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


def _messages(value) -> list[dict]:
    """Chat messages with text content (a string, or OpenAI's list of text parts, joined)."""
    if not isinstance(value, list) or not value:
        raise BadRequest("messages is required: a non-empty list of {role, content}", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        content = message.get("content")
        if content is None:  # an assistant turn that made a tool call, in an agent's history
            content = ""
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({"role": message["role"], "content": content})
    return out


def _common(body: dict, prompts: tuple, max_tokens: int | None, logprobs: int | None, chat: bool,
            echo: bool = False) -> ApiRequest:
    """The fields both endpoints share, checked."""
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be in 1..{MAX_N}, got {n}", "n")
    seed = _get(body, "seed", int)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1] - (n - 1):
        raise BadRequest(f"seed must be a 64-bit signed int (choice j draws from seed + j), got {seed} with n={n}",
                         "seed")
    stream = _get(body, "stream", bool, False)
    if max_tokens == 0 and (not echo or stream or chat):
        raise BadRequest("max_tokens 0 scores a prompt: a completion with echo, not streamed", "max_tokens")
    if max_tokens is not None and max_tokens < 0:
        raise BadRequest(f"max_tokens must be >= 0, got {max_tokens}", "max_tokens")
    if stream and echo and logprobs is not None:
        raise BadRequest("the prompt's logprobs (echo with logprobs) are not streamed: ask for them without stream",
                         "logprobs")
    stop = _get(body, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    options = {"stop": stop, "presence_penalty": _get(body, "presence_penalty", (int, float), 0.0),
               "frequency_penalty": _get(body, "frequency_penalty", (int, float), 0.0)}
    if logprobs is not None:
        options["logprobs"] = logprobs
        if echo:
            options["prompt_logprobs"] = logprobs
    try:
        options["logit_bias"] = {int(token): float(bias) for token, bias in _get(body, "logit_bias", dict, {}).items()}
    except (TypeError, ValueError):
        raise BadRequest("logit_bias must map token ids to numbers", "logit_bias") from None
    for name, kinds in VLLM_FIELDS.items():
        if body.get(name) is not None:
            options[name] = _get(body, name, kinds)
    return ApiRequest(
        prompts=prompts, chat=chat, n=n, max_tokens=max_tokens,
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)), seed=seed, stream=stream,
        include_usage=bool(_get(body, "stream_options", dict, {}).get("include_usage", False)), echo=echo,
        logprobs=logprobs, add_special_tokens=_get(body, "add_special_tokens", bool, not chat),
        request_class=_get(body, "request_class", str), options=options,
    )


def parse_completion(body) -> ApiRequest:
    """Check a /v1/completions body."""
    _check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise BadRequest("prompt is required", "prompt")
    if body.get("suffix") is not None:
        raise BadRequest("suffix is not supported (no fill-in-the-middle)", "suffix")
    n = _get(body, "n", int, 1)
    if (best_of := _get(body, "best_of", int, n)) != n:
        raise BadRequest(f"best_of other than n is not supported (as in vLLM V1), got {best_of} with n={n}", "best_of")
    logprobs = _get(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs must be in 0..{MAX_LOGPROBS}, got {logprobs}", "logprobs")
    return _common(body, _prompts(body["prompt"]), _get(body, "max_tokens", int, DEFAULT_MAX_TOKENS), logprobs,
                   chat=False, echo=_get(body, "echo", bool, False))


def parse_chat(body, tokenizer) -> ApiRequest:
    """Check a /v1/chat/completions body; its messages become one prompt through the
    tokenizer's chat template, with the assistant's turn opened."""
    _check_fields(body, CHAT_FIELDS)
    prompt = _chat_prompt(body, tokenizer)
    top = _get(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise BadRequest(f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {top}", "top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if _get(body, "logprobs", bool, False) else None
    max_tokens = _get(body, "max_completion_tokens", int, _get(body, "max_tokens", int))
    return _common(body, (prompt,), max_tokens, logprobs, chat=True)


def _chat_prompt(body: dict, tokenizer) -> str:
    """The body's messages through the tokenizer's chat template, the assistant's turn opened
    unless `add_generation_prompt` is false."""
    messages = _messages(body.get("messages"))
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model's tokenizer has no chat template: send a prompt to /v1/completions", "messages")
    opened = _get(body, "add_generation_prompt", bool, True)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=opened, tokenize=False)
    except Exception as exc:  # the template's own check (e.g. roles that must alternate)
        raise BadRequest(f"the chat template refused these messages: {exc}", "messages") from None


def parse_tokenize(body, tokenizer) -> tuple[str, bool, bool]:
    """Check vLLM's /tokenize body: the text to tokenize (a `prompt`, or `messages` through the
    chat template), whether the tokenizer adds its special tokens (by default as the
    completion endpoints do), and whether to answer each token's string too."""
    _check_fields(body, TOKENIZE_FIELDS)
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest("send either a prompt or messages", "prompt")
    chat = "messages" in body
    text = _chat_prompt(body, tokenizer) if chat else _get(body, "prompt", str)
    if text is None:
        raise BadRequest("prompt must be a string", "prompt")
    return text, _get(body, "add_special_tokens", bool, not chat), _get(body, "return_token_strs", bool, False)


def parse_detokenize(body, vocab_size: int) -> list[int]:
    """Check vLLM's /detokenize body: its `tokens`, ids in the model's vocabulary."""
    _check_fields(body, ("model", "tokens"))
    tokens = _get(body, "tokens", list)
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("tokens is required: a list of token ids", "tokens")
    if bad := [t for t in tokens if not 0 <= t < vocab_size]:
        raise BadRequest(f"token ids out of the vocabulary (0..{vocab_size - 1}): {bad[:5]}", "tokens")
    return tokens


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
        return {"index": index, "message": {"role": "assistant", "content": result.text}, "logprobs": logprobs,
                "finish_reason": result.finish_reason, "autotune": own}
    text, ids, entries = result.text, result.tokens, result.logprobs
    finish_reason = result.finish_reason
    if request.max_tokens == 0:  # the prompt scored: the token decoded with it is not part of the answer
        text, ids, entries, finish_reason = "", [], [], "length"
    if request.echo:
        text = prompt_text(prompt, tokenizer) + text
        ids, entries = prompt_ids + ids, (result.prompt_logprobs or []) + (entries or [])
    logprobs = None if request.logprobs is None else _completion_logprobs(tokenizer, ids, entries)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "autotune": own}


def chunk_choice(index: int, request: ApiRequest, text: str, finish_reason: str | None = None,
                 first: bool = False, logprobs: dict | None = None) -> dict:
    """One choice of a streamed chunk: a text delta (a chat's first opens the assistant's turn),
    with the `logprobs` of the tokens behind it (`chunk_logprobs`)."""
    if not request.chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


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
