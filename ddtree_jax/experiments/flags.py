"""argparse types of the benchmark commands and scripts: comma-separated lists checked as they are
parsed, so that a bad value stops the command with a message naming its flag before anything runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def int_list(text: str, maximum: int | None = None, *, empty: bool = False) -> list[int]:
    """``"1,8"`` -> ``[1, 8]``: ints >= 1 (and <= ``maximum`` if given); ``""`` -> ``[]`` only with
    ``empty``. Anything else is an ``argparse.ArgumentTypeError``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = None
    if values is None or not (values or empty) or any(v < 1 or (maximum is not None and v > maximum) for v in values):
        bound = ">= 1" if maximum is None else f"in [1, {maximum}]"
        raise argparse.ArgumentTypeError(f"expected comma-separated integers {bound}"
                                         f"{' (or nothing)' if empty else ''}, got {text!r}")
    return values


def int_list_or_empty(text: str) -> list[int]:
    """`int_list` that also takes ``""`` (``[]``: none of what the flag lists)."""
    return int_list(text, empty=True)


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
