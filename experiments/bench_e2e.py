"""Where a DDTree round's time goes, side by side with plain decoding and the HBM roofline.

The same benchmark as ``ddtree bench`` (see ``ddtree_jax/experiments/bench.py`` for what it measures):

    python experiments/bench_e2e.py --embedded --out experiments/results/bench_e2e.json
    python experiments/bench_e2e.py --shapes tiny                     # a quick check on a CPU
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
