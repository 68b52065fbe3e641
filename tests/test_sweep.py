"""Sweeps: the canonical grid, CSV rows, resuming (also after an interrupted write), ``ddtree sweep``, plots."""

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ddtree_jax import cli
from ddtree_jax.experiments import plot, sweep
from ddtree_jax.experiments.stats import paired_bootstrap_change, paired_bootstrap_diff
from ddtree_jax.experiments.sweep import COLUMNS, Grid, Settings, cell_of, grid_cells, read_rows, run_sweep

ROOT = Path(__file__).resolve().parents[1]

GRID = dict(methods=("ar", "chain", "ddtree"), budgets=(4, 16), topk_caps=(0, 4, 16), temperatures=(0.0, 1.0),
            top_ps=(1.0, 0.9), top_ks=(0, 5), draft_temperatures=(1.0, 2.0))


def test_grid_is_canonical_and_grouped_by_compiled_round():
    cells = grid_cells(Grid(**GRID), depth=15)
    assert len(cells) == len(set(cells))
    # T = 0 ignores truncation; T = 1 varies top-p and top-k one at a time: (1, 0), (0.9, 0), (1, 5).
    samplings = {(0.0, 1.0, 0), (1.0, 1.0, 0), (1.0, 0.9, 0), (1.0, 1.0, 5)}
    ar = [c for c in cells if c.method == "ar"]
    assert {(c.temperature, c.top_p, c.top_k) for c in ar} == samplings and len(ar) == 4
    assert {(c.budget, c.topk_cap, c.draft_temperature) for c in ar} == {(0, 0, 1.0)}
    chain = [c for c in cells if c.method == "chain"]
    assert len(chain) == 4 and {(c.budget, c.topk_cap, c.draft_temperature) for c in chain} == {(15, 1, 1.0)}
    trees = [c for c in cells if c.method == "ddtree"]
    # A cap >= the budget is no cap: B=4 keeps cap 0 only, B=16 caps 0 and 4.
    assert {(c.budget, c.topk_cap) for c in trees} == {(4, 0), (16, 0), (16, 4)}
    assert len(trees) == 3 * 2 * 4
    rounds = [(c.method, c.budget, c.topk_cap) for c in cells]
    assert len(set(rounds)) == len([r for i, r in enumerate(rounds) if i == 0 or r != rounds[i - 1]])

    crossed = grid_cells(dataclasses.replace(Grid(**GRID), cross_truncation=True), depth=15)
    assert len([c for c in crossed if c.method == "ar"]) == 1 + 4


@pytest.mark.parametrize("field,value,message", [
    ("methods", ("beam",), "methods"), ("budgets", (0,), "budgets"), ("topk_caps", (-1,), "topk_caps"),
    ("temperatures", (-0.5,), "temperatures"), ("top_ps", (1.5,), "top_ps"), ("top_ks", (-2,), "top_ks"),
    ("draft_temperatures", (0.0,), "draft_temperatures"), ("budgets", (), "budgets must not be empty"),
    ("budgets", (16, 40000), r"budgets .*in \[1, 32768\]"),
])
def test_bad_grid_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        Grid(**dict(GRID, **{field: value}))


def test_budgets_are_bounded_by_every_policy_of_the_grid():
    Grid(**dict(GRID, budgets=(32768,)))
    with pytest.raises(ValueError, match=r"in \[1, 8192\] \(the budget policies fixed, batch\)"):
        Grid(**dict(GRID, budgets=(9000,), budget_policies=("fixed", "batch")))


def test_the_output_must_be_a_csv(tmp_path):
    grid, settings, _ = tiny(tmp_path, (0.0,))
    with pytest.raises(ValueError, match="out must be a .csv path"):
        sweep.run_sweep(grid, settings, tmp_path / "sweep.json")
    assert list(tmp_path.iterdir()) == []


