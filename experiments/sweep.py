"""Parameter sweep of AR, DFlash chain and DDTree on held-out prompts (the same as ``ddtree sweep``).

The grid, the CSV columns and resuming are described in ``ddtree_jax/experiments/sweep.py``; the
findings in ``experiments/README.md``.

    python experiments/sweep.py --quick        # small grid, a few minutes on a CPU
    python experiments/sweep.py                # the full grid (an accelerator)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["sweep", *sys.argv[1:]]))
