"""Device-op profiles (ddtree_jax.experiments.profiling): kinds, per-line sums, and a real trace on the CPU."""

import jax
import jax.numpy as jnp
import pytest

from ddtree_jax.experiments import profiling


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "matmul"), ("nvjet_hsh_128x64", "matmul"),
    ("tree_attention", "tree attention kernel"), ("tree_sample", "fused sampler"),
    ("dynamic-update-slice.3", "data movement"), ("input_reduce_fusion_12", "other"),
])
def test_op_kinds(name, kind):
    assert profiling.op_kind(name) == kind


def test_summarize_sums_per_line_and_call():
    events = [("Stream #1", "gemm_a", 2_000_000), ("Stream #1", "gemm_a", 2_000_000),
              ("Stream #1", "loop_fusion", 1_000_000), ("Stream #1", "gemm_a", 3_000_000),
              ("XLA Ops", "dot.1", 6_000_000)]
    summary = profiling.summarize(events, calls=2, top=1)
    stream = summary["Stream #1"]
    assert stream["ms_per_call"] == pytest.approx(4.0)
    assert stream["kind_share"] == pytest.approx({"matmul": 3.5 / 4, "other": 0.5 / 4})
    assert stream["top_ops"] == [dict(name="gemm_a", kind="matmul", ms_per_call=pytest.approx(3.5),
                                      count_per_call=1.5)]
    assert summary["XLA Ops"]["ms_per_call"] == pytest.approx(3.0)
    text = profiling.format_summary(summary)
    assert "[Stream #1] 4.00 ms per call: matmul 88%, other 12%" in text and "gemm_a" in text


@pytest.mark.parametrize("calls", [0, 1.5])
def test_calls_must_be_a_positive_int(calls):
    with pytest.raises(ValueError, match="calls must be an int >= 1"):
        profiling.summarize([], calls)
    with pytest.raises(ValueError, match="calls must be an int >= 1"):
        profiling.device_op_times(lambda: jnp.ones(1), calls)


def test_device_op_times_traces_without_a_device_plane_on_cpu():
    x = jnp.ones((64, 64))
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    assert profiling.device_op_times(lambda: f(x), calls=2) == {}
    assert profiling.format_summary({}) == "    (no device trace on this backend)"
