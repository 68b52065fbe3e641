"""`experiments/bench_prefetch.py` on tiny shapes on the CPU: its rows, its variants' configs, and that the
table it patches is restored."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax import kernels  # noqa: E402
from experiments import bench_prefetch  # noqa: E402
from pallas_kernels import configs  # noqa: E402


def test_tiny_run_writes_every_variant_and_restores_the_table(tmp_path):
    out = tmp_path / "prefetch.json"
    before = dict(kernels.L2_PREFETCH)
    variants = ("shipped", "off", "wo=1", "wo=0.5+programs=8")
    argv = ["--shapes", "tiny", "--context", "16", "--batch", "2", "--budgets", "4", "--draft-vocab", "0",
            "--variants", ",".join(variants), "--repeats", "1", "--out", str(out)]
    assert bench_prefetch.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["round"]) for r in rows] == [(v, m) for v in variants for m in ("ar", "ddtree4")]
    assert all(r["back_to_back_ms"] > 0 for r in rows)
    assert kernels.L2_PREFETCH == before


def test_variants_name_configs_and_patch_the_table_while_tracing():
    parse = bench_prefetch.parse_variant
    base = kernels.L2Prefetch(wo=0.5, programs=16)
    assert parse("shipped", base) is base and parse("shipped", None) is None and parse("off", base) is None
    assert parse("wo=1", None) == kernels.L2Prefetch(wo=1.0)
    assert parse("wo=1+programs=32+num_warps=4", base) == kernels.L2Prefetch(wo=1.0, programs=32, num_warps=4)
    assert parse("block_rows=32", base) == kernels.L2Prefetch(wo=0.5, programs=16, block_rows=32)
    for bad in ("fast", "wo", "wo=", "speed=2", "programs=x", "wo=2"):
        with pytest.raises(ValueError, match="wo|--variants"):
            parse(bad, None)
    capability, before = configs.device_capability(), dict(kernels.L2_PREFETCH)
    with bench_prefetch.variant(capability, base):
        assert kernels.L2_PREFETCH[capability] == base
    with bench_prefetch.variant(capability, None):
        assert capability not in kernels.L2_PREFETCH
    assert kernels.L2_PREFETCH == before
