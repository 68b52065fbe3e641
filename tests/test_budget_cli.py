"""Budget policies through ``ddtree generate``, ``ddtree sweep`` (the knob, the modelled time, old CSVs)
and ``ddtree bench`` (the cost table it writes)."""

import csv
import dataclasses
import json

import pytest
from test_cli import PROMPT_IDS, one_line_error

from ddtree_jax import cli, costs
from ddtree_jax.experiments import bench, plot, sweep
from ddtree_jax.experiments.sweep import Grid, Settings, grid_cells, read_rows, run_sweep


def generated(capsys, *flags):
    assert cli.main(["generate", "--prompt-ids", PROMPT_IDS, "--temperature", "0", "--max-new-tokens", "10",
                     "--json", "--no-stop", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_takes_every_policy_and_stays_greedy_exact(capsys):
    fixed = generated(capsys)
    for flags in (["--budget-policy", "batch"], ["--budget-policy", "adaptive", "--cost-table", "nvidia-h200"]):
        out = generated(capsys, *flags)
        assert out["token_ids"] == fixed["token_ids"] and out["stats"]["budget_policy"] == flags[1]
    assert fixed["stats"]["budget_policy"] == "fixed" and fixed["stats"]["mean_tree_size"] == 17


@pytest.mark.parametrize("argv,message", [
    (["--budget-policy", "adaptive", "--method", "ar"], "--budget-policy adaptive needs --method ddtree"),
    (["--budget-policy", "batch", "--method", "chain"], "--budget-policy batch needs --method ddtree"),
    (["--cost-table", "nvidia-h200"], "--cost-table is the model of --budget-policy adaptive"),
    (["--budget-policy", "adaptive", "--cost-table", "/nonexistent.json"], "neither a file nor a shipped table"),
])
def test_bad_policy_flags_exit_with_one_line(argv, message, capsys):
    assert message in one_line_error(["generate", "--max-new-tokens", "4", *argv], capsys)


def test_unknown_policy_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--budget-policy", "global"])
    assert "invalid choice: 'global'" in capsys.readouterr().err


GRID = dict(methods=("ar", "chain", "ddtree"), budgets=(4, 8), topk_caps=(0,), temperatures=(0.0,), top_ps=(1.0,),
            top_ks=(0,), draft_temperatures=(1.0,))


def test_grid_crosses_the_policies_with_ddtree_only():
    cells = grid_cells(Grid(**GRID, budget_policies=("fixed", "adaptive", "batch")), depth=15)
    assert {c.budget_policy for c in cells if c.method != "ddtree"} == {"fixed"}
    assert sorted((c.budget, c.budget_policy) for c in cells if c.method == "ddtree") == [
        (b, p) for b in (4, 8) for p in ("adaptive", "batch", "fixed")]
    with pytest.raises(ValueError, match="budget_policies must be one of"):
        Grid(**GRID, budget_policies=("global",))


def test_sweep_prices_every_call_and_projects_tokens_per_s(tmp_path):
    # the CLI's default tree and the prompt and token counts of `generated`: the sweep's one-prompt calls
    # reuse the rounds the test above compiled
    budget, cap, prompt_tokens, new_tokens = 16, 4, len(PROMPT_IDS.split(",")), 10
    grid = Grid(**dict(GRID, methods=("ar", "ddtree"), budgets=(budget,), topk_caps=(cap,)),
                budget_policies=("fixed", "adaptive", "batch"))
    settings = Settings(target="embedded", drafter="embedded", dtype="float32", prompts=3, prompt_tokens=prompt_tokens,
                        new_tokens=new_tokens, prompt_seed=0, seed=0, batch=2, cost_table="nvidia-h200")
    out = tmp_path / "policies.csv"
    rows = run_sweep(grid, settings, out)
    assert read_rows(out) == rows and len(rows) == 4 * 3
    table = costs.load("nvidia-h200")
    for row in rows:  # one call of 2 prompts, one of 1: each priced by the curve of its own batch size
        curve = table.curve(2 if row["prompt"] < 2 else 1, prompt_tokens + new_tokens)
        if row["method"] == "ar":  # one token a round
            assert row["model_ms"] == pytest.approx(new_tokens * curve.decode_ms)
        else:  # a round verifies 0 .. 4 x budget drafts per request
            call = [r["rounds"] for r in rows if sweep.cell_of(r) == sweep.cell_of(row)
                    and (r["prompt"] < 2) == (row["prompt"] < 2)]
            assert float(curve.at(0)) * max(call) <= row["model_ms"] <= float(curve.at(4 * budget)) * max(call)
    greedy = {r["budget_policy"]: r["emitted"] for r in rows if r["method"] == "ddtree" and r["prompt"] == 2}
    assert len(set(greedy.values())) == 1  # greedy: every policy emits the same tokens
    summary = plot.summarise(rows)
    for cell in summary:
        assert cell["projected_tokens_per_s"] > 0 and cell["tokens_per_round"] >= cell["tau"]
        if cell["method"] == "ddtree":
            assert cell["expected_per_node"] == pytest.approx(cell["expected"] / cell["verified"])
    written = plot.plot_csv(out)
    assert (tmp_path / "policies_budget_policies.png").stat().st_size > 1000 and len(written) == 3 + len(plot.FIGURES)
    changes = plot.policy_changes(rows)
    assert [(c["budget_policy"], c["calls"]) for c in changes] == [("adaptive", 2), ("batch", 2)]
    with pytest.raises(ValueError, match="cost_table"):  # the adaptive policy's tokens depend on the table
        run_sweep(grid, dataclasses.replace(settings, cost_table="device"), out)


def test_csvs_from_before_the_policies_still_read(tmp_path):
    old = {k: v for k, v in sweep.COLUMNS.items() if k not in sweep.ADDED_COLUMNS}
    path = tmp_path / "old.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(old))
        writer.writeheader()
        writer.writerow({k: {str: "x", int: 1, float: 1.0}[parse] for k, parse in old.items()})
    (row,) = read_rows(path)
    assert row["budget_policy"] == "fixed" and row["cost_table"] == "device" and row["model_ms"] == 0
    assert sweep.cell_of(row).budget_policy == "fixed"


def test_bench_writes_the_cost_table_of_its_rounds(tmp_path):
    meta = dict(device="Some GPU", date="2026-01-02", command="ddtree bench", settings=dict(shapes="tiny", topk_cap=0,
                                                                                             temperature=1.0))
    rows = [dict(batch=b, context=c, budget=n, round_ms=ms, decode_ms=d)
            for b, c, n, ms, d in ((1, 64, 8, 2.0, 1.0), (1, 64, 4, 1.5, 1.0), (2, 64, 4, 3.0, 2.5))]
    path = bench.write_cost_table(dict(meta=meta, shapes=rows), tmp_path / "bench.json")
    assert path == tmp_path / "bench_costs.json"
    table = costs.load(path)
    assert table.device == "Some GPU" and costs.CostTable.from_json(json.loads(path.read_text())) == table
    one, two = table.curve(1, 64), table.curve(2, 64)
    assert (one.nodes, one.round_ms, one.decode_ms) == ((4, 8), (1.5, 2.0), 1.0)
    assert (two.nodes, two.round_ms, two.decode_ms) == ((4,), (3.0,), 2.5)
    assert bench.write_cost_table(dict(meta=meta, shapes=[]), tmp_path / "none.json") is None
