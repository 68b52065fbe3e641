"""The round-time cost model of the ``"adaptive"`` budget policy (and of projected speeds).

A *cost table* lists, per (batch, context), measured DDTree round times for a few numbers of drafts
per request (`CostCurve`); the time of any other number is interpolated linearly between the listed
points, held at the first point's time below it and extrapolated along the last segment above the
last point. `ddtree bench` writes a table for the device it runs on (``<out>_costs.json``); tables
shipped with the package live in ``ddtree_jax/assets/costs/`` (one for the NVIDIA H200, built from
the measurements in BENCHMARKS.md), and `for_device` picks the one for the local device. Without a
table the cost is flat, which makes the adaptive policy keep every node (the fixed policy).

JSON: ``{"device": str, "source": str, "curves": [{"batch": int, "context": int, "nodes": [int, ...],
"round_ms": [float, ...], "decode_ms": float | null, "source": str}, ...]}``, ``nodes`` strictly
increasing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np

from ddtree_jax.assets import ROOT as ASSETS

SHIPPED = ASSETS / "costs"


@dataclasses.dataclass(frozen=True)
class CostCurve:
    """Measured round times (ms) at ``nodes`` drafts per request, for one batch size and context;
    ``decode_ms`` the AR decode step at the same batch and context (``None``: not measured)."""

    batch: int
    context: int
    nodes: tuple[int, ...]
    round_ms: tuple[float, ...]
    decode_ms: float | None = None
    source: str = ""

    def __post_init__(self):
        object.__setattr__(self, "nodes", tuple(int(n) for n in self.nodes))
        object.__setattr__(self, "round_ms", tuple(float(t) for t in self.round_ms))
        where = f"cost curve (batch {self.batch}, context {self.context})"
        for name in ("batch", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
        if not self.nodes or len(self.nodes) != len(self.round_ms):
            raise ValueError(f"{where}: nodes and round_ms must be non-empty lists of one length, got "
                             f"{list(self.nodes)} and {list(self.round_ms)}")
        if self.nodes[0] < 0 or any(b <= a for a, b in zip(self.nodes, self.nodes[1:])):
            raise ValueError(f"{where}: nodes must be >= 0 and strictly increasing, got {list(self.nodes)}")
        times = self.round_ms + (() if self.decode_ms is None else (self.decode_ms,))
        if not all(math.isfinite(t) and t > 0 for t in times):
            raise ValueError(f"{where}: round_ms and decode_ms must be finite and > 0, got {list(times)}")

    def at(self, drafts) -> np.ndarray:
        """Modelled round ms at ``drafts`` drafts per request (a number or an array of them)."""
        x = np.asarray(drafts, np.float64)
        nodes, times = np.asarray(self.nodes, np.float64), np.asarray(self.round_ms, np.float64)
        inside = np.interp(x, nodes, times)
        if len(nodes) == 1:
            return inside
        slope = (times[-1] - times[-2]) / (nodes[-1] - nodes[-2])
        return np.where(x > nodes[-1], times[-1] + slope * (x - nodes[-1]), inside)


@dataclasses.dataclass(frozen=True)
class CostTable:
    """The cost curves of one device; no curves = the flat cost (`FLAT`)."""

    device: str
    curves: tuple[CostCurve, ...] = ()
    source: str = ""

    @property
    def flat(self) -> bool:
        return not self.curves

    def curve(self, batch: int, context: int) -> CostCurve | None:
        """The curve of the listed batch nearest to ``batch``, then of its contexts the one nearest to
        ``context`` (both on a log scale, ties to the smaller); ``None`` for the flat table."""
        if self.flat:
            return None
        distance = lambda a, b: abs(math.log2(a) - math.log2(max(b, 1)))  # noqa: E731
        best_batch = min({c.batch for c in self.curves}, key=lambda b: (distance(b, batch), b))
        same = [c for c in self.curves if c.batch == best_batch]
        return min(same, key=lambda c: (distance(c.context, context), c.context))

    def round_costs(self, batch: int, context: int, budget: int) -> tuple[float, ...]:
        """Modelled round ms with ``n = 0 .. budget`` drafts per request (all 1.0 for the flat table):
        the ``cost`` of `budget.adaptive_keep`."""
        curve = self.curve(batch, context)
        if curve is None:
            return (1.0,) * (budget + 1)
        return tuple(float(t) for t in curve.at(np.arange(budget + 1)))

    def to_json(self) -> dict:
        return dict(device=self.device, source=self.source, curves=[
            dict(batch=c.batch, context=c.context, decode_ms=c.decode_ms, nodes=list(c.nodes),
                 round_ms=list(c.round_ms), source=c.source) for c in self.curves])

    @classmethod
    def from_json(cls, data: dict, where: str = "cost table") -> CostTable:
        """From the JSON layout of the module docstring; ``ValueError`` naming ``where`` and the field."""
        if not isinstance(data, dict) or not isinstance(data.get("curves"), list):
            raise ValueError(f"{where}: expected an object with a 'curves' list")
        fields = {f.name for f in dataclasses.fields(CostCurve)}
        curves = []
        for i, c in enumerate(data["curves"]):
            if not isinstance(c, dict) or set(c) - fields or {"batch", "context", "nodes", "round_ms"} - set(c):
                raise ValueError(f"{where}: curves[{i}] must have batch, context, nodes and round_ms "
                                 f"(optional: decode_ms, source), got {c!r}")
            try:
                curves.append(CostCurve(**c))
            except (TypeError, ValueError) as err:
                raise ValueError(f"{where}: curves[{i}]: {err}") from None
        return cls(device=str(data.get("device", "")), curves=tuple(curves), source=str(data.get("source", "")))


FLAT = CostTable(device="flat")


def shipped() -> dict[str, Path]:
    """The tables shipped with the package: ``{name: path}`` (name = the file's stem)."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.json"))}


def load(source: str | Path) -> CostTable:
    """The table in the JSON file ``source``, or the shipped table of that name (see `shipped`)."""
    path = shipped().get(str(source), Path(source))
    if not path.is_file():
        raise ValueError(f"cost table {str(source)!r} is neither a file nor a shipped table {sorted(shipped())}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"cost table {path} is not valid JSON: {err}") from None
    return CostTable.from_json(data, where=f"cost table {path}")


def for_device(device_kind: str) -> CostTable:
    """The shipped table measured on ``device_kind`` (e.g. ``"NVIDIA H200"``), else `FLAT`."""
    for path in shipped().values():
        table = load(path)
        if table.device == device_kind:
            return table
    return FLAT


def resolve(cost_table) -> CostTable:
    """``cost_table`` as a `CostTable`: ``None`` = the local device's (`for_device`), a path or shipped
    name (`load`), or a `CostTable` as it is."""
    if isinstance(cost_table, CostTable):
        return cost_table
    if cost_table is None:
        return for_device(jax.devices()[0].device_kind)
    if isinstance(cost_table, (str, Path)):
        return load(cost_table)
    raise ValueError(f"cost_table must be None, a path, a shipped table name or a CostTable, got "
                     f"{type(cost_table).__name__}")
