"""`experiments/bench_residual_norm.py` on tiny shapes on the CPU: its rows, its variants' patches while
tracing, and that every patch is undone."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax import kernels  # noqa: E402
from ddtree_jax.models import layers  # noqa: E402
from experiments import bench_residual_norm  # noqa: E402
from pallas_kernels import configs  # noqa: E402
from pallas_kernels.matmul_reference import matmul_reference  # noqa: E402


def test_tiny_run_writes_every_variant_and_restores_the_patches(tmp_path):
    out = tmp_path / "rn.json"
    before, dense_mlp = dict(kernels.RESIDUAL_NORM_MIN_ROWS), layers.dense_mlp
    qkv, chunks = set(kernels.QKV_PARTIALS), kernels.split_k_chunks
    variants = ("shipped", "xla", "output_only", "rows_32", "splits_2", "qkv_summed")
    argv = ["--shapes", "tiny", "--context", "16", "--batch", "2", "--budgets", "4", "--ar", "--draft-vocab", "0",
            "--variants", ",".join(variants), "--repeats", "1", "--out", str(out)]
    assert bench_residual_norm.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["round"]) for r in rows] == [(v, m) for v in variants for m in ("ar", "ddtree4")]
    assert all(r["back_to_back_ms"] > 0 for r in rows)
    assert kernels.RESIDUAL_NORM_MIN_ROWS == before and layers.dense_mlp is dense_mlp
    assert kernels.QKV_PARTIALS == qkv and kernels.split_k_chunks is chunks


def test_variants_patch_the_rows_splits_partials_and_the_down_products_norm():
    """Inside a variant the kernel's rows and chunks are those named, the q/k/v partials are or are not handed
    over, and ``output_only``'s MLP asks its down product for no normalised rows; all restored after."""
    parse = bench_residual_norm.parse_variant
    assert parse("shipped") == {} and parse("xla") == {"rows": 0} and parse("output_only") == {"down": False}
    assert parse("rows_64") == {"rows": 64} and parse("splits_8") == {"splits": 8}
    assert parse("qkv_summed") == {"qkv": False}
    for bad in ("rows_0", "splits_x", "fast"):
        with pytest.raises(ValueError, match="--variants"):
            parse(bad)
    before, qkv, chunks = dict(kernels.RESIDUAL_NORM_MIN_ROWS), set(kernels.QKV_PARTIALS), kernels.split_k_chunks
    with bench_residual_norm.variant(rows=0):
        assert kernels.RESIDUAL_NORM_MIN_ROWS == {}
    with bench_residual_norm.variant(rows=48, splits=2, qkv=False):
        assert kernels.RESIDUAL_NORM_MIN_ROWS[configs.device_capability()] == 48
        assert kernels.split_k_chunks(12288) == 2 and kernels.QKV_PARTIALS == set()
    assert kernels.split_k_chunks is chunks and kernels.QKV_PARTIALS == qkv == {(9, 0)}
    asked = []

    def product(x, w, **kwargs):
        asked.append(kwargs.get("then_norm_N") is not None)
        return matmul_reference(x, w, **kwargs)

    shape = layers.LayerShape(8, 12, 2, 1, 4, 1e-6, 1e4)
    layer = layers.init_layer(jax.random.key(0), shape, jnp.float32)
    x = jnp.ones((1, 2, 8))
    for down, want in ((True, [False, True]), (False, [False, False])):
        asked.clear()
        with bench_residual_norm.variant(down=down):
            out, normed = layers.dense_mlp(layer, x, shape, product, then_norm_D=jnp.ones(8))
        assert asked == want and normed is None and out.shape == x.shape
    assert kernels.RESIDUAL_NORM_MIN_ROWS == before
