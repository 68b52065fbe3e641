"""argparse types of the benchmark commands and scripts: comma-separated lists checked as they are
parsed, so that a bad value stops the command with a message naming its flag before anything runs."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Iterable


def int_list(text: str, maximum: int | None = None, *, minimum: int = 1, empty: bool = False) -> list[int]:
    """``"1,8"`` -> ``[1, 8]``: ints >= ``minimum`` (and <= ``maximum`` if given); ``""`` -> ``[]`` only
    with ``empty``. Anything else is an ``argparse.ArgumentTypeError``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = None
    if values is None or not (values or empty) or any(v < minimum or (maximum is not None and v > maximum)
                                                      for v in values):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise argparse.ArgumentTypeError(f"expected comma-separated integers {bound}"
                                         f"{' (or nothing)' if empty else ''}, got {text!r}")
    return values


def int_list_or_empty(text: str) -> list[int]:
    """`int_list` that also takes ``""`` (``[]``: none of what the flag lists)."""
    return int_list(text, empty=True)


def non_negative_int_list(text: str) -> list[int]:
    """`int_list` of ints >= 0 (sizes where 0 means none or all, ids counted from 0)."""
    return int_list(text, minimum=0)


def float_list(text: str, *, positive: bool = False) -> list[float]:
    """``"0,1"`` -> ``[0.0, 1.0]``: finite numbers >= 0 (> 0 with ``positive``), at least one; anything
    else is an ``argparse.ArgumentTypeError``."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = None
    if not values or not all(math.isfinite(v) and (v > 0 if positive else v >= 0) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated finite numbers {'>' if positive else '>='} 0, "
                                         f"got {text!r}")
    return values


def positive_float_list(text: str) -> list[float]:
    """`float_list` of numbers > 0."""
    return float_list(text, positive=True)


def name_list(choices: Iterable[str], *, empty: bool = False) -> Callable[[str], list[str]]:
    """The argparse type of a comma-separated list of names out of ``choices``: one or more, or with
    ``empty`` also none (``""``)."""
    allowed = list(choices)

    def names(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [v for v in values if v not in allowed]
        if not (values or empty) or unknown:
            raise argparse.ArgumentTypeError(f"expected comma-separated names out of {', '.join(allowed)}, got "
                                             f"{text!r}" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        return values

    return names


# The tree-attention tiling fields by their letter in `attention_tiling`'s names.
TILING_FIELDS = {"m": "block_m", "k": "block_k", "w": "num_warps", "s": "num_stages", "p": "min_programs",
                 "c": "min_chunk", "j": "max_splits", "l": "split_by_length", "v": "whole_waves"}


def attention_tiling(text: str) -> dict:
    """``"m64k32w4s3"`` -> ``{"block_m": 64, "block_k": 32, "num_warps": 4, "num_stages": 3}``: letters of
    `TILING_FIELDS` each followed by a number (``l`` and ``v``, flags: 0 or 1), at least one; anything
    else is a ``ValueError`` quoting the text."""
    if re.fullmatch(r"(?:[mkwspcj]\d+|[lv][01])+", text) is None:
        raise ValueError(f"{text!r} is not a tiling like m64k64w4s3[p528][c1024][j8][l1][v1]")
    values = {TILING_FIELDS[key]: int(num) for key, num in re.findall(r"([mkwspcjlv])(\d+)", text)}
    for flag in ("split_by_length", "whole_waves"):
        if flag in values:
            values[flag] = bool(values[flag])
    return values
