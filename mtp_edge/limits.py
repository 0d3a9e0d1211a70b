"""The ranges of the settings that every way in takes: the commands' flags, the Python API's
keywords and the server's request fields. One table, so that a value one of them accepts is a
value all of them accept, and each checks before any loading starts."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from mtp_edge.errors import UserError

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed and the native core take 64 bits


@dataclass(frozen=True)
class Limit:
    """An int or a number in [low, high] (either end open, or absent), and what it means."""

    kind: type  # int or float
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # what special values mean, e.g. "0 = greedy"

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        if self.low is not None and self.high is not None:
            if self.kind is int:
                what += f" in {self.low}..{self.high}"
            else:
                left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
                what += f" in {left}{self.low:g}, {self.high:g}{right}"
        elif self.low is not None:
            what += f" {'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            what += f" {'<' if self.high_open else '<='} {self.high:g}"
        return f"{what} ({self.note})" if self.note else what

    def convert(self, value):
        """`value` as an int or float in range, or None when it is not one."""
        if isinstance(value, bool):
            return None  # True is an int to Python, never a count or a temperature
        if self.kind is int:
            try:
                value = operator.index(value)  # ints, numpy's and torch's included
            except TypeError:
                return None
        else:
            if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
                return None
            value = float(value)
            if not math.isfinite(value):
                return None
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return None
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return None
        return value

    def problem(self, value) -> str | None:
        """What is wrong with `value`, as the end of a sentence (None: nothing)."""
        if self.convert(value) is not None:
            return None
        return f"must be {self.describe()}, got {value!r}"

    def check(self, name: str, value):
        """`value` converted, or a UserError naming `name` (a keyword, a flag or a field)."""
        problem = self.problem(value)
        if problem is not None:
            raise UserError(f"{name} {problem}")
        return self.convert(value)


LIMITS = {
    "k": Limit(int, 1, 15, note="most tokens drafted per step"),
    "max_new_tokens": Limit(int, 1),
    "temperature": Limit(float, 0, note="0 = greedy"),
    "top_k": Limit(int, 0, note="0 = off"),
    "top_p": Limit(float, 0, 1, low_open=True, note="1 = off"),
    "seed": Limit(int, 0, MAX_SEED),
    "threads": Limit(int, 0, note="0 = all cores"),
    "max_seq_len": Limit(int, 2),
    "draft_confidence": Limit(float, 0, 1, high_open=True),
}

SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


def check(name: str, value, label: str | None = None):
    """`value` of the setting `name` converted, or a UserError that names it as `label`."""
    return LIMITS[name].check(label or name, value)


def check_stop(stop, label: str = "stop") -> tuple[str, ...]:
    """Stop strings: one text or a sequence of non-empty texts."""
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list | tuple):
        stop = tuple(stop)
    else:
        raise UserError(f"{label} must be a text or a list of texts, got {stop!r}")
    if not all(isinstance(s, str) for s in stop):
        raise UserError(f"{label} must be a text or a list of texts, got {list(stop)!r}")
    if any(s == "" for s in stop):
        raise UserError(f"{label}: a stop string must be non-empty (an empty one matches at once)")
    return stop
