"""`experiments/bench_attention_merge.py` on tiny shapes on the CPU: its rows, its variants' fields, and
that every patch is undone."""

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import bench_attention_merge  # noqa: E402
from ddtree_jax import kernels  # noqa: E402
from pallas_kernels import configs  # noqa: E402

KERNEL_MODULE = importlib.import_module("pallas_kernels.tree_attention")


def test_tiny_run_writes_every_variant_and_restores_the_patches(tmp_path, monkeypatch):
    """Every (variant, round) row is written, the baseline module's rounds last, compiled with its kernel; the
    variants of a round share one state (one KV cache a round, not one a variant); the patched configs and
    kernel are restored."""
    out = tmp_path / "merge.json"
    before = dict(configs.TREE_ATTENTION_CONFIGS)
    made, make_state = [], bench_attention_merge.bench.make_state
    monkeypatch.setattr(bench_attention_merge.bench, "make_state",
                        lambda *a: made.append(a[2].method) or make_state(*a))
    variants = ("shipped", "by_capacity", "whole_waves", "programs_64", "tile_m32k16")
    baseline = tmp_path / "old_tree_attention.py"
    baseline.write_text(Path(KERNEL_MODULE.__file__).read_text())
    seen, compile_round = [], bench_attention_merge.compiled_round
    monkeypatch.setattr(bench_attention_merge, "compiled_round",
                        lambda *a: seen.append(kernels.tree_attention.__module__) or compile_round(*a))
    argv = ["--shapes", "tiny", "--context", "16", "--batch", "2", "--budgets", "4,8", "--variants", ",".join(variants),
            "--repeats", "1", "--baseline-module", str(baseline), "--draft-vocab", "32", "--profile", "--out", str(out)]
    assert bench_attention_merge.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["round"]) for r in rows] == [
        (v, m) for v in (*variants, "baseline") for m in ("ar", "ddtree4", "ddtree8")]
    assert all(r["back_to_back_ms"] > 0 and "device_ms" in r and "profile" in r for r in rows)
    assert made == ["ar", "ddtree", "ddtree"]
    assert seen == ["pallas_kernels.tree_attention"] * 15 + ["tree_attention_baseline"] * 3
    assert configs.TREE_ATTENTION_CONFIGS == before and kernels.tree_attention is KERNEL_MODULE.tree_attention


def test_variant_names_parse_to_their_fields():
    parse = bench_attention_merge.parse_variant
    assert parse("shipped") == {} and parse("by_capacity") == {"split_by_length": False}
    assert parse("chunk_1024") == {"min_chunk": 1024} and parse("programs_128") == {"min_programs": 128}
    assert parse("splits_8") == {"max_splits": 8} and parse("whole_waves") == {"whole_waves": True}
    assert parse("tile_m64k32w4s3") == dict(block_m=64, block_k=32, num_warps=4, num_stages=3)
    assert parse("tile_j16v0") == dict(max_splits=16, whole_waves=False)
    assert bench_attention_merge.parse_variants("shipped,splits_9", parse) == [("shipped", {}),
                                                                                ("splits_9", {"max_splits": 9})]


@pytest.mark.parametrize("flag,value",
                         [("--variants", v)
                          for v in ("chunk_0", "programs_x", "nope", "shipped,shipped", "", "tile_m64x", "tile_")]
                         + [("--context", "0"), ("--batch", "0"), ("--topk-cap", "-1"), ("--draft-vocab", "-1")])
def test_bad_flags_raise(tmp_path, flag, value):
    with pytest.raises(ValueError, match=flag):
        bench_attention_merge.main(["--shapes", "tiny", flag, value, "--out", str(tmp_path / "x.json")])
