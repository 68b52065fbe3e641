"""`experiments/bench_attention_merge.py` on tiny shapes on the CPU: its rows, its merge variant's
equality with the shipped merge, and that every patch is undone."""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import bench_attention_merge  # noqa: E402
from pallas_kernels import configs, split_k, tree_attention  # noqa: E402


def test_merge_weights_first_equals_the_shipped_merge():
    keys = jax.random.split(jax.random.key(0), 3)
    o = jax.random.normal(keys[0], (2, 5, 3, 8))
    m = jax.random.normal(keys[1], (2, 5, 3)).at[:, 2].set(-np.inf)  # an empty split
    l_ = jax.random.uniform(keys[2], (2, 5, 3)).at[:, 2].set(0.0)
    np.testing.assert_allclose(np.asarray(bench_attention_merge.merge_weights_first(o, m, l_)),
                               np.asarray(split_k.merge_splits(o, m, l_)), rtol=1e-5, atol=1e-6)


def test_tiny_run_writes_every_variant_and_restores_the_patches(tmp_path):
    out = tmp_path / "merge.json"
    before = dict(configs.TREE_ATTENTION_CONFIGS)
    argv = ["--shapes", "tiny", "--context", "16", "--budget", "4", "--chunks", "256", "--repeats", "1",
            "--out", str(out)]
    assert bench_attention_merge.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["method"]) for r in rows] == [
        (v, m) for v in ("shipped", "weights_first", "by_length", "chunk_256") for m in ("ar", "ddtree")]
    assert all(r["back_to_back_ms"] > 0 for r in rows)
    assert tree_attention.merge_splits is split_k.merge_splits and configs.TREE_ATTENTION_CONFIGS == before


def test_bad_flags_raise(tmp_path):
    with pytest.raises(ValueError, match="--chunks"):
        bench_attention_merge.main(["--shapes", "tiny", "--chunks", "0", "--out", str(tmp_path / "x.json")])
