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
    variants = ("shipped", "xla", "output_only", "rows_32")
    argv = ["--shapes", "tiny", "--context", "16", "--batch", "2", "--budgets", "4", "--ar", "--draft-vocab", "0",
            "--variants", ",".join(variants), "--repeats", "1", "--out", str(out)]
    assert bench_residual_norm.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["round"]) for r in rows] == [(v, m) for v in variants for m in ("ar", "ddtree4")]
    assert all(r["back_to_back_ms"] > 0 for r in rows)
    assert kernels.RESIDUAL_NORM_MIN_ROWS == before and layers.dense_mlp is dense_mlp


def test_variants_patch_the_rows_and_the_down_products_norm():
    """Inside a variant the kernel's rows are those named, and ``output_only``'s MLP asks its down product
    for no normalised rows; both are restored after."""
    parse = bench_residual_norm.parse_variant
    assert parse("shipped") == (None, True) and parse("xla") == (0, True) and parse("output_only") == (None, False)
    assert parse("rows_64") == (64, True)
    before = dict(kernels.RESIDUAL_NORM_MIN_ROWS)
    with bench_residual_norm.variant(0, True):
        assert kernels.RESIDUAL_NORM_MIN_ROWS == {}
    with bench_residual_norm.variant(48, True):
        assert kernels.RESIDUAL_NORM_MIN_ROWS[configs.device_capability()] == 48
    asked = []

    def product(x, w, **kwargs):
        asked.append(kwargs.get("then_norm_N") is not None)
        return matmul_reference(x, w, **kwargs)

    shape = layers.LayerShape(8, 12, 2, 1, 4, 1e-6, 1e4)
    layer = layers.init_layer(jax.random.key(0), shape, jnp.float32)
    x = jnp.ones((1, 2, 8))
    for down, want in ((True, [False, True]), (False, [False, False])):
        asked.clear()
        with bench_residual_norm.variant(None, down):
            out, normed = layers.dense_mlp(layer, x, shape, product, then_norm_D=jnp.ones(8))
        assert asked == want and normed is None and out.shape == x.shape
    assert kernels.RESIDUAL_NORM_MIN_ROWS == before


@pytest.mark.parametrize("flag,value", [("--variants", v) for v in ("rows_0", "rows_x", "nope", "xla,xla", "")]
                         + [("--context", "0"), ("--batch", "0"), ("--topk-cap", "-1"), ("--draft-vocab", "-1")])
def test_bad_flags_raise(tmp_path, flag, value):
    with pytest.raises(ValueError, match=flag):
        bench_residual_norm.main(["--shapes", "tiny", flag, value, "--out", str(tmp_path / "x.json")])
