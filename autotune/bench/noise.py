"""A noisy machine for `autotune bench controller --noise`: other work beside the engine.

`InjectedDelays` slows the models' forward passes in bursts of time (seeded): during a
burst each forward pass takes `slowdown` times its time, as when other processes take the
cores.
`CpuHog` is the real thing: processes that keep both cores busy with matrix products
(torch's threads then run up to 40x slower per step).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time

import torch

HOG = "import torch\ntorch.set_num_threads(2)\na = torch.randn(384, 384)\nwhile True:\n    a = torch.tanh(a @ a)\n"


class InjectedDelays:
    """Bursts of slow forward passes on every model of an engine (target and model drafters).

    Bursts come in time, not per forward pass, as other work on a machine does: they start at
    random moments, `burst_rate` a second on average, each lasts `burst_s` seconds, and every
    forward pass that ends inside one takes `slowdown` times its time. (Counted per forward
    pass, a burst of 20 slowed 20 of the target's steps for OFF but mostly cheap drafter steps
    for a model drafter, and OFF measured at half the speed it has.)

    `restart(key)` starts the bursts afresh from a schedule of `key`'s own: a benchmark that
    serves one request with several configurations in turn restarts before each, so every
    configuration meets the same bursts at the same moments of that request (common random
    numbers). Without it which configuration a burst happened to hit decided ratios between
    them by more than their policies did: a burst costs a request several times its time.
    """

    def __init__(self, models: list[torch.nn.Module], seed: int = 0, burst_rate: float = 0.5,
                 burst_s: float = 0.2, slowdown: float = 8.0) -> None:
        self.models = models
        self.seed = seed
        self.rng = random.Random(seed)
        self.burst_rate = burst_rate
        self.burst_s = burst_s
        self.slowdown = slowdown
        self.slowed = 0  # forwards slowed so far
        self._handles = []
        self._started = 0.0
        self._burst = (0.0, 0.0)  # (start, end) of the next or current burst, perf_counter seconds

    def restart(self, key: int) -> None:
        """Bursts from now on as schedule `key` has them, the same whenever `key` restarts."""
        self.rng = random.Random(f"{self.seed}:{key}")
        self._next_burst(time.perf_counter())

    def _next_burst(self, after: float) -> None:
        start = after + self.rng.expovariate(self.burst_rate)
        self._burst = (start, start + self.burst_s)

    def _before(self, module, args) -> None:
        self._started = time.perf_counter()

    def _after(self, module, args, output) -> None:
        now = time.perf_counter()
        while now > self._burst[1]:
            self._next_burst(self._burst[1])
        if now >= self._burst[0]:
            self.slowed += 1
            time.sleep((self.slowdown - 1.0) * (now - self._started))

    def __enter__(self) -> InjectedDelays:
        self._next_burst(time.perf_counter())
        for model in self.models:
            self._handles.append(model.register_forward_pre_hook(self._before))
            self._handles.append(model.register_forward_hook(self._after))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class CpuHog:
    """`processes` busy processes beside this one, ended on exit."""

    def __init__(self, processes: int = 2) -> None:
        self.processes = processes
        self._running: list[subprocess.Popen] = []

    def __enter__(self) -> CpuHog:
        self._running = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(self.processes)]
        return self

    def __exit__(self, *exc) -> None:
        for process in self._running:
            process.kill()
            process.wait()
        self._running.clear()
