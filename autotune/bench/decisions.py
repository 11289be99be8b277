"""`autotune bench decisions`: what choosing an arm, and learning from a request, cost a policy.

`bench controller` reports the decision time among seconds of decoding on a shared machine;
this isolates the policies' own bookkeeping on simulated traffic shaped like the demo's (four
classes at three load buckets, OFF and five drafters at each of BENCH_KS), so a change to it
shows without the engine in the way. A decision runs before the request's first token; an
update runs after its last. `classes` can be many: a server whose clients label requests per
tenant or per user has a key for each, most of them new or rarely seen.
"""

from __future__ import annotations

import random
import statistics
import time

from autotune.bench.arms import BENCH_KS
from autotune.bench.common import p99
from engine import OFF, Arm
from policies import Context, Outcome, make_policy

DRAFTERS = ("small", "medium", "distilled", "ngram", "ngram+distilled")  # the demo family's
CLASSES = ("code", "docs", "edit", "creative")
LOADS = (1, 3, 16)  # one per load bucket
REPLAYED = 8  # a key's first requests come with replayed estimates of the sibling arms, as in the controller


def bench_decisions(policies=("ucb", "thompson", "contextual"), decisions: int = 3000, warmup: int = 500,
                    seed: int = 0, classes: tuple[str, ...] = CLASSES) -> dict:
    arms = [OFF] + [Arm(d, k) for d in DRAFTERS for k in BENCH_KS]
    result = {"arms": len(arms), "keys": len(classes) * len(LOADS), "decisions": decisions, "policies": {}}
    for name in policies:
        rng = random.Random(seed)
        means = {(c, str(a)): 1.0 if a.is_off else rng.uniform(0.6, 1.5) for c in classes for a in arms}
        contexts = [Context(c, load, {"prompt_tokens": rng.randint(20, 300), "max_new_tokens": 64,
                                      "temperature": 0.0, "top_p": 1.0, "ngram_overlap": rng.random()})
                    for c in classes for load in LOADS]
        policy = make_policy(name, arms)
        served: dict[str, int] = {}
        choose_ms, update_ms = [], []
        for step in range(warmup + decisions):
            context = rng.choice(contexts)
            started = time.perf_counter()
            arm = policy.choose(context)
            chosen = time.perf_counter()
            served[context.key] = served.get(context.key, 0) + 1
            siblings = {}
            if served[context.key] <= REPLAYED:
                siblings = {str(a): (rng.gauss(means[context.request_class, str(a)], 0.1), 0.5) for a in arms
                            if a != arm and not a.is_off}
            reward = rng.gauss(means[context.request_class, str(arm)], 0.2)
            outcome = Outcome(100.0 * reward, reward, 0.5, 64, siblings)
            learning = time.perf_counter()
            policy.update(context, arm, outcome)
            if step >= warmup:
                choose_ms.append((chosen - started) * 1e3)
                update_ms.append((time.perf_counter() - learning) * 1e3)
        result["policies"][name] = {"choose_ms_p50": round(statistics.median(choose_ms), 4),
                                    "choose_ms_p99": p99(choose_ms),
                                    "update_ms_p50": round(statistics.median(update_ms), 4),
                                    "update_ms_p99": p99(update_ms)}
    return result
