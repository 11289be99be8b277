"""`bench limits`: the bytes a decode step reads and the shape of its report."""

import pytest
from conftest import tiny_llama

from autotune.bench.limits import bench_limits, llama_shaped_engine, weight_bytes_per_step
from engine import NGramDrafter, SpeculativeEngine


def _bytes(tensor):
    return tensor.numel() * tensor.element_size()


def test_a_step_reads_every_weight_but_the_input_embedding_unless_it_is_also_the_output():
    untied = tiny_llama(0)
    every = sum(_bytes(p) for p in untied.parameters())
    assert weight_bytes_per_step(untied) == every - _bytes(untied.get_input_embeddings().weight)
    tied = tiny_llama(0)
    tied.get_output_embeddings().weight = tied.get_input_embeddings().weight
    assert weight_bytes_per_step(tied) == sum(_bytes(p) for p in tied.parameters())  # counted once


def test_bench_limits_measures_every_verify_length_and_each_model_drafter(target, draft_model):
    engine = SpeculativeEngine(target, {"small": draft_model, "ngram": NGramDrafter()})
    result = bench_limits(engine, max_k=3, prompt_tokens=8, repeats=3)
    assert list(result["verify_cost_vs_one_token"]) == ["1", "2", "3"]
    assert list(result["drafters"]) == ["small"]  # n-gram lookup has no model step
    target_row = result["target"]
    assert target_row["weight_MB"] == round(weight_bytes_per_step(target) / 2**20, 1)
    # The limit is the copy's bandwidth (bytes read + written per second) over the weight bytes.
    limit = result["copy_bandwidth_GBps"] * 1e9 / (target_row["weight_MB"] * 2**20)
    assert target_row["bandwidth_limit_tokens_per_s"] == pytest.approx(limit, rel=0.01)
    assert target_row["fraction_of_limit"] == pytest.approx(
        target_row["tokens_per_s"] / target_row["bandwidth_limit_tokens_per_s"], rel=0.01, abs=1e-3)  # rounded


def test_llama_shapes_refuse_a_cpu_with_a_clear_error():
    with pytest.raises(ValueError, match="need a CUDA device"):
        llama_shaped_engine("cpu")
