"""`experiments/bench_moe.py` end to end on the tiny Qwen3-MoE shapes, and its byte counts."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax.experiments import bench  # noqa: E402
from experiments import bench_moe  # noqa: E402


def test_bench_moe_tiny_rows(tmp_path):
    out = tmp_path / "moe.json"
    argv = ["--shapes", "tiny-moe", "--batch", "2", "--budgets", "4,12", "--context", "16", "--repeats", "1",
            "--attention-impl", "xla", "--out", str(out)]
    assert bench_moe.main(argv) == 0
    result = json.loads(out.read_text())
    meta, rows = result["meta"], result["rows"]
    assert (meta["sparse_layers"], meta["num_experts"], meta["experts_per_token"]) == (3, 16, 4)
    assert [(r["kind"], r["budget"], r["nodes"]) for r in rows] == [("decode", 0, 1), ("verify", 4, 5),
                                                                    ("verify", 12, 13)]
    for row in rows:
        tokens = row["batch"] * row["nodes"]
        # every token picks 4 distinct experts of 16; the step touches their union over the batch
        assert 4 <= row["distinct_experts_min"] <= row["distinct_experts_mean"] <= row["distinct_experts_max"]
        assert row["distinct_experts_max"] <= min(16, 4 * tokens)
        assert row["touched_fraction"] == pytest.approx(row["distinct_experts_mean"] / 16)
        assert 0 < row["roofline_ms"] <= row["all_experts_roofline_ms"]
        assert row["ms"] > 0 and row["experts_ms"] > 0 and row["first_call_s"] > 0
        assert row["over_decode"] == pytest.approx(row["ms"] / rows[0]["ms"])
    assert rows[2]["distinct_experts_mean"] >= rows[0]["distinct_experts_mean"]  # 26 tokens cover at least 2's experts


def test_byte_counts_split_the_streamed_weights():
    """The non-expert bytes plus every expert of every sparse layer are all the weights a forward
    streams (`bench.streamed_bytes`); an expert of tiny-moe is 3 x 64 x 32 bf16 values."""
    target = bench_moe.make_target("tiny-moe")
    assert bench_moe.expert_bytes(target) == 3 * 64 * 32 * 2
    experts = len(target.config.sparse_layers) * target.config.num_experts
    assert bench_moe.other_bytes(target) + experts * bench_moe.expert_bytes(target) == bench.streamed_bytes(target)
    _, _, _, cache = bench_moe.step_inputs(target, batch=3, context=10, budget=None, depth=2)
    assert bench_moe.cache_bytes(cache, 10) == 2 * 4 * 3 * 4 * 10 * 16 * 2
    assert int(cache.lengths[0]) == 10 and cache.k.shape[3] == 11
    tokens, positions, mask, _ = bench_moe.step_inputs(target, batch=3, context=10, budget=6, depth=2)
    assert tokens.shape == (3, 7) and mask.shape == (3, 7, 7) and int(positions[0, 0]) == 10


def test_bench_moe_refuses_dense_shapes_and_bad_flags(tmp_path):
    with pytest.raises(ValueError, match="not a Qwen3-MoE shape"):
        bench_moe.make_target("tiny")
    with pytest.raises(ValueError, match="--context must be positive"):
        bench_moe.main(["--shapes", "tiny-moe", "--context", "0", "--out", str(tmp_path / "x.json")])
