# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 03 · Reading the parameter sweeps
#
# Loads the committed sweep results (`experiments/results/sweep.csv`, the full grid, when present;
# otherwise `sweep_quick.csv`, the quick grid run on a CPU), pools every cell over its prompts with
# 95% bootstrap intervals, and draws the figures of `ddtree_jax.experiments.plot`. Set `DDTREE_SWEEP_CSV`
# to read another sweep. Figures go to `$DDTREE_NOTEBOOK_OUT` (default `notebooks/figures/`).
# Every committed sweep (the full grid, `sweep_quick.csv`, the budget-policy sweeps) comes from the
# shipped embedded pair; the date and command of each run are printed below.

# %%
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] if "__file__" in globals() else Path.cwd().resolve().parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ddtree_jax.experiments import plot  # noqa: E402
from ddtree_jax.experiments.sweep import read_rows  # noqa: E402

OUT = Path(os.environ.get("DDTREE_NOTEBOOK_OUT", ROOT / "notebooks" / "figures"))
OUT.mkdir(parents=True, exist_ok=True)
RESULTS = ROOT / "experiments" / "results"
default_csv = RESULTS / "sweep.csv" if (RESULTS / "sweep.csv").is_file() else RESULTS / "sweep_quick.csv"
CSV = Path(os.environ.get("DDTREE_SWEEP_CSV", default_csv))

rows = read_rows(CSV)
summary = plot.summarise(rows)
print(f"{CSV.name}: {len(rows)} rows, {len(summary)} cells, device {rows[0]['device']!r}, "
      f"{rows[0]['prompts']} prompts x {rows[0]['new_tokens']} new tokens, run on {rows[0]['date']}")

# %% [markdown]
# ## tau per method and budget
#
# No truncation, draft temperature 1; `cap` is DDTree's per-depth rank cap (- = none). `tau` counts
# the tokens a round emits (accepted drafts + the bonus token); `1 + expected` is its exact
# expectation given the drafted trees.

# %%
base = plot.select(summary, **plot.BASE)
temps = sorted({c["temperature"] for c in base})
print(f"{'method':>8} {'B':>4} {'cap':>4} " + " ".join(f"{'T=' + format(t, 'g'):>22}" for t in temps))
for key in sorted({(c["method"], c["budget"], c["topk_cap"]) for c in base}, key=lambda k: (k[0] != "ar", k)):
    cells = {c["temperature"]: c for c in plot.select(base, method=key[0], budget=key[1], topk_cap=key[2])}
    cap = key[2] if key[0] == "ddtree" and key[2] else "-"
    print(f"{key[0]:>8} {key[1]:>4} {cap:>4} " + " ".join(
        f"{cells[t]['tau']:6.2f} [{cells[t]['tau_lo']:.2f}, {cells[t]['tau_hi']:.2f}]    " if t in cells
        else " " * 22 for t in temps))

# %% [markdown]
# ## DDTree over the chain
#
# The ratio of DDTree's tau to the DFlash chain's at the same temperature. Both decode the same
# prompts with the same coins, so most of the prompt-to-prompt variation cancels in the ratio.

# %%
fig, ax = plt.subplots(figsize=(5.5, 3.8))
for t in temps:
    chain = plot.select(base, method="chain", temperature=t)
    trees = sorted(plot.select(base, method="ddtree", temperature=t, topk_cap=0), key=lambda c: c["budget"])
    if chain and trees:
        ratio = [c["tau"] / chain[0]["tau"] for c in trees]
        ax.plot([c["budget"] for c in trees], ratio, marker="o", label=f"T = {t:g}")
        print(f"T = {t:g}: DDTree / chain tau = " + ", ".join(
            f"{r:.2f} (B={c['budget']})" for r, c in zip(ratio, trees)))
ax.axhline(1.0, color="gray", linewidth=1)
ax.set_xscale("log", base=2)
ax.set(xlabel="node budget B", ylabel="tau(DDTree) / tau(chain)", title=CSV.name)
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(OUT / "03_ddtree_over_chain.png", dpi=120)
plt.close(fig)

# %% [markdown]
# ## Measured vs expected acceptance
#
# Every round's expected number of accepted drafts is computed exactly from the target's law on the
# drafted tree; averaged over rounds it must agree with what the verifier accepted.

# %%
drafted = [c for c in summary if c["method"] != "ar"]
inside = np.mean([c["accepted_lo"] <= c["expected"] <= c["accepted_hi"] for c in drafted])
gap = np.array([c["accepted"] - c["expected"] for c in drafted])
print(f"{len(drafted)} drafted cells: expected inside the measured 95% interval in {inside:.0%}; "
      f"measured - expected: mean {gap.mean():+.3f}, max |.| {np.abs(gap).max():.3f}")

# %% [markdown]
# ## Tempering the draft marginals to the target temperature
#
# Does building the tree from the drafter's marginals at the target's temperature T (instead of at
# 1) change acceptance? Each line pairs the two cells over the same prompts and coins:
# tau(draft temperature 1) - tau(draft temperature T) with a paired 95% bootstrap interval.

# %%
for row in plot.tempering(rows):
    cap = f", cap {row['topk_cap']}" if row["topk_cap"] else ""
    print(f"T = {row['temperature']:g}, B = {row['budget']}{cap}: {row['tau_draft_1']:.2f} vs "
          f"{row['tau_tempered']:.2f}, difference {row['difference']:+.3f} [{row['lo']:+.3f}, {row['hi']:+.3f}]")

# %% [markdown]
# ## The figures of `ddtree_jax.experiments.plot`

# %%
for name, make in plot.FIGURES.items():
    fig = make(summary)
    fig.savefig(OUT / f"03_{name}.png", dpi=120)
    plt.close(fig)
print("figures in", OUT)
