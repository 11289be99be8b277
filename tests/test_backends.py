"""The controller over engines it does not own: real llama-server processes (built from
llama-cpp-python's sdist by `autotune llamacpp`), and `autotune serve` replicas behind the
routing backend, as vLLM or SGLang replicas would be.

llama.cpp's tests skip where it is not built, except in CI (AUTOTUNE_REQUIRE_LLAMACPP=1), which
builds it first."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from autotune.backends import (
    BackendController,
    BackendError,
    BackendRequest,
    BackendResponse,
    LlamaCpp,
    LlamaCppBackend,
    family_servers,
)
from autotune.backends.controller import bounded_speedup
from autotune.backends.llamacpp_build import check_gpt2_pretokenizer, default_dir
from autotune.backends.routing import Replica, RoutingBackend
from autotune.control.inspect_store import latest_policy
from autotune.data.classes import builtin_classes
from autotune.train.zoo import DEFAULT_FAMILY_DIR, load_engine
from engine import OFF, Arm
from store import Store

MEMBERS = ("target", "distilled")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_FAMILY_DIR / "target")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Code and copy-with-a-change prompts, as token ids (held-out stdlib source)."""
    classes = builtin_classes(include_shared=False)
    return [tokenizer.encode(p) for name in ("code", "edit") for p in classes[name].prompts[:2]]


@pytest.fixture(scope="module")
def llama():
    """llama.cpp's server, built."""
    llama = LlamaCpp(default_dir())
    if not llama.server.exists():
        if os.environ.get("AUTOTUNE_REQUIRE_LLAMACPP"):
            pytest.fail(f"AUTOTUNE_REQUIRE_LLAMACPP is set but {llama.server} is not built: run `autotune llamacpp`")
        pytest.skip("llama-server not built: `autotune llamacpp` builds it")
    return llama


@pytest.fixture(scope="module")
def ggufs(llama):
    """The family's target and distilled drafter in GGUF."""
    return {name: llama.convert(DEFAULT_FAMILY_DIR / name) for name in MEMBERS}


@pytest.fixture(scope="module")
def llama_servers(llama, ggufs):
    """OFF, the distilled draft model, n-gram lookup of 4 tokens: three llama-server processes."""
    specs = family_servers(ggufs, drafters=("distilled",), ngram_ks=(4,), threads=1)
    backend, servers = LlamaCppBackend.start(llama.server, specs, timeout_s=30)
    yield backend, servers
    for server in servers:
        server.stop()
    backend.close()


@pytest.mark.slow
def test_llamacpp_greedy_is_the_engines_and_speculation_keeps_it(llama_servers, prompts):
    """llama.cpp OFF, fed the same token ids, gives this engine's greedy tokens; its draft model
    and n-gram speculation give the same tokens, or a prefix of them: with a draft model a round
    whose accepted drafts cross max_new_tokens loses them (llama.cpp's own miscount)."""
    backend, _ = llama_servers
    engine = load_engine(drafters=[], ngram=False)
    drafted = {"distilled:3": 0, "ngram:4": 0}
    for ids in prompts:
        off = backend.serve(BackendRequest(ids, 48), OFF)
        assert off.tokens == engine.generate(ids, OFF, 48).tokens
        assert off.drafted == 0 and off.new_tokens == len(off.tokens) == 48
        for arm in drafted:
            spec = backend.serve(BackendRequest(ids, 48), Arm.of(arm))
            assert spec.tokens == off.tokens[:len(spec.tokens)] and len(spec.tokens) >= 48 - 4, arm
            assert 0 <= spec.accepted <= spec.drafted
            drafted[arm] += spec.drafted
    assert all(drafted.values()), drafted  # each drafter drafted on some prompt: speculation ran


