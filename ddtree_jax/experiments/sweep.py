"""Parameter sweeps: acceptance and speed of AR, DFlash chain and DDTree over a grid of settings.

A *cell* is one setting of every knob: method, node budget, top-k cap, target temperature, top-p,
top-k, draft temperature, budget policy (`ddtree_jax.budget`) and draft vocabulary (the drafter
drafts from the W most frequent tokens, `ddtree_jax.draft_vocab`; 0 = all). The grid is the product
of the knob lists, canonicalised so that knobs a cell ignores take their neutral value and
duplicates vanish: AR has no tree (budget 0, cap 0) and no drafter (draft temperature 1, draft
vocabulary 0); the chain is the drafter's argmax per slot (budget L, cap 1, draft temperature 1);
both have the fixed policy; greedy cells (temperature 0) have top-p 1 and top-k 0; a cap of at least
the budget is no cap (0). Top-p and top-k vary one at a time (the other off) unless
``cross_truncation``.

Each cell generates ``new_tokens`` tokens for every held-out prompt (no stop token), prompt ``i``
with request id ``i`` and ``jax.random.key(seed)``, so all cells see the same prompts and the same
coin streams. Each call's decoding is also priced by a cost table (``--cost-table``, default the
device's; `ddtree_jax.costs`): the ``model_ms`` column, the sum over its rounds of the modelled
round time at the mean number of drafts its live requests verified (the AR decode step for AR; 0
without a table), from which `plot.summarise` projects tokens/s on the table's device; the same
table is the adaptive policy's cost model. The output CSV has one row per cell and prompt; a cell's
rows are appended once it is finished, and a rerun skips finished cells (resumable). ``<out>.json`` records every run's
command, date, device and settings. The default output is ``ddtree-sweep/sweep.csv`` (``--quick``:
``ddtree-sweep/sweep_quick.csv``) under the working directory, and the run ends with the table and
figures of `ddtree_jax.experiments.plot` next to the CSV (``--no-plot`` skips them).

    ddtree sweep --quick          # or: python experiments/sweep.py --quick
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ddtree_jax import costs
from ddtree_jax.assets import DRAFTER_DIR, TARGET_DIR, TOKENIZER_PATH
from ddtree_jax.budget import POLICIES
from ddtree_jax.checkpoint import load_drafter, load_target
from ddtree_jax.draft_vocab import with_frequent_tokens
from ddtree_jax.engine import METHODS, generate, max_budget
from ddtree_jax.experiments import corpus
from ddtree_jax.experiments.provenance import command_line
from ddtree_jax.experiments.stats import per_request_tau
from ddtree_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, order=True)
class Cell:
    """One grid point. ``topk_cap = 0`` means no cap; see the module docstring for AR and chain."""

    method: str
    budget: int
    topk_cap: int
    temperature: float
    top_p: float
    top_k: int
    draft_temperature: float
    budget_policy: str = "fixed"
    draft_vocab: int = 0


CELL_FIELDS = tuple(f.name for f in dataclasses.fields(Cell))


@dataclasses.dataclass(frozen=True)
class Grid:
    """The knob lists whose (canonicalised) product is swept."""

    methods: tuple[str, ...]
    budgets: tuple[int, ...]
    topk_caps: tuple[int, ...]
    temperatures: tuple[float, ...]
    top_ps: tuple[float, ...]
    top_ks: tuple[int, ...]
    draft_temperatures: tuple[float, ...]
    cross_truncation: bool = False
    budget_policies: tuple[str, ...] = ("fixed",)
    draft_vocabs: tuple[int, ...] = (0,)

    def __post_init__(self):
        _check_values("methods", self.methods, lambda m: m in METHODS, f"one of {METHODS}")
        _check_values("budget_policies", self.budget_policies, lambda p: p in POLICIES, f"one of {POLICIES}")
        limit = min(max_budget(p) for p in self.budget_policies)
        _check_values("budgets", self.budgets, lambda b: 1 <= b <= limit,
                      f"in [1, {limit}] (the budget policies {', '.join(self.budget_policies)})")
        _check_values("topk_caps", self.topk_caps, lambda c: c >= 0, ">= 0 (0 = no cap)")
        _check_values("temperatures", self.temperatures, lambda t: np.isfinite(t) and t >= 0, "finite and >= 0")
        _check_values("top_ps", self.top_ps, lambda p: 0 < p <= 1, "in (0, 1]")
        _check_values("top_ks", self.top_ks, lambda k: k >= 0, ">= 0 (0 = off)")
        _check_values("draft_temperatures", self.draft_temperatures, lambda t: np.isfinite(t) and t > 0,
                      "finite and > 0")
        _check_values("draft_vocabs", self.draft_vocabs, lambda w: w >= 0, ">= 0 (0 = the whole vocabulary)")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every cell shares. All but ``batch`` must match to resume an existing CSV.

    ``target`` and ``drafter`` are HF-format directories, or ``"embedded"`` for the packaged pair;
    ``cost_table`` a cost-table JSON or shipped name, or ``"device"`` for the device's (`costs.resolve`).
    """

    target: str
    drafter: str
    dtype: str
    prompts: int
    prompt_tokens: int
    new_tokens: int
    prompt_seed: int
    seed: int
    batch: int
    cost_table: str = "device"

    def __post_init__(self):
        for name in ("prompts", "prompt_tokens", "new_tokens", "batch"):
            _check_values(name, (getattr(self, name),), lambda v: v >= 1, ">= 1")
        for name in ("prompt_seed", "seed"):
            _check_values(name, (getattr(self, name),), lambda v: 0 <= v < 2**32, "in [0, 2**32)")


