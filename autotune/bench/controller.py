"""`autotune bench controller`: the controller's policies against OFF, the best static arm and
the per-(class, load) oracle in hindsight, on one request stream that every configuration
serves, taking turns; with a drift run (class weights flip) and a restart run (stop, reopen
the store, continue). A second OFF configuration is the negative control: how far apart two
configurations that serve alike read, per cell, on this machine in this run."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from autotune.bench.common import device_name, p99, rotate
from autotune.control.controller import AutotuneController, default_arms
from autotune.data.classes import Request, RequestClass, Workload
from engine import OFF, Arm, SpeculativeEngine
from policies import Context, Policy, make_policy
from store import Store


class OraclePolicy(Policy):
    """Hindsight: the ground-truth best arm of each class at each load (not available online)."""

    name = "oracle"

    def __init__(self, arms: list[Arm], best: dict[str, Arm]) -> None:
        super().__init__([*arms, *best.values()])
        self.best = best  # "class@load<bucket>" -> arm

    def choose(self, context: Context) -> Arm:
        return self.best.get(context.key, self.best.get(Context(context.request_class).key, OFF))


OFF_CONTROL = "off_control"  # a second OFF configuration


def _goodput(rows: list[dict]) -> float:
    seconds = sum(r["seconds"] for r in rows)
    return sum(r["tokens"] for r in rows) / seconds if seconds else 0.0


def _cell(request_class: str, load: int) -> str:
    return Context(request_class, load).key


def _run_stream(engine, stream: list[list[Request]], controllers: dict[str, AutotuneController],
                restart: dict | None = None, noise=None, progress=print) -> dict[str, list[dict]]:
    """Serve every arrival (a request, or a burst served as one batch) with every controller,
    rotating who goes first; `noise` (injected delays) restarted before each, so that all of them
    meet the same bursts on it."""
    log = {name: [] for name in controllers}
    names = list(controllers)
    for i, item in enumerate(stream):
        if restart and i == restart["at"]:
            for name in restart["names"]:
                controllers[name] = restart["reopen"](name, controllers[name])
        req = item[0]
        for name in rotate(names, i):
            ctl = controllers[name]
            if noise is not None:
                noise.restart(i)
            if len(item) == 1:
                rs = [ctl.generate(req.prompt, req.request_class, req.max_new_tokens, req.temperature, req.top_p,
                                   req.seed)]
                seconds = rs[0].metrics.total_s
            else:
                rs = ctl.generate_batch([r.prompt for r in item], req.request_class, req.max_new_tokens,
                                        req.temperature, req.top_p, [r.seed for r in item])
                seconds = max(r.metrics.total_s for r in rs)  # the batch's wall time
            log[name].append({"class": req.request_class, "cell": _cell(req.request_class, len(item)),
                              "arm": str(rs[0].arm), "tokens": sum(r.metrics.new_tokens for r in rs),
                              "seconds": seconds + rs[0].decision_s + rs[0].learn_s, "engine_s": seconds,
                              "overhead_s": rs[0].decision_s + rs[0].learn_s,
                              "reward": rs[0].reward, "decision_ms": rs[0].decision_s * 1000})
        if (i + 1) % 20 == 0:
            progress(f"  {i + 1}/{len(stream)} arrivals")
    return log


def _summary(log: dict[str, list[dict]], warmup: float) -> dict:
    start = int(len(next(iter(log.values()))) * warmup)
    out = {}
    for name, rows in log.items():
        after = rows[start:]
        per_cell = defaultdict(list)
        for r in after:
            per_cell[r["cell"]].append(r)
        out[name] = {"goodput": round(_goodput(after), 2),
                     "per_class": {c: round(_goodput(rs), 2) for c, rs in sorted(per_cell.items())}}
    return out


def _worst_cell(summary: dict, off: dict) -> float:
    """The lowest per-(class, load) goodput of one configuration's summary over OFF's."""
    return round(min(summary["per_class"][c] / off["per_class"][c] for c in off["per_class"]), 3)


def _overhead_share(rows: list[dict], warmup: float) -> dict[str, float]:
    """Per load (1, or a burst's size) after the warm-up: the share of the controller's seconds
    spent deciding and learning (replays included) rather than serving."""
    by_load = defaultdict(list)
    for r in rows[int(len(rows) * warmup):]:
        by_load[r["cell"].split("@load")[1]].append(r)
    return {load: round(sum(r["overhead_s"] for r in rs) / sum(r["seconds"] for r in rs), 4)
            for load, rs in sorted(by_load.items())}


def reward_calibration(log: dict[str, list[dict]], name: str, warmup: float) -> dict[str, float]:
    """Per cell: the mean reward `name` recorded (its estimate of its speedup over OFF) over the
    mean speedup it measured against the OFF configuration on the same arrivals. 1.0: the
    rewards the policy learns from, and the store keeps, are true to scale."""
    start = int(len(log[name]) * warmup)
    per_cell = defaultdict(lambda: ([], []))
    for r, o in zip(log[name][start:], log["off"][start:]):
        rewards, measured = per_cell[r["cell"]]
        rewards.append(r["reward"])
        measured.append(r["tokens"] / r["engine_s"] / (o["tokens"] / o["engine_s"]))
    return {c: round(sum(rw) / sum(ms), 3) for c, (rw, ms) in sorted(per_cell.items())}


def _cell_weights(ground_truth: dict[int, dict], workload: Workload) -> dict[tuple[int, str], float]:
    """(load, class) -> the cell's share of the stream's OFF time: its share of arrivals times the
    OFF seconds of one arrival there (per output token of each row)."""
    shares = {1: 1.0 - workload.burst_share}
    if workload.burst_share > 0:
        if workload.burst_size not in ground_truth:
            raise ValueError(f"the workload has bursts of {workload.burst_size} but the ground truth covers"
                             f" batches of {sorted(ground_truth)} only: run `bench arms --batch {workload.burst_size}`")
        shares[workload.burst_size] = workload.burst_share
    return {(size, c): workload.weights[c] * share * size / truth["arms"]["off"]["tokens_per_s"]
            for size, share in shares.items() for c, truth in ground_truth[size]["classes"].items()
            if c in workload.weights}


def hindsight_arms(ground_truth: dict[int, dict], workload: Workload) -> tuple[dict[str, Arm], Arm, float]:
    """The per-(class, load) oracle arms, the best single static arm for this workload, and how
    much faster the ground truth says the oracle is than that static arm.

    `ground_truth` maps a batch size (1: requests alone) to `bench arms` output. The static arm
    minimises the stream's expected time: each (class, load) cell weighs its share of the OFF
    time, divided by the arm's speedup in that cell. The expected gain is the most a controller
    choosing per class and load can have over the static arm (within-class choices aside).
    """
    weight = _cell_weights(ground_truth, workload)
    truth = {cell: ground_truth[cell[0]]["classes"][cell[1]] for cell in weight}

    def stream_time(arm_in) -> float:  # arm_in(cell) -> the arm played there
        return sum(w / truth[cell]["arms"][arm_in(cell)]["speedup_vs_off"] for cell, w in weight.items())

    candidates = set.intersection(*(set(t["arms"]) for t in truth.values()))
    static = min(sorted(candidates), key=lambda a: stream_time(lambda _: a))
    gain = stream_time(lambda _: static) / stream_time(lambda cell: truth[cell]["best_arm"])
    best = {_cell(c, size): Arm.parse(truth[(size, c)]["best_arm"]) for size, c in weight}
    return best, Arm.parse(static), round(gain, 3)


def bench_controller(engine: SpeculativeEngine, classes: dict[str, RequestClass], ground_truth: dict[int, dict],
                     workload: Workload, out_dir: Path, policies=("ucb", "thompson", "contextual"),
                     warmup: float = 0.2, drift: Workload | None = None, noise=None, progress=print) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = default_arms(engine)
    best, static, expected_gain = hindsight_arms(ground_truth, workload)
    best_drafter = static.drafter or next(iter(engine.drafters))

    def controllers(tag: str, names) -> dict[str, AutotuneController]:
        built = {}
        for name in names:
            path = out_dir / f"{tag}-{name}.db"
            for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                stale.unlink(missing_ok=True)  # a previous run's store would resume what it learned
            store = Store(f"sqlite:///{path}", label=f"bench {tag} {name}")
            if name == "oracle":
                policy = OraclePolicy(arms, best)
            elif name == OFF_CONTROL:
                policy = make_policy("off", arms)
            elif name == "static_best":
                policy = make_policy("static", arms, arm=static)
            elif name == "heuristic":
                policy = make_policy("heuristic", arms, arm=Arm(best_drafter, 5))
            else:
                policy = make_policy(name, arms)
            built[name] = AutotuneController(engine, store, policy=policy)
        return built

    def close(ctls):
        for c in ctls.values():
            c.close()
            c.store.close()

    stream = workload.stream(classes)
    bursts = sum(len(item) > 1 for item in stream)
    progress(f"stationary stream: {len(stream)} arrivals ({bursts} bursts of {workload.burst_size});"
             f" static best in hindsight {static}")
    main = controllers("main", [*policies, "static_best", "oracle", "off", OFF_CONTROL, "heuristic"])
    log = _run_stream(engine, stream, main, noise=noise, progress=progress)
    close(main)
    summary = _summary(log, warmup)
    lead = policies[0]
    ctl, oracle, off = summary[lead], summary["oracle"], summary["off"]
    result = {
        "device": device_name(engine),
        "requests": workload.n_requests,
        "bursts": bursts,
        "burst_size": workload.burst_size if bursts else None,
        "warmup_fraction": warmup,
        "policy": lead,
        "static_best_arm": str(static),
        "oracle_arms": {c: str(a) for c, a in best.items()},
        "ratio_vs_best_static": round(ctl["goodput"] / summary["static_best"]["goodput"], 3),
        "ratio_vs_oracle": round(ctl["goodput"] / oracle["goodput"], 3),
        "ratio_vs_off": round(ctl["goodput"] / off["goodput"], 3),
        "ratio_vs_heuristic": round(ctl["goodput"] / summary["heuristic"]["goodput"], 3),
        "oracle_vs_best_static": round(oracle["goodput"] / summary["static_best"]["goodput"], 3),
        "oracle_vs_best_static_expected": expected_gain,  # from the ground truth: the ceiling of ratio_vs_best_static
        "worst_class_ratio_vs_off": _worst_cell(ctl, off),
        # the same for OFF served by another configuration: how far timing alone moves a cell
        "off_control_worst_class_ratio_vs_off": _worst_cell(summary[OFF_CONTROL], off),
        "off_control_ratio_vs_off": round(summary[OFF_CONTROL]["goodput"] / off["goodput"], 3),
        "regret_fraction": round(1 - ctl["goodput"] / oracle["goodput"], 3),
        "decision_overhead_ms_p99": p99(r["decision_ms"] for p in policies for r in log[p]),
        "policies": {p: {"ratio_vs_oracle": round(summary[p]["goodput"] / oracle["goodput"], 3),
                         "ratio_vs_best_static": round(summary[p]["goodput"] / summary["static_best"]["goodput"], 3),
                         "ratio_vs_off": round(summary[p]["goodput"] / off["goodput"], 3),
                         "decision_overhead_ms_p99": p99(r["decision_ms"] for r in log[p]),
                         "overhead_share": _overhead_share(log[p], warmup),
                         "reward_calibration": reward_calibration(log, p, warmup)} for p in policies},
        "goodput": summary,
    }
    _plot(log, lead, out_dir / "controller_arms.png", out_dir / "controller_regret.png")
    if drift is not None:
        result["drift"] = _drift_and_restart(engine, classes, drift, controllers, close, lead, warmup, noise, progress)
    return result


def _windows(log: dict[str, list[dict]], a: str, b: str, size: int) -> list[float]:
    rows_a, rows_b = log[a], log[b]
    return [round(_goodput(rows_a[i:i + size]) / _goodput(rows_b[i:i + size]), 3)
            for i in range(0, len(rows_a), size)]


def _drift_and_restart(engine, classes, drift: Workload, controllers, close, lead, warmup, noise, progress) -> dict:
    """Class weights flip half way; one copy of the policy is also stopped and reopened there."""
    progress(f"drift stream: {drift.n_requests} requests, weights flip at 50%, '{lead}-restart' restarts there")
    names = [lead, f"{lead}-restart", "oracle", "off"]
    ctls = controllers("drift", [n for n in names if n != f"{lead}-restart"])
    ctls[f"{lead}-restart"] = controllers("restart", [lead])[lead]

    def reopen(name, old: AutotuneController) -> AutotuneController:
        url = old.store.url
        old.close()
        old.store.close()
        return AutotuneController(engine, Store(url, label="restarted"), policy=make_policy(lead, old.policy.arms))

    half = drift.n_requests // 2
    log = _run_stream(engine, drift.stream(classes), ctls,
                      restart={"at": half, "names": [f"{lead}-restart"], "reopen": reopen}, noise=noise,
                      progress=progress)
    close(ctls)
    size = max(5, drift.n_requests // 10)
    settled = int(half * warmup)
    return {
        "requests": drift.n_requests,
        "ratio_vs_oracle_before_flip": round(
            _goodput(log[lead][settled:half]) / _goodput(log["oracle"][settled:half]), 3),
        "ratio_vs_oracle_after_flip": round(_goodput(log[lead][half:]) / _goodput(log["oracle"][half:]), 3),
        "ratio_vs_oracle_by_window": _windows(log, lead, "oracle", size),
        "restart_ratio_vs_oracle_by_window": _windows(log, f"{lead}-restart", "oracle", size),
        "restart_vs_uninterrupted_after_restart": round(
            _goodput(log[f"{lead}-restart"][half:]) / _goodput(log[lead][half:]), 3),
        "window_size": size,
    }


def _plot(log, policy: str, arms_png: Path, regret_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = log[policy]
    arm_names = sorted({r["arm"] for r in rows}, key=lambda a: (a != "off", a))
    cells = sorted({r["cell"] for r in rows})
    fig, ax = plt.subplots(figsize=(10, 4))
    for c in cells:
        pts = [(i, arm_names.index(r["arm"])) for i, r in enumerate(rows) if r["cell"] == c]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, label=c)
    ax.set_yticks(range(len(arm_names)), arm_names)
    ax.set_xlabel("request")
    ax.set_title(f"arm chosen by {policy}, per class and load")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(arms_png, dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in log:
        if name == "oracle":
            continue
        regret, total = [], 0.0
        for r, o in zip(log[name], log["oracle"]):
            total += r["seconds"] - o["seconds"] * (r["tokens"] / o["tokens"] if o["tokens"] else 1.0)
            regret.append(total)
        ax.plot(regret, label=name)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("request")
    ax.set_ylabel("seconds lost vs per-class oracle")
    ax.set_title("cumulative regret")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(regret_png, dpi=100)
    plt.close(fig)