def joint_of_tokens_1_and_2(ids: list[int], top: int = 24) -> torch.Tensor:
    """The target's exact joint distribution of its first two output tokens at temperature 1 for
    the `top` likeliest first tokens (a row each over the vocabulary), with the rest of the first
    token's mass in one last cell."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_FAMILY_DIR / "target", dtype=torch.float32)
    with torch.no_grad():
        first = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
        likeliest = first.topk(top).indices
        rows = [first[t] * model(torch.tensor([ids + [int(t)]])).logits[0, -1].softmax(-1) for t in likeliest]
    joint = torch.cat([*rows, (1 - first[likeliest].sum()).reshape(1)])
    return joint, likeliest.tolist()


def sampled_p_value(post, ids: list[int], samples: int, expected: torch.Tensor, likeliest: list[int]) -> float:
    """Chi-square p-value of `samples` draws of the first two tokens (`post(seed)`: the tokens, or
    None where llama-server could not return them) against `expected`; cells expected fewer than 5
    times pooled. Draws llama-server fails on (output that is not valid UTF-8, llama.cpp#27543) are
    left out: at most 1 % of them, a bias far below what the test can see."""
    from scipy.stats import chisquare

    vocab = (len(expected) - 1) // len(likeliest)
    counts = torch.zeros(len(expected))
    failed = 0
    for seed in range(samples):
        tokens = post(seed)
        if tokens is None:
            failed += 1
            continue
        first, second = tokens[:2]
        counts[likeliest.index(first) * vocab + second if first in likeliest else -1] += 1
    assert failed <= samples // 100, f"{failed} of {samples} draws failed"
    expected = expected * samples
    keep = expected >= 5
    f_obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    f_exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    return chisquare(f_obs.numpy(), f_exp.numpy() * f_obs.sum().item() / f_exp.sum().item()).pvalue


@pytest.mark.slow
def test_llamacpp_sampling_follows_the_target_and_the_test_can_tell(llama_servers, tokenizer):
    """Sampled at temperature 1 through the backend, with the draft model verifying the second
    token, llama.cpp's first two tokens follow the target's joint distribution; its own default
    samplers (top-k 40, min-p 0.05, which the backend turns off) fail the same test."""
    backend, _ = llama_servers
    ids = tokenizer.encode("def main():\n    ")
    expected, likeliest = joint_of_tokens_1_and_2(ids)
    arm = Arm("distilled", 3)

    def served(seed: int) -> list[int] | None:
        try:
            return backend.serve(BackendRequest(ids, 3, temperature=1.0, seed=seed), arm).tokens
        except BackendError as exc:
            if "not valid UTF-8" not in str(exc):
                raise
            return None

    assert sum(backend.serve(BackendRequest(ids, 3, 1.0, seed=s), arm).drafted for s in range(20)) > 0
    assert sampled_p_value(served, ids, 2000, expected, likeliest) > 1e-3  # seen: 0.099
    client = httpx.Client(timeout=30)

    def llamas_defaults(seed: int) -> list[int]:
        body = backend.body(BackendRequest(ids, 3, temperature=1.0, seed=seed), arm)
        del body["top_k"], body["min_p"]
        answer = client.post(backend.url(arm) + "/completion", json=body).json()
        return None if "Failed to parse input" in answer.get("error", {}).get("message", "") else answer["tokens"]

    assert sampled_p_value(llamas_defaults, ids, 500, expected, likeliest) < 1e-3  # seen: 3e-41


@pytest.mark.slow
def test_controller_on_llamacpp_learns_bounded_rewards_and_resumes(llama_servers, prompts, tokenizer, tmp_path):
    backend, _ = llama_servers
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with Store(url) as store, BackendController(backend, store, policy="ucb", tokenizer=tokenizer) as controller:
        first = controller.generate(prompts[0], "code", 32)
        assert first.arm == OFF  # OFF's rate is what rewards are relative to
        results = [controller.generate(ids, "code", 32) for ids in prompts * 3]
        assert any(not r.arm.is_off for r in results)
        for r in results:
            assert r.reward is not None
            decoded = r.response.new_tokens - 1
            if not r.arm.is_off and decoded > r.response.accepted:  # never more than its accepted drafts allow
                assert r.reward <= decoded / (decoded - r.response.accepted) + 1e-9
        assert results[0].text == tokenizer.decode(results[0].tokens, skip_special_tokens=True)
        learned = controller.policy.state_dict()
        off_rate = controller.costs.off_rate(1)
    with Store(url) as store:
        assert len(store.observations()) == 1 + len(results)
        assert latest_policy(store) == "ucb"  # `inspect` reads the policy, not the controller's costs
        resumed = BackendController(backend, store, policy="ucb", tokenizer=tokenizer)
        assert resumed.policy.state_dict() == learned
        assert resumed.costs.off_rate(1) == off_rate  # no OFF request needed after a restart


@pytest.mark.slow
def test_llamacpp_down_or_silent_fails_fast_with_its_address(llama, ggufs, llama_servers, prompts):
    """A server that is gone: the request goes to OFF, naming the failure; a server that accepts
    but never answers: an error at the timeout, not a hang."""
    backend, servers = llama_servers
    gone = family_servers(ggufs, drafters=("distilled",), ngram_ks=(), threads=1)
    spare, [off, drafter] = LlamaCppBackend.start(llama.server, gone, timeout_s=30)
    try:
        drafter.stop()
        controller = BackendController(spare, policy="static", arm=Arm("distilled", 3))
        result = controller.generate(prompts[0], "code", 16)
        assert result.arm == OFF and result.fell_back and drafter.url in result.error
        assert result.tokens == backend.serve(BackendRequest(prompts[0], 16), OFF).tokens
        off.stop()
        with pytest.raises(BackendError, match=re.escape(off.url)):
            controller.generate(prompts[0], "code", 16)
    finally:
        for server in (off, drafter):
            server.stop()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(BackendError, match="no answer in 1 s"):
            LlamaCppBackend({"off": url}, timeout_s=1).serve(BackendRequest(prompts[0], 8), OFF)
        assert time.monotonic() - started < 5


@pytest.mark.slow
def test_the_server_in_front_of_llamacpp(llama_servers, prompts, tokenizer):
    """`autotune serve --backend llamacpp`'s server: completions served on llama.cpp through the
    controller, the same text as llama.cpp's own greedy output; an option llama.cpp is not sent
    is refused by name; /metrics counts what was served."""
    from autotune.backends.serving import ServedBackend
    from autotune.serve.server import CompletionServer

    backend, _ = llama_servers
    served = ServedBackend(BackendController(backend, policy="ucb", tokenizer=tokenizer), max_length=1024)
    server = CompletionServer(served, ("127.0.0.1", 0), "family").start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        text = tokenizer.decode(prompts[0])
        for _ in range(3):
            answer = httpx.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 16, "temperature": 0},
                                timeout=60).json()
            choice = answer["choices"][0]
            expected = backend.serve(BackendRequest(tokenizer.encode(text), 16), OFF).tokens
            assert choice["text"] == tokenizer.decode(expected[:len(tokenizer.encode(choice["text"]))],
                                                      skip_special_tokens=True)
            assert answer["usage"]["completion_tokens"] <= 16 and choice["autotune"]["arm"]
        streamed = httpx.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 16, "temperature": 0,
                                                             "stream": True}, timeout=60).text
        deltas = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.splitlines()
                  if line.startswith("data: {")]
        assert len([d for d in deltas if d]) > 2  # as llama.cpp streams them, not in one piece
        whole = "".join(deltas)  # greedy, as above: the same text, or a prefix where llama.cpp cut one short
        assert whole.startswith(choice["text"]) or choice["text"].startswith(whole)
        refused = httpx.post(url + "/v1/completions", json={"prompt": text, "stop": ["x"]}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop"
        metrics = httpx.get(url + "/metrics").text
        assert 'vllm:request_success_total{finished_reason="length",model_name="family"} 4.0' in metrics
    finally:
        server.shutdown()
        served.close()


class ScriptedBackend:
    """Answers from a script: a decode rate per arm, or an error for the arms in `failing`."""

    name = "scripted"
    variable_k = frozenset()

    def __init__(self, rates: dict[Arm, float], failing: set[Arm] = frozenset()) -> None:
        self.rates, self.failing = rates, set(failing)
        self.served: list[Arm] = []

    def arms(self) -> list[Arm]:
        return list(self.rates)

    def serve(self, request: BackendRequest, arm: Arm, on_tokens=None) -> BackendResponse:
        self.served.append(arm)
        if arm in self.failing:
            raise BackendError(f"scripted failure on {arm}")
        n = request.max_new_tokens
        accepted = 0 if arm.is_off else n // 2
        return BackendResponse(list(range(n)), "x" * n, len(request.prompt), n, 0.001, (n - 1) / self.rates[arm],
                               0.01, "length", 0 if arm.is_off else n, accepted)

    def close(self) -> None:
        pass


def test_controller_learns_nothing_from_a_failed_arm_and_passes_it_over():
    off, good, broken = OFF, Arm("a", 2), Arm("b", 2)
    backend = ScriptedBackend({off: 100.0, good: 150.0, broken: 400.0}, failing={broken})
    controller = BackendController(backend, policy="static", arm=broken, cooldown_s=60)
    first = controller.generate([1, 2, 3], "c", 9)
    assert first.fell_back and first.arm == OFF and "scripted failure" in first.error and first.reward is None
    controller.generate([1, 2, 3], "c", 9)
    assert backend.served == [broken, OFF, OFF]  # passed over during its cool-down: no second failure
    ucb = BackendController(ScriptedBackend({off: 100.0, good: 150.0, broken: 400.0}, failing={broken}), policy="ucb")
    for _ in range(12):
        ucb.generate([1, 2, 3], "c", 9)
    assert broken in ucb.backend.served  # it was tried, failed, and taught nothing
    counts = ucb.policy.state_dict()["c@load1"]["counts"]
    assert counts[str(broken)] == 0 and counts[str(good)] > 0 and counts[str(off)] > 0


def test_a_request_that_began_to_stream_is_not_served_again():
    """Its caller has the start of the output: served again on OFF it would get it twice."""
    class FailsMidStream(ScriptedBackend):
        def serve(self, request, arm, on_tokens=None):
            if arm in self.failing and on_tokens is not None:
                on_tokens([7, 8])
            return super().serve(request, arm, on_tokens)

    broken = Arm("b", 2)
    backend = FailsMidStream({OFF: 100.0, broken: 400.0}, failing={broken})
    controller = BackendController(backend, policy="static", arm=broken)
    received = []
    with pytest.raises(BackendError, match="scripted failure"):
        controller.generate([1, 2, 3], "c", 9, on_tokens=received.extend)
    assert received == [7, 8] and backend.served == [broken]
    assert controller.generate([1, 2, 3], "c", 9).arm == OFF  # the failed drafter is passed over meanwhile


def test_rewards_respect_accepted_drafts():
    """A request whose drafts were all rejected cannot have run faster than OFF, however its
    clock read (a moment of contention on OFF's side, or a fast moment on its own)."""
    response = BackendResponse([0] * 65, "", 10, 65, 0.0, 0.1, 0.1, "length", drafted=64, accepted=0)
    assert bounded_speedup(2000.0, 1000.0, response) == 1.0
    half = BackendResponse([0] * 65, "", 10, 65, 0.0, 0.1, 0.1, "length", drafted=64, accepted=32)
    assert bounded_speedup(5000.0, 1000.0, half) == 2.0
    assert bounded_speedup(1500.0, 1000.0, half) == 1.5


def test_converter_is_told_gpt2_only_for_gpt2_style_tokenizers(tmp_path):
    check_gpt2_pretokenizer(DEFAULT_FAMILY_DIR / "target")
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Unigram"}, "pre_tokenizer": {"type": "Metaspace"}}')
    with pytest.raises(ValueError, match="not GPT-2's"):
        check_gpt2_pretokenizer(tmp_path)


def test_controller_refuses_an_arm_the_backend_cannot_serve():
    backend = ScriptedBackend({OFF: 100.0, Arm("a", 2): 150.0})
    with pytest.raises(ValueError, match=r"cannot serve arm\(s\) \['b:3'\]"):
        BackendController(backend, arms=[OFF, Arm("b", 3)])
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
        BackendController(backend).generate("text", "c", 4)


# ----- the routing backend over `autotune serve` replicas ------------------------------------
def _replica(arm: str, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """`autotune serve --arm ARM` on a free port: a replica with one speculative configuration."""
    command = [sys.executable, "-m", "autotune.cli", "serve", "--port", "0", "--arm", arm, "--max-batch", "1",
               "--db", f"sqlite:///{tmp_path / (arm.replace(':', '-') + '.db')}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found: list[str] = []

    def read() -> None:  # the line naming the port, then drain the rest
        for line in process.stdout:
            if not found and (match := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)):
                found.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 120
    while not found and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    if not found:
        process.kill()
        pytest.fail(f"autotune serve --arm {arm} did not start")
    return process, found[0]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    started = {arm: _replica(arm, tmp) for arm in ("off", "distilled:3")}
    yield {arm: url for arm, (_, url) in started.items()}, {arm: p for arm, (p, _) in started.items()}
    for process, _ in started.values():
        process.terminate()
        process.wait(30)


@pytest.mark.slow
def test_routing_backend_over_replicas(replicas, prompts, tokenizer):
    """Each arm served by its replica: the same greedy text; drafted and accepted counts read
    from the replica's vLLM counters; the controller learns over them; a replica that is gone
    sends its requests to OFF with its address in the error."""
    urls, processes = replicas
    backend = RoutingBackend([Replica(Arm.of(arm), url, "spec-autotune") for arm, url in urls.items()], timeout_s=30)
    for ids in prompts[:2]:
        off = backend.serve(BackendRequest(ids, 24), OFF)
        spec = backend.serve(BackendRequest(ids, 24), Arm("distilled", 3))
        assert spec.text == off.text and spec.new_tokens == off.new_tokens == 24
        assert off.drafted == 0 and spec.drafted > 0 and 0 <= spec.accepted <= spec.drafted
        assert spec.decode_s > 0 and spec.prefill_s > 0
    controller = BackendController(backend, policy="ucb", tokenizer=tokenizer)
    served = [controller.generate(ids, "code", 16) for ids in prompts * 2]
    assert {str(r.arm) for r in served} == {"off", "distilled:3"} and all(r.reward is not None for r in served[1:])
    processes["distilled:3"].terminate()
    processes["distilled:3"].wait(30)
    fixed = BackendController(backend, policy="static", arm=Arm("distilled", 3))
    result = fixed.generate(prompts[0], "code", 8)
    assert result.fell_back and result.arm == OFF and urls["distilled:3"] in result.error