EMBEDDED = "embedded"
RESUME_FIELDS = ("target", "drafter", "dtype", "prompts", "prompt_tokens", "new_tokens", "prompt_seed", "seed",
                 "cost_table")

# Column -> parser; the CSV holds exactly these columns in this order.
COLUMNS = {
    "method": str, "budget": int, "topk_cap": int, "temperature": float, "top_p": float, "top_k": int,
    "draft_temperature": float, "budget_policy": str, "draft_vocab": int,
    "prompt": int, "emitted": int, "rounds": int, "tau": float, "expected_accepted": float,
    "mean_tree_size": float, "model_ms": float, "tokens_per_s": float, "cell_seconds": float,
    "prompts": int, "prompt_tokens": int, "new_tokens": int, "prompt_seed": int, "seed": int, "batch": int,
    "cost_table": str, "dtype": str, "target": str, "drafter": str, "device": str, "backend": str, "jax": str,
    "date": str,
}
# The values of the columns added after the first sweeps, for CSVs written before them.
ADDED_COLUMNS = {"budget_policy": "fixed", "model_ms": "0", "cost_table": "device", "draft_vocab": "0"}

GRID_FLAGS = ("methods", "budgets", "topk_caps", "temperatures", "top_ps", "top_ks", "draft_temperatures",
              "budget_policies", "draft_vocabs")
QUICK = dict(methods=("ar", "chain", "ddtree"), budgets=(4, 16, 64), topk_caps=(0,), temperatures=(0.0, 0.5, 1.0),
             top_ps=(1.0, 0.8), top_ks=(0, 8), draft_temperatures=(0.5, 1.0, 2.0), budget_policies=("fixed",),
             draft_vocabs=(0,), prompts=6, prompt_tokens=48, new_tokens=24, out="ddtree-sweep/sweep_quick.csv")
FULL = dict(methods=("ar", "chain", "ddtree"), budgets=(4, 8, 16, 32, 64, 128, 256), topk_caps=(0, 8),
            temperatures=(0.0, 0.6, 1.0), top_ps=(1.0, 0.95, 0.8), top_ks=(0, 20, 5),
            draft_temperatures=(0.4, 0.6, 1.0, 1.5), budget_policies=("fixed",), draft_vocabs=(0,), prompts=64,
            prompt_tokens=64, new_tokens=128, out="ddtree-sweep/sweep.csv")


def _check_values(name, values, ok, rule) -> None:
    if not values:
        raise ValueError(f"{name} must not be empty")
    bad = [v for v in values if not ok(v)]
    if bad:
        raise ValueError(f"{name} must be {rule}, got {bad[0]!r}")


def canonical(cell: Cell, depth: int) -> Cell:
    """``cell`` with the knobs it ignores set to their neutral values (``depth`` = the drafter's L)."""
    if cell.temperature == 0:
        cell = dataclasses.replace(cell, top_p=1.0, top_k=0)
    if cell.method == "ar":
        return dataclasses.replace(cell, budget=0, topk_cap=0, draft_temperature=1.0, budget_policy="fixed",
                                   draft_vocab=0)
    if cell.method == "chain":
        return dataclasses.replace(cell, budget=depth, topk_cap=1, draft_temperature=1.0, budget_policy="fixed")
    return dataclasses.replace(cell, topk_cap=0) if cell.topk_cap >= cell.budget else cell


