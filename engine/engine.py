"""The speculative decoding engine: one target, any number of named drafters.

`SpeculativeEngine.generate` decodes one request: a prefill, then rounds of engine/round.py's
`decode_round` until the request ends. Invariant between rounds: the request's tokens hold
prompt + committed output, and the target's KV cache holds every position except the last
token; a round feeds [last, d1..dK] in one forward pass and crops the cache back to what was
committed. OFF is the same round with K = 0. `generate_batch` and `open_batch` decode many
requests together with the same rounds (engine/batch.py).
"""

from __future__ import annotations

import copy
import functools
import numbers
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from engine.arms import MAX_K, OFF, Arm
from engine.batch import BatchRun, check_batchable
from engine.coupled import PositionNoise
from engine.drafters import Drafter, ModelDrafter, capabilities, model_drafter_of
from engine.errors import IncompatibleDrafterError, InvalidRequestError
from engine.feature import FeatureDrafter, is_head_folder
from engine.identity import weights_hash
from engine.kvcache import recurrent_kinds, uses_alibi
from engine.prefix import PrefixCache
from engine.results import BatchRequest, BatchResult, GenerationMetrics, GenerationResult
from engine.round import Drafts, Row, decode_round, stream
from engine.runner import ModelRunner
from engine.sampling import Randomness, SamplingParams, probabilities, prompt_logprobs, sample
from engine.schedule import NO_CONTROL, ConstantK, KSchedule, RoundControl
from engine.stopping import Stopping, finish_reason
from engine.streaming import Streamer, check_streamer, end_stream

PROMPT_CHARS_SLACK = 4


def _load(path_or_model, device, dtype) -> PreTrainedModel:
    if isinstance(path_or_model, (str, Path)):
        # No weight-loading bar per model (four for the demo family) in a library's output.
        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            path_or_model = AutoModelForCausalLM.from_pretrained(path_or_model, dtype=dtype)
        finally:
            if shown:
                hf_logging.enable_progress_bar()
    return path_or_model.to(device=device, dtype=dtype).eval()


# What a drafter that declares each capability must have (engine/drafters.py `Capabilities`).
DECLARED = {"batch": ("for_batch",), "replay": ("replay_chains",), "features": ("attach", "take_features"),
            "shares_target": ("share",)}


def check_declared(name: str, drafter) -> None:
    """Refuse, by name, a drafter without the protocol's calls or without a method its declared
    capabilities need, rather than let it fail in a batch or a replay later."""
    missing = [call for call in ("begin", "propose", "rollback") if not callable(getattr(drafter, call, None))]
    able = capabilities(drafter)
    missing += [f"{method} (for {what}=True)" for what, methods in DECLARED.items() if getattr(able, what)
                for method in methods if not callable(getattr(drafter, method, None))]
    if missing:
        raise IncompatibleDrafterError(f"drafter {name!r} ({type(drafter).__name__}) lacks {', '.join(missing)}")


class _Alone:
    """How one request's round feeds the models (`engine.round.Feed`): the target's runner, and
    the drafter with its own cache, one sequence each."""

    def __init__(self, runner: ModelRunner, drafter: Drafter | None, device: torch.device) -> None:
        self.runner, self.drafter, self.device = runner, drafter, device
        self.fell_back, self.error = False, None

    @property
    def drafting(self) -> bool:
        return self.drafter is not None

    def begin(self, prompt: torch.Tensor, max_length: int) -> None:
        """The drafter's prefill; one that fails leaves the request OFF."""
        try:
            self.drafter.begin(prompt, max_length)
            if capabilities(self.drafter).features:
                self.drafter.take_features(self.runner.reused, self.runner.hidden)
        except Exception as exc:  # speculation must never lose a request
            self.fall_back(f"drafter prefill: {type(exc).__name__}: {exc}")

    def draft(self, rows: list[Row], ks: list[int]) -> Drafts:
        row = rows[0]
        tokens, dist = self.drafter.propose(row.tokens, ks[0], row.sampling, row.generator)
        return Drafts([tokens], [dist])

    def verify(self, rows: list[Row], drafts: list[list[int]]) -> torch.Tensor:
        row = rows[0]
        step = torch.tensor([[row.tokens[-1], *drafts[0]]], device=self.device)
        return self.runner.step(step, len(row.tokens) - 1, keep=step.shape[1])[None]

    def undo_verify(self, rows: list[Row]) -> None:
        self.runner.truncate(len(rows[0].tokens) - 1)

    def accepted(self, b: int, row: Row, start: int, kept: int, drafts: Drafts) -> None:
        self.runner.truncate(start + kept)
        if self.drafter is None:
            return
        if drafts.tokens[b]:
            self.drafter.rollback(start + kept)
        if capabilities(self.drafter).features:  # the verify fed the last token and the drafts from start - 1
            try:
                self.drafter.take_features(start - 1, self.runner.hidden[: kept + 1])
            except Exception as exc:
                self.fall_back(f"drafter features: {type(exc).__name__}: {exc}")

    def fall_back(self, error: str) -> None:
        self.drafter, self.fell_back, self.error = None, True, error


