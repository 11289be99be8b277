"""How a batch prefills its rows, the engine's way against the way before, the same requests
both ways, taking turns.

`autotune bench choices`: a request's n sampled choices (vLLM's and OpenAI's `n`; best-of-n and
self-consistency sampling ask for them) with their prompt prefilled once and shared, against
every choice prefilling it. `autotune bench lengths`: rows of mixed lengths (a burst of every
class) prefilled in groups of similar length, against all in one forward padded to the longest.
`autotune bench chunked`: long prompts joining a batch that decodes, and bursts of clients,
prefilled a chunk a round against in one go. `autotune bench prefix`: requests sharing a long
context, their models keeping earlier prompts' keys and values against keeping none.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable
from unittest import mock

import engine.batch as engine_batch
from autotune.bench.common import client_plan, device_name, p99, rotate, run_clients
from autotune.control.controller import AutotuneController
from autotune.data.classes import RequestClass
from engine import Arm, BatchRequest, SamplingParams, SpeculativeEngine
from engine.drafters import model_drafter_of


def _every_choice():
    """Every row fed, also rows with the same prompt."""
    return mock.patch.object(engine_batch, "prefilled", functools.partial(engine_batch.prefilled, share=False))


def _one_forward():
    """Every row in one forward, padded to the longest."""
    return mock.patch.object(engine_batch, "length_groups", lambda lengths: [list(range(len(lengths)))])


class _Tally:
    """Per way (of prefilling, of keeping prompts), the seconds, prefill seconds, output tokens
    and prompt tokens reused of the requests or batches served, and whether the outputs were the
    same every way."""

    def __init__(self, ways: dict[str, Callable]) -> None:
        self.ways = ways
        self.seconds, self.prefill, self.tokens, self.cached = (dict.fromkeys(ways, 0.0) for _ in range(4))
        self.served, self.prompt_tokens, self.identical = 0, 0, True

    def serve(self, engine: SpeculativeEngine, i: int, prompts: list[list[int]], arm: Arm, limits,
              sampling: list[SamplingParams] | None = None, alone: bool = False) -> list:
        """One batch served each way (`alone`: its one prompt through `generate`), the i-th way
        first; the first way's results."""
        outputs, first = [], None
        for way in rotate(list(self.ways), i):
            with self.ways[way]():
                began = time.perf_counter()
                if alone:
                    served = [engine.generate(prompts[0], arm, limits, sampling[0] if sampling else None)]
                    prefill = served[0].metrics.prefill_s
                else:
                    batch = engine.generate_batch(prompts, arm, limits, sampling)
                    served, prefill = list(batch), batch.metrics.prefill_s
                self.seconds[way] += time.perf_counter() - began
            self.prefill[way] += prefill
            self.tokens[way] += sum(r.metrics.new_tokens for r in served)
            self.cached[way] += sum(r.metrics.cached_prompt_tokens for r in served)
            outputs.append([r.tokens for r in served])
            first = first or served
        self.identical &= all(o == outputs[0] for o in outputs)
        self.served += 1
        self.prompt_tokens += sum(map(len, prompts))
        return first

    def summary(self, per: str) -> dict:
        """Tokens/s and prefill seconds per `per` (a request or batch served) each way, and the
        first way's tokens/s over the second's."""
        tps = {w: self.tokens[w] / self.seconds[w] for w in self.ways}
        first, second = self.ways
        return {"tokens_per_s": {w: round(v, 1) for w, v in tps.items()},
                f"prefill_s_per_{per}": {w: round(self.prefill[w] / self.served, 4) for w in self.ways},
                f"{first}_vs_{second}".replace(" ", "_"): round(tps[first] / tps[second], 3)}


def long_prompts(engine: SpeculativeEngine, cls: RequestClass, tokens: int, count: int) -> list[list[int]]:
    """`count` prompts of `tokens` tokens, each the class's prompts joined from a different one
    on (a few-shot prompt's shape)."""
    out = []
    for i in range(count):
        ids: list[int] = []
        j = i
        while len(ids) < tokens:
            ids += engine.encode(cls.prompts[j % len(cls.prompts)]).tolist()
            j += 1
        out.append(ids[-tokens:])
    return out