def truncations(grid: Grid) -> list[tuple[float, int]]:
    """``(top_p, top_k)`` pairs: the product, or each knob varied with the other off."""
    if grid.cross_truncation:
        return list(itertools.product(grid.top_ps, grid.top_ks))
    return [(p, 0) for p in grid.top_ps] + [(1.0, k) for k in grid.top_ks]


def grid_cells(grid: Grid, depth: int) -> list[Cell]:
    """The distinct canonical cells of ``grid``, ordered so that cells sharing a compiled round are adjacent."""
    cells = {
        canonical(Cell(m, b, c, float(t), float(p), int(k), float(d), policy, int(w)), depth)
        for m, b, c, t, (p, k), d, policy, w in itertools.product(grid.methods, grid.budgets, grid.topk_caps,
                                                                  grid.temperatures, truncations(grid),
                                                                  grid.draft_temperatures, grid.budget_policies,
                                                                  grid.draft_vocabs)
    }
    return sorted(cells, key=lambda c: (METHODS.index(c.method), c.budget, c.topk_cap, c.budget_policy, c))


def cell_of(row: dict) -> Cell:
    """The cell a CSV row belongs to (the fixed policy and the whole vocabulary for a row without them)."""
    return Cell(*(row[f] for f in CELL_FIELDS[:-2]), row.get("budget_policy", "fixed"), row.get("draft_vocab", 0))


