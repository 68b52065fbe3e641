"""`experiments/bench_models.py` on tiny shapes on the CPU: every variant's rows are written."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import bench_models  # noqa: E402


def test_bench_models_tiny_variants(tmp_path):
    out = tmp_path / "models.json"
    bench_models.main(["--shapes", "tiny", "--matmul-impls", "xla", "--nodes", "", "--variants",
                       "default,cublaslt", "--repeats", "2", "--profile", "--draft-vocab", "64", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["forward"]) for r in rows] == [("default", "decode"), ("default", "drafter"),
                                                          ("cublaslt", "decode"), ("cublaslt", "drafter")]
    assert all(r["ms"] > 0 and "error" not in r for r in rows)
    assert all(r["profile"] == {} for r in rows)  # every forward profiled; the CPU records no device plane


def test_bench_models_names_an_unknown_variant(tmp_path):
    with pytest.raises(SystemExit):
        bench_models.main(["--shapes", "tiny", "--variants", "default,fastest", "--out", str(tmp_path / "x.json")])


def test_bench_models_hlo_of_each_forward(tmp_path):
    """``--hlo`` writes the optimized HLO of the first forward of each kind: decode, each verify, drafter."""
    out = tmp_path / "models.json"
    bench_models.main(["--shapes", "tiny", "--matmul-impls", "xla", "--nodes", "4", "--variants", "default,cublaslt",
                       "--repeats", "1", "--hlo", "--draft-vocab", "64", "--out", str(out)])
    written = sorted(p.name for p in tmp_path.glob("*.hlo.txt"))
    assert written == ["models_decode_xla.hlo.txt", "models_drafter_xla.hlo.txt", "models_verify4_xla.hlo.txt"]
    assert all("ENTRY" in (tmp_path / name).read_text() for name in written)