class SpeculativeEngine:
    """Holds a target and named drafters on one device and dtype, and runs requests on arms."""

    def __init__(
        self,
        target: PreTrainedModel | str | Path,
        drafters: dict[str, PreTrainedModel | str | Path | Drafter] | None = None,
        tokenizer=None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        static_cache: bool = False,
        compile: bool | None = None,
        compiled_cache_len: int | None = None,
        prefix_cache_tokens: int = 0,
    ) -> None:
        self.device = torch.device(device)
        if dtype is None:
            # float32 everywhere by default: in bfloat16 a (K+1)-token verify and a 1-token step
            # round differently, so at near-ties the greedy output can change (measured on an H100).
            dtype = torch.float32
        self.dtype = dtype
        if tokenizer is None and isinstance(target, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(target)
        self.tokenizer = tokenizer
        self.target = _load(target, self.device, dtype)
        if compile is None:  # on CPU each graph takes ~3-13 s to compile here: opt in
            compile = (self.device.type == "cuda" and not recurrent_kinds(self.target.config)
                       and not uses_alibi(self.target.config))  # see kvcache
        self.cache_kind = "compiled" if compile else "static" if static_cache else "dynamic"
        self.runner = ModelRunner(self.target, self.cache_kind, compiled_cache_len)
        # Drafters compile for the target's cache length (runner.py says how it defaults).
        self.compiled_cache_len = getattr(self.runner, "max_cache_len", compiled_cache_len)
        # The target's weights, for drafters trained for exactly this target (engine/feature.py).
        folder = self.target.name_or_path  # where from_pretrained found it ("" if built in memory)
        self.target_hash = weights_hash(folder) if folder and Path(folder).is_dir() else None
        # Each model keeps this many tokens of earlier prompts' keys and values (0: none), so a
        # request that starts as one did prefills only the rest (engine/prefix.py).
        self.prefix_cache_tokens = prefix_cache_tokens
        self._prefix_caches: dict[PreTrainedModel, PrefixCache] = {}
        self._keep_prefixes(self.runner)
        self.vocab_size = self.target.config.vocab_size
        self.max_length = getattr(self.target.config, "max_position_embeddings", None)
        self.eos_token_id = self._eos_ids()
        self.identity = ""  # names + content hashes of the models, recorded with every observation
        self.model_records: list[dict] = []  # name, role, path, content_hash, params, size_bytes
        self.drafters: dict[str, Drafter] = {}
        for name, drafter in (drafters or {}).items():
            self.add_drafter(name, drafter)

    def _eos_ids(self) -> set[int]:
        eos = getattr(self.target.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.target.config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}

    def add_drafter(self, name: str, drafter, tokenizer=None) -> None:
        """Register a drafter: a model, a local model folder, a feature head's folder (engine/feature.py),
        or any `Drafter` object."""
        if not self.runner.verifies:
            raise IncompatibleDrafterError(
                f"the target ({type(self.target).__name__}) cannot verify drafts: its steps of several tokens"
                " do not continue its recurrent state (see ModelRunner._check_steps); it decodes OFF only"
            )
        if isinstance(drafter, (str, Path)) and is_head_folder(drafter):
            drafter = FeatureDrafter.load(drafter)
        elif isinstance(drafter, (str, Path)):
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(drafter)
            drafter = _load(drafter, self.device, self.dtype)
        if isinstance(drafter, PreTrainedModel):
            drafter = ModelDrafter(_load(drafter, self.device, self.dtype), tokenizer)
        check_declared(name, drafter)
        model = model_drafter_of(drafter)
        if model is not None:
            if model.runner.kind != self.cache_kind or self.cache_kind == "compiled":  # a dynamic one is as good
                model.runner = ModelRunner(model.model, self.cache_kind, self.compiled_cache_len)
            self._keep_prefixes(model.runner)
            if not model.runner.verifies:
                raise IncompatibleDrafterError(
                    f"drafter {name!r} ({type(model.model).__name__}) cannot draft: its steps of several tokens"
                    " do not continue its recurrent state, and a drafter catches up and rolls back in such steps"
                )
        if capabilities(drafter).shares_target:
            drafter.share(self.runner)
        if capabilities(drafter).features:
            drafter.attach(name, self.target, self.target_hash, compiled=self.cache_kind == "compiled",
                           compiled_cache_len=self.compiled_cache_len)
            self.runner.keeps_hidden = True
        vocab = getattr(drafter, "vocab_size", None)
        if vocab is not None and vocab != self.vocab_size:
            raise IncompatibleDrafterError(
                f"drafter {name!r} has vocabulary size {vocab}, the target has {self.vocab_size}:"
                " a drafter must share the target's tokenizer"
            )
        drafter_tok = getattr(drafter, "tokenizer", None)
        if drafter_tok is not None and self.tokenizer is not None:
            if drafter_tok.get_vocab() != self.tokenizer.get_vocab():
                raise IncompatibleDrafterError(
                    f"drafter {name!r} uses a tokenizer that does not match the target's"
                )
        self.drafters[name] = drafter

    def _keep_prefixes(self, runner: ModelRunner) -> None:
        """Give `runner` its model's prefix cache, one per model (a hybrid drafter's model shares
        the plain drafter's)."""
        if self.prefix_cache_tokens:
            if runner.model not in self._prefix_caches:
                self._prefix_caches[runner.model] = PrefixCache(self.prefix_cache_tokens)
            runner.prefixes = self._prefix_caches[runner.model]

    def warm_up(self, arms: list[Arm | str]) -> dict[str, dict[str, float]]:
        """Compile, before serving, every graph `arms` can use, so no request pays for compiling.

        A round of K verifies up to K+1 tokens (fewer near max_new_tokens); a model drafter feeds
        1 or 2 tokens per step, and drafts a greedy round of up to K as one graph, as a feature
        head does. On CUDA it also runs the sampling ops once: their kernels load lazily, and the
        first sampled request would pay for them. Returns the compile report; eager engines have
        none.
        """
        if self.device.type == "cuda":
            sampling = SamplingParams(1.0, 0.9, seed=0, coupled=False)
            generator = self._generator(sampling)
            with torch.inference_mode():
                sample(probabilities(torch.zeros(self.vocab_size, device=self.device), sampling), generator)
                torch.rand(1, device=self.device, generator=generator)
        if self.cache_kind != "compiled":
            return {}
        arms = [Arm.of(a) for a in arms]
        prompt = torch.zeros(4, dtype=torch.long, device=self.device)
        top = max((a.k for a in arms), default=0)
        with torch.inference_mode():
            self.runner.begin(prompt, prompt.numel() + top + 2)
            for length in range(1, top + 2):
                self.runner.step(prompt[:1].repeat(1, length), prompt.numel(), keep=length)
            for name in {a.drafter for a in arms if not a.is_off}:
                able = capabilities(self.drafters.get(name))
                if able.features or able.shares_target:  # its draft loops, one graph per K
                    self.drafters[name].warm_up(list(range(1, top + 1)))  # K shrinks near a request's end
                drafter = model_drafter_of(self.drafters.get(name))
                if drafter is not None:  # steps of 1 and 2 tokens, and greedy rounds starting with either
                    drafter.runner.begin(prompt, prompt.numel() + 2 + top)
                    for length in (1, 2):
                        drafter.runner.step(prompt[:1].repeat(1, length), prompt.numel(), keep=1)
                        for k in range(1, top + 1):
                            drafter.runner.greedy_drafts(prompt[:1].repeat(1, length), prompt.numel(), k)
        return self.compile_report()

    def compile_report(self) -> dict[str, dict[str, float]]:
        """Seconds each compiled graph's first call took, per model: {"target": {"T->keep": s}, ...}."""
        report = {"target": dict(self.runner.compile_s)}
        for name, drafter in self.drafters.items():
            model = model_drafter_of(drafter)
            if model is not None and model.runner.compile_s:
                report[name] = dict(model.runner.compile_s)
            elif getattr(drafter, "compile_s", None):  # a feature head's draft loops
                report[name] = dict(drafter.compile_s)
        return report

    @property
    def arms_available(self) -> list[str]:
        return ["off", *self.drafters]

    def encode(self, prompt: str | list[int] | torch.Tensor, add_special_tokens: bool = True) -> torch.Tensor:
        """A prompt's token ids. Text gets the tokenizer's special tokens (a Llama's BOS) unless
        `add_special_tokens` is false, as `tokenizer(prompt)` and vLLM give them: a model trained
        with a BOS first decodes worse without it. Token ids are taken as they are."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: the tokenizer would raise a TypeError
                raise InvalidRequestError(f"the prompt is not valid Unicode text ({exc.reason} at character"
                                          f" {exc.start})") from None
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids instead")
            self.check_prompt_text(prompt)
            ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"] if prompt else []
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.reshape(-1).tolist()
        else:
            ids = list(prompt) if isinstance(prompt, Iterable) and not isinstance(prompt, bytes) else [None]
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError(f"a prompt is text, or token ids (ints) in a list or a tensor, got"
                                      f" {str(prompt)[:80]}")
        ids = [int(t) for t in ids]
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of vocabulary range: {bad[:5]}")
        return torch.tensor(ids, device=self.device)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Characters of the tokenizer's longest token as its vocabulary spells it (a byte-level
        token's string has a character per byte, so no token covers more text than this)."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)

    def check_prompt_text(self, text: str) -> None:
        """Refuse, before tokenizing it, a text far too long for the target's context: more than
        PROMPT_CHARS_SLACK x the context x the longest token's characters (the slack is for
        normalizers that merge characters), since tokenizing a huge text first costs far more than
        refusing it."""
        if self.max_length is None or self.tokenizer is None:
            return
        limit = PROMPT_CHARS_SLACK * self.max_length * self.longest_token_chars
        if len(text) > limit:
            raise InvalidRequestError(f"the prompt is {len(text)} characters, far more than the target's context of"
                                      f" {self.max_length} tokens holds (refused from {limit} characters, before"
                                      " tokenizing)")

    def bad_words_as_ids(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with its `bad_words` tokenized into `bad_words_ids`, as vLLM does: each word
        as written and after a space (how it reads inside a text)."""
        if not sampling.bad_words:
            return sampling
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words need the engine's tokenizer: pass bad_words_ids instead")
        spelled = {tuple(self.tokenizer.encode(text, add_special_tokens=False))
                   for word in sampling.bad_words for text in (word, " " + word.lstrip(" "))}
        extra = tuple(ids for ids in sorted(spelled) if ids and ids not in sampling.bad_words_ids)
        return replace(sampling, bad_words=(), bad_words_ids=sampling.bad_words_ids + extra)

    def check_request(self, prompt_len: int, arm: Arm, max_new_tokens: int,
                      sampling: SamplingParams | None = None) -> Drafter | None:
        """Refuse, with a clear error, a request this engine cannot serve on `arm`; its drafter."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if sampling is not None and (bad := sorted(t for t in sampling.token_ids() if t >= self.vocab_size)):
            raise InvalidRequestError(f"token ids in the sampling options are out of vocabulary range"
                                      f" (size {self.vocab_size}): {bad[:5]}")
        if sampling is not None and sampling.min_tokens > max_new_tokens:
            raise InvalidRequestError(f"min_tokens ({sampling.min_tokens}) exceeds max_new_tokens ({max_new_tokens}):"
                                      " the request could not end")
        if sampling is not None and sampling.min_tokens and sampling.allowed_token_ids is not None:
            if set(sampling.allowed_token_ids) <= self._end_ids(sampling):
                raise InvalidRequestError("allowed_token_ids are all end tokens, which min_tokens forbids:"
                                          " no token could be decoded")
        if self.max_length is not None and prompt_len + max_new_tokens > self.max_length:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the"
                f" target's context of {self.max_length} tokens"
            )
        if arm.is_off:
            return None
        if arm.drafter not in self.drafters:
            raise InvalidRequestError(
                f"unknown drafter {arm.drafter!r}; this engine has: {sorted(self.drafters) or 'none'}"
            )
        drafter = self.drafters[arm.drafter]
        limit = getattr(drafter, "max_length", None)
        if limit is not None and prompt_len + max_new_tokens + arm.k > limit:
            raise InvalidRequestError(
                f"prompt + max_new_tokens + K exceeds drafter {arm.drafter!r}'s context of {limit}"
            )
        return drafter

    def check_batch_request(self, prompt_len: int, arm: Arm, max_new_tokens: int) -> Drafter | None:
        """`check_request` for a request served in a batch: also refuses a target or a drafter
        that cannot decode batched."""
        check_batchable(self.target)
        drafter = self.check_request(prompt_len, arm, max_new_tokens)
        if drafter is not None and not capabilities(drafter).batch:
            raise InvalidRequestError(f"drafter {arm.drafter!r} ({type(drafter).__name__}) cannot run batched:"
                                      " it does not declare Capabilities(batch=True)")
        return drafter

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.inference_mode()
    def generate(
        self,
        prompt: str | list[int] | torch.Tensor,
        arm: Arm | str = OFF,
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        schedule: KSchedule | None = None,
        streamer: Streamer | None = None,
        control: RoundControl = NO_CONTROL,
    ) -> GenerationResult:
        """Decode one request on `arm`; the output is the target's own, whatever the arm.

        `streamer` (transformers' `TextStreamer`, `TextIteratorStreamer`, ...) gets the output as
        each round commits it (engine/streaming.py). `control`: what a scheduler asks of the
        rounds (`RoundControl`: pause for a batch, OFF rounds among them).
        """
        arm = Arm.of(arm)
        sampling = self.bad_words_as_ids(sampling or SamplingParams())
        schedule = schedule or ConstantK()
        ids = self.encode(prompt)
        drafter = self.check_request(ids.numel(), arm, max_new_tokens, sampling)
        if streamer is not None:
            check_streamer(streamer)
        try:
            result = self._decode(ids, arm, drafter, max_new_tokens, sampling, schedule, streamer, control)
        except BaseException:
            end_stream(streamer)  # the decoding error is the one to raise
            raise
        if result.rest is None:
            ended = end_stream(streamer)
            result.stream_error = result.stream_error or ended
        return result

    def _decode(self, ids: torch.Tensor, arm: Arm, drafter: Drafter | None, max_new_tokens: int,
                sampling: SamplingParams, schedule: KSchedule, streamer: Streamer | None,
                control: RoundControl) -> GenerationResult:
        pause, probe_off = control.pause, control.probe_off
        m = GenerationMetrics.of_request(ids.numel())
        row = Row(ids.tolist(), ids.numel(), max_new_tokens, sampling, self._generator(sampling),
                  self.stopping(sampling, ids.numel()), m, streamer)
        start = self._sync()
        max_length = ids.numel() + max_new_tokens  # K <= remaining - 1: no round writes past this
        logits = self.runner.begin(ids, max_length, 1 if sampling.prompt_logprobs is None else 0)
        m.cached_prompt_tokens = self.runner.reused
        if sampling.prompt_logprobs is not None:
            row.prompt_logprobs = prompt_logprobs(logits, row.tokens, sampling.prompt_logprobs)
        row.start(logits[-1:])
        feed = _Alone(self.runner, drafter, self.device)
        if drafter is not None:
            target_done = self._sync()
            feed.begin(ids, max_length)
            m.draft_prefill_s = self._sync() - target_done
        m.prefill_s = self._sync() - start
        now = stream([row], [row.prompt_len], m, prompt=True)

        k, paused = arm.k, False
        # output lengths at which a round runs OFF, spread over the request as its rounds are
        probe_at = [row.prompt_len + (i + 1) * max_new_tokens // (probe_off + 1) for i in range(probe_off)] \
            if drafter is not None else []
        while not row.done:
            if pause is not None and pause():
                paused = True
                break
            before = len(row.tokens)
            probing = bool(probe_at) and before >= probe_at[0] and feed.drafting
            report = decode_round(feed, [row], 0 if probing else k, self._sync, began=now)
            if probing:
                probe_at.pop(0)
                m.probe_s += report.ended - now
                m.probe_rounds += 1
                m.probe_tokens += 1
            elif report.drafted[0]:
                k = schedule.next_k(k, report.drafted[0], report.accepted[0])
            now = stream([row], [before], m, since=report.ended)

        tokens = row.tokens
        if not paused:  # a chat's next turn starts with this prompt and output
            self.runner.keep(tokens[:-1])
            if (model := model_drafter_of(feed.drafter)) is not None:
                model.keep(tokens[:-1])
        m.trim_positions()
        result = GenerationResult(tokens[row.prompt_len:], arm, m, fell_back=feed.fell_back,
                                  fallback_error=feed.error, stream_error=row.stream_error)
        result.prompt_logprobs = row.prompt_logprobs
        result.logprobs = None if row.logprobs is None else row.logprobs[: len(result.tokens)]  # a stop cut the tokens
        m.new_tokens = len(result.tokens)
        m.total_s = self._sync() - start - m.stream_s
        if self.tokenizer is not None:
            result.text = row.stopping.text(result.tokens)
        if paused:
            result.rest = BatchRequest(tokens, row.remaining, sampling, streamer, copy.copy(result), row.generator,
                                       self.runner.cached(len(tokens) - 1))
        else:
            result.finish_reason = finish_reason(row.stopped, result.stream_error)
        return result

    @torch.inference_mode()
    def generate_batch(
        self,
        prompts: list[str | list[int] | torch.Tensor],
        arm: Arm | str = OFF,
        max_new_tokens: int | list[int] = 64,
        sampling: SamplingParams | list[SamplingParams] | None = None,
        streamers: list[Streamer | None] | None = None,
        admit: Callable[[int], list[BatchRequest]] | None = None,
        on_done: Callable[[int, GenerationResult], None] | None = None,
        prefill_chunk: int | None = None,
        control: RoundControl = NO_CONTROL,
    ) -> BatchResult:
        """Decode several requests together, in one forward pass per round, on one arm.

        Each request's output is the one `generate` gives it alone (see engine/batch.py). The
        time fields of each result are the batch's: prefill, draft and verify time of the rounds
        the request took part in, and total_s from its prefill to its last token; the batch's
        own metrics count its rounds, drafter steps and wall time. `streamers`, one per request
        (or None), get each request's output as its rounds commit it.

        Continuous batching: `admit(live_rows)`, called before every round with the number of
        rows decoding, returns requests (`BatchRequest`) that join the batch there, on its arm,
        checked as its own prompts are. `on_done(i, result)` gets each request's result as soon
        as the request is done; i counts the prompts, then the joiners in order, as the returned
        results do. `prefill_chunk`: see `BatchSession`; a joiner whose prefill fails raises here.
        `control.probe_off`: as `generate`'s, rounds of every live row, run as the rows' mean
        output passes even fractions of the largest `max_new_tokens` (`BatchSession.step`'s
        `off`); a batch is not paused.
        """
        if isinstance(prompts, (str, bytes)):
            raise InvalidRequestError(f"prompts must be a list of prompts, got a single {type(prompts).__name__}:"
                                      " wrap it as [prompt]")
        if not prompts:
            raise InvalidRequestError("the batch is empty")
        count = len(prompts)
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * count
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * count
        streamers = streamers if streamers is not None else [None] * count
        if len(limits) != count or len(params) != count or len(streamers) != count:
            raise InvalidRequestError("max_new_tokens, sampling and streamers lists must have one entry per prompt")
        probe_off = control.probe_off
        # where the rows' mean output has grown to these lengths, a round runs OFF
        probe_at = [(i + 1) * max(limits) // (probe_off + 1) for i in range(probe_off)]
        for streamer in streamers:
            if streamer is not None:
                check_streamer(streamer)
        session = self.open_batch(arm, prefill_chunk)
        try:
            session.add([BatchRequest(*request) for request in zip(prompts, limits, params, streamers)])
            while True:
                if admit is not None and (joining := admit(session.live_rows)):
                    session.add(joining)
                for i, result in session.finished():
                    if on_done is not None:
                        on_done(i, result)
                for _, exc in session.failed():
                    raise exc
                if not session.live_rows and not session.prefilling:
                    return session.close()
                probing = bool(probe_at) and session.committed >= probe_at[0] * count
                if probing:
                    probe_at.pop(0)
                session.step(off=probing)
        except BaseException:
            session.abort()
            raise

    def open_batch(self, arm: Arm | str = OFF, prefill_chunk: int | None = None,
                   keep_results: bool = True) -> BatchSession:
        """A batch run a round at a time (see `BatchSession`): for a server that keeps one batch
        going, adding requests as they come and changing the arm between rounds."""
        return BatchSession(self, Arm.of(arm), prefill_chunk, keep_results)

    def _batch_row(self, request: BatchRequest, arm: Arm) -> Row:
        ids = self.encode(request.prompt)
        sampling = self.bad_words_as_ids(request.sampling or SamplingParams())
        self.check_request(ids.numel(), arm, request.max_new_tokens, sampling)
        generator = request.generator if request.generator is not None else self._generator(sampling)
        output_start = request.resumes.metrics.prompt_tokens if request.resumes is not None else ids.numel()
        return Row(ids.tolist(), ids.numel(), request.max_new_tokens, sampling, generator,
                   self.stopping(sampling, output_start), GenerationMetrics.of_request(ids.numel()),
                   request.streamer, resumes=request.resumes, cached=request.cached)

    def _end_ids(self, sampling: SamplingParams) -> set[int]:
        """The token ids that end this request's output: the model's EOS unless ignored, and its stop ids."""
        return (set() if sampling.ignore_eos else set(self.eos_token_id)).union(sampling.stop_token_ids)

    def stopping(self, sampling: SamplingParams, output_start: int) -> Stopping:
        """The end test of a request whose output starts at `output_start` (the prompt's length)."""
        return Stopping(self._end_ids(sampling), sampling.stop, self.tokenizer, output_start,
                        sampling.include_stop_str_in_output, sampling.min_tokens, sampling.stopping_criteria,
                        sampling.skip_special_tokens)

    def _generator(self, sampling: SamplingParams) -> Randomness | None:
        """A sampled request's own randomness (seeded when it gives a seed): its noise per position
        when it is coupled, else a random stream; None for greedy."""
        if sampling.greedy:
            return None
        seed = sampling.seed if sampling.seed is not None else torch.seed()
        if sampling.couples:
            return PositionNoise(seed, self.device)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator


class BatchSession:
    """One batch decoding round by round, which requests join and leave between rounds
    (continuous batching) and whose arm may change between rounds, as a server runs one
    (vLLM's engine step): `add` requests, `step` one round, take the `finished` results,
    `switch` the arm, `close` for the batch's metrics. Each request's output is the one it gets
    alone, whatever rows it shared rounds with and whatever arms decoded it.

    `prefill_chunk` (tokens; None: off): requests added while rows decode are prefilled at
    most that many tokens per round, before the round (chunked prefill), so the rows decoding
    wait for a chunk, not for a long prompt's whole prefill; they count in `prefilling` until
    they join, and one whose prefill fails alone comes back from `failed`.

    `keep_results=False` (a server's session, which may never drain): a request is forgotten
    once `finished` or `failed` has handed it over, its counts kept in the batch's totals, so
    the session holds only the requests still in it (one that kept them all would grow with
    every request it ever served); `close` then returns only the batch's metrics.
    """

    def __init__(self, engine: SpeculativeEngine, arm: Arm, prefill_chunk: int | None = None,
                 keep_results: bool = True) -> None:
        self.engine = engine
        self.arm = arm
        self.metrics = GenerationMetrics()  # the batch's: its rounds, drafter steps and times
        self.results: dict[int, GenerationResult] = {}
        self.keep_results = keep_results
        # the counts of the requests forgotten (keep_results=False)
        self._retired = GenerationMetrics.of_request(0)
        self._run = BatchRun(engine.target, self._drafter(arm), arm.k, self.metrics, engine._sync, prefill_chunk,
                             engine.runner.prefixes)

    def _drafter(self, arm: Arm) -> Drafter | None:
        return self.engine.check_batch_request(1, arm, 1)  # the model and the drafter can run batched

    @property
    def live_rows(self) -> int:
        return len(self._run.live)

    @property
    def prefilling(self) -> int:
        """Requests added but still prefilling (chunked prefill): not decoding yet."""
        return sum(len(join.indexes) for join in self._run.joins)

    @property
    def committed(self) -> int:
        """Output tokens the rounds so far committed, over every row (a prefill's first token excluded)."""
        return self._run.committed

    @property
    def fell_back(self) -> bool:
        """A drafter failed: the batch went on OFF."""
        return self._run.fell_back

    @property
    def live(self) -> list[int]:
        """The indexes of the requests still decoding."""
        return list(self._run.live)

    @property
    def row_rounds(self) -> int:
        """Live rows summed over the rounds so far (over rounds: the mean load)."""
        return self._run.row_rounds

    def totals(self) -> GenerationMetrics:
        """The batch's counters so far, for `GenerationMetrics.minus` between two moments: rounds,
        drafter steps, times, and drafts kept (by position) over every request."""
        out = copy.deepcopy(self.metrics)
        out.new_tokens = self._retired.new_tokens + sum(len(r.tokens) - r.prompt_len for r in self._run.rows.values())
        metrics = [*(r.metrics for r in self._run.rows.values()), self._retired]
        out.drafted = sum(m.drafted for m in metrics)
        out.accepted = sum(m.accepted for m in metrics)
        out.drafted_per_position = [sum(m.drafted_per_position[j] for m in metrics if j < len(m.drafted_per_position))
                                    for j in range(MAX_K)]
        out.accepted_per_position = [sum(m.accepted_per_position[j] for m in metrics
                                         if j < len(m.accepted_per_position)) for j in range(MAX_K)]
        out.total_s = self._run.elapsed()
        return out

    @torch.inference_mode()
    def add(self, requests: list[BatchRequest]) -> list[int]:
        """Prefill `requests` (all checked first) into the batch; their indexes (in the order added)."""
        rows = [self.engine._batch_row(request, self.arm) for request in requests]
        first = self._run.added
        self._run.admit(rows)
        return list(range(first, first + len(rows)))

    @torch.inference_mode()
    def step(self, off: bool = False) -> None:
        """One round of every live row, after a chunk of the prefill of requests waiting to join;
        `off`: a round without drafts on a drafting arm, timed into the metrics' `probe_s` (see
        `generate`'s `probe_off`)."""
        self._run.step(off)

    def failed(self) -> list[tuple[int, Exception]]:
        """The requests whose chunked prefill failed (alone) since the last call, as (index,
        exception); the batch went on without them."""
        out, self._run.failed = self._run.failed, []
        if not self.keep_results:
            for i, _ in out:
                self._forget(i)
        return out

    def _forget(self, i: int) -> None:
        """Drop request i from the session (keep_results=False), its counts kept in the totals."""
        self._retired = self._retired.plus(self._run.rows.pop(i).metrics)  # its prompt_tokens and new_tokens too

    @torch.inference_mode()
    def switch(self, arm: Arm) -> None:
        """Decode on `arm` from the next round on; refused (InvalidRequestError) if a live row
        does not fit its drafter's context."""
        drafter = self._drafter(arm)
        for i in self._run.live:
            row = self._run.rows[i]
            self.engine.check_request(row.prompt_len, arm, row.max_new_tokens)
        self._run.switch(drafter, arm.k)
        self.arm = arm if not self._run.fell_back else OFF

    def finished(self) -> list[tuple[int, GenerationResult]]:
        """The requests done since the last call, as (index, result); their streams are ended."""
        out = []
        for i in self._run.finished:
            row = self._run.rows[i]
            m = row.metrics
            m.trim_positions()
            tokens = row.tokens[row.prompt_len:]
            logprobs = None if row.logprobs is None else row.logprobs[:len(tokens)]  # a stop cut the tokens
            m.new_tokens = len(tokens)
            fell_back, error = self._run.fell_back, self._run.error
            if row.resumes is not None:  # a paused request: its output and metrics so far come first
                head = row.resumes
                tokens = head.tokens + tokens
                m = head.metrics.plus(m)
                m.prompt_tokens, m.new_tokens = head.metrics.prompt_tokens, len(tokens)
                m.trim_positions()
                fell_back, error = fell_back or head.fell_back, error or head.fallback_error
                if logprobs is not None:
                    logprobs = head.logprobs + logprobs
            tokenizer = self.engine.tokenizer
            text = None if tokenizer is None else row.stopping.text(tokens)
            result = GenerationResult(tokens, self.arm, m, text, fell_back, error)
            result.logprobs = logprobs
            result.prompt_logprobs = row.resumes.prompt_logprobs if row.resumes is not None else row.prompt_logprobs
            ended = end_stream(row.streamer)  # also a streamer that raised: its client hears the end
            result.stream_error = row.stream_error or ended
            result.finish_reason = finish_reason(row.stopped, result.stream_error)
            if self.keep_results:
                self.results[i] = result
            else:
                self._forget(i)
            out.append((i, result))
        self._run.finished = []
        return out

    def close(self) -> BatchResult:
        """The results of every request served (all done; not those that `failed`; none with
        keep_results=False), in the order added, and the batch's metrics."""
        self.finished()
        batch = self.totals()  # sums per position over untrimmed lengths: rows were trimmed when done
        batch.prompt_tokens = self._retired.prompt_tokens + sum(r.prompt_len for r in self._run.rows.values())
        batch.cached_prompt_tokens = sum(m.cached_prompt_tokens
                                         for m in [self._retired, *(r.metrics for r in self._run.rows.values())])
        batch.trim_positions()
        return BatchResult([self.results[i] for i in sorted(self.results)], batch)

    def abort(self) -> None:
        """End every request's stream (the batch failed)."""
        for row in self._run.rows.values():
            end_stream(row.streamer)
