"""Request features and GPU utilization sampling.

GPU figures come from NVML (the nvidia-ml-py package) sampled in a thread while a request
runs; on a machine without an NVIDIA GPU they are recorded as unavailable (None), never an
error.
"""

from __future__ import annotations

import threading

from engine import SamplingParams


def ngram_overlap(ids: list[int], n: int = 3) -> float:
    """Share of the prompt's n-grams seen earlier in the prompt: how repetitive it is."""
    if len(ids) <= n:
        return 0.0
    seen, repeats = set(), 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats / (len(ids) - n + 1)


def request_features(ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> dict:
    """What the classifier and the contextual policy see of a request. `edits_logits` (penalties,
    bias, allowed tokens, bad words, a caller's processors) changes which arm wins: under a
    repetition penalty n-gram lookup's repeats are mostly rejected."""
    return {
        "prompt_tokens": len(ids),
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "ngram_overlap": round(ngram_overlap(ids), 4),
        "edits_logits": float(sampling.adjusts_logits),
    }


class GpuMonitor:
    """Samples utilization and memory of one GPU while a request runs (None without NVML)."""

    def __init__(self, index: int = 0, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # no driver, no GPU, no library: unavailable, not an error
            self.handle = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def _sample(self) -> tuple[float, float]:
        util = self._nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
        mem = self._nvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20
        return float(util), float(mem)

    def measure(self) -> _Measurement:
        return _Measurement(self)


class _Measurement:
    """Context manager: mean utilization (%) and peak memory (MiB) over its body."""

    def __init__(self, monitor: GpuMonitor) -> None:
        self.monitor = monitor
        self.util: float | None = None
        self.mem_mb: float | None = None
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._samples.append(self.monitor._sample())
            self._stop.wait(self.monitor.interval_s)

    def __enter__(self) -> _Measurement:
        if self.monitor.available:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def so_far(self) -> tuple[float | None, float | None]:
        """Mean utilization and peak memory from the start until now: a request handed over
        before its batch is done."""
        if not self.monitor.available:
            return None, None
        samples = [*self._samples, self.monitor._sample()]
        return sum(s[0] for s in samples) / len(samples), max(s[1] for s in samples)

    def __exit__(self, *exc) -> None:
        if not self.monitor.available:
            return
        self._stop.set()
        self._thread.join()
        self._samples.append(self.monitor._sample())
        self.util = sum(s[0] for s in self._samples) / len(self._samples)
        self.mem_mb = max(s[1] for s in self._samples)
