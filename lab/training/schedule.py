"""What a run trains when: per-task option values, the order tasks take steps in,
and the learning-rate schedule."""

from __future__ import annotations

import math


def parse_task_values(text: str, names: list[str], what: str) -> dict[str, int]:
    """`retrieval=4,addition=2` -> {"retrieval": 4, "addition": 2}; names must be trained tasks."""
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            raise ValueError(f"{what}: '{item}' is not task=N for one of the trained tasks ({', '.join(names)})")
        try:
            values[name] = int(value)
        except ValueError:
            raise ValueError(f"{what}: '{value}' in '{item}' is not a whole number") from None
        if values[name] < 1:
            raise ValueError(f"{what}: '{item}' must be at least 1")
    return values


def parse_shares(text: str, names: list[str], flag: str) -> dict[str, float]:
    """`0.5` (every task) or `0.5,chain=1` (every task, then chain's own) -> a share
    per trained task; `flag` names the option in errors."""
    shares = dict.fromkeys(names, 0.0)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.rpartition("=")
        if sep and name not in names:
            raise ValueError(f"{flag}: '{item}' names no trained task ({', '.join(names)})")
        try:
            share = float(value)
        except ValueError:
            raise ValueError(f"{flag}: '{value}' in '{item}' is not a number") from None
        if sep:
            shares[name] = share
        else:
            shares = {n: share for n in names}
    return shares


def parse_mask_ranges(text: str, names: list[str]) -> dict[str, tuple[float, float]]:
    """`0.3-0.8` (every task) or `multiply=0.5-1` (one task; others the whole range) ->
    a (lo, hi) mask-ratio range per trained task, 0 <= lo < hi <= 1."""
    ranges = dict.fromkeys(names, (0.0, 1.0))
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, span = item.rpartition("=")
        if sep and name not in names:
            raise ValueError(f"--mask-range: '{item}' names no trained task ({', '.join(names)})")
        low, dash, high = span.partition("-")
        try:
            lo, hi = float(low), float(high)
        except ValueError:
            raise ValueError(f"--mask-range: '{span}' in '{item}' is not LO-HI, e.g. 0.3-0.8") from None
        if not (dash and 0 <= lo < hi <= 1):
            raise ValueError(f"--mask-range: '{span}' in '{item}' must be LO-HI with 0 <= LO < HI <= 1")
        if sep:
            ranges[name] = (lo, hi)
        else:
            ranges = dict.fromkeys(names, (lo, hi))
    return ranges


def task_cycle(names: list[str], weights: dict[str, int]) -> list[str]:
    """The order tasks take steps in: each name `weights[name]` times (default once),
    interleaved so a heavily weighted task never runs long stretches alone."""
    counts = {n: weights.get(n, 1) for n in names}
    cycle: list[str] = []
    for round_ in range(max(counts.values())):
        cycle.extend(n for n in names if counts[n] > round_)
    return cycle


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
