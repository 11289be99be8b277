"""Tuning, the CLI and the notebooks, on a small store made from tiny models."""

import base64
import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import nbformat
import optuna
import pytest
from conftest import tiny_llama
from nbclient import NotebookClient

from autotune.cli import main
from autotune.control.controller import AutotuneController
from autotune.data.classes import RequestClass, Workload
from autotune.train.tune import add_tuned_skip_sets, load_priors, seed_from_studies, tune_class, tune_skip_sets
from autotune.train.zoo import DEFAULT_FAMILY_DIR
from engine import OFF, Arm, NGramDrafter, SpeculativeEngine
from policies import Context
from store import Store

ROOT = Path(__file__).resolve().parents[1]
ARMS = [OFF, Arm("small", 1), Arm("small", 3), Arm("ngram", 2)]
ARMS_NAMED = [str(a) for a in ARMS]


@pytest.fixture(scope="module")
def classes():
    def ids(seed, n, repeat):
        return [[(seed * 31 + i * 7 + j) % 64 for j in range(5)] * repeat for i in range(n)]

    return {"rep": RequestClass("rep", "repetitive", tuple(ids(1, 6, 4)), max_new_tokens=10),
            "mixed": RequestClass("mixed", "sampled", tuple(ids(2, 6, 1)), temperature=1.0, max_new_tokens=10)}


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, target, draft_model, classes):
    engine = SpeculativeEngine(target, {"small": draft_model, "ngram": NGramDrafter()})
    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'small.db'}"
    with Store(url) as store:
        with AutotuneController(engine, store, policy="thompson", arms=ARMS, save_every=4) as ctl:
            for req in Workload({"rep": 1, "mixed": 1}, n_requests=30).requests(classes):
                ctl.generate(req.prompt, req.request_class, req.max_new_tokens, req.temperature, req.top_p, req.seed)
        for cls in classes.values():
            tune_class(engine, cls, url, ARMS, budget=6, prompts_per_trial=2, progress=False)
    return engine, url


@pytest.mark.slow
def test_tuning_is_resumable_and_seeds_the_online_policy(small_store, classes):
    engine, url = small_store
    study = tune_class(engine, classes["rep"], url, ARMS, budget=2, prompts_per_trial=2, progress=False)
    assert len(study.trials) == 8  # the 6 earlier trials were continued, not restarted
    assert study.trials[0].params == {"arm": "off"}
    priors = load_priors(url)
    assert set(priors) == {"rep", "mixed"} and priors["rep"]["off"][0] == pytest.approx(1.0)
    ctl = AutotuneController(engine, policy="thompson", arms=ARMS)
    for name, p in priors.items():
        ctl.policy.set_prior(name, p)
    table = ctl.policy.table(Context("rep"))
    assert {a for a, row in table.rows.items() if row[0] > 0} == set(priors["rep"])


def test_tuning_by_replay_leaves_a_policy_that_serving_resumes_without_replaying_again(target, draft_model, classes,
                                                                                         tmp_path, monkeypatch):
    from autotune.control import estimates
    from autotune.train.tune import tune_by_replay

    replays = []
    replay = estimates.arm_rewards
    monkeypatch.setattr(estimates, "arm_rewards", lambda *a, **kw: (replays.append(1), replay(*a, **kw))[1])
    engine = SpeculativeEngine(target, {"small": draft_model, "ngram": NGramDrafter()})
    url = f"sqlite:///{tmp_path / 'tuned.db'}"
    with Store(url) as store:
        assert tune_by_replay(engine, store, classes, "ucb", prompts=2) == 4
    assert len(replays) == 4  # every offline request replayed
    with Store(url) as store, AutotuneController(engine, store, policy="ucb") as ctl:
        assert {"rep@load1", "mixed@load1"} <= set(ctl.policy.tables)
        assert ctl.policy.tables["rep@load1"].pulls == 2
        for prompt in classes["rep"].prompts[2:5]:
            ctl.generate(prompt, "rep", 10)
    assert len(replays) == 4  # served from what was learned, with no replay of its own