def tiny(tmp_path, temperatures):
    grid = Grid(methods=("ar", "ddtree"), budgets=(4,), topk_caps=(0,), temperatures=temperatures, top_ps=(1.0,),
                top_ks=(0,), draft_temperatures=(1.0,))
    settings = Settings(target="embedded", drafter="embedded", dtype="float32", prompts=2, prompt_tokens=16,
                        new_tokens=6, prompt_seed=0, seed=0, batch=2)
    return grid, settings, tmp_path / "sweep.csv"


def test_default_outputs_are_fresh_paths_of_the_working_directory():
    for preset in (sweep.QUICK, sweep.FULL):
        out = Path(preset["out"])
        assert not out.is_absolute() and out.parts[0] == "ddtree-sweep"
        tracked = subprocess.run(["git", "ls-files", "ddtree-sweep"], cwd=ROOT, capture_output=True, text=True)
        assert tracked.returncode == 0 and tracked.stdout == ""
    assert "ddtree-sweep/" in (ROOT / ".gitignore").read_text().splitlines()


def test_tiny_sweep_resumes_and_plots(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    grid, settings, _ = tiny(tmp_path, (0.0,))
    out = tmp_path / "ddtree-sweep" / "sweep.csv"  # where the CLI writes by default
    rows = run_sweep(grid, settings, out)
    assert read_rows(out) == rows and len(rows) == 2 * 2
    assert list(rows[0]) == list(COLUMNS)
    for row in rows:
        assert row["tau"] == pytest.approx(row["emitted"] / row["rounds"])
        assert row["emitted"] >= settings.new_tokens and row["device"] and row["seed"] == 0
        # Greedy: the expected acceptance of a tree under a one-hot law is the accepted length itself.
        assert row["expected_accepted"] == pytest.approx(row["tau"] - 1, abs=1e-6)
    assert {r["tau"] for r in rows if r["method"] == "ar"} == {1.0}

    # Resume through the CLI (its default output) with a larger grid: only the new temperature runs, and
    # the run ends with the table and figures next to the CSV.
    argv = ["sweep", "--methods", "ar,ddtree", "--budgets", "4", "--topk-caps", "0", "--temperatures", "0,1",
            "--top-ps", "1", "--top-ks", "0", "--draft-temperatures", "1", "--prompts", "2", "--prompt-tokens", "16",
            "--new-tokens", "6", "--batch", "2", "--dtype", "float32"]
    assert cli.main(argv) == 0
    assert all((out.parent / f"sweep_{name}.csv").is_file() for name in ("cells", "tempering", "policy_changes"))
    assert all((out.parent / f"sweep_{name}.png").stat().st_size > 1000 for name in plot.FIGURES)
    runs = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert (runs[-1]["cells_skipped"], runs[-1]["cells_run"]) == (2, 2)
    both = read_rows(out)
    assert both[:4] == rows and len(both) == 8

    # An interrupted write: a cell missing a prompt and a truncated line. The cell is run again with the
    # same prompts and coins (the same tokens), everything else is kept.
    text = out.read_text().splitlines(keepends=True)
    dropped = next(i for i, line in enumerate(text) if line.startswith("ddtree,4,0,1.0,"))
    lost = both[dropped - 1]
    out.write_text("".join(text[:dropped] + text[dropped + 1:]) + text[dropped][:25])
    assert cli.main([*argv, "--no-plot"]) == 0
    assert (json.loads(out.with_suffix(".json").read_text())["runs"][-1]["cells_run"]) == 1
    final = read_rows(out)
    kept = [r for r in both if cell_of(r) != cell_of(lost)]
    assert len(kept) == 6 and final[:6] == kept and len(final) == 8
    old = [r for r in both if cell_of(r) == cell_of(lost)]
    keys = ("prompt", "emitted", "rounds", "tau", "expected_accepted")
    assert [[r[k] for k in keys] for r in final[6:]] == [[r[k] for k in keys] for r in old]

    with pytest.raises(ValueError, match="new_tokens"):
        run_sweep(grid, dataclasses.replace(settings, new_tokens=7), out)

    written = plot.plot_csv(out, tmp_path / "figures")
    assert [p.name for p in written] == ["sweep_cells.csv", "sweep_tempering.csv", "sweep_policy_changes.csv"] + [
        f"sweep_{name}.png" for name in plot.FIGURES]
    assert all(p.stat().st_size > 1000 for p in written[3:])
    cells = plot.summarise(final)
    assert {cell_of(c) for c in cells} == {cell_of(r) for r in final} and len(cells) == 4
    for cell in cells:
        assert cell["tau_lo"] <= cell["tau"] <= cell["tau_hi"]
        assert cell["accepted"] == pytest.approx(cell["tau"] - 1)


def test_draft_vocabularies_are_a_grid_axis(tmp_path):
    """``draft_vocabs``: every drafted cell at each size, AR once (it has no drafter); greedy cells keep AR's
    tokens, so their tau is at least 1; a CSV written before the column reads as the whole vocabulary."""
    grid = Grid(methods=("ar", "chain", "ddtree"), budgets=(4,), topk_caps=(0,), temperatures=(0.0,), top_ps=(1.0,),
                top_ks=(0,), draft_temperatures=(1.0,), draft_vocabs=(0, 512))
    assert [(c.method, c.draft_vocab) for c in grid_cells(grid, depth=15)] == [
        ("ar", 0), ("chain", 0), ("chain", 512), ("ddtree", 0), ("ddtree", 512)]
    _, settings, out = tiny(tmp_path, (0.0,))
    rows = run_sweep(grid, settings, out)
    assert sorted({(r["method"], r["draft_vocab"]) for r in rows}) == [
        ("ar", 0), ("chain", 0), ("chain", 512), ("ddtree", 0), ("ddtree", 512)]
    assert all(r["tau"] >= 1 for r in rows)
    header, *lines = out.read_text().splitlines()
    names = header.split(",")
    old = [",".join(v for n, v in zip(names, line.split(",")) if n != "draft_vocab")
           for line in [header, *lines] if "512" not in line.split(",")[names.index("draft_vocab")]]
    out.write_text("\n".join(old) + "\n")
    assert {r["draft_vocab"] for r in read_rows(out)} == {0} and len(read_rows(out)) == 3 * 2
    with pytest.raises(ValueError, match="draft_vocabs must be >= 0"):
        dataclasses.replace(grid, draft_vocabs=(-1,))


def test_mismatched_model_directory_is_rejected(tmp_path):
    grid, settings, out = tiny(tmp_path, (0.0,))
    with pytest.raises(ValueError, match="no config.json"):
        run_sweep(grid, dataclasses.replace(settings, target=str(tmp_path)), out)


def test_paired_bootstrap_difference():
    rounds = np.array([10.0, 20.0, 5.0, 8.0])
    assert paired_bootstrap_diff(2 * rounds, rounds, rounds, rounds) == (1.0, 1.0, 1.0)
    rng = np.random.default_rng(0)
    emitted = rounds * (2 + rng.random(4))
    diff, lo, hi = paired_bootstrap_diff(emitted + 3, rounds, emitted, rounds)
    assert diff == pytest.approx(12 / rounds.sum()) and lo < diff < hi and lo > 0
    with pytest.raises(ValueError, match="one shape"):
        paired_bootstrap_diff(rounds, rounds, rounds[:3], rounds[:3])


def test_paired_bootstrap_change():
    rounds = np.array([10.0, 20.0, 5.0, 8.0])
    assert paired_bootstrap_change(3 * rounds, rounds, 2 * rounds, rounds) == (0.5, 0.5, 0.5)
    rng = np.random.default_rng(1)
    accepted, verified = rounds * (1 + rng.random(4)), rounds * 16
    change, lo, hi = paired_bootstrap_change(accepted * 1.1, verified, accepted, verified)
    assert change == pytest.approx(0.1) and lo == pytest.approx(0.1) and hi == pytest.approx(0.1)
    change, lo, hi = paired_bootstrap_change(accepted + rng.random(4), verified, accepted, verified)
    assert lo < change < hi
    with pytest.raises(ValueError, match="one shape"):
        paired_bootstrap_change(rounds, rounds, rounds[:3], rounds[:3])


def test_policy_changes_pair_calls_of_a_batch():
    """Two calls of two prompts: accepted per verified draft 12 / 64 under batch-global against 10 / 64
    under fixed (+20%), expected 6 / 64 against 8 / 64 (-25%), projected tokens/s 28 / 20 ms against
    26 / 20 ms (+1/13) and against the best fixed budget, 32: 36 / 20 ms (-2/9); AR and cells without a
    fixed twin are left out."""
    def rows(policy, accepted, expected, budget=16, method="ddtree", model_ms=10.0):
        cell = dict(method=method, budget=budget, topk_cap=0, temperature=1.0, top_p=1.0, top_k=0,
                    draft_temperature=1.0, budget_policy=policy, batch=2)
        return [dict(cell, prompt=i, emitted=a + 4, rounds=4, expected_accepted=e / 4, mean_tree_size=5.0,
                     model_ms=model_ms) for i, (a, e) in enumerate(zip(accepted, expected))]

    table = plot.policy_changes(rows("fixed", [1, 2, 3, 4], [2, 2, 2, 2]) + rows("batch", [2, 2, 4, 4], [1, 2, 1, 2])
                                + rows("fixed", [5, 5, 5, 5], [1, 1, 1, 1], budget=32)
                                + rows("batch", [1, 1, 1, 1], [1, 1, 1, 1], budget=64)
                                + rows("fixed", [1, 1, 1, 1], [1, 1, 1, 1], budget=0, method="ar"))
    assert len(table) == 1
    row = table[0]
    assert (row["budget"], row["budget_policy"], row["calls"], row["best_fixed_budget"]) == (16, "batch", 2, 32)
    assert (row["accepted_per_node_fixed"], row["accepted_per_node"]) == (10 / 64, 12 / 64)
    assert row["accepted_change"] == pytest.approx(0.2) and row["expected_change"] == pytest.approx(-0.25)
    assert row["projected_change"] == pytest.approx(1 / 13)
    assert row["projected_change_vs_best_fixed"] == pytest.approx(-2 / 9)
    for name in ("accepted_change", "projected_change", "projected_change_vs_best_fixed"):
        assert row[f"{name}_lo"] <= row[name] <= row[f"{name}_hi"]
    no_costs = plot.policy_changes(rows("fixed", [1, 2], [1, 1], model_ms=0.0) + rows("batch", [2, 2], [1, 1],
                                                                                     model_ms=0.0))
    assert np.isnan(no_costs[0]["projected_change"]) and no_costs[0]["accepted_change"] == pytest.approx(4 / 3 - 1)


def test_tempering_table_pairs_prompts():
    def rows(draft_temperature, emitted):
        cell = dict(method="ddtree", budget=8, topk_cap=0, temperature=0.6, top_p=1.0, top_k=0,
                    draft_temperature=draft_temperature)
        return [dict(cell, prompt=i, emitted=e, rounds=10) for i, e in enumerate(emitted)]

    table = plot.tempering(rows(1.0, [30, 20, 25]) + rows(0.6, [20, 20, 20]) + rows(0.4, [5, 5, 5]))
    assert len(table) == 1
    row = table[0]
    assert (row["budget"], row["temperature"], row["prompts"]) == (8, 0.6, 3)
    assert row["difference"] == pytest.approx(2.5 - 2.0) and row["lo"] <= row["difference"] <= row["hi"]


@pytest.mark.parametrize("field,value", [("seed", -1), ("seed", 2**32), ("prompt_seed", -3)])
def test_bad_seeds_are_named(tmp_path, field, value):
    _, settings, _ = tiny(tmp_path, (0.0,))
    with pytest.raises(ValueError, match=f"{field} must be in \\[0, 2\\*\\*32\\), got {value}"):
        dataclasses.replace(settings, **{field: value})