def bench_choices(engine: SpeculativeEngine, cls: RequestClass, arms: list[Arm], n: int, requests: int,
                  long_tokens: int) -> dict:
    """Each case (the class's prompts, or `long_tokens`-token ones; an arm) serves `requests`
    requests of `n` choices, seeded 0..n-1, as one batch each, with the prompt shared and fed
    for every choice; the outputs must be identical."""
    prompt_sets = {"workload": [engine.encode(p).tolist() for p in cls.prompts[:requests]],
                   f"{long_tokens} tokens": long_prompts(engine, cls, long_tokens, requests)}
    sampling = [SamplingParams(cls.temperature, cls.top_p, seed=j) for j in range(n)]
    out, identical = {}, True
    for kind, prompts in prompt_sets.items():
        for arm in arms:
            tally = _Tally({"shared": contextlib.nullcontext, "every choice": _every_choice})
            for i, prompt in enumerate(prompts):
                tally.serve(engine, i, [prompt] * n, arm, cls.max_new_tokens, sampling)
            identical &= tally.identical
            out[f"{kind} {arm}"] = {"prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
                                    **tally.summary("request")}
    return {"device": device_name(engine), "class": cls.name, "n": n, "requests": requests,
            "max_new_tokens": cls.max_new_tokens, "identical_outputs": identical, "cases": out}


def bench_lengths(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm], size: int,
                  batches: int) -> dict:
    """Each arm serves `batches` batches of `size` requests, every class's prompts in turn (so
    lengths mix as in a burst of every class; greedy and sampled by their classes), prefilled
    in groups of similar length and in one forward; the outputs must be identical."""
    names = list(classes)
    picked = [classes[names[j % len(names)]] for j in range(size)]
    limits = [cls.max_new_tokens for cls in picked]
    sampling = [SamplingParams(cls.temperature, cls.top_p, seed=j) for j, cls in enumerate(picked)]
    batched = [[engine.encode(cls.prompts[(i * size + j) % len(cls.prompts)]).tolist() for j, cls in enumerate(picked)]
               for i in range(batches)]
    padding = sum(len(p) * max(map(len, p)) / sum(map(len, p)) for p in batched) / batches
    out, identical = {}, True
    for arm in arms:
        tally = _Tally({"grouped": contextlib.nullcontext, "one forward": _one_forward})
        for i, prompts in enumerate(batched):
            tally.serve(engine, i, prompts, arm, limits, sampling)
        identical &= tally.identical
        out[str(arm)] = {"padded_over_real_tokens": round(padding, 2), **tally.summary("batch")}
    return {"device": device_name(engine), "classes": names, "batch": size, "batches": batches,
            "identical_outputs": identical, "arms": out}