@pytest.mark.slow
def test_a_skip_set_search_per_class_adds_its_best_sets_as_arms_and_seeds_them(classes, tmp_path):
    """SWIFT's search offline: one yes/no per skippable layer and K; OFF (nothing skipped) first."""
    target = tiny_llama(3, layers=4)
    url = f"sqlite:///{tmp_path / 'skip.db'}"
    study = tune_skip_sets(SpeculativeEngine(target), classes["rep"], url, budget=8, prompts_per_trial=2,
                           progress=False)
    assert study.trials[0].user_attrs["arm"] == "off"
    assert set(study.trials[0].params) == {"skip_1", "skip_2", "skip_3", "k"}  # layer 0 sizes the masks
    tried = {t.user_attrs["arm"] for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}
    assert len(tried) >= 4 and all(a == "off" or a.startswith("skip-") for a in tried)
    priors = load_priors(url)["rep"]
    assert priors["off"][0] == pytest.approx(1.0) and set(priors) <= tried

    serving = SpeculativeEngine(target)  # a fresh engine, as `autotune serve` builds one
    added = add_tuned_skip_sets(serving, url, per_class=2)
    best = sorted((a for a in priors if a != "off"), key=lambda a: -priors[a][0])
    # the two best sets, distinct: the best two arms were one set at two Ks in a CI run
    assert added == list(dict.fromkeys(Arm.parse(a).drafter for a in best))[:2]
    assert set(serving.drafters) == set(added)
    ctl = AutotuneController(serving, policy="thompson")
    seeded = seed_from_studies(ctl, url)["rep"]
    assert set(best[:2]) <= set(seeded) and ctl.policy.table(Context("rep")).rows[best[0]][0] > 0


