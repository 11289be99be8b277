"""What a request's decoding produces, and what a request joining a batch brings: the engine's
result types, apart from the loops that fill them (engine.py alone, batch.py batched)."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch

from engine.arms import MAX_K, Arm
from engine.sampling import Randomness, SamplingParams
from engine.streaming import Streamer


@dataclass
class GenerationMetrics:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, taken from earlier prompts' keys and values (engine/prefix.py)
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_steps: int = 0  # drafter calls; a batch drafts one token per row per step
    draft_rounds: int = 0  # rounds that drafted: the first draft step of a round costs more (cold caches)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_prefill_s: float = 0.0  # the drafter's part of prefill_s (its cache over the prompt); OFF has none
    draft_s: float = 0.0
    verify_s: float = 0.0
    verify_by_width: dict[int, list[float]] = field(default_factory=dict)  # tokens per row -> [seconds, rounds]
    total_s: float = 0.0
    stream_s: float = 0.0  # in the caller's streamer: left out of every time above, which are the engine's
    # OFF steps a speculative request (or batch) ran among its rounds (`probe_off`); they count above too
    probe_s: float = 0.0
    probe_rounds: int = 0
    probe_tokens: int = 0  # the tokens they committed: one per row and round

    @classmethod
    def of_request(cls, prompt_tokens: int) -> GenerationMetrics:
        """A request's counters, before its prefill."""
        return cls(prompt_tokens=prompt_tokens, drafted_per_position=[0] * MAX_K, accepted_per_position=[0] * MAX_K)

    def add_round(self, draft_s: float, draft_steps: int, width: int, verify_s: float) -> None:
        """A round took part in: `draft_steps` drafter steps in `draft_s`, then a verify of
        `width` tokens per row in `verify_s`."""
        self.rounds += 1
        self.draft_s += draft_s
        self.draft_steps += draft_steps
        self.draft_rounds += draft_steps > 0
        self.add_verify(width, verify_s)

    def add_drafts(self, drafted: int, accepted: int) -> None:
        """A round drafted `drafted` tokens for this request and the target kept the first `accepted`."""
        self.drafted += drafted
        self.accepted += accepted
        for j in range(drafted):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < accepted

    def add_verify(self, width: int, seconds: float) -> None:
        """A verify round of `width` tokens per row took `seconds`."""
        self.verify_s += seconds
        row = self.verify_by_width.setdefault(width, [0.0, 0])
        row[0] += seconds
        row[1] += 1

    def minus(self, earlier: GenerationMetrics) -> GenerationMetrics:
        """What happened between `earlier` (a snapshot of the same counters) and now."""
        out = GenerationMetrics()
        for name, value in vars(self).items():
            before = getattr(earlier, name)
            if isinstance(value, dict):
                value = {k: [a - b for a, b in zip(v, before.get(k, [0] * len(v)))] for k, v in value.items()}
                value = {k: v for k, v in value.items() if v[-1]}
            elif isinstance(value, list):
                value = [a - (before[i] if i < len(before) else 0) for i, a in enumerate(value)]
            else:
                value = value - before
            setattr(out, name, value)
        return out

    def plus(self, later: GenerationMetrics) -> GenerationMetrics:
        """This run and a `later` one of the same request added up (a request paused on one path
        and finished on another); prompt_tokens and new_tokens are left for the caller to set."""
        out = copy.deepcopy(self)
        for name, value in vars(later).items():
            mine = getattr(out, name)
            if isinstance(value, dict):
                for k, v in value.items():
                    mine[k] = [a + b for a, b in zip(mine.get(k, [0] * len(v)), v)]
            elif isinstance(value, list):
                mine += [0] * (len(value) - len(mine))
                for i, a in enumerate(value):
                    mine[i] += a
            else:
                setattr(out, name, mine + value)
        return out

    def without_probes(self) -> GenerationMetrics:
        """These counters less the OFF rounds `probe_off` served among the arm's (1-token verifies,
        one token per row): the arm's own work."""
        if not self.probe_rounds:
            return self
        out = copy.deepcopy(self)
        out.rounds -= self.probe_rounds
        out.new_tokens -= self.probe_tokens
        out.verify_s -= self.probe_s
        out.total_s -= self.probe_s
        one = out.verify_by_width[1]
        one[0] -= self.probe_s
        one[1] -= self.probe_rounds
        if not one[1]:
            del out.verify_by_width[1]
        out.probe_s, out.probe_rounds, out.probe_tokens = 0.0, 0, 0
        return out

    def trim_positions(self) -> None:
        """Drop the per-position counts beyond the last position ever drafted."""
        used = max((i + 1 for i, d in enumerate(self.drafted_per_position) if d), default=0)
        self.drafted_per_position = self.drafted_per_position[:used]
        self.accepted_per_position = self.accepted_per_position[:used]

    @property
    def acceptance(self) -> float | None:
        """Fraction of drafted tokens the target kept; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target forward after prefill (1.0 for OFF)."""
        return (self.new_tokens - 1) / self.rounds if self.rounds else 0.0

    @property
    def probe_step(self) -> float | None:
        """Seconds of an OFF step measured inside this request (`probe_off`); None if none was."""
        return self.probe_s / self.probe_rounds if self.probe_rounds else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance=self.acceptance,
            acceptance_per_position=self.acceptance_per_position,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_s=self.tokens_per_s,
        )
        return out


@dataclass(frozen=True)
class BatchRequest:
    """A request joining a running batch (`generate_batch`'s `admit`), or the rest of a request
    `generate` paused (its `rest`): that one carries the output so far (`resumes`: the result
    of the paused part, whose tokens end `prompt`, added to the batch's result), its random
    stream, so its draws go on where they stopped, and the target's keys and values over all
    of `prompt` but its last token (`cached`), so it joins a batch without a second prefill."""

    prompt: str | list[int] | torch.Tensor
    max_new_tokens: int = 64
    sampling: SamplingParams | None = None
    streamer: Streamer | None = None
    resumes: GenerationResult | None = None
    generator: Randomness | None = None
    cached: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # the paused part's (ModelRunner.cached)


@dataclass
class BatchResult:
    """The requests of a batch, in order, and the batch's own metrics (rounds, draft steps, times)."""

    results: list[GenerationResult]
    metrics: GenerationMetrics

    def __iter__(self):
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, i: int) -> GenerationResult:
        return self.results[i]


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    arm: Arm
    metrics: GenerationMetrics
    text: str | None = None
    fell_back: bool = False  # speculation failed mid-request and OFF finished it
    fallback_error: str | None = None
    stream_error: str | None = None  # the request's streamer raised: the output stops there
    rest: BatchRequest | None = None  # paused (`generate`'s `pause`): what finishes it in a batch
    logprobs: list[dict[int, float]] | None = None  # per output token, with SamplingParams.logprobs
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with SamplingParams.prompt_logprobs
    # vLLM's and OpenAI's: "stop" (the model's EOS, a stop token or string, a stopping criterion),
    # "length" (max_new_tokens reached), "abort" (its streamer raised); None while paused (`rest`).
    finish_reason: str | None = None