class _Stream:
    """A streamer that keeps its request's output and when each put after the prompt came."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.puts = 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts > 1:  # the first put is the prompt
            self.times.append(time.perf_counter())
            self.tokens += value.reshape(-1).tolist()

    def end(self) -> None:
        pass


def bench_chunked(engine: SpeculativeEngine, classes: dict[str, RequestClass], arms: list[Arm],
                  chunks: tuple[int | None, ...] = (None, 256, 512), rows: int = 8, joins: int = 6,
                  long_tokens: int = 900, every: int = 24, rounds: int = 2) -> dict:
    """`rows` requests of every class (their sampling, EOS ignored) decode in one batch session
    while a `long_tokens`-token prompt (greedy, 16 new tokens) is added every `every` rounds,
    `joins` of them; the session ends when the last has finished. Each case (arm x prefill_chunk,
    None: in one go) serves the same requests, cases taking turns round by round. Reported: the
    gaps between a decoding row's streamed rounds (a join in one go stalls them for its whole
    prefill), the long prompts' time to first token from being added, and tokens/s over
    everything committed; each arm's outputs must be identical (the decoding rows' as far as every
    case got)."""
    names = list(classes)
    picked = [classes[names[j % len(names)]] for j in range(rows)]
    prompts = [engine.encode(cls.prompts[j // len(names) % len(cls.prompts)]).tolist() for j, cls in enumerate(picked)]
    sampling = [SamplingParams(cls.temperature, cls.top_p, seed=j, ignore_eos=True) for j, cls in enumerate(picked)]
    longs = long_prompts(engine, classes[names[0]], long_tokens, joins)
    limit = joins * every + 120  # rounds enough for the decoding rows to outlast the last join
    cases = [(arm, chunk) for arm in arms for chunk in chunks]
    stats = {case: {"gaps": [], "ttft": [], "seconds": 0.0, "tokens": 0} for case in cases}
    outputs: dict = {case: [] for case in cases}
    for r in range(-1, rounds):  # round -1 warms up each case (a first forward of a shape allocates)
        for arm, chunk in rotate(cases, r):
            s, decoding = stats[(arm, chunk)], [_Stream() for _ in prompts]
            session = engine.open_batch(arm, chunk)
            began = time.perf_counter()
            session.add([BatchRequest(p, limit, sp, st) for p, sp, st in zip(prompts, sampling, decoding)])
            added, done, step = {}, {}, 0
            while len(done) < joins:
                if step % every == 0 and len(added) < joins:
                    stream = _Stream()
                    added[session.add([BatchRequest(longs[len(added)], 16, streamer=stream)])[0]] = (
                        stream, time.perf_counter())
                session.step()
                step += 1
                done.update((i, result.tokens) for i, result in session.finished() if i in added)
            if r < 0:
                continue
            s["seconds"] += time.perf_counter() - began
            s["tokens"] += sum(len(st.tokens) for st in decoding) + sum(len(t) for t in done.values())
            s["gaps"] += [b - a for st in decoding for a, b in zip(st.times, st.times[1:])]
            s["ttft"] += [st.times[0] - at for st, at in added.values()]
            outputs[(arm, chunk)].append(([done[i] for i in sorted(done)], [st.tokens for st in decoding]))
    identical = True  # per arm (a sampled row draws other tokens on another arm)
    for arm, r in itertools.product(arms, range(rounds)):
        got = [outputs[(arm, chunk)][r] for chunk in chunks]
        identical &= all(g[0] == got[0][0] for g in got)
        for row in range(rows):
            shortest = min(len(g[1][row]) for g in got)
            identical &= all(g[1][row][:shortest] == got[0][1][row][:shortest] for g in got)
    out = {}
    for arm in arms:
        per = {}
        for chunk in chunks:
            s = stats[(arm, chunk)]
            ms = [1e3 * g for g in s["gaps"]]
            per["in one go" if chunk is None else f"{chunk} tokens"] = {
                "gap_ms": {"p50": round(sorted(ms)[len(ms) // 2], 1), "p99": round(p99(ms), 1),
                           "max": round(max(ms), 1)},
                "long_ttft_s": {"mean": round(sum(s["ttft"]) / len(s["ttft"]), 3), "max": round(max(s["ttft"]), 3)},
                "tokens_per_s": round(s["tokens"] / s["seconds"], 1)}
        base = per["in one go"]["tokens_per_s"] if None in chunks else None
        for v in per.values():
            if base:
                v["tokens_per_s_vs_in_one_go"] = round(v["tokens_per_s"] / base, 3)
        out[str(arm)] = per
    return {"device": device_name(engine), "rows": rows, "joins": joins, "long_prompt_tokens": long_tokens,
            "every_rounds": every, "rounds": rounds, "identical_outputs": identical, "arms": out}


def bench_chunked_clients(engine: SpeculativeEngine, classes: dict[str, RequestClass],
                          chunks: tuple[int | None, ...] = (None, 256, 512), clients: int = 16,
                          requests_per_client: int = 4, rounds: int = 3) -> dict:
    """Bursts of short prompts: `clients` threads (bench concurrency's plan), each sending its
    requests one after another through a continuous-batching controller (policy off, so every
    case serves the same tokens) with each prefill_chunk, cases taking turns round by round
    after a warm-up round. Reported: tokens/s, time to first token from the call, and gaps
    between a request's streamed rounds; outputs must be identical."""
    plan = client_plan(engine, classes, clients, requests_per_client)
    controllers = {chunk: AutotuneController(engine, policy="off", arms=[Arm()], max_batch=clients,
                                             prefill_chunk=chunk) for chunk in chunks}
    stats = {chunk: {"seconds": 0.0, "tokens": 0, "ttft": [], "gaps": []} for chunk in chunks}
    outputs: dict = {chunk: {} for chunk in chunks}
    for r in range(-1, rounds):  # round -1 warms up
        for chunk in rotate(list(chunks), r):
            ctl, s = controllers[chunk], stats[chunk]

            def client(c: int, ctl=ctl, s=s, chunk=chunk, r=r) -> None:
                cls, prompts = plan[c]
                for j, prompt in enumerate(prompts):
                    stream, began = _Stream(), time.perf_counter()
                    result = ctl.generate(prompt, cls.name, cls.max_new_tokens, cls.temperature, cls.top_p,
                                          seed=c * requests_per_client + j, streamer=stream)
                    outputs[chunk][(r, c, j)] = result.tokens
                    if r >= 0:
                        s["tokens"] += len(result.tokens)
                        s["ttft"].append(stream.times[0] - began)
                        s["gaps"] += [b - a for a, b in zip(stream.times, stream.times[1:])]

            seconds = run_clients(client, clients)
            if r >= 0:
                s["seconds"] += seconds
    out = {}
    for chunk in chunks:
        s = stats[chunk]
        ttft, ms = sorted(s["ttft"]), sorted(1e3 * g for g in s["gaps"])
        out["in one go" if chunk is None else f"{chunk} tokens"] = {
            "tokens_per_s": round(s["tokens"] / s["seconds"], 1),
            "ttft_s": {"p50": round(ttft[len(ttft) // 2], 3), "p99": p99(ttft)},
            "gap_ms": {"p50": round(ms[len(ms) // 2], 1), "p99": round(p99(ms), 1), "max": round(ms[-1], 1)}}
    return {"clients": clients, "requests_per_client": requests_per_client, "rounds": rounds,
            "identical_outputs": all(outputs[chunk] == outputs[chunks[0]] for chunk in chunks), "cases": out}


def _runners(engine: SpeculativeEngine) -> list:
    """The target's runner and each model drafter's."""
    return [engine.runner] + [model_drafter_of(d).runner for d in engine.drafters.values()
                              if model_drafter_of(d) is not None]


@contextlib.contextmanager
def _no_kept_prefixes(engine: SpeculativeEngine):
    """The engine's models keeping no prompts for the while (each prompt prefilled whole)."""
    runners = _runners(engine)
    kept = [r.prefixes for r in runners]
    for r in runners:
        r.prefixes = None
    try:
        yield
    finally:
        for r, prefixes in zip(runners, kept):
            r.prefixes = prefixes


def _keeping_or_not(engine: SpeculativeEngine) -> dict[str, Callable]:
    """The two ways bench prefix compares: the engine's models keeping prompts, and keeping none."""
    return {"kept": contextlib.nullcontext, "none": functools.partial(_no_kept_prefixes, engine)}


def after(engine: SpeculativeEngine, context: list[int], prompt: list[int], max_new_tokens: int) -> list[int]:
    """`context` then `prompt`, the prompt's start cut off if that would not leave room for
    `max_new_tokens` in the target's context (an edit prompt after a 600-token context)."""
    room = (engine.max_length or 1 << 30) - max_new_tokens - len(context)
    if room < 1:
        raise ValueError(f"a {len(context)}-token context leaves no room for a prompt and {max_new_tokens} new tokens")
    return context + prompt[-room:]


def bench_prefix(engine: SpeculativeEngine, cls: RequestClass, arms: list[Arm], context_tokens: int,
                 requests: int, batch: int, turns: int = 4) -> dict:
    """Per arm, greedy, with the engine's prefix caches (built with it) and with none, taking
    turns; the outputs must be identical. Cases, each starting with nothing kept:
    - `requests` requests of one `context_tokens`-token context (the class's prompts joined, a
      document or few-shot prompt's shape), each followed by one of the class's prompts, served
      one at a time and in batches of `batch`;
    - the class's prompts alone, served the same two ways: what keeping prompts costs where
      nothing is shared (a copy of each prompt, and of its output when done);
    - chats of `turns` turns, one at a time: a turn's prompt is the last turn's prompt and output
      followed by the next of the class's prompts (as the user's next message)."""
    if engine.runner.prefixes is None:
        raise ValueError("bench prefix needs an engine that keeps prefixes (prefix_cache_tokens)")
    context = long_prompts(engine, cls, context_tokens, 1)[0]
    messages = [engine.encode(p, add_special_tokens=False).tolist() for p in cls.prompts]
    shared = [after(engine, context, messages[i % len(messages)], cls.max_new_tokens) for i in range(requests)]
    unrelated = [engine.encode(cls.prompts[i % len(cls.prompts)]).tolist() for i in range(requests)]
    ways = _keeping_or_not(engine)

    def case() -> _Tally:
        for runner in _runners(engine):  # each case starts with nothing kept
            runner.prefixes.clear()
        return _Tally(ways)

    def summary(tally: _Tally, per: str) -> dict:
        return {"prompt_tokens": round(tally.prompt_tokens / tally.served, 1),
                "cached_prompt_share": round(tally.cached["kept"] / tally.prompt_tokens, 3), **tally.summary(per)}

    out, identical = {}, True
    for arm in arms:
        for prompts, mode, size in ((shared, "alone", 1), (shared, f"batches of {batch}", batch),
                                    (unrelated, "unrelated prompts alone", 1),
                                    (unrelated, f"unrelated prompts in batches of {batch}", batch)):
            tally = case()
            for i, start in enumerate(range(0, requests, size)):
                tally.serve(engine, i, prompts[start:start + size], arm, cls.max_new_tokens, alone=size == 1)
            out[f"{arm} {mode}"] = summary(tally, "request" if size == 1 else "batch")
            identical &= tally.identical
        tally = case()
        for chat in range(requests // turns):
            prompt: list[int] = []
            for turn in range(turns):
                message = messages[(chat * turns + turn) % len(messages)]
                if len(prompt) + len(message) + cls.max_new_tokens > (engine.max_length or 1 << 30):
                    break  # the chat outgrew the context
                prompt = prompt + message
                served = tally.serve(engine, chat * turns + turn, [prompt], arm, cls.max_new_tokens, alone=True)
                prompt = prompt + served[0].tokens  # the next turn starts with this one's prompt and output
        out[f"{arm} chats of {turns} turns"] = summary(tally, "request")
        identical &= tally.identical
    return {"device": device_name(engine), "class": cls.name, "context_tokens": context_tokens,
            "requests": requests, "max_new_tokens": cls.max_new_tokens, "identical_outputs": identical, "cases": out}


def bench_prefix_clients(engine: SpeculativeEngine, classes: dict[str, RequestClass], context_tokens: int,
                         clients: int = 16, requests_per_client: int = 4, rounds: int = 2,
                         policies: tuple[str, ...] = ("off", "ucb")) -> dict:
    """A server's view: `clients` threads (bench concurrency's plan, every prompt after one
    `context_tokens`-token context: a system prompt), each sending its requests one after
    another through a continuous-batching controller per policy, with the engine's prefix caches
    and with none; configurations take turns round by round, each round starting with nothing
    kept. Reported: tokens/s, time to first token from the call, the share of prompt tokens
    reused; greedy outputs must be identical."""
    if engine.runner.prefixes is None:
        raise ValueError("bench prefix needs an engine that keeps prefixes (prefix_cache_tokens)")
    first = next(iter(classes.values()))
    context = long_prompts(engine, first, context_tokens, 1)[0]
    plan = [(cls, [after(engine, context, prompt, cls.max_new_tokens) for prompt in prompts])
            for cls, prompts in client_plan(engine, classes, clients, requests_per_client)]
    ways = _keeping_or_not(engine)
    configs = [(p, way) for p in policies for way in ways]
    controllers = {config: AutotuneController(engine, policy=config[0], max_batch=clients) for config in configs}
    stats = {config: {"seconds": 0.0, "tokens": 0, "prompt": 0, "cached": 0, "ttft": []} for config in configs}
    greedy: dict = {}
    for r in range(rounds):
        for config in rotate(configs, r):
            ctl, s = controllers[config], stats[config]
            for runner in _runners(engine):
                runner.prefixes.clear()

            def client(c: int, ctl=ctl, s=s) -> None:
                cls, prompts = plan[c]
                for j, prompt in enumerate(prompts):
                    stream, began = _Stream(), time.perf_counter()
                    result = ctl.generate(prompt, cls.name, cls.max_new_tokens, cls.temperature, cls.top_p,
                                          seed=c * requests_per_client + j, streamer=stream)
                    s["tokens"] += len(result.tokens)
                    s["prompt"] += len(prompt)
                    s["cached"] += result.metrics.cached_prompt_tokens
                    s["ttft"].append(stream.times[0] - began)
                    if cls.temperature == 0:
                        greedy.setdefault((c, j), set()).add(tuple(result.tokens))

            with ways[config[1]]():
                s["seconds"] += run_clients(client, clients)
    out = {}
    for (policy, way), s in stats.items():
        ttft = sorted(s["ttft"])
        out[f"{policy} {way}"] = {"tokens_per_s": round(s["tokens"] / s["seconds"], 1),
                                  "ttft_s": {"p50": round(ttft[len(ttft) // 2], 3), "p99": p99(ttft)},
                                  "cached_prompt_share": round(s["cached"] / s["prompt"], 3)}
    return {"clients": clients, "requests_per_client": requests_per_client, "rounds": rounds,
            "context_tokens": context_tokens, "configs": out,
            "kept_vs_none": {p: round(out[f"{p} kept"]["tokens_per_s"] / out[f"{p} none"]["tokens_per_s"], 3)
                             for p in policies},
            "identical_greedy_outputs": all(len(v) == 1 for v in greedy.values())}
