"""Altered working: multiply rows whose written partial products are changed and whose
result is the sum of the partial products as written.

Shown the right partial products, a model trained on the product alone keeps computing
the product from the prompt's factors (lab/training-log.md: both partial
products right in 106 of 150 answers, their written sum in 7).  In an altered row the
factors no longer give the result; only the written working does, so the result can be
learned only by adding the two numbers the answer shows.  The trainer shows the working
of such a row as given (never masked, never scored, training/llada2_objective.py), so
nothing teaches the altered numbers themselves."""

from __future__ import annotations

import random

from lab.tasks import Instance, multiply_answer, multiply_factors, written_sum


def _changed_digits(number: int, rng: random.Random, keep_last: bool) -> int:
    """`number` with one or two of its digits changed (the leading one never to 0, the
    last one kept where `keep_last`: a tens partial product ends in 0)."""
    digits = list(str(number))
    places = range(len(digits) - (1 if keep_last else 0))
    if not places:
        return number
    for place in rng.sample(places, min(len(places), rng.choice((1, 2)))):
        choices = [d for d in "0123456789" if d != digits[place] and not (place == 0 and d == "0" and len(digits) > 1)]
        digits[place] = rng.choice(choices)
    return int("".join(digits))


def _altered(a: int, digit: int, scale: int, rng: random.Random) -> int:
    """a * digit * scale changed: by another digit, or in one or two of its digits."""
    right = a * digit * scale
    if rng.random() < 0.5:
        others = [d for d in range(1 if scale > 1 else 0, 10) if a * d * scale != right]
        if others:
            return a * rng.choice(others) * scale
    changed = _changed_digits(right, rng, keep_last=scale > 1)
    return changed if changed != right else right + scale


def altered_working(instance: Instance, rng: random.Random) -> Instance:
    """The instance with one or both of its partial products changed and the sum of the
    written ones as its result ("mul 4821*97=": "33747+433890=467637" may become
    "33747+385680=419427"), in the instance's layout (plain or padded).  Only a multiply
    instance that writes its working can be altered."""
    factors = multiply_factors(instance.prompt) if instance.task == "multiply" else None
    width = len(instance.answer.split("+")[0]) if instance.answer.startswith("0") else None
    if (factors is None or "=" not in instance.answer
            or instance.answer != multiply_answer(*factors, width=width)):
        raise ValueError(f"only a multiply answer with working can be altered, not {instance.answer!r}")
    a, b = factors
    units, tens = a * (b % 10), a * (b // 10) * 10
    which = rng.randrange(3)  # the units product, the tens product, or both
    if which != 1:
        units = _altered(a, b % 10, 1, rng)
    if which != 0:
        tens = _altered(a, b // 10, 10, rng)
    # A padded working stays padded (an altered sum may be a digit wider).
    return Instance(instance.task, instance.prompt, written_sum(units, tens, width))
