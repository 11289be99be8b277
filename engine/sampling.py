"""Sampling parameters and the verification rules that keep speculation lossless.

Greedy: a draft token is kept while it equals the target's argmax.
Sampling: the standard rejection scheme (Leviathan et al. 2023, Chen et al. 2023): keep draft
token x with probability min(1, p(x)/q(x)); on the first rejection sample from
normalize(max(p - q, 0)); if all K are kept, sample a bonus token from p. A drafter without a
distribution (n-gram lookup) is a point mass, q(x) = 1.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.coupled import PositionNoise, verify_coupled
from engine.errors import InvalidRequestError

# A sampled request's randomness: its generator, or its noise per position when it is coupled
Randomness = torch.Generator | PositionNoise

MAX_LOGPROBS = 20  # alternatives per output token, as vLLM's default limit
SEED_RANGE = (-2**63, 2**63 - 1)  # vLLM's: a 64-bit signed seed
FLOAT32 = torch.finfo(torch.float32)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; seed makes a sampled request reproducible. A sampled token is
    drawn as generate() draws it: at `temperature`, from the `top_k` likeliest tokens (0 or -1:
    all), then the smallest set holding `top_p` of their mass, then those at least `min_p` times
    as likely as the likeliest. Besides the model's EOS, the output ends at the first of
    `stop_token_ids`, as generate() with them added to `eos_token_id`, or at the token whose text
    completes one of the `stop` strings (vLLM's names and defaults: the ending token is kept, the
    text ends before the stop string unless `include_stop_str_in_output`; see engine/stopping.py).
    `ignore_eos` leaves the model's EOS out of that; before `min_tokens` output tokens nothing
    ends the output (transformers' min_new_tokens: the target cannot pick a stop token there).
    `logprobs` N: each output token's log-probability and those of the N likeliest tokens at its
    position, under the target's raw distribution (vLLM's default), from the forward that
    verified it (`token_logprobs`); `prompt_logprobs` N: the same for every prompt token after
    the first (vLLM's: the list starts with None), from the prefill. Penalties (`adjust_logits`), greedy or sampled:
    `repetition_penalty` on every token of prompt and output (transformers' and vLLM's),
    `presence_penalty` and `frequency_penalty` on the output's tokens (OpenAI's and vLLM's).
    Before the penalties, `allowed_token_ids` (vLLM's) leaves only those tokens possible,
    `logit_bias` {token: bias} (OpenAI's, -100..100) adds to their logits (a dict given is kept
    as sorted (token, bias) pairs, so the parameters stay hashable), and `bad_words_ids`
    (generate()'s) makes impossible the last token of each sequence whose other tokens end the
    text so far. `bad_words` (vLLM's) are strings the engine tokenizes into `bad_words_ids`
    (`SpeculativeEngine.bad_words_as_ids`), as written and after a space. `logits_processor`
    (generate()'s): the caller's own processors, such as a transformers `LogitsProcessorList`,
    each called as generate() calls it, `(input_ids [1, L], scores [1, V]) -> scores`, after
    every edit above and min_tokens and before temperature and the cuts. A verify calls them at
    each position up to its first rejected draft, with that position's own history (the drafts
    before it included); model drafters and the controller's replay call them too, on drafts
    later rejected, so a processor must be a function of `input_ids` (as for generate()'s
    assisted decoding). `stopping_criteria` (generate()'s), such as a transformers
    `StoppingCriteriaList`: the output also ends at the first token after which one of them,
    called as `(input_ids [1, L], None)`, returns true (see engine/stopping.py).
    `skip_special_tokens` (vLLM's, default true): the output's text leaves them out. `coupled`:
    drafter-invariant sampling (engine/coupled.py), each token drawn from noise of the seed and
    its position and a draft kept only when it equals that draw, so that the output depends on
    the prompt, these options and the seed alone, whatever the arm; None: for a seeded request.
    Otherwise drafts are kept by the standard rejection rule, which keeps more of them."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    logits_processor: tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ...] = ()
    stopping_criteria: tuple[Callable[[torch.Tensor, None], torch.Tensor | bool], ...] = ()
    skip_special_tokens: bool = True
    coupled: bool | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _as_float(name, getattr(self, name)))
        if not 0 <= self.temperature < math.inf:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise InvalidRequestError(f"seed must be an int in [-2**63, 2**63 - 1] (a 64-bit seed), got {self.seed}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be an int >= 0 (0 or -1: every token), got {self.top_k}")
        object.__setattr__(self, "top_k", max(self.top_k, 0))
        if not (0 <= self.min_p <= 1):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be an int >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be None or an int in 0..{MAX_LOGPROBS}, got {value}")
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.coupled not in (None, True, False):
            raise InvalidRequestError(f"coupled must be None, True or False, got {self.coupled!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be True or False, got {getattr(self, name)!r}")
        stops = _items("stop_token_ids", self.stop_token_ids)
        if not all(_is_token_id(t) for t in stops):
            raise InvalidRequestError(f"stop_token_ids must be token ids (ints >= 0), got {list(stops)}")
        object.__setattr__(self, "stop_token_ids", stops)  # a list given is kept as a tuple: hashable
        strings = _items("stop", self.stop, single=str)
        if not all(isinstance(s, str) and s for s in strings):
            raise InvalidRequestError(f"stop must be non-empty strings, got {list(strings)}")
        object.__setattr__(self, "stop", strings)
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else _items("logit_bias", self.logit_bias)
        bias = tuple(tuple(pair) for pair in pairs if isinstance(pair, (tuple, list)) and len(pair) == 2)
        if len(bias) < len(pairs) or not all(_is_token_id(t) and isinstance(b, (int, float)) and -100 <= b <= 100
                                             for t, b in bias):
            raise InvalidRequestError(f"logit_bias must map token ids (ints >= 0) to biases in [-100, 100], got"
                                      f" {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted(bias)))
        if self.allowed_token_ids is not None:
            allowed = _items("allowed_token_ids", self.allowed_token_ids)
            if not allowed or not all(_is_token_id(t) for t in allowed):
                raise InvalidRequestError(f"allowed_token_ids must be a non-empty list of token ids (ints >= 0), got"
                                          f" {list(allowed)}")
            object.__setattr__(self, "allowed_token_ids", allowed)
        words = _items("bad_words", self.bad_words, single=str)
        if not all(isinstance(w, str) and w for w in words):
            raise InvalidRequestError(f"bad_words must be non-empty strings, got {list(words)}")
        object.__setattr__(self, "bad_words", words)
        sequences = tuple(_items("bad_words_ids", ids) for ids in _items("bad_words_ids", self.bad_words_ids))
        if not all(ids and all(_is_token_id(t) for t in ids) for ids in sequences):
            raise InvalidRequestError(f"bad_words_ids must be non-empty lists of token ids (ints >= 0), got"
                                      f" {[list(ids) for ids in sequences]}")
        object.__setattr__(self, "bad_words_ids", sequences)
        object.__setattr__(self, "logits_processor", _callables(
            self.logits_processor, "logits_processor must be callables (input_ids, scores) -> scores, such as a"
                                   " transformers LogitsProcessorList"))
        object.__setattr__(self, "stopping_criteria", _callables(
            self.stopping_criteria, "stopping_criteria must be callables (input_ids, scores) -> bool, such as a"
                                    " transformers StoppingCriteriaList"))

    def token_ids(self) -> set[int]:
        """Every token id the request names (stops, biases, allowed tokens, bad words), for
        checking them against a model's vocabulary."""
        return {*self.stop_token_ids, *(t for t, _ in self.logit_bias), *(self.allowed_token_ids or ()),
                *(t for ids in self.bad_words_ids for t in ids)}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def couples(self) -> bool:
        """Whether the request is sampled by the drafter-invariant rule (`coupled`)."""
        return not self.greedy and (self.seed is not None if self.coupled is None else self.coupled)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether `adjust_logits` changes anything: a model drafter then drafts with it too."""
        return (self.penalized or bool(self.logit_bias or self.bad_words_ids or self.logits_processor)
                or self.allowed_token_ids is not None)


def _callables(value, message: str) -> tuple:
    """A callable or a list of them as a tuple; a transformers LogitsProcessorList or
    StoppingCriteriaList is a list and callable, and is kept as its items."""
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not all(callable(item) for item in items):
        raise InvalidRequestError(f"{message}, got {list(items)}")
    return items


def _items(name: str, value, single: type | None = None) -> tuple:
    """A collection given as a tuple (hashable), `value` alone if it is a `single`, and None as
    none (vLLM's default for its lists)."""
    if value is None:
        return ()
    if single is not None and isinstance(value, single):
        return (value,)
    try:
        return tuple(value)
    except TypeError:  # not a collection at all (a number, a 0-d tensor)
        kind = "a list" if single is None else f"a {single.__name__} or a list"
        raise InvalidRequestError(f"{name} must be {kind}, got {value!r}") from None


def _as_float(name: str, value) -> float:
    """A number given kept as a float: a huge int (10**30) would overflow the tensors it scales."""
    if not isinstance(value, bool) and isinstance(value, numbers.Real):
        with contextlib.suppress(OverflowError):
            return float(value)
    raise InvalidRequestError(f"{name} must be a number, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value) -> bool:
    return _is_int(value) and value >= 0


def adjust_logits(logits: torch.Tensor, tokens: list[int], drafts: list[int], output_start: int,
                  params: SamplingParams, hold: Callable[[torch.Tensor, int], torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """The request's own edits of `logits` [n, V], whose row j picks the token after `tokens` +
    `drafts[:j]`: each row sees its own history, so a verify keeps exactly what one-token decoding
    would pick. In transformers' order: the allowed tokens, the bad words (its
    NoBadWordsLogitsProcessor) and the logit bias (its SequenceBiasLogitsProcessor, one-token
    sequences), then the repetition penalty as its RepetitionPenaltyLogitsProcessor (a seen
    token's logit divided by the penalty, or multiplied when negative); presence and frequency
    subtract from the logits of the output's tokens, once and per occurrence. Then `hold` (the
    request's `Stopping.hold`, min_tokens: the target's side only), then the caller's
    `logits_processor`, which generate() applies after its own."""
    if params.adjusts_logits:
        logits = _edit(logits.float(), tokens, drafts, output_start, params)
    if hold is not None:
        logits = hold(logits, len(tokens))
    if params.logits_processor:
        logits = _process(logits, tokens, drafts, params.logits_processor)
    return logits


def _edit(logits: torch.Tensor, tokens: list[int], drafts: list[int], output_start: int,
          params: SamplingParams) -> torch.Tensor:
    n, vocab = logits.shape
    device = logits.device
    if params.allowed_token_ids is not None:
        barred = torch.full((vocab,), float("-inf"), device=device)
        barred[list(params.allowed_token_ids)] = 0.0
        logits = logits + barred
    if params.bad_words_ids:
        rows, ids = _bad_words(tokens, drafts, n, params.bad_words_ids)
        logits = logits.index_put((torch.tensor(rows, dtype=torch.long, device=device),
                                   torch.tensor(ids, dtype=torch.long, device=device)),
                                  torch.tensor(float("-inf"), device=device))
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        biases = torch.tensor(biases, dtype=logits.dtype, device=device).expand(n, -1)
        logits = logits.index_add(1, torch.tensor(ids, device=device), biases)
    if not params.penalized:
        return logits
    history = torch.tensor(tokens, device=device)
    later = torch.zeros(n, vocab, device=device)  # per row: occurrences among the drafts before it
    for j, token in enumerate(drafts[: n - 1]):
        later[j + 1:, token] += 1
    if params.repetition_penalty != 1.0:
        seen = later > 0
        seen[:, history] = True
        # Kept finite (a penalty of 1e-30 or 1e30 overflows float32; inf logits give a nan
        # distribution), and a token impossible before (-inf) stays impossible.
        penalty, largest = max(params.repetition_penalty, FLOAT32.tiny), FLOAT32.max
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty).clamp(-largest, largest)
        logits = torch.where(seen & logits.isfinite(), penalized, logits)
    if params.presence_penalty or params.frequency_penalty:
        counts = later + torch.bincount(history[output_start:], minlength=vocab)[:vocab].float()
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return logits


def _process(logits: torch.Tensor, tokens: list[int], drafts: list[int], processors: tuple) -> torch.Tensor:
    """Row j through the caller's processors with its own history as input_ids [1, len(tokens) + j]
    (a view of one tensor); each row is a copy, since a processor may write into its scores."""
    n, vocab = logits.shape
    history = torch.tensor([tokens + drafts[: n - 1]], dtype=torch.long, device=logits.device)
    out = torch.empty_like(logits)
    for j in range(n):
        row = logits[j:j + 1].clone()
        for processor in processors:
            row = processor(history[:, : len(tokens) + j], row)
            if not isinstance(row, torch.Tensor) or row.shape != (1, vocab):
                raise InvalidRequestError(f"logits_processor {processor!r} must return scores of shape"
                                          f" {(1, vocab)}, got {getattr(row, 'shape', type(row))}")
        out[j] = row[0]
    return out


def _bad_words(tokens: list[int], drafts: list[int], n: int, words: tuple[tuple[int, ...], ...]
               ) -> tuple[list[int], list[int]]:
    """(rows, token ids) to make impossible: per row j (after `tokens` + `drafts[:j]`), the last
    token of each bad word whose other tokens end that history."""
    longest = max(map(len, words)) - 1
    recent = tokens[max(len(tokens) - longest, 0):] if longest else []
    rows, ids = [], []
    for j in range(n):
        history = recent + drafts[:j]
        for word in words:
            before = len(word) - 1
            if before <= len(history) and (not before or history[len(history) - before:] == list(word[:-1])):
                rows.append(j)
                ids.append(word[-1])
    return rows, ids


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., V] into the distribution the request samples from: temperature, top-k,
    top-p and min-p, in transformers' order. The logits are shifted to a maximum of 0 before
    the temperature divides them (one float32 can hold), so a tiny temperature gives its limit,
    the likeliest tokens, and a huge one its limit, every token not ruled out alike, instead of
    a distribution of nan (an impossible token's -inf over an infinite temperature)."""
    logits = logits.float()
    temperature = min(max(params.temperature, FLOAT32.tiny), FLOAT32.max)
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / temperature, dim=-1)
    if 0 < params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)  # ties with the k-th token stay, as in transformers
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop[..., 0] = False  # a top_p below float32's smallest number compares as 0
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def log_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The target's raw log-probabilities [n, V] for a request that asked for logprobs, else None;
    taken before anything (min_tokens) edits the logits."""
    return None if params.logprobs is None else torch.log_softmax(logits.float(), dim=-1)


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], top: int) -> list[dict[int, float] | None]:
    """vLLM's prompt_logprobs from the prefill's `logits` [len(prompt), V]: None for the first
    token, then each token's log-probability given the ones before it, and the `top` likeliest."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return [None, *token_logprobs(logp, prompt[1:], top)]


def token_logprobs(logp: torch.Tensor, chosen: list[int], top: int) -> list[dict[int, float]]:
    """Per row of `logp` [n, V] (n = len(chosen)): {token: log-probability} of the chosen token
    and the `top` likeliest ones."""
    picked = logp[torch.arange(len(chosen)), torch.tensor(chosen, dtype=torch.long)].tolist()  # none: a 1-token prompt
    out = [{token: value} for token, value in zip(chosen, picked)]
    if top:
        values, ids = logp.topk(top, dim=-1)
        for entry, row_ids, row_values in zip(out, ids.tolist(), values.tolist()):
            entry.update(zip(row_ids, row_values))
    return out


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def draw(probs: torch.Tensor, randomness: Randomness | None, position: int) -> int:
    """A token drawn from `probs` [V] for `position` of the sequence, by the request's randomness:
    its coupled noise there, or its generator's next draw."""
    if isinstance(randomness, PositionNoise):
        return randomness.draw(probs, position)
    return sample(probs, randomness)


def draft_token(logits: torch.Tensor, history: list[int], output_start: int, params: SamplingParams,
                generator: Randomness | None) -> tuple[int, torch.Tensor | None]:
    """A drafter's next token from its logits [V] after `history` (the request's tokens and the
    round's drafts so far), edited and drawn as the target will pick, so that its drafts are
    kept; and the distribution it was drawn from [V] (None when greedy: a point mass)."""
    if params.adjusts_logits:
        logits = adjust_logits(logits[None], history, [], output_start, params)[0]
    if params.greedy:
        return int(logits.argmax()), None
    q = probabilities(logits, params)
    return draw(q, generator, len(history)), q


def commit(logits: torch.Tensor, tokens: list[int], draft: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, stopping, generator: Randomness | None
           ) -> tuple[list[int], list[dict[int, float]] | None]:
    """What a round commits after `tokens`, from the target's `logits` [len(draft) + 1, V] over
    `draft` (a prefill: no draft, one row): the drafts kept and the target's next token, and
    their logprobs if the request asked for them. The request's penalties and `stopping`'s
    min_tokens apply at each position with its own history, so the tokens are those one-token
    decoding would pick."""
    logp = log_probabilities(logits, params)
    if params.logits_processor:
        rows = RowByRow(logits, tokens, draft, params, stopping)
    else:
        rows = adjust_logits(logits, tokens, draft, stopping.output_start, params, stopping.hold)
        rows = rows if params.greedy else probabilities(rows, params)
    if params.greedy:
        n, nxt = verify_greedy(rows, draft)
    elif isinstance(generator, PositionNoise):
        n, nxt = verify_coupled(rows, draft, generator, len(tokens))
    else:
        n, nxt = verify_sampled(rows, draft, draft_probs, generator)
    kept = [*draft[:n], nxt]
    return kept, None if logp is None else token_logprobs(logp[: n + 1], kept, params.logprobs)


class RowByRow:
    """A verify's rows (greedy: edited logits; sampled: probabilities), each edited as it is
    read; a verify reads each row once, and only up to its first rejected draft, so a caller's
    logits processors run accepted + 1 times per round rather than K + 1."""

    def __init__(self, logits: torch.Tensor, tokens: list[int], draft: list[int], params: SamplingParams,
                 stopping) -> None:
        self._logits, self._tokens, self._draft, self._params, self._stopping = logits, tokens, draft, params, stopping
        self.device = logits.device

    def __getitem__(self, j: int) -> torch.Tensor:
        row = adjust_logits(self._logits[j:j + 1], self._tokens + self._draft[:j], [], self._stopping.output_start,
                            self._params, self._stopping.hold)[0]
        return row if self._params.greedy else probabilities(row, self._params)


def verify_greedy(target_logits: torch.Tensor | RowByRow, draft: list[int]) -> tuple[int, int]:
    """Return (number of draft tokens kept, the target's next token) for K+1 verify logits
    (a tensor: every row's argmax at once, one device sync)."""
    if isinstance(target_logits, RowByRow):
        for n in range(len(draft) + 1):
            choice = int(target_logits[n].argmax())
            if n == len(draft) or draft[n] != choice:
                return n, choice
    choice = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == choice[n]:
        n += 1
    return n, choice[n]


def verify_sampled(
    target_probs: torch.Tensor | RowByRow,
    draft: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Rejection sampling over K drafts; target_probs is [K+1, V], draft_probs [K, V] or None."""
    device = target_probs.device
    uniforms = torch.rand(len(draft), generator=generator, device=device).tolist() if draft else []
    for i, x in enumerate(draft):
        p = target_probs[i]
        p_x = float(p[x])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if uniforms[i] * q_x < p_x:  # accept with probability min(1, p/q), no division by zero
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[i], min=0.0)
        total = float(residual.sum())
        # A rejection implies p(x) < q(x), hence positive residual mass; guard float underflow.
        return i, sample(residual / total if total > 0 else p, generator)
    return len(draft), sample(target_probs[len(draft)], generator)
