"""Figures from a sweep CSV (`ddtree_jax.experiments.sweep`), with 95% bootstrap intervals over prompts.

`plot_csv` writes next to the CSV (or into ``out_dir``), for ``NAME.csv``:

- ``NAME_cells.csv``: one row per cell, pooled tau, measured and expected accepted drafts per round
  with their intervals, tokens/s;
- ``NAME_tau_vs_budget.png``: tau vs DDTree node budget per target temperature, DDTree vs the DFlash
  chain (and AR), no truncation, draft temperature 1;
- ``NAME_measured_vs_expected.png``: measured accepted drafts per round vs the exact expectation;
- ``NAME_truncation.png``: tau vs top-p (top-k off) and vs top-k (top-p off) at T = 1;
- ``NAME_draft_temperature.png``: tau vs draft temperature at T = 1, and draft temperature 1 vs
  tempered to the target temperature (T < 1);
- ``NAME_budget_policies.png``: per target temperature, expected accepted drafts per verified draft
  and the projected tokens/s (from the ``model_ms`` column) vs the budget, a line per budget policy;
- ``NAME_draft_vocab.png``: tau vs the draft vocabulary size per target temperature, a line per
  drafted method and budget;
- ``NAME_tempering.csv``: for every DDTree cell at a temperature 0 < T != 1 (no truncation) that
  also ran with draft temperature T, tau(draft temperature 1) - tau(draft temperature T) with a
  paired 95% bootstrap interval (same prompts and coins in both cells);
- ``NAME_policy_changes.csv``: for every DDTree cell of the ``adaptive`` or ``batch`` budget policy that
  also ran under ``fixed``, the relative change of accepted (and of expected accepted) drafts per
  verified draft and of projected tokens/s, and the projected tokens/s against the best fixed budget,
  with paired 95% bootstrap intervals over ``generate`` calls.

Every figure but ``_budget_policies`` shows the fixed budget policy only, and every figure but
``_draft_vocab`` the whole vocabulary.

``ddtree sweep`` calls `plot_csv` at the end of a run (``--no-plot`` to skip);
``python experiments/plot.py CSV...`` redraws the figures of existing CSVs.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from ddtree_jax.experiments.stats import bootstrap_ci, paired_bootstrap_change, paired_bootstrap_diff
from ddtree_jax.experiments.sweep import CELL_FIELDS, cell_of, read_rows

BASE = dict(top_p=1.0, top_k=0, draft_temperature=1.0, budget_policy="fixed", draft_vocab=0)


def summarise(rows: list[dict], *, seed: int = 0) -> list[dict]:
    """One dict per cell (the ``CELL_FIELDS``, then statistics pooled over its prompts).

    ``tau`` = emitted tokens / rounds; ``accepted`` = tau - 1, the measured accepted drafts per round;
    ``expected`` = the exact expected accepted drafts per round; each with ``_lo``/``_hi``, the 95%
    bootstrap interval resampling prompts. ``tokens_per_s`` and ``mean_tree_size`` are per cell.
    Per verified draft (``verified``: drafts per request-round, root excluded): ``expected_per_node`` and
    ``accepted_per_node``. ``tokens_per_round``: tokens per round of a whole ``generate`` call (its
    rounds = its longest request's); ``projected_tokens_per_s``: the emitted tokens over the calls'
    ``model_ms`` (NaN without a cost table, whose ``model_ms`` is 0).
    """
    groups: dict = {}
    for row in rows:
        groups.setdefault(cell_of(row), []).append(row)
    out = []
    for cell, cell_rows in sorted(groups.items()):
        emitted = np.array([r["emitted"] for r in cell_rows], np.float64)
        rounds = np.array([r["rounds"] for r in cell_rows], np.float64)
        expected = np.array([r["expected_accepted"] * r["rounds"] for r in cell_rows])
        tau_lo, tau_hi = bootstrap_ci(emitted, rounds, seed=seed)
        exp_lo, exp_hi = bootstrap_ci(expected, rounds, seed=seed)
        tau = emitted.sum() / rounds.sum()
        verified = sum((r["mean_tree_size"] - 1) * r["rounds"] for r in cell_rows)
        calls: dict = {}
        for r in cell_rows:  # prompts of one generate call share its rounds and its model_ms
            call = calls.setdefault(r["prompt"] // r["batch"], dict(rounds=0, model_ms=r["model_ms"]))
            call["rounds"] = max(call["rounds"], r["rounds"])
        model_s = sum(c["model_ms"] for c in calls.values()) / 1e3
        out.append(dict(
            {f: getattr(cell, f) for f in CELL_FIELDS}, prompts=len(cell_rows),
            tau=tau, tau_lo=tau_lo, tau_hi=tau_hi,
            accepted=tau - 1, accepted_lo=tau_lo - 1, accepted_hi=tau_hi - 1,
            expected=expected.sum() / rounds.sum(), expected_lo=exp_lo, expected_hi=exp_hi,
            mean_tree_size=float(np.mean([r["mean_tree_size"] for r in cell_rows])),
            verified=verified / rounds.sum(),
            expected_per_node=expected.sum() / verified if verified else float("nan"),
            accepted_per_node=(emitted.sum() - rounds.sum()) / verified if verified else float("nan"),
            tokens_per_round=emitted.sum() / sum(c["rounds"] for c in calls.values()),
            projected_tokens_per_s=emitted.sum() / model_s if model_s > 0 else float("nan"),
            tokens_per_s=cell_rows[0]["tokens_per_s"], device=cell_rows[0]["device"]))
    return out


def select(summary: list[dict], **fixed) -> list[dict]:
    """The cells whose fields equal every ``fixed`` value."""
    return [c for c in summary if all(c[k] == v for k, v in fixed.items())]


def _errorbar(ax, xs, cells, stat="tau", **kw):
    ys = np.array([c[stat] for c in cells])
    err = np.array([[c[stat] - c[f"{stat}_lo"] for c in cells], [c[f"{stat}_hi"] - c[stat] for c in cells]])
    ax.errorbar(xs, ys, yerr=err, capsize=3, **{"marker": "o", **kw})


def _log_ticks(ax, values, base):
    ax.set_xscale("log", base=base)
    ax.set_xticks(values, [f"{v:g}" for v in values])
    ax.minorticks_off()


def _tree_label(cell) -> str:
    return f"DDTree B={cell['budget']}" + (f", cap {cell['topk_cap']}" if cell["topk_cap"] else "")


def _reference_line(ax, cell, label, style):
    ax.axhline(cell["tau"], color="gray" if style == ":" else "C3", linestyle=style, label=label)
    ax.axhspan(cell["tau_lo"], cell["tau_hi"], color="gray" if style == ":" else "C3", alpha=0.12)


def _sampled_temperature(summary) -> float | None:
    """1.0 if the grid has it, else its largest positive temperature (None: greedy only)."""
    temps = sorted({c["temperature"] for c in summary if c["temperature"] > 0})
    return 1.0 if 1.0 in temps else (temps[-1] if temps else None)


def plot_tau_vs_budget(summary: list[dict]):
    """tau vs budget, one panel per temperature: a line per DDTree cap, the chain and AR as references."""
    temps = sorted({c["temperature"] for c in summary})
    fig, axes = plt.subplots(1, len(temps), figsize=(4.5 * len(temps), 3.8), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], temps):
        base = select(summary, temperature=t, **BASE)
        trees = select(base, method="ddtree")
        for cap in sorted({c["topk_cap"] for c in trees}):
            line = sorted(select(trees, topk_cap=cap), key=lambda c: c["budget"])
            _errorbar(ax, [c["budget"] for c in line], line, label="DDTree" + (f", cap {cap}" if cap else ""))
        for cell in select(base, method="chain"):
            _reference_line(ax, cell, f"DFlash chain (L={cell['budget']})", "--")
        for cell in select(base, method="ar"):
            _reference_line(ax, cell, "AR", ":")
        if trees:
            _log_ticks(ax, sorted({c["budget"] for c in trees}), 2)
        ax.set(title=f"T = {t:g}", xlabel="node budget B")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("tau (tokens per round)")
    axes[0, -1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_measured_vs_expected(summary: list[dict]):
    """Measured accepted drafts per round vs the exact expectation, every drafted cell."""
    fig, ax = plt.subplots(figsize=(5, 4.5))
    temps = sorted({c["temperature"] for c in summary})
    for i, t in enumerate(temps):
        for method, marker in (("ddtree", "o"), ("chain", "s")):
            cells = select(summary, temperature=t, method=method, budget_policy="fixed", draft_vocab=0)
            if not cells:
                continue
            _errorbar(ax, [c["expected"] for c in cells], cells, stat="accepted", color=f"C{i}", linestyle="none",
                      label=f"{method}, T = {t:g}", marker=marker, elinewidth=0.8, alpha=0.8)
    lim = max([c["accepted_hi"] for c in summary] + [c["expected_hi"] for c in summary] + [1.0])
    ax.plot([0, lim], [0, lim], color="gray", linewidth=1, label="measured = expected")
    ax.set(xlabel="expected accepted drafts per round (exact)", ylabel="measured accepted drafts per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_truncation(summary: list[dict]):
    """tau vs top-p (top-k off) and vs top-k (top-p off) at T = 1, a line per drafted method/budget."""
    t = _sampled_temperature(summary)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    if t is None:
        return fig
    cells = [c for c in select(summary, temperature=t, draft_temperature=1.0, budget_policy="fixed", draft_vocab=0)
             if c["method"] != "ar"]
    panels = (("top_p", dict(top_k=0), lambda v: -v, "top-p (top-k off)", lambda v: "off" if v == 1 else f"{v:g}"),
              ("top_k", dict(top_p=1.0), lambda v: -v if v else -np.inf, "top-k (top-p off)",
               lambda v: f"{v}" if v else "off"))
    for ax, (knob, other, strength, xlabel, fmt) in zip(axes, panels):
        values = sorted({c[knob] for c in select(cells, **other)}, key=strength)
        for key in sorted({(c["method"], c["budget"], c["topk_cap"]) for c in cells}):
            line = sorted(select(cells, method=key[0], budget=key[1], topk_cap=key[2], **other),
                          key=lambda c: strength(c[knob]))
            label = "DFlash chain" if key[0] == "chain" else _tree_label(line[0])
            _errorbar(ax, [values.index(c[knob]) for c in line], line, label=label)
        ax.set_xticks(range(len(values)), [fmt(v) for v in values])
        ax.set(xlabel=xlabel + ", stronger to the right", title=f"T = {t:g}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tau (tokens per round)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_draft_temperature(summary: list[dict]):
    """Left: tau vs draft temperature at T = 1, a line per DDTree budget. Right: for each target
    temperature 0 < T < 1, tau vs budget with draft temperature 1 and with draft temperature T."""
    t = _sampled_temperature(summary)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    if t is None:
        return fig
    trees = select(summary, method="ddtree", top_p=1.0, top_k=0, budget_policy="fixed", draft_vocab=0)
    at_t = select(trees, temperature=t)
    for key in sorted({(c["budget"], c["topk_cap"]) for c in at_t}):
        line = sorted(select(at_t, budget=key[0], topk_cap=key[1]), key=lambda c: c["draft_temperature"])
        _errorbar(axes[0], [c["draft_temperature"] for c in line], line, label=_tree_label(line[0]))
    _log_ticks(axes[0], sorted({c["draft_temperature"] for c in at_t}), 10)
    axes[0].set(xlabel="draft temperature", ylabel="tau (tokens per round)", title=f"T = {t:g}")
    for i, low in enumerate(sorted({c["temperature"] for c in trees if 0 < c["temperature"] < 1})):
        for draft, style in ((1.0, "-"), (low, "--")):
            line = sorted(select(trees, temperature=low, draft_temperature=draft, topk_cap=0),
                          key=lambda c: c["budget"])
            if line:
                _errorbar(axes[1], [c["budget"] for c in line], line, color=f"C{i}", linestyle=style,
                          label=f"T = {low:g}, draft T = {draft:g}")
    _log_ticks(axes[1], sorted({c["budget"] for c in trees}), 2)
    axes[1].set(xlabel="node budget B", title="draft temperature 1 vs tempered to T")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_budget_policies(summary: list[dict]):
    """Top: expected accepted drafts per verified draft vs the budget; bottom: projected tokens/s (the
    cost table's device) vs the budget, with AR's as a line; a column per temperature, a line per
    budget policy (no truncation, draft temperature 1, no cap)."""
    temps = sorted({c["temperature"] for c in summary})
    fig, axes = plt.subplots(2, len(temps), figsize=(4.5 * len(temps), 7), squeeze=False)
    for col, t in enumerate(temps):
        base = select(summary, temperature=t, top_p=1.0, top_k=0, draft_temperature=1.0, draft_vocab=0)
        trees = select(base, method="ddtree", topk_cap=0)
        for policy in sorted({c["budget_policy"] for c in trees}):
            line = sorted(select(trees, budget_policy=policy), key=lambda c: c["budget"])
            xs = [c["budget"] for c in line]
            axes[0, col].plot(xs, [c["expected_per_node"] for c in line], marker="o", label=policy)
            axes[1, col].plot(xs, [c["projected_tokens_per_s"] for c in line], marker="o", label=policy)
        for cell in select(base, method="ar"):
            axes[1, col].axhline(cell["projected_tokens_per_s"], color="gray", linestyle=":", label="AR")
        for row, ylabel in enumerate(("expected accepted per verified draft", "projected tokens/s")):
            ax = axes[row, col]
            if trees:
                _log_ticks(ax, sorted({c["budget"] for c in trees}), 2)
            ax.set(title=f"T = {t:g}", xlabel="node budget B (adaptive: the most; batch: per request)",
                   ylabel=ylabel if col == 0 else None)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_draft_vocab(summary: list[dict]):
    """tau vs the draft vocabulary size, a panel per temperature, a line per drafted method and budget
    (no truncation, draft temperature 1, the fixed policy); the whole vocabulary rightmost."""
    temps = sorted({c["temperature"] for c in summary})
    fig, axes = plt.subplots(1, len(temps), figsize=(4.5 * len(temps), 3.8), sharey=True, squeeze=False)
    cells = [c for c in select(summary, top_p=1.0, top_k=0, draft_temperature=1.0, budget_policy="fixed")
             if c["method"] != "ar"]
    sizes = sorted({c["draft_vocab"] for c in cells}, key=lambda w: w or np.inf)
    for ax, t in zip(axes[0], temps):
        at_t = select(cells, temperature=t)
        for key in sorted({(c["method"], c["budget"], c["topk_cap"]) for c in at_t}):
            line = sorted(select(at_t, method=key[0], budget=key[1], topk_cap=key[2]),
                          key=lambda c: c["draft_vocab"] or np.inf)
            label = "DFlash chain" if key[0] == "chain" else _tree_label(line[0])
            _errorbar(ax, [sizes.index(c["draft_vocab"]) for c in line], line, label=label)
        ax.set_xticks(range(len(sizes)), [f"{w:,}" if w else "all" for w in sizes])
        ax.set(title=f"T = {t:g}", xlabel="draft vocabulary (most frequent tokens)")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("tau (tokens per round)")
    if axes[0, -1].get_legend_handles_labels()[0]:
        axes[0, -1].legend(fontsize=8)
    fig.tight_layout()
    return fig


FIGURES = {
    "tau_vs_budget": plot_tau_vs_budget,
    "measured_vs_expected": plot_measured_vs_expected,
    "truncation": plot_truncation,
    "draft_temperature": plot_draft_temperature,
    "budget_policies": plot_budget_policies,
    "draft_vocab": plot_draft_vocab,
}


def tempering(rows: list[dict], *, seed: int = 0) -> list[dict]:
    """Paired effect of tempering the draft marginals to the target temperature (see the module
    docstring), one dict per (budget, cap, temperature)."""
    by_cell: dict = {}
    for row in rows:
        by_cell.setdefault(cell_of(row), {})[row["prompt"]] = (row["emitted"], row["rounds"])
    out = []
    for cell, plain in sorted(by_cell.items()):
        if (cell.method != "ddtree" or cell.draft_temperature != 1.0 or cell.temperature in (0.0, 1.0)
                or (cell.top_p, cell.top_k) != (1.0, 0)):
            continue
        tempered = by_cell.get(dataclasses.replace(cell, draft_temperature=cell.temperature))
        prompts = sorted(set(plain) & set(tempered or {}))
        if not prompts:
            continue
        a, b = (np.array([side[p] for p in prompts], np.float64) for side in (plain, tempered))
        diff, lo, hi = paired_bootstrap_diff(a[:, 0], a[:, 1], b[:, 0], b[:, 1], seed=seed)
        out.append(dict(budget=cell.budget, topk_cap=cell.topk_cap, temperature=cell.temperature,
                        prompts=len(prompts), tau_draft_1=a[:, 0].sum() / a[:, 1].sum(),
                        tau_tempered=b[:, 0].sum() / b[:, 1].sum(), difference=diff, lo=lo, hi=hi))
    return out


def policy_changes(rows: list[dict], *, seed: int = 0) -> list[dict]:
    """Each DDTree cell of a budget policy other than ``fixed`` against the same cell under ``fixed``: the
    relative change of accepted and of expected accepted drafts per verified draft, and of projected
    tokens/s (emitted tokens over the calls' ``model_ms``), each with a paired 95% bootstrap interval; and
    the projected tokens/s against the best fixed budget of the same settings (``best_fixed_budget``).
    The units resampled are ``generate`` calls (prompts ``// batch``): under ``budget_policy="batch"`` the
    requests of one call share its budget, so they are not independent."""
    calls: dict = {}  # cell -> call -> [accepted, expected accepted, verified, emitted, model_ms]
    for row in rows:
        per_call = calls.setdefault(cell_of(row), {}).setdefault(row["prompt"] // row["batch"], np.zeros(5))
        per_call[:4] += (row["emitted"] - row["rounds"], row["expected_accepted"] * row["rounds"],
                         (row["mean_tree_size"] - 1) * row["rounds"], row["emitted"])
        per_call[4] = row["model_ms"]  # the call's modelled time, on each of its rows

    def change(name, policy, fixed, num, den):
        shared = sorted(set(policy) & set(fixed))
        a, b = (np.array([side[c] for c in shared]) for side in (policy, fixed))
        if not b[:, den].sum() or not a[:, den].sum():
            return {name: float("nan"), f"{name}_lo": float("nan"), f"{name}_hi": float("nan")}
        value, lo, hi = paired_bootstrap_change(a[:, num], a[:, den], b[:, num], b[:, den], seed=seed)
        return {name: value, f"{name}_lo": lo, f"{name}_hi": hi}

    def projected(cell_calls):
        total = np.sum(list(cell_calls.values()), axis=0)
        return total[3] / total[4] if total[4] else float("nan")

    out = []
    for cell, policy in sorted(calls.items()):
        fixed = calls.get(dataclasses.replace(cell, budget_policy="fixed"))
        if cell.method != "ddtree" or cell.budget_policy == "fixed" or not fixed:
            continue
        fixed_budgets = {c.budget: c_calls for c, c_calls in calls.items()
                         if c == dataclasses.replace(cell, budget_policy="fixed", budget=c.budget)}
        best = max(fixed_budgets, key=lambda budget: np.nan_to_num(projected(fixed_budgets[budget]), nan=-1.0))
        total_a, total_b = (np.sum(list(side.values()), axis=0) for side in (policy, fixed))
        out.append(dict(
            {f: getattr(cell, f) for f in CELL_FIELDS}, calls=len(set(policy) & set(fixed)),
            accepted_per_node_fixed=total_b[0] / total_b[2], accepted_per_node=total_a[0] / total_a[2],
            **change("accepted_change", policy, fixed, 0, 2), **change("expected_change", policy, fixed, 1, 2),
            **change("projected_change", policy, fixed, 3, 4), best_fixed_budget=best,
            **change("projected_change_vs_best_fixed", policy, fixed_budgets[best], 3, 4)))
    return out


def write_table(table: list[dict], path: Path) -> None:
    """A list of same-keyed dicts as CSV (a header only when empty)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]) if table else [])
        writer.writeheader()
        writer.writerows(table)


def plot_csv(csv_path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """``NAME_cells.csv``, ``NAME_tempering.csv``, ``NAME_policy_changes.csv`` and the five ``NAME_*.png``
    figures of the sweep CSV ``csv_path``."""
    csv_path = Path(csv_path)
    rows = read_rows(csv_path)
    if not rows:
        raise ValueError(f"{str(csv_path)!r} holds no sweep rows")
    out_dir = csv_path.parent if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarise(rows)
    written = [out_dir / f"{csv_path.stem}_{name}.csv" for name in ("cells", "tempering", "policy_changes")]
    write_table(summary, written[0])
    write_table(tempering(rows), written[1])
    write_table(policy_changes(rows), written[2])
    for name, make in FIGURES.items():
        fig = make(summary)
        written.append(out_dir / f"{csv_path.stem}_{name}.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
