"""A noisy machine for `autotune bench controller --noise`: other work beside the engine.

`InjectedDelays` slows the models' forward passes in bursts (seeded, so runs repeat): each
forward starts a burst with probability `burst_rate`, and during a burst of `burst_length`
forwards each one takes `slowdown` times its time, as when other processes take the cores.
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
    """Bursts of slow forward passes on every model of an engine (target and model drafters)."""

    def __init__(self, models: list[torch.nn.Module], seed: int = 0, burst_rate: float = 0.005,
                 burst_length: int = 20, slowdown: float = 8.0) -> None:
        self.models = models
        self.rng = random.Random(seed)
        self.burst_rate = burst_rate
        self.burst_length = burst_length
        self.slowdown = slowdown
        self.left = 0  # forwards left in the current burst
        self.slowed = 0  # forwards slowed so far
        self._handles = []
        self._started = 0.0

    def _before(self, module, args) -> None:
        self._started = time.perf_counter()

    def _after(self, module, args, output) -> None:
        if self.left == 0 and self.rng.random() < self.burst_rate:
            self.left = self.burst_length
        if self.left:
            self.left -= 1
            self.slowed += 1
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - self._started))

    def __enter__(self) -> InjectedDelays:
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
