"""Where a result came from: the command line a benchmark or sweep records beside its numbers."""

from __future__ import annotations

import os
import sys


def command_line(argv: list[str] | None = None) -> str:
    """``argv`` (default ``sys.argv``) as one line to record, the program named as a user would type
    it: relative to the working directory when it lies under it (``experiments/bench_models.py``,
    ``ddtree_jax/cli.py`` for ``python -m ddtree_jax.cli``), else by its file name (an installed
    ``ddtree``), so that no machine's directories end up in committed results."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        program = os.path.abspath(argv[0])
        inside = os.path.commonpath([program, os.getcwd()]) == os.getcwd()
        argv[0] = os.path.relpath(program) if inside else os.path.basename(program)
    return " ".join(argv)
