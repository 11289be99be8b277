"""What a policy learned survives kill -9, and controllers sharing a store add up their evidence
(autotune/control/learning.py), on SQLite and on PostgreSQL."""

import json
import random
import signal
import threading

import pytest
from test_store import run_python

from autotune.control.learning import SharedLearning, Update, learned_states
from engine import OFF, Arm
from policies import Context, Outcome, make_policy
from policies.bandits import LEVELS_KEY
from store import Store

ARMS = [OFF, Arm("small", 2), Arm("ngram", 3)]

# A controller's learning loop without the engine: choose, update, journal, record the
# observation, sync every 5 updates (as save_every=5 would), as fast as it goes.
LEARNER = """
import random, sys, threading
from autotune.control.learning import SharedLearning
from engine import OFF, Arm
from policies import Context, Outcome, make_policy
from store import Store

url, updates, seed = {url!r}, {updates}, {seed}
policy = make_policy("ucb", [OFF, Arm("small", 2), Arm("ngram", 3)])
store = Store(url)
learning = SharedLearning(store, policy)
learning.resume()
lock, rng = threading.Lock(), random.Random(seed)
for i in range(updates):
    context = Context(rng.choice(["code", "chat", "docs"]), rng.choice([1, 3]))
    with lock:
        arm = policy.choose(context)
        outcome = Outcome(100.0, rng.uniform(0.5, 2.0), siblings={{"small:2": (rng.uniform(0.5, 2.0), 0.5)}})
        policy.update(context, arm, outcome)
        learning.add(context, arm, outcome)
    store.record(request_class=context.request_class, arm=str(arm), prompt_tokens=i, new_tokens=1, goodput=1.0)
    if i % 5 == 4:
        learning.sync(lock)
    print("updated", i, flush=True)
store.flush()
learning.sync(lock)
print("pulls", sum(t.pulls for t in policy.tables.values()), flush=True)
store.close()
"""


def resumed(url: str) -> tuple[dict, int]:
    """The state a restarted controller resumes (newest checkpoint + the journal after it), and
    the journal's length."""
    with Store(url) as store:
        policy = make_policy("ucb", ARMS)
        SharedLearning(store, policy).resume()
        return policy.state_dict(), len(store.policy_updates("ucb"))


def replayed(url: str) -> dict:
    """The state folded from the whole journal, no checkpoint."""
    with Store(url) as store:
        policy = make_policy("ucb", ARMS)
        for row in store.policy_updates("ucb"):
            update = Update.from_row(row, {str(a): a for a in ARMS})
            policy.update(update.context, update.arm, update.outcome)
        return policy.state_dict()


def same_learning(a: dict, b: dict) -> bool:
    """Equal counts, and sums equal up to rounding (folds from different checkpoints round apart);
    the policy-wide entries (the fitted arm effects, contextual's history) equal up to rounding."""
    if a.keys() != b.keys():
        return False
    for key in a:
        if "@" not in key:
            if not close(a[key], b[key]):
                return False
        elif (a[key]["counts"], a[key]["pulls"]) != (b[key]["counts"], b[key]["pulls"]):
            return False
        elif not close(a[key]["rows"], b[key]["rows"]):
            return False
    return True


