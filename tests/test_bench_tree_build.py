"""`experiments/bench_tree_build.py` end to end on tiny flags on the CPU: every row and field is written."""

import json
import math
import sys
from pathlib import Path

import pytest

from pallas_kernels.top_k import TopKConfig
from pallas_kernels.tree_build import TreeBuildConfig
from pallas_kernels.tree_build_wide import WideBuildConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import bench_tree_build  # noqa: E402


def run_bench(tmp_path, argv) -> dict:
    """``bench_tree_build.main(argv)`` writing to a file of ``tmp_path``: the JSON it wrote."""
    out = tmp_path / "tree_build.json"
    assert bench_tree_build.main([*argv, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_tree_build_tiny_rows(tmp_path):
    result = run_bench(tmp_path, ["--vocab", "4096", "--depth", "3", "--budgets", "24,80", "--batches", "1,2",
                                  "--repeats", "2"])
    meta, rows = result["meta"], result["rows"]
    assert {"backend", "device", "jax", "date", "command", "dispatch_ms", "elapsed_s"} <= set(meta)
    assert meta["dispatch_ms"] > 0
    assert [(r["batch"], r["budget"]) for r in rows] == [(1, 24), (1, 80), (2, 24), (2, 80)]
    kernel_columns = ("beam_kernel_ms", "kernel_in_loop_ms")
    for row in rows:
        assert (row["vocab"], row["depth"], row["k"]) == (4096, 3, row["budget"])
        assert row["plan"] == "lax" and row["top_k_exact"]  # a CPU runs lax.top_k (the stages: on a GPU)
        assert all(row[c] > 0 for c in bench_tree_build.COLUMNS if c not in kernel_columns)
        if row["budget"] == 24:  # the kernel (interpreted here, beams 32 wide) builds the same tree
            assert row["kernel_equal"] is True and all(row[c] > 0 for c in kernel_columns)
        else:  # past the kernel's 64: no kernel, the wide build
            assert row["kernel_equal"] is None and all(math.isnan(row[c]) for c in kernel_columns)
            assert row["wide_equal"] is True and row["wide_in_loop_ms"] > 0 and row["beam_wide_in_loop_ms"] > 0
        assert row["hbm_floor_ms"] == pytest.approx(1e3 * row["batch"] * 3 * 4096 * 4 / 4.8e12)
        assert row["top_k_kernel_exact"] is True and row["top_k_kernel_in_loop_ms"] > 0 and row["top_k_in_loop_ms"] > 0


def test_bench_tree_build_rejects_bad_flags(tmp_path):
    with pytest.raises(SystemExit):  # a list flag fails in parsing (tests/test_experiment_flags.py)
        bench_tree_build.main(["--budgets", "0", "--out", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="--repeats"):
        bench_tree_build.main(["--repeats", "0", "--out", str(tmp_path / "x.json")])


def test_bench_tree_build_topk_cap(tmp_path):
    """With ``--topk-cap`` each depth keeps the cap's tokens, and the kernel still builds the XLA path's tree."""
    (row,) = run_bench(tmp_path, ["--vocab", "512", "--depth", "3", "--budgets", "8", "--batches", "2",
                                  "--repeats", "1", "--topk-cap", "2"])["rows"]
    assert (row["topk_cap"], row["k"], row["kernel_equal"]) == (2, 2, True)


def test_bench_tree_build_kernel_variants(tmp_path):
    """``--kernel-variants`` times the kernel with other launches, each where it takes the budget; every
    launch builds the same tree."""
    small, large = run_bench(tmp_path, ["--vocab", "512", "--depth", "3", "--budgets", "8,64", "--batches", "1",
                                        "--repeats", "1", "--kernel-variants", "w2,c8,w16c64,c0"])["rows"]
    for v in ("w2", "c8", "w16c64", "c0"):
        assert small[f"kernel_{v}_equal"] is True and small[f"beam_kernel_{v}_in_loop_ms"] > 0
    assert small["beam_in_loop_ms"] > 0 and small["beam_kernel_in_loop_ms"] > 0
    assert large["kernel_equal"] is True and large["kernel_w16c64_equal"] is True and large["kernel_w2_equal"]  # B = 64
    assert "kernel_c8_equal" not in large and "kernel_c0_equal" not in large  # 35 chunks; a 512-wide tile
    assert bench_tree_build.parse_variant("w16c64") == TreeBuildConfig(num_warps=16, chunk=64)
    assert bench_tree_build.parse_variant("c0") == TreeBuildConfig(chunk=0)
    assert bench_tree_build.parse_variant("w4") == TreeBuildConfig(num_warps=4, chunk=TreeBuildConfig().chunk)
    for bad, message in [("w3", "num_warps must be"), ("c32w16", "w<num_warps>c<chunk> in that order"),
                         ("c32s", "w<num_warps>c<chunk>"), ("c12", "chunk must be")]:
        with pytest.raises(ValueError, match=f"--kernel-variants: .*{message}"):
            bench_tree_build.main(["--kernel-variants", bad, "--out", str(tmp_path / "x.json")])


def test_bench_tree_build_top_k_variants(tmp_path):
    """``--top-k-variants`` times the radix top-k with other launches; each selects the same top-K."""
    (row,) = run_bench(tmp_path, ["--vocab", "3000", "--depth", "2", "--budgets", "8", "--batches", "1",
                                  "--repeats", "1", "--top-k-variants", "s4,b128w2s2"])["rows"]
    for v in ("s4", "b128w2s2"):
        assert row[f"top_k_kernel_{v}_exact"] is True and row[f"top_k_kernel_{v}_in_loop_ms"] > 0
    assert bench_tree_build.parse_top_k_variant("b512w4s32") == TopKConfig(block=512, num_warps=4, segments=32)
    assert bench_tree_build.parse_top_k_variant("s8") == TopKConfig(segments=8)
    assert bench_tree_build.parse_wide_variant("r16c256w8") == WideBuildConfig(rows=16, cols=256, num_warps=8)
    assert bench_tree_build.parse_wide_variant("g1") == WideBuildConfig(gather_keys=True)
    with pytest.raises(ValueError, match="--wide-variants: a wide variant is "
                                         "r<rows>c<cols>e<entries>w<num_warps>g<gather_keys>"):
        bench_tree_build.main(["--wide-variants", "w8r16", "--out", str(tmp_path / "x.json")])
    for bad, message in [("s8b512", "b<block>w<num_warps>s<segments> in that order"), ("b100", "block must be")]:
        with pytest.raises(ValueError, match=f"--top-k-variants: .*{message}"):
            bench_tree_build.main(["--top-k-variants", bad, "--out", str(tmp_path / "x.json")])
