"""Streaming and asyncio: each request's streamer gets exactly its own output, round by round, and is
ended once; requests awaited together are served together."""

import asyncio
import sys
import time

import pytest
from test_engine import FailingDrafter, hf_greedy, prompts
from transformers import AsyncTextIteratorStreamer, TextIteratorStreamer

from autotune.control.coalesce import Batch
from autotune.control.controller import AutotuneController, PendingRequest
from engine import OFF, SamplingParams, SpeculativeEngine
from store import Store


class Recorder:
    """transformers' streamer protocol, recording what it is given."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ends += 1

    @property
    def prompt(self):
        return self.puts[0][0] if self.puts else None

    @property
    def output(self):
        return [t for chunk in self.puts[1:] for t in chunk]


@pytest.fixture(scope="module")
def engine(target, draft_model):
    return SpeculativeEngine(target, {"self": target, "small": draft_model, "flaky": FailingDrafter(target, 3)})


def test_a_request_streams_its_prompt_then_its_output_as_each_round_commits_it(engine, target):
    prompt = prompts(3)[2]
    for arm in ("self:4", "small:3", "off"):
        streamer = Recorder()
        result = engine.generate(prompt, arm, max_new_tokens=20, streamer=streamer)
        assert streamer.prompt == prompt and streamer.output == result.tokens == hf_greedy(target, prompt, 20)
        assert streamer.ends == 1
        if arm == "self:4":  # a drafter that is always right commits K + 1 tokens a round
            assert [len(c) for c in streamer.puts[1:4]] == [1, 5, 5]
        if arm == "off":
            assert all(len(c) == 1 for c in streamer.puts[1:])


def test_a_drafter_failure_streams_on_without_repeating_a_token(engine, target):
    engine.drafters["flaky"].calls = 0
    streamer = Recorder()
    result = engine.generate(prompts(2, seed=5)[1], "flaky:4", max_new_tokens=30, streamer=streamer)
    assert result.fell_back and streamer.output == result.tokens == hf_greedy(target, prompts(2, seed=5)[1], 30)
    assert streamer.ends == 1


def test_each_row_of_a_batch_streams_its_own_output(engine, target):
    batch = prompts(5)
    streamers = [Recorder() if i != 2 else None for i in range(5)]
    out = engine.generate_batch(batch, "small:3", [8 + 3 * i for i in range(5)], streamers=streamers)
    for i, (p, r, s) in enumerate(zip(batch, out.results, streamers)):
        assert r.tokens == hf_greedy(target, p, 8 + 3 * i)
        if s is not None:
            assert s.prompt == p and s.output == r.tokens and s.ends == 1


class LogprobRecorder(Recorder):
    """A streamer that also takes log-probabilities (engine/streaming.py's optional method)."""

    def __init__(self):
        super().__init__()
        self.entries, self.order = [], []

    def put_logprobs(self, entries):
        self.entries.append(entries)
        self.order.append(("logprobs", len(entries)))

    def put(self, value):
        super().put(value)
        self.order.append(("put", value.numel()))


def test_a_streamer_that_takes_logprobs_gets_each_rounds_entries_just_before_its_tokens(engine, target):
    """Each round's entries match its tokens, also where a stop token cuts a round short, so the
    stream's entries are the result's."""
    prompt = prompts(3)[2]
    free = engine.generate(prompt, "off", 24).tokens
    cut = next(j for j in range(10, 24) if free[j] not in free[:j])
    sampling = SamplingParams(logprobs=2, stop_token_ids=[free[cut]])
    for arm in ("self:4", "small:3", "off"):
        streamer = LogprobRecorder()
        result = engine.generate(prompt, arm, 24, sampling, streamer=streamer)
        assert result.finish_reason == "stop" and result.tokens == free[:cut + 1]
        rounds = [len(c) for c in streamer.puts[1:]]
        assert streamer.order[1:] == [(kind, n) for n in rounds for kind in ("logprobs", "put")]
        assert [e for chunk in streamer.entries for e in chunk] == result.logprobs
    streamers = [LogprobRecorder(), Recorder(), LogprobRecorder()]  # one that does not take them
    batch = [prompt, prompts(3)[0], prompts(3)[1]]
    out = engine.generate_batch(batch, "small:3", 24, [sampling, SamplingParams(logprobs=2), SamplingParams()],
                                streamers=streamers)
    assert out.results[0].tokens == free[:cut + 1]
    assert [e for chunk in streamers[0].entries for e in chunk] == out.results[0].logprobs
    assert streamers[1].output == out.results[1].tokens and streamers[2].entries == []


def test_the_controller_streams_coalesced_requests_and_ends_a_refused_ones_stream(engine, target):
    ctl = AutotuneController(engine, policy="static", arms=[OFF], arm="small:3", max_batch=4)
    too_long = list(range(60)) * 5  # 300 tokens: more than the target's context of 256
    batch = [prompts(3)[0], too_long, prompts(3)[1]]
    streamers = [Recorder() for _ in batch]
    # The batch is refused before decoding (one row over the target's context), then each is
    # served alone: the others stream their output once, the refused one streams nothing.
    outcomes = ctl._serve_coalesced(None, Batch.of([PendingRequest(p, "code", False, 4, SamplingParams(), s, 0.0)
                                                    for p, s in zip(batch, streamers)]))
    assert "exceeds the target's context" in str(outcomes[1]) and streamers[1].puts == []
    for i in (0, 2):
        assert streamers[i].output == outcomes[i].tokens == hf_greedy(target, batch[i], 4)

    served = Recorder()  # through `generate`: ended once, though the engine and the controller both end it
    assert ctl.generate(batch[0], request_class="code", max_new_tokens=4, streamer=served).tokens == served.output
    assert served.ends == 1
    refused = Recorder()  # a request that fails still has its stream ended
    with pytest.raises(Exception, match="exceeds the target's context"):
        ctl.generate(list(range(60)) * 5, request_class="code", max_new_tokens=4, streamer=refused)
    assert refused.puts == [] and refused.ends == 1


@pytest.fixture(scope="module")
def family():
    from autotune.train.zoo import load_engine

    return load_engine(device="cpu")  # the committed model family, with its tokenizer


def test_transformers_text_iterator_streamer_yields_the_requests_text(family):
    ctl = AutotuneController(family, policy="static", arms=[OFF], arm="ngram+distilled:4")
    streamer = TextIteratorStreamer(family.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = ctl.generate("def parse_args(argv):\n    ", request_class="code", max_new_tokens=48, streamer=streamer)
    assert "".join(streamer) == result.text and len(result.text) > 20


def test_a_stop_string_ends_the_output_and_its_stream_at_the_token_that_completes_it(family):
    """The stream, token-level as transformers' streamers are, holds the stop string; the result's
    text ends before it unless include_stop_str_in_output."""
    ctl = AutotuneController(family, policy="static", arms=[OFF], arm="ngram+distilled:4")
    prompt = "def parse_args(argv):\n    "
    free = ctl.generate(prompt, request_class="code", max_new_tokens=48)
    stop = free.text[len(free.text) // 2:][:3]
    results, streamed = [], []
    for keep in (False, True):
        streamer = TextIteratorStreamer(family.tokenizer, skip_prompt=True, skip_special_tokens=True)
        results.append(ctl.generate(prompt, request_class="code", max_new_tokens=48, streamer=streamer, stop=[stop],
                                    include_stop_str_in_output=keep))
        streamed.append("".join(streamer))
    result, kept = results
    assert result.tokens == kept.tokens == free.tokens[:len(result.tokens)] and len(result.tokens) < len(free.tokens)
    assert stop in kept.text and stop not in family.tokenizer.decode(result.tokens[:-1], skip_special_tokens=True)
    assert result.text == kept.text[:kept.text.index(stop)] and streamed == [kept.text] * 2


def test_requests_awaited_together_are_coalesced_and_each_gets_its_own_output(engine, target):
    ctl = AutotuneController(engine, policy="static", arms=[OFF], arm="small:3", max_batch=8, batch_wait_ms=200)
    batch = prompts(8)

    async def serve():
        return await asyncio.gather(*(ctl.agenerate(p, request_class="code", max_new_tokens=5 + i)
                                      for i, p in enumerate(batch)))

    for _ in range(2):  # the controller's threads serve more than one event loop's requests
        results = asyncio.run(serve())
        assert [r.tokens for r in results] == [hf_greedy(target, p, 5 + i) for i, p in enumerate(batch)]
        assert max(r.load for r in results) > 1
    ctl.close()
    assert ctl._threads is None


def test_a_cancelled_agenerate_stops_its_request(engine, target, tmp_path):
    """The task awaiting a request is cancelled once its output has begun (an asyncio server
    whose client went away): the request stops at its next round, where its thread used to
    decode all 200 tokens; and one cancelled while it waits for the engine never decodes."""
    with Store(f"sqlite:///{tmp_path / 'cancel.db'}") as store:
        ctl = AutotuneController(engine, store, policy="static", arms=[OFF], arm=OFF)

        async def serve():
            begun = Recorder()
            running = asyncio.ensure_future(ctl.agenerate(prompts(1)[0], "code", max_new_tokens=200, ignore_eos=True,
                                                          streamer=begun))
            waiting = asyncio.ensure_future(ctl.agenerate(prompts(2)[1], "chat", max_new_tokens=200, ignore_eos=True))
            while len(begun.puts) < 3:  # the prompt, then two rounds
                await asyncio.sleep(0.001)
            for task in (running, waiting):
                task.cancel()
            for task in (running, waiting):
                with pytest.raises(asyncio.CancelledError):
                    await task
            return begun

        begun = asyncio.run(serve())
        ctl.close()
        observed = {o["request_class"]: o for o in store.observations()}
    assert begun.ends == 1 and begun.output == hf_greedy(target, prompts(1)[0], len(begun.output))
    for cls in ("code", "chat"):
        assert observed[cls]["finish_reason"] == "abort" and "cancelled" in observed[cls]["stream_error"]
    assert observed["code"]["new_tokens"] < 200 and observed["chat"]["new_tokens"] == 1


@pytest.mark.skipif(sys.version_info < (3, 11), reason="AsyncTextIteratorStreamer needs asyncio.timeout")
def test_transformers_async_streamer_yields_the_requests_text_while_it_is_served(family):
    ctl = AutotuneController(family, policy="static", arms=[OFF], arm="ngram+distilled:4")

    async def serve():
        streamer = AsyncTextIteratorStreamer(family.tokenizer, skip_prompt=True, skip_special_tokens=True)
        request = asyncio.ensure_future(ctl.agenerate("def parse_args(argv):\n", request_class="code",
                                                      max_new_tokens=48, streamer=streamer))
        pieces = [piece async for piece in streamer]
        return pieces, await request

    pieces, result = asyncio.run(serve())
    assert "".join(pieces) == result.text and len(pieces) > 1
    ctl.close()


class GoneAway(Recorder):
    """A client that disconnects: its streamer raises from the `fail_at`-th put on."""

    def __init__(self, fail_at):
        super().__init__()
        self.fail_at = fail_at

    def put(self, value):
        if len(self.puts) + 1 >= self.fail_at:
            raise ConnectionResetError("client went away")
        super().put(value)


def test_a_streamer_that_raises_stops_only_its_own_request(engine, target, tmp_path):
    batch = prompts(4)
    streamers = [Recorder(), GoneAway(fail_at=3), Recorder(), None]
    out = engine.generate_batch(batch, "small:3", 20, streamers=streamers)
    for i in (0, 2, 3):  # the rest of the batch goes on as if the row had finished
        assert out.results[i].tokens == hf_greedy(target, batch[i], 20) and out.results[i].stream_error is None
    stopped = out.results[1]
    assert "ConnectionResetError: client went away" in stopped.stream_error
    assert [r.finish_reason for r in out.results] == ["length", "abort", "length", "length"]
    # It keeps what was decoded up to the round whose put failed; the client got the rounds before.
    assert stopped.tokens == hf_greedy(target, batch[1], 20)[: len(stopped.tokens)] and len(stopped.tokens) < 20
    assert streamers[1].output == stopped.tokens[: len(streamers[1].output)] != []
    assert [s.ends for s in streamers[:3]] == [1, 1, 1]

    with Store(f"sqlite:///{tmp_path / 's.db'}") as store:
        ctl = AutotuneController(engine, store, policy="static", arms=[OFF], arm="small:3")
        gone = GoneAway(fail_at=2)
        alone = ctl.generate(batch[0], request_class="code", max_new_tokens=20, streamer=gone)
        assert "went away" in alone.stream_error and alone.tokens == hf_greedy(target, batch[0], 20)[:1]
        assert alone.finish_reason == "abort"
        results = ctl.generate_batch(batch, request_class="code", max_new_tokens=20,
                                     streamers=[GoneAway(3), None, None, None])
        assert "went away" in results[0].stream_error
        assert [r.tokens for r in results[1:]] == [hf_greedy(target, p, 20) for p in batch[1:]]
        ctl.close()
        recorded = sorted(store.observations(), key=lambda o: o["id"])
    # The store tells a request cut short by its client from one that ended on its own.
    assert [o["new_tokens"] for o in recorded] == [len(r.tokens) for r in [alone, *results]]
    assert [o["stream_error"] for o in recorded] == [alone.stream_error, results[0].stream_error, None, None, None]
    assert [o["finish_reason"] for o in recorded] == ["abort", "abort", "length", "length", "length"]


class Slow(Recorder):
    """A streamer that takes 20 ms a put, as a slow client would."""

    def put(self, value):
        time.sleep(0.02)
        super().put(value)


def test_a_slow_streamers_time_is_kept_out_of_the_engines_timings(engine):
    # The policy learns from these timings: a slow client must not read as a slow arm.
    alone = engine.generate(prompts(3)[0], "off", max_new_tokens=10, streamer=Slow()).metrics
    batch = engine.generate_batch(prompts(3), "small:2", 10, streamers=[Slow(), None, Slow()]).metrics
    for m in (alone, batch):
        assert m.stream_s >= 0.02 * 10  # 11 puts alone; in the batch at least 5 per slow row (prompt, first, 3+ rounds)
        assert m.prefill_s + m.draft_s + m.verify_s < m.stream_s / 2 and m.total_s < m.stream_s / 2
