"""Where a jitted call's device time goes: a trace of a few calls, summed per device op.

`device_op_times` runs a function under ``jax.profiler.trace`` and reads the trace back
(``jax.profiler.ProfileData``): every event on a device plane (``/device:GPU:0`` and the like) is
an op or a kernel with its duration. A device plane has several lines that may show the same
work twice (XLA ops, the CUDA streams that ran their kernels, whole modules), so each line is
summarised on its own; the kinds (``op_kind``) group kernel names into matmuls, the Pallas
kernels, data movement and the rest. On the CPU there is no device plane and the result is empty.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax

# (kind, substrings of a lower-cased op or kernel name), first match wins
KINDS = (
    ("tree attention kernel", ("tree_attention",)),
    ("q/k norm + RoPE kernel", ("qk_norm_rope",)),
    ("fused sampler", ("tree_sample",)),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "dot")),
    ("data movement", ("copy", "scatter", "dynamic_update_slice", "dynamic-update-slice", "memcpy", "memset",
                       "transpose", "concatenate", "gather")),
)


def op_kind(name: str) -> str:
    """The kind of an op or kernel name (see ``KINDS``), ``"other"`` if none matches."""
    lower = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lower for k in keys)), "other")


def _check_calls(calls) -> None:
    if not (isinstance(calls, int) and calls >= 1):
        raise ValueError(f"calls must be an int >= 1, got {calls!r}")


def summarize(events, calls: int, top: int = 15) -> dict:
    """Per line: ms per call, the share of each kind and the ``top`` ops by time.

    Args:
      events: ``(line, name, duration_ns)`` triples of ``calls`` traced calls.
    """
    _check_calls(calls)
    per_line = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
    for line, name, duration_ns in events:
        entry = per_line[line][name]
        entry[0] += duration_ns / 1e6 / calls
        entry[1] += 1
    summary = {}
    for line, ops in per_line.items():
        total = sum(ms for ms, _ in ops.values())
        kinds = collections.Counter()
        for name, (ms, _) in ops.items():
            kinds[op_kind(name)] += ms
        ranked = sorted(ops.items(), key=lambda item: -item[1][0])[:top]
        summary[line] = dict(
            ms_per_call=total,
            kind_share={kind: ms / total for kind, ms in kinds.most_common()} if total else {},
            top_ops=[dict(name=name, kind=op_kind(name), ms_per_call=ms, count_per_call=count / calls)
                     for name, (ms, count) in ranked])
    return summary


def device_events(profile_data):
    """``(line, name, duration_ns)`` of every event on the device planes of a trace."""
    for plane in profile_data.planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                for event in line.events:
                    yield line.name, event.name, event.duration_ns


def device_op_times(fn, calls: int = 3, top: int = 15) -> dict:
    """`summarize` of ``calls`` calls of ``fn`` (a warm-up call runs first, untraced).

    ``fn()`` must return arrays to block on. Returns ``{}`` where the backend records no device
    plane (the CPU).
    """
    _check_calls(calls)
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(fn())
        paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        events = [e for path in paths for e in device_events(jax.profiler.ProfileData.from_file(path))]
    return summarize(events, calls, top)


def format_summary(summary: dict, ops: int = 5) -> str:
    """A few printable lines: per line, ms per call, kind shares and the largest ops."""
    lines = []
    for line, s in summary.items():
        shares = ", ".join(f"{kind} {100 * share:.0f}%" for kind, share in s["kind_share"].items())
        lines.append(f"    [{line}] {s['ms_per_call']:.2f} ms per call: {shares}")
        lines += [f"      {op['ms_per_call']:7.3f} ms  x{op['count_per_call']:<5g} {op['kind']:<22} {op['name'][:70]}"
                  for op in s["top_ops"][:ops]]
    return "\n".join(lines) if lines else "    (no device trace on this backend)"
