"""Benchmarks, one module each, behind `autotune bench <what>`.

Every ratio is measured side by side in one run: the compared methods take turns on the same
prompts, in rotating order, so a slow moment of a shared machine hits them all alike. Nothing
here asserts speed; the numbers go to a table and to JSON (docs/benchmarks.md holds the
current figures with their commands).
"""

from autotune.bench.arms import BENCH_KS, bench_arms
from autotune.bench.backends import bench_backend_controller, bench_peer
from autotune.bench.cache import bench_cache, bench_long_batch
from autotune.bench.common import device_name, fresh_stores
from autotune.bench.concurrency import bench_concurrency
from autotune.bench.controller import bench_controller, hindsight_arms
from autotune.bench.decisions import bench_decisions
from autotune.bench.durability import bench_durability
from autotune.bench.engine_speed import bench_engine
from autotune.bench.hostile import bench_hostile
from autotune.bench.layer_skip import bench_layer_skip
from autotune.bench.limits import bench_limits, llama_shaped_engine
from autotune.bench.lossless import bench_lossless
from autotune.bench.prefill import (
    bench_choices,
    bench_chunked,
    bench_chunked_clients,
    bench_lengths,
    bench_prefix,
    bench_prefix_clients,
)
from autotune.bench.replay import bench_replay
from autotune.bench.reward_scale import bench_reward_scale
from autotune.bench.serving import bench_serve
from autotune.bench.store_speed import bench_store
from autotune.bench.tenants import bench_many_classes

__all__ = ["BENCH_KS", "bench_arms", "bench_backend_controller",
           "bench_cache", "bench_choices", "bench_chunked", "bench_chunked_clients",
           "bench_concurrency", "bench_controller", "bench_decisions", "bench_durability", "bench_engine",
           "bench_hostile", "bench_layer_skip",
           "bench_lengths", "bench_limits", "bench_long_batch", "bench_lossless", "bench_many_classes",
           "bench_peer", "bench_prefix", "bench_prefix_clients", "bench_replay", "bench_reward_scale", "bench_serve",
           "bench_store", "device_name", "fresh_stores", "hindsight_arms", "llama_shaped_engine"]
