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

from engine.errors import InvalidRequestError

SLACK_TOKENS = 4  # decoded beyond one token per character of the longest stop string


class Stopping:
    """The end test of one request: `stop_ids` (EOS and stop_token_ids) and `strings`, whose text
    counts from `output_start` (the prompt's length) on; `keep_strings`: whether the output's
    text keeps the stop string that ended it."""

    def __init__(self, stop_ids: set[int], strings: tuple[str, ...], tokenizer, output_start: int,
                 keep_strings: bool = False) -> None:
        if strings and tokenizer is None:
            raise InvalidRequestError("stop strings need the engine's tokenizer: pass stop_token_ids instead")
        self.stop_ids, self.strings, self.tokenizer = stop_ids, strings, tokenizer
        self.output_start, self.keep_strings = output_start, keep_strings
        self.window = max(map(len, strings), default=0) + SLACK_TOKENS

    def text(self, text: str) -> str:
        """The output's text as its caller gets it: up to the first stop string it holds."""
        found = [text.find(s) for s in self.strings if s in text]
        return text if self.keep_strings or not found else text[:min(found)]

    def end(self, tokens: list[int], start: int) -> int | None:
        """The index of the first token from `start` on that ends the output, or None."""
        for j in range(max(start, self.output_start), len(tokens)):
            if tokens[j] in self.stop_ids or (self.strings and self._completes_a_string(tokens, j)):
                return j
        return None

    def _completes_a_string(self, tokens: list[int], j: int) -> bool:
        first = max(self.output_start, j - self.window)
        before = self.tokenizer.decode(tokens[first:j], skip_special_tokens=True)  # as the result's text
        after = self.tokenizer.decode(tokens[first:j + 1], skip_special_tokens=True)
        return any(s in after and s not in before for s in self.strings)