@pytest.mark.slow
def test_bench_layer_skip_compares_tuned_sets_with_the_best_single_set_and_early_exit(classes):
    from autotune.bench import bench_layer_skip

    engine = SpeculativeEngine(tiny_llama(3, layers=4))
    result = bench_layer_skip(engine, classes, tune_prompts=2, eval_prompts=2, budget=5, exits=(2, 3),
                              progress=lambda *_: None)
    tuned = {c["tuned"]["arm"] for c in result["classes"].values()}
    assert result["best_single_skip_arm"] in tuned
    assert result["best_early_exit_arm"] in ("skip-2.3:2", "skip-3:2")
    for name, c in result["classes"].items():
        assert set(c["arms"]) == {"off", *tuned, "skip-2.3:2", "skip-3:2"}, name
        assert c["arms"]["off"]["speedup_vs_off"] == 1.0 and set(c["transformers_early_exit"]) == {"2", "3"}
        speedup = {arm: row["speedup_vs_off"] for arm, row in c["arms"].items()}
        ratio = speedup[c["tuned"]["arm"]] / speedup[result["best_single_skip_arm"]]
        assert c["tuned_vs_best_single"] == pytest.approx(ratio, abs=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("notebook, figures", [("policy_inspection.ipynb", 6), ("tuning_report.ipynb", 4)])
def test_notebooks_run_top_to_bottom_and_draw_their_figures(small_store, notebook, figures, monkeypatch, tmp_path):
    """Every cell runs and every plot is drawn; the figures are written to $NOTEBOOK_FIGURES
    (CI: notebooks/figures/) to be looked at."""
    _, url = small_store
    monkeypatch.setenv("AUTOTUNE_DB", url)
    nb = nbformat.read(ROOT / "notebooks" / notebook, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    printed = "".join(o.get("text", "") for o in outputs)
    assert "rep" in printed and "mixed" in printed
    images = [base64.b64decode(o["data"]["image/png"]) for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= figures
    folder = Path(os.environ.get("NOTEBOOK_FIGURES") or tmp_path) / Path(notebook).stem
    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        (folder / f"{i:02d}.png").write_bytes(image)


def test_cli_inspect_prints_the_learned_table(small_store, capsys):
    _, url = small_store
    assert main(["inspect", "--db", url]) == 0
    out = capsys.readouterr().out
    assert "policy: thompson" in out and "rep" in out and "speedup_vs_off" in out


def test_cli_gives_clear_errors_and_exit_codes(tmp_path, capsys):
    assert main(["inspect", "--db", f"sqlite:///{tmp_path / 'none.db'}"]) == 3
    assert "no store at" in capsys.readouterr().err
    junk = tmp_path / "junk.db"
    junk.write_text("not a database")
    assert main(["inspect", "--db", f"sqlite:///{junk}"]) == 3
    assert "not a SQLite database" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["bench", "nothing"])
    assert usage.value.code == 2
    for argv, words in [(["demo", "--requests", "-1"], "argument --requests: must be >= 1, got -1"),  # ran 0, exit 0
                        (["serve", "--port", "99999"], "argument --port: must be in 0..65535"),  # a traceback, exit 1
                        (["serve", "--head-timeout", "-1"], "argument --head-timeout: must be >= 0.001"),
                        (["tune", "--budget", "0"], "argument --budget: must be >= 1"),  # optuna: Record does not exist
                        (["bench", "controller", "--burst-share", "2"], "argument --burst-share: must be in 0..1")]:
        with pytest.raises(SystemExit) as usage:
            main(argv)
        assert usage.value.code == 2 and words in capsys.readouterr().err
    assert main(["bench", "engine", "--quick", "--arm", "nope:3"]) == 2  # was: `autotune: 'nope'`, a KeyError's text
    assert "unknown drafter 'nope'; this engine has: ['distilled'," in capsys.readouterr().err
    bad = tmp_path / "requests.jsonl"
    bad.write_text('{"class": "a", "prompt": "x"}\n{"class": "a", "prompt": ""}\n', encoding="utf-8")
    assert main(["tune", "--method", "replay", "--requests-file", str(bad)]) == 2
    assert f"{bad}, line 2: 'prompt' must be a non-empty string" in capsys.readouterr().err
    help_text = subprocess.run([sys.executable, "-m", "autotune.cli", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "demo" in help_text.stdout and "zoo" in help_text.stdout


def test_optuna_studies_share_the_store_database(small_store):
    _, url = small_store
    names = {s.study_name for s in optuna.get_all_study_summaries(storage=url)}
    assert names == {"autotune:rep", "autotune:mixed"}
    with Store(url) as store:
        assert store.count() == 30 and store.integrity_check() == "ok"


@pytest.mark.slow
def test_demo_runs_end_to_end_on_the_committed_family(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    assert main(["demo", "--requests", "8", "--db", url, "--json", str(tmp_path / "demo.json")]) == 0
    out = capsys.readouterr().out
    assert "arm_now" in out and url in out
    with Store(url) as store:
        assert store.count() == 8
        family = json.loads((DEFAULT_FAMILY_DIR / "family.json").read_text())
        assert {m["name"] for m in store.models()} == {family["target"], *family["drafters"], *family["feature_heads"]}
        assert all(o["engine_identity"].startswith("target@") for o in store.observations())


@pytest.mark.slow
@pytest.mark.parametrize("options", [[], ["--no-repeat-ngram", "2"]])
def test_bench_engine_quick_matches_transformers_token_for_token(tmp_path, options):
    """Also with generate()'s no_repeat_ngram_size against the engine given its processor class."""
    import json

    path = tmp_path / "engine.json"
    assert main(["bench", "engine", "--quick", "--arm", "distilled:3", *options, "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["identical_outputs"] is True
    assert 0.0 <= result["acceptance"] <= 1.0 and result["tokens_per_s"]["engine_spec"] > 0


def test_bench_lossless_passes_a_lossless_engine_and_fails_a_lossy_one(tmp_path, monkeypatch, capsys):
    import json

    import engine.sampling

    argv = ["bench", "lossless", "--classes", "code,docs", "--prompts", "1", "--max-new-tokens", "24",
            "--arms", "distilled:2,ngram:3"]
    path = tmp_path / "lossless.json"
    assert main([*argv, "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["requests"] == result["identical"] == 4 and result["divergences"] == []

    def accept_every_draft(target_logits, draft):  # a broken verifier: keeps drafts the target rejects
        return len(draft), int(target_logits[len(draft)].argmax())

    monkeypatch.setattr(engine.sampling, "verify_greedy", accept_every_draft)
    assert main([*argv, "--json", str(path)]) == 1
    assert "float32 outputs differ from generate()" in capsys.readouterr().err
    divergences = json.loads(path.read_text())["divergences"]
    assert max(d["float32_gap"] for d in divergences) > 0.5  # a real preference overruled, not a tie


@pytest.mark.slow
def test_bench_arms_and_controller_end_to_end_on_tiny_models(small_store, classes, tmp_path):
    from autotune.bench import bench_arms, bench_controller

    engine, _ = small_store
    truth = {size: bench_arms(engine, classes, ARMS, prompts_per_class=2, batch=size, progress=lambda *_: None)
             for size in (1, 4)}
    for measured in truth.values():
        for cls in measured["classes"].values():
            assert cls["arms"]["off"]["speedup_vs_off"] == 1.0
            assert cls["best_arm"] in cls["arms"]
        cells = measured["classes"].values()
        slowest = max(sum(1 / c["arms"][a]["speedup_vs_off"] for c in cells) for a in ARMS_NAMED)
        fastest = sum(1 / c["arms"][c["best_arm"]]["speedup_vs_off"] for c in cells)  # equal OFF times: a bound
        assert 1.0 <= measured["oracle_vs_best_static"] <= slowest / fastest + 1e-3
        assert measured["distinct_best_arms"] == len({c["best_arm"] for c in cells})
    load = {"burst_share": 0.3, "burst_size": 4}
    stream = Workload({"rep": 1, "mixed": 1}, n_requests=10, **load)
    drift = Workload({"rep": 1, "mixed": 0.1}, n_requests=10, seed=1, drift=((0.5, {"rep": 0.1, "mixed": 1}),),
                     **load)
    with pytest.raises(ValueError, match="bench arms --batch 4"):
        bench_controller(engine, classes, {1: truth[1]}, stream, tmp_path, progress=lambda *_: None)
    with Store(f"sqlite:///{tmp_path / 'main-thompson.db'}") as stale:  # an earlier run's store in the folder
        stale.record(request_class="rep", arm="off", policy="thompson", prompt_tokens=1, new_tokens=1, total_s=0.1,
                     goodput=10.0)
    result = bench_controller(engine, classes, truth, stream, tmp_path, policies=("thompson",), drift=drift,
                              progress=lambda *_: None)
    with Store(f"sqlite:///{tmp_path / 'main-thompson.db'}") as fresh:  # every run starts from scratch
        assert fresh.count() == sum(len(arrival) for arrival in stream.stream(classes))
    assert result["bursts"] > 0
    assert set(result["oracle_arms"]) == {"rep@load1", "mixed@load1", "rep@load2-4", "mixed@load2-4"}
    with Store(f"sqlite:///{tmp_path / 'main-off_control.db'}") as control:  # the negative control serves OFF only
        assert {row["arm"] for row in control.observations()} == {"off"}
    for key in ("ratio_vs_best_static", "ratio_vs_oracle", "ratio_vs_off", "worst_class_ratio_vs_off",
                "off_control_worst_class_ratio_vs_off", "off_control_ratio_vs_off", "decision_overhead_ms_p99"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["regret_fraction"] == pytest.approx(1 - result["ratio_vs_oracle"], abs=2e-3)
    assert result["oracle_vs_best_static_expected"] >= 1.0  # the oracle is best in every cell of the truth
    assert result["drift"]["restart_vs_uninterrupted_after_restart"] > 0
    assert set(result["policies"]["thompson"]["reward_calibration"]) <= set(result["oracle_arms"])
    # learning's share of the controller's time, alone and in bursts: replays run on a key's first request
    shares = result["policies"]["thompson"]["overhead_share"]
    assert "1" in shares and set(shares) <= {"1", "2-4"} and all(0 <= share < 1 for share in shares.values())
    assert (tmp_path / "controller_arms.png").stat().st_size > 0
    assert (tmp_path / "controller_regret.png").stat().st_size > 0


def test_reward_calibration_compares_recorded_rewards_with_speedups_measured_against_off():
    from autotune.bench.controller import reward_calibration

    def arrival(cell, tokens, engine_s, reward):
        return {"cell": cell, "tokens": tokens, "engine_s": engine_s, "reward": reward}

    off = [arrival("a@load1", 10, 1.0, 1.0), arrival("a@load1", 20, 1.0, 1.0), arrival("b@load1", 10, 1.0, 1.0)]
    # Twice OFF's goodput on every "a" arrival, but rewards that claim 2.4x; "b" claims what it measured.
    ucb = [arrival("a@load1", 10, 0.5, 2.4), arrival("a@load1", 20, 0.5, 2.4), arrival("b@load1", 10, 0.8, 1.25)]
    assert reward_calibration({"ucb": ucb, "off": off}, "ucb", warmup=0.0) == {"a@load1": 1.2, "b@load1": 1.0}
    assert reward_calibration({"ucb": ucb, "off": off}, "ucb", warmup=0.5) == {"a@load1": 1.2, "b@load1": 1.0}


def test_bench_replay_scores_every_arm_of_every_class(small_store, classes):
    from autotune.bench import bench_replay

    engine, _ = small_store
    result = bench_replay(engine, classes, ARMS, prompts_per_class=2, progress=lambda *_: None)
    for cls in result["classes"].values():
        assert set(cls) == {str(a) for a in ARMS}
        # OFF replayed from its own output: the same steps priced at the same measured step cost.
        # Two 10-token requests on tiny models take milliseconds, so a hiccup of the machine moves
        # this (a fresh-clone CI run saw 1.19); a replay priced wrong is off by far more.
        assert cls["off"]["estimated"] == pytest.approx(1.0, abs=0.3)
    assert 0 <= result["mean_abs_error"] <= result["max_abs_error"]


@pytest.mark.slow
def test_bench_rewards_prices_each_arms_requests_by_calibration_and_by_learned_costs(target, draft_model, classes):
    from autotune.bench import bench_reward_scale

    # "self" drafts with the target itself: every draft kept, so each of its Ks estimates the other.
    engine = SpeculativeEngine(target, {"small": draft_model, "ngram": NGramDrafter(), "self": target})
    arms = [Arm("small", 3), Arm("ngram", 2), Arm("self", 2), Arm("self", 3)]
    result = bench_reward_scale(engine, classes, arms, prompts_per_class=2, progress=lambda *_: None)
    assert set(result["arms"]) == {"small:3", "ngram:2", "self:2", "self:3"}
    assert set(result["kinds"]) == {"model", "n-gram", "model, short prompts", "n-gram, short prompts"}
    for name, row in [*result["arms"].items(), *result["kinds"].items()]:
        assert row["requests"] == 4 * (3 if name.startswith("model") else 1)  # 2 classes x 2 prompts
        assert row["speedup_measured"] > 0
        assert row["calibration_over_measured"] > 0 and row["learned_over_measured"] > 0
    siblings = result["siblings"]
    assert set(siblings["arms"]) == {"self:2", "self:3"} and set(siblings["kinds"]) == {"model"}
    for row in siblings["arms"].values():
        assert row["requests"] == 4 and 0.3 < row["estimated_over_measured"] < 3.0


def test_hindsight_picks_the_static_arm_by_time_and_prices_the_oracles_gain():
    from autotune.bench import hindsight_arms

    def truth(speedups: dict[str, dict[str, float]]) -> dict:
        return {"classes": {c: {"best_arm": max(arms, key=arms.get),
                                "arms": {a: {"speedup_vs_off": v, "tokens_per_s": 100.0 * v} for a, v in arms.items()}}
                            for c, arms in speedups.items()}}

    # "a" doubles class x and halves class y; "b" is a modest 1.25x on both. Over the stream's time
    # b wins (0.8 + 0.8 against 0.5 + 2.0); the oracle takes a on x and b on y: 0.5 + 0.8.
    ground = {1: truth({"x": {"off": 1.0, "a:1": 2.0, "b:1": 1.25}, "y": {"off": 1.0, "a:1": 0.5, "b:1": 1.25}})}
    best, static, gain = hindsight_arms(ground, Workload({"x": 1, "y": 1}))
    assert static == Arm("b", 1)
    assert best == {"x@load1": Arm("a", 1), "y@load1": Arm("b", 1)}
    assert gain == pytest.approx(1.6 / 1.3, abs=1e-3)


def test_bench_cache_serves_identically_with_either_cache(small_store, classes):
    from autotune.bench import bench_cache

    engine, _ = small_store
    cases = [(1, "rep", Arm("small", 3), 4), (1, "mixed", Arm("ngram", 2), 4), (3, "mixed", Arm("small", 3), 2),
             (3, "rep", Arm("ngram", 2), 2)]
    result = bench_cache(engine, classes, cases)
    assert result["identical_outputs"] is True
    assert set(result["cases"]) == {"batch 1 rep small:3", "batch 1 mixed ngram:2", "batch 3 mixed small:3",
                                    "batch 3 rep ngram:2"}


def test_bench_choices_serves_n_choices_alike_with_their_prompt_shared_or_fed_for_each(small_store, classes):
    from autotune.bench import bench_choices

    engine, _ = small_store
    result = bench_choices(engine, classes["mixed"], [Arm(), Arm("small", 3)], n=3, requests=2, long_tokens=40)
    assert result["identical_outputs"] is True
    assert set(result["cases"]) == {"workload off", "workload small:3", "40 tokens off", "40 tokens small:3"}
    assert result["cases"]["40 tokens small:3"]["prompt_tokens"] == 40


def test_bench_lengths_serves_mixed_lengths_alike_grouped_or_in_one_forward(small_store, classes):
    from autotune.bench import bench_lengths

    engine, _ = small_store
    result = bench_lengths(engine, classes, [Arm(), Arm("small", 3)], size=4, batches=2)
    assert result["identical_outputs"] is True and set(result["arms"]) == {"off", "small:3"}
    assert result["arms"]["off"]["padded_over_real_tokens"] == 1.6  # 4 x 20 tokens padded over 20 + 5 + 20 + 5


def test_bench_chunked_serves_long_joins_and_clients_alike_chunked_or_in_one_go(small_store, classes):
    from autotune.bench import bench_chunked, bench_chunked_clients

    engine, _ = small_store
    result = bench_chunked(engine, classes, [Arm(), Arm("small", 3)], chunks=(None, 8), rows=3, joins=2,
                           long_tokens=40, every=4, rounds=2)
    assert result["identical_outputs"] is True and set(result["arms"]) == {"off", "small:3"}
    assert all(set(cases) == {"in one go", "8 tokens"} for cases in result["arms"].values())
    clients = bench_chunked_clients(engine, classes, chunks=(None, 8), clients=3, requests_per_client=2, rounds=1)
    assert clients["identical_outputs"] is True and set(clients["cases"]) == {"in one go", "8 tokens"}


@pytest.mark.slow
def test_bench_long_batch_serves_alike_with_holes_dropped_or_kept(small_store, classes):
    from autotune.bench import bench_long_batch

    engine, _ = small_store
    staggered = {"rep": classes["rep"], "mixed": dataclasses.replace(classes["mixed"], max_new_tokens=17)}
    result = bench_long_batch(engine, staggered, [Arm(), Arm("small", 3)], rows=3, requests=30, rounds=1)
    assert result["identical_outputs"] is True and set(result["arms"]) == {"off", "small:3"}
    for arm in result["arms"].values():
        assert arm["rounds"]["compacted"] == arm["rounds"]["holes kept"] > 30
        assert arm["most_slots"]["compacted"] < arm["most_slots"]["holes kept"]


def test_the_gap_to_the_oracle_splits_into_overhead_exploration_and_convergence():
    from autotune.bench.tenants import paired_interval, where_the_loss_goes

    def row(arm, engine_s, overhead_s=0.0):
        return {"class": "x", "arm": arm, "tokens": 10, "engine_s": engine_s, "seconds": engine_s + overhead_s,
                "overhead_s": overhead_s}

    # The oracle's arm a takes 1 s a request. The policy explored b (3 s, with 1 s of replays),
    # then kept c (1.5 s): 2 s of exploration, 1 s of convergence, 1 s of overhead in 7 s.
    log = {"a": [row("a", 1.0)] * 3, "ucb": [row("b", 3.0, 1.0), row("c", 1.5), row("c", 1.5)]}
    by_class = {name: {"x": rows} for name, rows in log.items()}
    loss = where_the_loss_goes(log, "ucb", by_class, {"x": "a"})
    assert loss["overhead"] == pytest.approx(1 / 7, abs=1e-4)
    assert loss["exploration"] == pytest.approx(2 / 7, abs=1e-4)
    assert loss["convergence"] == pytest.approx(1 / 7, abs=1e-4)
    assert loss["gap_to_oracle"] == pytest.approx(4 / 7, abs=1e-4)
    assert loss["overhead_after_10_requests"] is None  # no class served more than 10
    low, high = paired_interval(log["ucb"], log["a"])
    assert low <= 3 / 7 <= high and high < 1.0  # slower on every request: the whole interval below 1
    assert paired_interval(log["a"], log["a"]) == [1.0, 1.0]
    assert loss["per_class"]["x"] == {"kept": "c", "oracle": "a", "explored": 1, "requests": 3,
                                      "ratio_vs_oracle": round(3 / 7, 3)}


@pytest.mark.serial
@pytest.mark.slow
def test_bench_concurrency_coalesces_waiting_clients_without_changing_outputs(small_store, classes):
    from autotune.bench import bench_concurrency

    engine, _ = small_store
    result = bench_concurrency(engine, classes, clients=6, requests_per_client=2, max_batch=6, policies=("ucb",),
                               rounds=1, progress=lambda _: None)
    assert result["identical_greedy_outputs"] is True
    configs = result["configs"]
    assert set(configs) == {"ucb/batch1", "ucb/batch6-static", "ucb/batch6-continuous", "ucb/batch6-continuous-nopause"}
    assert configs["ucb/batch1"]["mean_load"] == 1
    assert configs["ucb/batch6-static"]["mean_load"] > 1 and configs["ucb/batch6-continuous"]["mean_load"] > 1
    assert all(0 < c["ttft_s_p50"] <= c["latency_s_p50"] for c in configs.values())  # streamed before done
    # Queued, then prefilled (a p50 wait under 0.5 ms rounds to 0 in the report).
    assert all(c["queue_s_p50"] < c["ttft_s_p50"] and c["queue_s_p99"] > 0 for c in configs.values())


@pytest.mark.slow
def test_bench_prefix_serves_alike_from_kept_prefixes_or_whole_prompts(target, draft_model, classes):
    from autotune.bench import bench_prefix, bench_prefix_clients

    engine = SpeculativeEngine(target, {"small": draft_model}, prefix_cache_tokens=512)
    result = bench_prefix(engine, classes["rep"], [Arm(), Arm("small", 3)], context_tokens=40, requests=4, batch=2)
    assert result["identical_outputs"] is True
    share = {case: (c["prompt_tokens"], c["cached_prompt_share"]) for case, c in result["cases"].items()}
    # each case starts cold. Shared context: the first request (or batch of 2) prefills whole, the rest
    # reuse the 40-token context, 3 x 40 or 2 x 40 of 4 x 60 prompt tokens. A chat of 4 turns (prompts of
    # 20, 50, 80, 110 tokens: 20 more and the 10 output tokens each turn) reuses 0, 29, 59, 89 tokens.
    assert share == {f"{arm} {case}": value for arm in ("off", "small:3") for case, value in [
        ("alone", (60, 0.5)), ("batches of 2", (120, 0.333)), ("unrelated prompts alone", (20, 0.0)),
        ("unrelated prompts in batches of 2", (40, 0.0)), ("chats of 4 turns", (65, 0.681))]}
    with pytest.raises(ValueError, match="keeps prefixes"):
        bench_prefix(SpeculativeEngine(target), classes["rep"], [Arm()], 40, 2, 2)
    clients = bench_prefix_clients(engine, classes, context_tokens=40, clients=2, requests_per_client=2, rounds=1)
    assert clients["identical_greedy_outputs"] is True
    # prompts of 60 ("rep") and 45 tokens ("mixed"), 2 each, each round starting with nothing kept: the
    # second requests reuse the 40-token context (80 of 210 tokens), the first ones too if the other
    # client's was prefilled before they came (at most 160)
    shares = {config: c["cached_prompt_share"] for config, c in clients["configs"].items()}
    assert shares["off none"] == shares["ucb none"] == 0
    assert all(80 / 210 - 0.001 <= shares[f"{p} kept"] <= 160 / 210 + 0.001 for p in ("off", "ucb"))


def test_a_benchmark_client_that_fails_fails_the_benchmark():
    """A client thread that raised used to end quietly, leaving figures over fewer requests."""
    from autotune.bench.common import run_clients

    def client(c):
        if c == 1:
            raise ValueError("prompt too long")

    with pytest.raises(RuntimeError, match="1 of 3 clients failed") as failed:
        run_clients(client, 3)
    assert isinstance(failed.value.__cause__, ValueError)


def test_bench_serves_client_process_answers_a_failed_client_with_its_error():
    """The HTTP clients' process sends a failed client's error back, where it used to die of it
    and leave `bench serve` waiting for its answer forever (seen once in a probe)."""
    import multiprocessing
    import socket

    from autotune.bench.serving import _client_process

    with socket.socket() as unused:  # a port that nothing listens on: every request fails
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    ours, theirs = multiprocessing.Pipe()
    process = threading.Thread(target=_client_process, args=(f"http://127.0.0.1:{port}", [[{"prompt": "x"}]] * 2,
                                                             theirs), daemon=True)
    process.start()
    assert ours.recv() == "ready"
    ours.send("go")
    assert ours.poll(30), "no answer from the clients' process"
    answer = ours.recv()
    ours.send("stop")
    process.join(10)
    assert isinstance(answer, RuntimeError) and "2 of 2 clients failed" in str(answer) and "refused" in str(answer)


@pytest.mark.slow
def test_many_classes_bench_serves_every_request_on_every_configuration(small_store, classes, tmp_path):
    from autotune.bench import bench_many_classes
    from autotune.bench.tenants import tenant_classes

    engine, _ = small_store
    tenants = tenant_classes(classes, 3)
    assert list(tenants) == ["rep", "mixed", "rep-t0.7"] and tenants["rep-t0.7"].temperature == 0.7
    result = bench_many_classes(engine, tenants, tmp_path, per_class=2, policies=("ucb",),
                                statics=("off", "small:1", "ngram:2", "absent:2"), progress=lambda *_: None)
    assert result["static_arms"] == ["off", "small:1", "ngram:2"]  # an arm the engine lacks is left out
    ucb = result["policies"]["ucb"]
    assert ucb["rewards"] == 6 and ucb["rewards_above_bound"] == 0
    assert set(result["oracle_arms"]) == set(tenants) and result["oracle_vs_best_static"] >= 1.0
    assert 0 < ucb["overhead_share"] < 1
    assert result["greedy_mismatches"] == 0


def test_many_classes_summary_picks_static_and_oracle_in_hindsight_and_checks_rewards_against_physics(small_store):
    from autotune.bench.tenants import summarize

    engine, _ = small_store

    def row(cls, arm, tokens, seconds, reward=1.0, bound=1.0, estimates=None):
        return {"class": cls, "arm": arm, "tokens": tokens, "engine_s": seconds, "seconds": seconds,
                "overhead_s": 0.0, "reward": reward, "bound": bound, "estimates": estimates or {},
                "prompt_tokens": 10}

    # small:1 halves x's time and doubles y's; ngram:2 is 1.25x on both: the static best is ngram:2,
    # the oracle small:1 on x and ngram:2 on y.
    log = {"off": [row("x", "off", 10, 1.0), row("y", "off", 10, 1.0)],
           "small:1": [row("x", "small:1", 10, 0.5), row("y", "small:1", 10, 2.0)],
           "ngram:2": [row("x", "ngram:2", 10, 0.8), row("y", "ngram:2", 10, 0.8)],
           # played small:1 on x (reward 2.5 where 2 tokens a round allow 2), ngram:2 on y, told small:1 0.5
           "ucb": [row("x", "small:1", 10, 0.5, reward=2.5, bound=2.0),
                   row("y", "ngram:2", 10, 0.8, reward=1.25, bound=2.0, estimates={"small:1": 0.5})]}
    result = summarize(engine, log, ["ucb"], ["off", "small:1", "ngram:2"], {"x": None, "y": None}, 1)
    assert result["static_best_arm"] == "ngram:2" and result["greedy_mismatches"] == 0
    for rows in log.values():  # x greedy; ucb's output on it differs from the others'
        rows[0].update(greedy=True, output=1)
    log["ucb"][0]["output"] = 2
    assert summarize(engine, log, ["ucb"], ["off", "small:1", "ngram:2"], {"x": None, "y": None},
                     1)["greedy_mismatches"] == 1
    assert result["oracle_arms"] == {"x": "small:1", "y": "ngram:2"}
    assert result["oracle_vs_best_static"] == pytest.approx(1.6 / 1.3, abs=1e-3)
    ucb = result["policies"]["ucb"]
    assert ucb["ratio_vs_oracle"] == 1.0 and ucb["rewards_above_bound"] == 1
    calibration = ucb["reward_calibration"]
    assert calibration["model, recorded"] == {"told_over_measured": 1.25, "requests": 1}  # 2.5 told, 2.0 measured
    assert calibration["model, replayed"] == {"told_over_measured": 1.0, "requests": 1}
    assert calibration["n-gram"] == {"told_over_measured": 1.0, "requests": 1}  # told on y alone
    # Arms chosen by another run (a quiet one, for a noisy run) are measured, not picked again
    other = summarize(engine, log, ["ucb"], ["off", "small:1", "ngram:2"], {"x": None, "y": None}, 1,
                      chosen={"static_best_arm": "small:1", "oracle_arms": {"x": "ngram:2", "y": "ngram:2"}})
    assert other["arms_chosen"] == "by another run"
    assert other["oracle_vs_best_static"] == pytest.approx(2.5 / 1.6, abs=1e-3)


@pytest.mark.serial
@pytest.mark.slow
def test_bench_hostile_refuses_huge_bodies_unread_and_serves_normal_requests_among_held_connections():
    from autotune.bench import bench_hostile

    cpus = sorted(os.sched_getaffinity(0))
    attacker_cpus = set(cpus[-1:]) if len(cpus) > 1 else None  # the server on the others
    result = bench_hostile(classes=3, idle=40, slow=2, held_s=2.0, policy="off", attacker_nice=19,
                           attacker_cpus=attacker_cpus)
    for name in ("prompt_30MB", "tokenize_10MB"):  # refused from the head, before the body is read
        assert result[name].get("answer_to_the_head", result[name]["status"]) == 413
    assert result["prompt_6MB"]["status"] == 400 and result["classes"]["ok"] == 3
    attack = result["attack"]
    assert len(attack["series_s"]) == attack["series_ok"] == 2
    assert attack["normal_ok"] == 10 and len(attack["kept_alive_s_each"]) == 10
    assert attack["server_descriptors_open"] > 40  # the attackers' connections were held, not refused
    assert attack["exit_code"] == 0  # SIGTERM stopped it with all of them open
    assert set(result["server_cpus"]) == set(cpus) - (attacker_cpus or set())  # the server's own, read back
    assert result["server_own_session"]  # not ranked by nice against the attackers, which share the bench's
    with pytest.raises(ValueError, match="some, not all"):
        bench_hostile(attacker_cpus=set(cpus))
