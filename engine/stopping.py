"""Where a request's output ends: at the model's EOS, at one of the request's `stop_token_ids`,
or at the token whose text completes one of its `stop` strings (vLLM's names).

A speculative round commits several tokens at once, so the end may fall inside them: the output
is cut right after the token that ended it, where one-token decoding would have stopped. That
token is kept in the output's tokens, as an EOS is; the output's text ends before the stop
string, as vLLM's does (`include_stop_str_in_output` keeps it and whatever else that token
spells). Stop strings are looked for in the text of the output's last few tokens, enough for
the longest string, so a check costs the same at any output length.
"""

from __future__ import annotations

import torch

from engine.errors import InvalidRequestError

SLACK_TOKENS = 4  # decoded beyond one token per character of the longest stop string


class Stopping:
    """The end test of one request: `stop_ids` (EOS and stop_token_ids) and `strings`, whose text
    counts from `output_start` (the prompt's length) on, none of them before `min_tokens` output
    tokens; `keep_strings`: whether the output's text keeps the stop string that ended it.
    `criteria`: a caller's stopping criteria (generate()'s), each called after every output
    token as generate() calls them, with prompt + output so far as input_ids [1, L] and no
    scores; as in generate(), min_tokens does not hold them back. `skip_special_tokens`
    (vLLM's): whether the output's text, where stop strings are looked for, leaves out the
    tokenizer's special tokens."""

    def __init__(self, stop_ids: set[int], strings: tuple[str, ...], tokenizer, output_start: int,
                 keep_strings: bool = False, min_tokens: int = 0, criteria: tuple = (),
                 skip_special_tokens: bool = True) -> None:
        if strings and tokenizer is None:
            raise InvalidRequestError("stop strings need the engine's tokenizer: pass stop_token_ids instead")
        self.stop_ids, self.strings, self.tokenizer = stop_ids, strings, tokenizer
        self.output_start, self.keep_strings, self.min_tokens = output_start, keep_strings, min_tokens
        self.criteria, self.skip_special_tokens = criteria, skip_special_tokens
        self.window = max(map(len, strings), default=0) + SLACK_TOKENS
        self._held_ids: torch.Tensor | None = None

    def hold(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        """`logits` [n, V] of the tokens at `index`, `index` + 1, ...: where the output would
        still be shorter than `min_tokens`, the stop ids made impossible (in place), as
        transformers' MinNewTokensLengthLogitsProcessor does, so a verify keeps exactly what
        one-token decoding would pick."""
        held = self.output_start + self.min_tokens - index
        if held > 0 and self.stop_ids:
            if self._held_ids is None:
                self._held_ids = torch.tensor(sorted(t for t in self.stop_ids if t < logits.shape[-1]),
                                              dtype=torch.long, device=logits.device)
            logits[:held].index_fill_(-1, self._held_ids, float("-inf"))
        return logits

    def text(self, tokens: list[int]) -> str:
        """The text of output `tokens` as its caller gets it: up to the first stop string it holds."""
        text = self._decode(tokens)
        found = [text.find(s) for s in self.strings if s in text]
        return text if self.keep_strings or not found else text[:min(found)]

    def end(self, tokens: list[int], start: int) -> int | None:
        """The index of the first token from `start` on that ends the output, or None."""
        ids = torch.tensor([tokens]) if self.criteria else None
        for j in range(start, len(tokens)):
            if j >= self.output_start + self.min_tokens and (
                    tokens[j] in self.stop_ids or (self.strings and self._completes_a_string(tokens, j))):
                return j
            if ids is not None and any(bool(torch.as_tensor(met(ids[:, :j + 1], None)).any()) for met in self.criteria):
                return j
        return None

    def _completes_a_string(self, tokens: list[int], j: int) -> bool:
        first = max(self.output_start, j - self.window)
        before, after = self._decode(tokens[first:j]), self._decode(tokens[first:j + 1])  # as the result's text
        return any(s in after and s not in before for s in self.strings)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)


def finish_reason(stopped: bool, stream_error: str | None) -> str:
    """vLLM's and OpenAI's name for why an output ended: "abort" if its streamer raised (the
    client went away), "stop" at an end of its own, else "length" (max_new_tokens)."""
    return "abort" if stream_error is not None else "stop" if stopped else "length"