def read_rows(path: str | Path) -> list[dict]:
    """The well-formed rows of a sweep CSV, values parsed (a truncated last line is dropped; columns
    added later, `ADDED_COLUMNS`, take their default in a CSV written without them)."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {k: v for k, v in ADDED_COLUMNS.items() if k not in (reader.fieldnames or ())}
        for raw in reader:
            raw.update(missing)
            try:
                rows.append({name: parse(raw[name]) for name, parse in COLUMNS.items()})
            except (KeyError, TypeError, ValueError):
                continue
    return rows


def finished_rows(rows: list[dict], settings: Settings) -> list[dict]:
    """Rows of the cells that have all ``settings.prompts`` prompts; ``ValueError`` if a row was made
    with other settings (another model, prompt set, length, seed or dtype: resuming would mix them)."""
    for row in rows:
        for name in RESUME_FIELDS:
            if str(row[name]) != str(getattr(settings, name)):
                raise ValueError(f"the existing CSV was written with {name}={row[name]!r}, this run has "
                                 f"{getattr(settings, name)!r}: choose another --out or pass --restart")
    prompts = {}
    for row in rows:
        prompts.setdefault(cell_of(row), set()).add(row["prompt"])
    done = {cell for cell, seen in prompts.items() if seen >= set(range(settings.prompts))}
    return [row for row in rows if cell_of(row) in done]


def write_rows(path: Path, rows: list[dict], *, append: bool) -> None:
    """Write (or append) rows, header included for a new file; flushed to disk before returning."""
    new = not append or not path.exists()
    with open(path, "w" if new else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        if new:
            writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())


def model_ms(res, method: str, table: costs.CostTable, context: int) -> float:
    """Modelled decoding time (ms) of one ``generate`` result under ``table``: per round, the round
    time at the mean number of drafts of its live requests (the decode step for AR); 0 (not modelled)
    for the flat table or a curve without a decode step."""
    curve = table.curve(len(res.lengths), context)
    if curve is None or (method == "ar" and curve.decode_ms is None):
        return 0.0
    if method == "ar":
        return curve.decode_ms * len(res.rounds)
    drafts = [np.mean(r.tree_size[r.accepted >= 0] - 1) for r in res.rounds]
    return float(np.sum(curve.at(drafts)))


def run_cell(target, drafter, prompts_PT: np.ndarray, cell: Cell, settings: Settings, device: dict,
             table: costs.CostTable = costs.FLAT) -> list[dict]:
    """Generate for every prompt with ``cell``'s settings (``table``: the cost model, see the module
    docstring); one row per prompt (see ``COLUMNS``)."""
    emitted, rounds, expected, tree_size, modelled, seconds, tokens = [], [], [], [], [], 0.0, 0
    for start in range(0, len(prompts_PT), settings.batch):
        chunk = prompts_PT[start:start + settings.batch]
        res = generate(target, drafter, chunk, method=cell.method, budget=cell.budget,
                       topk_cap=cell.topk_cap or None, draft_temperature=cell.draft_temperature,
                       temperature=cell.temperature, top_k=cell.top_k, top_p=cell.top_p,
                       max_new_tokens=settings.new_tokens, key=jax.random.key(settings.seed),
                       request_ids=np.arange(start, start + len(chunk)), budget_policy=cell.budget_policy,
                       cost_table=table)
        e, r = per_request_tau(res)
        live_RB = np.stack([x.accepted for x in res.rounds]) >= 0
        emitted.append(e)
        rounds.append(r)
        expected.append(np.where(live_RB, np.stack([x.expected for x in res.rounds]), 0).sum(0))
        tree_size.append(np.where(live_RB, np.stack([x.tree_size for x in res.rounds]), 0).sum(0))
        modelled.append(np.full(len(chunk), model_ms(res, cell.method, table, prompts_PT.shape[1] +
                                                     settings.new_tokens)))
        seconds += res.seconds
        tokens += int(res.lengths.sum())
    emitted, rounds, modelled = np.concatenate(emitted), np.concatenate(rounds), np.concatenate(modelled)
    expected, tree_size = np.concatenate(expected), np.concatenate(tree_size)
    shared = dict(dataclasses.asdict(cell), tokens_per_s=tokens / seconds, cell_seconds=seconds,
                  **dataclasses.asdict(settings), **device)
    rows = [dict(shared, prompt=i, emitted=int(emitted[i]), rounds=int(rounds[i]), tau=float(emitted[i] / rounds[i]),
                 expected_accepted=float(expected[i] / rounds[i]), mean_tree_size=float(tree_size[i] / rounds[i]),
                 model_ms=float(modelled[i]))
            for i in range(len(prompts_PT))]
    return [{name: row[name] for name in COLUMNS} for row in rows]


def device_info() -> dict:
    """The device columns: device kind, backend, JAX version, date."""
    return dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                date=time.strftime("%Y-%m-%d"))


def run_sweep(grid: Grid, settings: Settings, out: str | Path, *, tokenizer: str | Path | None = None,
              restart: bool = False) -> list[dict]:
    """Run every unfinished cell of ``grid`` and append its rows to the CSV ``out``; return all rows.

    ``tokenizer`` (default: the target directory's ``tokenizer.json``, else the packaged one)
    encodes the held-out prompts. ``restart`` discards an existing CSV instead of resuming it.
    """
    out = Path(out)
    if out.suffix != ".csv":
        raise ValueError(f"out must be a .csv path (the run record goes beside it, to <out>.json), got {str(out)!r}")
    target_dir = TARGET_DIR if settings.target == EMBEDDED else Path(settings.target)
    drafter_dir = DRAFTER_DIR if settings.drafter == EMBEDDED else Path(settings.drafter)
    for name, path in (("target", target_dir), ("drafter", drafter_dir)):
        if not (path / "config.json").is_file():
            raise ValueError(f"{name} {str(path)!r} is not an HF-format model directory (no config.json)")
    if tokenizer is None:
        tokenizer = target_dir / "tokenizer.json"
        tokenizer = tokenizer if tokenizer.is_file() else TOKENIZER_PATH
    table = costs.resolve(None if settings.cost_table == "device" else settings.cost_table)
    dtype = jnp.dtype(settings.dtype)
    target, drafter = load_target(target_dir, dtype), load_drafter(drafter_dir, dtype)
    cells = grid_cells(grid, depth=drafter.config.block_size - 1)
    drafters = {w: with_frequent_tokens(drafter, target, target_dir, w) for w in {cell.draft_vocab for cell in cells}}

    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [] if restart or not out.exists() else finished_rows(read_rows(out), settings)
    write_rows(out, rows, append=False)  # drops unfinished cells and any truncated line
    done = {cell_of(row) for row in rows}
    todo = [cell for cell in cells if cell not in done]
    _record_run(out.with_suffix(".json"), grid, settings, len(cells) - len(todo), len(todo))
    if not todo:
        return rows

    prompts_PT = corpus.heldout_prompts(Tokenizer.from_file(tokenizer), settings.prompts, settings.prompt_tokens,
                                        settings.prompt_seed)
    device = device_info()
    bar = tqdm(todo, desc="sweep", unit="cell")
    for cell in bar:
        bar.set_postfix_str(f"{cell.method} B={cell.budget} T={cell.temperature:g} p={cell.top_p:g} "
                            f"k={cell.top_k} dT={cell.draft_temperature:g} {cell.budget_policy}"
                            + (f" W={cell.draft_vocab}" if cell.draft_vocab else ""))
        new = run_cell(target, drafters[cell.draft_vocab], prompts_PT, cell, settings, device, table)
        write_rows(out, new, append=True)
        rows += new
    return rows


def _record_run(path: Path, grid: Grid, settings: Settings, skipped: int, pending: int) -> None:
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    runs.append(dict(command=command_line(), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                     device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__,
                     python=sys.version.split()[0], grid=dataclasses.asdict(grid),
                     settings=dataclasses.asdict(settings), cells_skipped=skipped, cells_run=pending))
    path.write_text(json.dumps(dict(runs=runs), indent=1) + "\n")


def _model_name(path: Path, default: Path) -> str:
    return EMBEDDED if path.resolve() == default.resolve() else str(path)


def _list_of(kind):
    def parse(text: str) -> tuple:
        return tuple(kind(x) for x in text.split(",") if x.strip())

    parse.__name__ = f"comma-separated {kind.__name__}"
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's flags (shared by ``experiments/sweep.py`` and ``ddtree sweep``)."""
    lists = [("--methods", str, "methods: ar, chain, ddtree"), ("--budgets", int, "DDTree node budgets"),
             ("--topk-caps", int, "DDTree per-depth rank caps (0 = none)"),
             ("--temperatures", float, "target temperatures (0 = greedy)"), ("--top-ps", float, "top-p values"),
             ("--top-ks", int, "top-k values (0 = off)"), ("--draft-temperatures", float, "draft temperatures"),
             ("--budget-policies", str, f"DDTree budget policies ({', '.join(POLICIES)}; ddtree_jax/budget.py)"),
             ("--draft-vocabs", int, "draft vocabulary sizes: the chain and DDTree draft from the W most frequent "
              "tokens (counts: <target>/token_counts.npy; 0 = the whole vocabulary)")]
    def preset(flag: str) -> str:
        name = flag[2:].replace("-", "_")
        full, quick = (",".join(map(str, v)) if isinstance(v, tuple) else v for v in (FULL[name], QUICK[name]))
        return f"(default: {full}; with --quick {quick})"

    for flag, kind, what in lists:
        parser.add_argument(flag, type=_list_of(kind), help=f"comma-separated {what} {preset(flag)}")
    parser.add_argument("--cross-truncation", action="store_true",
                        help="sweep the product of top-p and top-k (default: vary one with the other off)")
    for flag, what in [("--prompts", "held-out prompts"), ("--prompt-tokens", "tokens per prompt"),
                       ("--new-tokens", "tokens generated per prompt")]:
        parser.add_argument(flag, type=int, help=f"{what} {preset(flag)}")
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the held-out prompt choice")
    parser.add_argument("--seed", type=int, default=0, help="sampling key seed")
    parser.add_argument("--batch", type=int, default=64, help="prompts per generate call")
    parser.add_argument("--cost-table", default="device",
                        help="cost model of the adaptive policy and of the model_ms column: a JSON written by "
                             f"ddtree bench, a shipped table ({', '.join(costs.shipped())}) or 'device' for the "
                             "device's own (none on a CPU: flat)")
    parser.add_argument("--target", type=Path, default=TARGET_DIR,
                        help="HF-format target directory (default: the embedded one)")
    parser.add_argument("--drafter", type=Path, default=DRAFTER_DIR,
                        help="HF-format DFlash drafter directory (default: the embedded one)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the target's, else the packaged one)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto = float32 on CPU, bfloat16 on accelerators")
    parser.add_argument("--out", type=Path, help="output CSV (default: ddtree-sweep/sweep.csv, with --quick "
                        "ddtree-sweep/sweep_quick.csv, under the working directory)")
    parser.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                        help="draw the per-cell table and the figures next to the CSV when the run ends")
    parser.add_argument("--quick", action="store_true",
                        help="the small preset grid (a few minutes on a CPU) instead of the full one")
    parser.add_argument("--restart", action="store_true", help="discard an existing output CSV instead of resuming")


def run_from_args(args: argparse.Namespace) -> Path:
    """Fill unset flags from the quick or full preset, then ``run_sweep``; returns the CSV written."""
    preset = QUICK if args.quick else FULL
    get = lambda name: preset[name] if getattr(args, name) is None else getattr(args, name)  # noqa: E731
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    grid = Grid(**{name: get(name) for name in GRID_FLAGS}, cross_truncation=args.cross_truncation)
    settings = Settings(target=_model_name(args.target, TARGET_DIR),
                        drafter=_model_name(args.drafter, DRAFTER_DIR), dtype=dtype, prompts=get("prompts"),
                        prompt_tokens=get("prompt_tokens"), new_tokens=get("new_tokens"),
                        prompt_seed=args.prompt_seed, seed=args.seed, batch=args.batch, cost_table=args.cost_table)
    out = Path(get("out"))
    rows = run_sweep(grid, settings, out, tokenizer=args.tokenizer, restart=args.restart)
    print(f"{len({cell_of(r) for r in rows})} cells, {len(rows)} rows in {out}")
    return out
