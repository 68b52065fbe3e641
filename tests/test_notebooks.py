"""Every notebook runs top to bottom (small settings) as a plain script and writes its figures."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = {
    "01_tree_anatomy.py": ["01_marginals.png", "01_tree.png", "01_mask.png"],
    "02_exact_sampling.py": ["02_first_token.png"],
    "03_sweeps.py": ["03_ddtree_over_chain.png", "03_tau_vs_budget.png", "03_measured_vs_expected.png",
                     "03_truncation.png", "03_draft_temperature.png"],
}


def test_every_notebook_is_listed():
    assert sorted(p.name for p in (ROOT / "notebooks").glob("*.py")) == sorted(NOTEBOOKS)


def start_background():
    """Every notebook started now, side by side, each in a fresh directory of its own that receives its
    figures, ``stdout.txt`` and ``stderr.txt``: ``{name: (process, directory)}``. conftest.py starts them
    as soon as the tests are collected (see its ``background`` fixture)."""
    started = {}
    for name in sorted(NOTEBOOKS):
        out = Path(tempfile.mkdtemp(prefix=name.removesuffix(".py") + "_"))
        env = dict(os.environ, DDTREE_NOTEBOOK_SMALL="1", DDTREE_NOTEBOOK_OUT=str(out), MPLBACKEND="Agg")
        with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
            started[name] = subprocess.Popen([sys.executable, str(ROOT / "notebooks" / name)], cwd=out, env=env,
                                             stdout=stdout, stderr=stderr), out
    return started


def stop_background(started) -> None:
    for proc, out in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_runs(name, background):
    source = (ROOT / "notebooks" / name).read_text()
    assert "# %% [markdown]" in source and source.count("\n# %%\n") >= 2, "jupytext percent format"
    proc, out = background[name]
    returncode = proc.wait(timeout=600)
    stdout, stderr = (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text()
    assert returncode == 0, f"{name} failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    for figure in NOTEBOOKS[name]:
        assert (out / figure).stat().st_size > 1000, figure
    if name == "03_sweeps.py":  # the tau table: one row per (method, budget, cap), the cap shown
        lines = stdout.splitlines()
        header = next(line.split() for line in lines if line.split()[:1] == ["method"])
        labels = [tuple(line.split()[:3]) for line in lines if line.split()[:1] in (["ar"], ["chain"], ["ddtree"])]
        assert header[:3] == ["method", "B", "cap"] and len(labels) > 3 and len(set(labels)) == len(labels)