def close(x, y) -> bool:
    """JSON-like values equal, floats up to rounding."""
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(close(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(close(u, v) for u, v in zip(x, y))
    if isinstance(x, float) or isinstance(y, float):
        return abs(x - y) <= 1e-9 * max(1.0, abs(x))
    return x == y


def pulls(state: dict) -> int:
    return sum(table["pulls"] for key, table in state.items() if "@" in key)


def test_killed_at_random_points_a_controller_loses_no_update_it_journaled(store_url):
    """5 lives of a learner on one store, each killed with SIGKILL at a random point (mid-save,
    mid-sync, mid-write), each resuming the last: what the last resumes is every journaled update,
    each counted once, and the journal holds every observation's update."""
    rng = random.Random(0)
    for life in range(5):
        child = run_python(LEARNER.format(url=store_url, updates=10_000, seed=life))
        stop_after = rng.randint(5, 120)
        for line in child.stdout:
            if int(line.split()[1]) >= stop_after:
                break
        if rng.random() < 0.5:
            threading.Event().wait(rng.uniform(0.0, 0.05))  # sometimes mid-update rather than just after one
        child.send_signal(signal.SIGKILL)
        child.wait()
    state, journaled = resumed(store_url)
    with Store(store_url) as store:
        observations = store.count()
    assert pulls(state) == journaled
    assert observations <= journaled <= observations + 5  # a kill between an update and its observation
    assert journaled >= 5 * 5
    assert same_learning(state, replayed(store_url))
    with Store(store_url, read_only=True) as store:  # what `inspect` shows: the same, nothing written
        assert same_learning(learned_states(store, "ucb"), state)


@pytest.mark.slow
def test_four_controllers_on_one_store_add_up_their_evidence(store_url):
    """4 learners x 150 updates at once: the resumed state counts all 600 (each key's pulls the
    journal's), and while they ran they learned from each other (the last to finish had folded
    all 600 into the policy it serves from)."""
    children = [run_python(LEARNER.format(url=store_url, updates=150, seed=n)) for n in range(4)]
    final = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        final.append(int(out.split()[-1]))
    state, journaled = resumed(store_url)
    assert journaled == 600 and pulls(state) == 600
    assert same_learning(state, replayed(store_url))
    assert max(final) == 600 and min(final) >= 150


def test_a_checkpoint_the_database_refused_is_written_whole_with_the_next(tmp_path, monkeypatch):
    """A checkpoint that fails (a locked or full database) keeps the keys it would have saved:
    the next one, reaching further, saves them too, and a resume counts every update."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    lock = threading.Lock()
    with Store(url) as store:
        policy = make_policy("ucb", ARMS)
        learning = SharedLearning(store, policy)
        learning.resume()

        def teach(request_class: str) -> None:
            context = Context(request_class)
            outcome = Outcome(100.0, 1.2)
            policy.update(context, OFF, outcome)
            learning.add(context, OFF, outcome)
            store.flush()

        teach("code")
        def full(*args, **kwargs):
            raise OSError("disk full")

        real = store.save_checkpoint
        monkeypatch.setattr(store, "save_checkpoint", full)
        with pytest.raises(OSError, match="disk full"):
            learning.sync(lock)
        monkeypatch.setattr(store, "save_checkpoint", real)
        teach("docs")
        learning.sync(lock)
        states, through = store.load_checkpoint("ucb")
        assert through == 2 and set(states) == {"code@load1", "docs@load1", LEVELS_KEY}
    state, journaled = resumed(url)
    assert journaled == 2 and pulls(state) == 2


@pytest.mark.parametrize("name", ["ucb", "thompson", "contextual"])
def test_a_fold_resumed_from_any_checkpoint_learns_what_the_whole_fold_learns(name):
    """What a controller folds from a checkpoint onwards is what folding the whole journal gives:
    a key that first appears after the checkpoint starts from the same prior either way (it
    was taken from arm effects last fitted at a moment that differed between the two folds)."""
    rng = random.Random(1)
    classes = [f"class{i}" for i in range(12)]
    level = {c: rng.uniform(0.6, 2.5) for c in classes}
    updates = []
    for i in range(400):
        context = Context(rng.choice(classes[: 2 + i // 40]), rng.choice([1, 3]))
        arm = rng.choice(ARMS)
        effect = 1.3 if arm.k == 3 else 1.0
        reward = 1.0 if arm == OFF else level[context.request_class] * effect * rng.uniform(0.7, 1.3)
        updates.append((context, arm, Outcome(100.0, reward, siblings={"small:2": (reward * 0.9, 0.5)})))
    whole = make_policy(name, ARMS)
    for update in updates:
        whole.update(*update)
    for cut in (37, 150, 233, 301):
        before = make_policy(name, ARMS)
        for update in updates[:cut]:
            before.update(*update)
        resumed = make_policy(name, ARMS)
        resumed.load_state_dict(json.loads(json.dumps(before.state_dict())))
        for update in updates[cut:]:
            resumed.update(*update)
        assert same_learning(resumed.state_dict(), whole.state_dict()), cut
