"""`experiments/bench_tp.py` on 8 CPU devices with tiny shapes: greedy DDTree tokens agree across tp,
and every latency row is written."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_tp_tiny_on_8_cpu_devices(tmp_path):
    out = tmp_path / "tp.json"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_tp.py"), "--shapes", "tiny", "--tps", "1,8",
           "--check-tps", "1,4,8", "--budgets", "8", "--context", "16", "--new-tokens", "6", "--repeats", "1",
           "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    entry = json.loads(out.read_text())["shapes"]["tiny"]
    assert entry["tokens"]["identical"] == {"1": True, "4": True, "8": True}
    tokens = entry["tokens"]["tokens"]["8"]
    assert len(tokens) == 1 and len(tokens[0]) == 6 and min(tokens[0]) >= 0
    rows = {(r["tp"], r["kind"], r["budget"]) for r in entry["latency"]}
    assert rows == {(1, "decode", 0), (1, "ddtree", 8), (8, "decode", 0), (8, "ddtree", 8)}
    assert all(r["ms"] > 0 for r in entry["latency"])
    assert all((r["allreduce_per_layer_ms"] > 0) == (r["tp"] > 1) for r in entry["latency"])
