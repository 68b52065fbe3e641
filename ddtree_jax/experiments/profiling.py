"""Where a jitted call's device time goes: a trace of a few calls, summed per device op.

`device_op_times` runs a function under ``jax.profiler.trace`` and reads the trace back
(``jax.profiler.ProfileData``): every event on a device plane (``/device:GPU:0`` and the like) is
an op or a kernel with its duration. A device plane has several lines that may show the same
work twice (XLA ops, the CUDA streams that ran their kernels, whole modules), so each line is
summarised on its own; the kinds (``op_kind``) group kernel names into matmuls, the Pallas
kernels, data movement and the rest. On the CPU there is no device plane and the result is empty.

A profile can also be summed by *part*: the named scope (``jax.named_scope``) each op was traced in,
such as the steps of a decoding round (`ddtree_jax.engine.ROUND_PARTS`). `scope_parts` reads the
compiled program's HLO text (each instruction's ``op_name`` metadata holds its scopes) into a table
from instruction names, and from the names of the kernels XLA launches for them (its fusions', and the
Pallas kernels', which XLA numbers in launch order), to parts; each traced event is looked up by the HLO
instruction it ran (`event_hlo_op`: the ``hlo_op`` the runtime records with it, where it does), else by
its own name, else it takes the part of the event before it on its line (a library kernel such as
cuBLAS's names neither: it runs between the ops of its own part). Ops fused across a scope boundary
count for the scope of the op their metadata names.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
from collections.abc import Iterable, Mapping

import jax

# (kind, substrings of a lower-cased op or kernel name), first match wins
KINDS = (
    ("tree attention kernel", ("tree_attention",)),
    ("q/k norm + RoPE kernel", ("qk_norm_rope",)),
    ("fused sampler", ("tree_sample",)),
    ("residual + RMSNorm kernel", ("residual_norm",)),
    ("tree build kernels", ("tree_build", "top_k_merge", "top_k_select")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "dot")),
    ("data movement", ("copy", "scatter", "dynamic_update_slice", "dynamic-update-slice", "memcpy", "memset",
                       "transpose", "concatenate", "gather", "kv_write")),
)


def op_kind(name: str) -> str:
    """The kind of an op or kernel name (see ``KINDS``), ``"other"`` if none matches."""
    lower = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lower for k in keys)), "other")


def _check_calls(calls) -> None:
    if not (isinstance(calls, int) and calls >= 1):
        raise ValueError(f"calls must be an int >= 1, got {calls!r}")


UNATTRIBUTED = "unattributed"


def _kind_shares(kinds: collections.Counter, total: float) -> dict:
    return {kind: ms / total for kind, ms in kinds.most_common()} if total else {}


def summarize(events, calls: int, top: int = 15, parts: Mapping[str, str] | None = None) -> dict:
    """Per line: ms per call, the share of each kind and the ``top`` ops by time; with ``parts``, also
    ``parts``: ``{part: {ms_per_call, kind_share}}``, the longest first, and ``by_neighbour_ms``: the ms
    per call of the events that took their part from the event before them.

    Args:
      events: ``(line, name, duration_ns, hlo_op)`` of ``calls`` traced calls, each line's in time order
        (``hlo_op`` the HLO instruction the event ran, ``""`` if unknown).
      parts: a `scope_parts` table. An event whose ``hlo_op`` and name it lacks takes the part of the
        last event before it on its line that had one; the events before any such count as
        `UNATTRIBUTED`.
    """
    _check_calls(calls)
    per_line = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
    per_part = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    last_part, by_neighbour = {}, collections.Counter()
    for line, name, duration_ns, hlo_op in events:
        entry = per_line[line][name]
        ms = duration_ns / 1e6 / calls
        entry[0] += ms
        entry[1] += 1
        if parts is not None:
            part = parts.get(hlo_op) or parts.get(name)
            if part:
                last_part[line] = part
            elif line in last_part:
                part = last_part[line]
                by_neighbour[line] += ms
            else:
                part = UNATTRIBUTED
            per_part[line][part][op_kind(name)] += ms
    summary = {}
    for line, ops in per_line.items():
        total = sum(ms for ms, _ in ops.values())
        kinds = collections.Counter()
        for name, (ms, _) in ops.items():
            kinds[op_kind(name)] += ms
        ranked = sorted(ops.items(), key=lambda item: -item[1][0])[:top]
        summary[line] = dict(
            ms_per_call=total,
            kind_share=_kind_shares(kinds, total),
            top_ops=[dict(name=name, kind=op_kind(name), ms_per_call=ms, count_per_call=count / calls)
                     for name, (ms, count) in ranked])
        if parts is not None:
            part_ms = {part: sum(k.values()) for part, k in per_part[line].items()}
            summary[line]["parts"] = {part: dict(ms_per_call=ms, kind_share=_kind_shares(per_part[line][part], ms))
                                      for part, ms in sorted(part_ms.items(), key=lambda item: -item[1])}
            summary[line]["by_neighbour_ms"] = by_neighbour[line]
    return summary


_HLO_OP_FIELD = re.compile(r"hlo_op=([^,#\s]+)")


def event_hlo_op(stats: Iterable[tuple[str, object]]) -> str:
    """The HLO instruction a traced event ran, from its ``(name, value)`` stats: an ``hlo_op`` stat, or
    the ``hlo_op=`` field of an annotation such as ``Thunk:#name=...,hlo_op=fusion.3,...#``; ``""``
    if none names one."""
    annotated = ""
    for key, value in stats:
        if key == "hlo_op":
            return str(value)
        if not annotated and isinstance(value, str) and (match := _HLO_OP_FIELD.search(value)):
            annotated = match.group(1)
    return annotated


def device_events(profile_data, planes: str = "/device:"):
    """``(line, name, duration_ns, hlo_op)`` of every event on the planes of a trace whose names start
    with ``planes`` (the devices'; ``hlo_op`` by `event_hlo_op`), each line's in time order."""
    for plane in profile_data.planes:
        if plane.name.startswith(planes):
            for line in plane.lines:
                for event in sorted(line.events, key=lambda e: e.start_ns):
                    yield line.name, event.name, event.duration_ns, event_hlo_op(event.stats)


def device_op_times(fn, calls: int = 3, top: int = 15, parts: Mapping[str, str] | None = None,
                    planes: str = "/device:") -> dict:
    """`summarize` of ``calls`` calls of ``fn`` (a warm-up call runs first, untraced), by part too
    with a `scope_parts` table ``parts``.

    ``fn()`` must return arrays to block on. ``planes``: the trace planes read (`device_events`).
    Returns ``{}`` where the backend records no such plane (the device planes on a CPU).
    """
    _check_calls(calls)
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(fn())
        paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        events = [e for path in paths for e in device_events(jax.profiler.ProfileData.from_file(path), planes)]
    return summarize(events, calls, top, parts)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|called_computations)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")
_NAME = re.compile(r"%?([\w.\-]+)")
_SOURCE = re.compile(r"\s(?:parameter|constant)\(")
_TRITON_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'
# The kernel name in a Pallas (Triton) custom call's backend config, ``name = "k"`` (escaped or not) or
# JSON ``"name":"k"``; not ``op_name=``. The config's keys are sorted, so its ``name`` is the last match.
_KERNEL_NAME = re.compile(r'(?<![\w])(?:name\s*=\s*\\?"|\\?"name\\?"\s*:\s*\\?")([A-Za-z_][\w.\-]*)')


def kernel_name(instruction: str) -> str:
    """The name XLA gives the kernel of a fused instruction: ``gemm_fusion_dot.21`` runs as
    ``gemm_fusion_dot_21``."""
    return re.sub(r"[.\-]", "_", instruction)


def _vote(parts) -> str | None:
    votes = collections.Counter(p for p in parts if p)
    return votes.most_common(1)[0][0] if votes else None


def scope_parts(hlo_text: str, parts: Iterable[str]) -> dict[str, str]:
    """``{instruction or kernel name: part}`` for the instructions of a compiled program (its HLO text,
    ``compiled.as_text()``) traced in one of the named scopes ``parts``: the last (innermost) component
    of the instruction's ``op_name`` that is a part (``jit(f)/while/body/draft/layer_0/dot_general`` ->
    ``draft``, ``jit(f)/verify/encode/iota`` -> ``encode``). An instruction without one (XLA adds copies
    and converts without metadata) takes the part most of the instructions it calls have (a fusion's
    fused computation), else most of its operands', else most of its users'. A Pallas kernel is also
    found by the name its launch gets: XLA numbers the launches of each kernel name in the order it emits
    them (``tree_attention``, ``tree_attention__1``, ...; `pallas_kernel_names`)."""
    parts = frozenset(parts)
    own, calls, operands, members = {}, {}, {}, collections.defaultdict(list)
    kernels, computation, entry = {}, None, None
    for line in hlo_text.splitlines():
        if instruction := _INSTRUCTION.match(line):
            name = instruction.group(1)
            op_name = _OP_NAME.search(line)
            path = op_name.group(1).split("/") if op_name else ()
            own[name] = next((c for c in reversed(path) if c in parts), None)
            calls[name] = [n for group in _CALLED.findall(line) for n in _NAME.findall(group)]
            # parameters and constants run nothing: no part of their own to infer
            operands[name] = None if _SOURCE.search(line) else re.findall(r"%([\w.\-]+)", line[instruction.end():])
            if _TRITON_CALL in line and (found := _KERNEL_NAME.findall(line)):
                kernels[name] = found[-1]
            if computation is not None:
                members[computation].append(name)
        elif header := _COMPUTATION.match(line):
            computation = header.group(1)
            entry = computation if line.startswith("ENTRY") else entry

    def part_of(name, seen):
        if own.get(name):
            return own[name]
        return _vote(part_of(m, seen | {c}) for c in calls.get(name, ()) if c not in seen for m in members.get(c, ()))

    base = {name: part_of(name, frozenset()) for name in own}
    users = collections.defaultdict(list)
    for name, names in operands.items():
        for operand in names or ():
            users[operand].append(name)
    table = {}
    for name, part in base.items():
        if not part and operands[name] is not None:
            part = _vote(base.get(o) for o in operands[name]) or _vote(base[u] for u in users[name])
        if part:
            table[name] = part
            table.setdefault(kernel_name(name), part)
    for launch, name in pallas_kernel_names(kernels, calls, members, entry).items():
        if table.get(name):
            table.setdefault(launch, table[name])
    return table


def pallas_kernel_names(kernels: Mapping[str, str], calls: Mapping[str, list], members: Mapping[str, list],
                        entry: str | None) -> dict[str, str]:
    """``{launch name: instruction}`` for the Pallas custom calls ``kernels`` (``{instruction: kernel
    name}``) of a program whose computations hold the instructions ``members`` and call ``calls``: the
    instructions in the order XLA emits them, from the ``entry`` computation down through the computations
    each instruction calls (a while loop's condition and body where the loop stands); the n-th launch of
    a kernel name ``k`` is named ``k`` for n = 0, else ``k__n``."""
    order, counts = {}, collections.Counter()

    def visit(computation, path):
        for name in members.get(computation, ()):
            for called in calls.get(name, ()):
                if called not in path:
                    visit(called, path | {called})
            if name in kernels:
                base = kernels[name]
                order[base if counts[base] == 0 else f"{base}__{counts[base]}"] = name
                counts[base] += 1

    if entry is not None:
        visit(entry, frozenset({entry}))
    return order


def part_ms(summary: dict, parts: Iterable[str] | None = None) -> float | None:
    """Ms per call that a `summarize` result (all its lines, summed by part) spent in ``parts`` (every
    part by default); ``None`` for a summary without time or parts (the CPU's)."""
    lines = [s["parts"] for s in summary.values() if "parts" in s]
    if not any(p["ms_per_call"] for line in lines for p in line.values()):
        return None
    parts = None if parts is None else frozenset(parts)
    return sum(p["ms_per_call"] for line in lines for part, p in line.items() if parts is None or part in parts)


def part_share(summary: dict, parts: Iterable[str]) -> float | None:
    """The share of a `summarize` result's time (all its lines; summed by part) spent in ``parts``;
    ``None`` for a summary without time or parts (the CPU's)."""
    total = part_ms(summary)
    return None if total is None else part_ms(summary, parts) / total


def format_summary(summary: dict, ops: int = 5) -> str:
    """A few printable lines: per line, ms per call, kind shares, the parts' ms (when summed by part)
    and the largest ops."""
    lines = []
    for line, s in summary.items():
        shares = ", ".join(f"{kind} {100 * share:.0f}%" for kind, share in s["kind_share"].items())
        lines.append(f"    [{line}] {s['ms_per_call']:.2f} ms per call: {shares}")
        if "parts" in s:
            by_part = ", ".join(f"{part} {p['ms_per_call']:.3f}" for part, p in s["parts"].items())
            lines.append(f"      by part: {by_part} ms ({s['by_neighbour_ms']:.3f} ms of these matched no op "
                         "and took the part of the op before)")
        lines += [f"      {op['ms_per_call']:7.3f} ms  x{op['count_per_call']:<5g} {op['kind']:<22} {op['name'][:70]}"
                  for op in s["top_ops"][:ops]]
    return "\n".join(lines) if lines else "    (no device trace on this backend)"
