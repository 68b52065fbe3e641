"""Redraw the table and figures of sweep CSVs (`ddtree_jax.experiments.plot`; ``ddtree sweep`` draws
them itself at the end of a run).

    python experiments/plot.py [experiments/results/sweep_quick.csv ...] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from ddtree_jax.experiments.plot import plot_csv  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="*", type=Path, default=[Path("experiments/results/sweep_quick.csv")],
                    help="sweep CSVs (default: experiments/results/sweep_quick.csv)")
    ap.add_argument("--out-dir", type=Path, help="where the table and figures go (default: next to each CSV)")
    args = ap.parse_args(argv)
    for path in args.csv:
        if not path.is_file():
            raise SystemExit(f"plot: {path} does not exist (run ddtree sweep first)")
        for written in plot_csv(path, args.out_dir):
            print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
