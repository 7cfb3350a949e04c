"""argparse `type=` converters that refuse nonsense where it is typed: a negative count, a
negative timeout, an empty name. argparse turns their ArgumentTypeError into its usual one-line
error and exit status 2, naming the flag:

    graphlm stats: error: argument --top: must be an integer >= 1, got -2
"""
from __future__ import annotations

import argparse
import math


def _number(kind, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def int_at_least(low: int):
    """An integer >= `low`."""
    def convert(text: str) -> int:
        value = _number(int, text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value
    convert.__name__ = f"int>={low}"   # (argparse names the type in some messages)
    return convert


def float_at_least(low: float, strict: bool = False):
    """A finite number >= `low` (> `low` when `strict`)."""
    def convert(text: str) -> float:
        value = _number(float, text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be a number {'>' if strict else '>='} {low:g}, got {text}")
        return value
    convert.__name__ = f"float{'>' if strict else '>='}{low:g}"
    return convert


def nonempty(text: str) -> str:
    """A string with something in it."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


__all__ = ["int_at_least", "float_at_least", "nonempty"]
