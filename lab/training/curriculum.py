"""Task-size curricula: short copies and two retrieval pairs before the full ranges.

Small instances teach the reading mechanisms (find the matching position in the
prompt, copy what is there) in cheap steps with few distractors.  Sizes grow from a
level in [0, 1]: linearly with the step (`linear_steps`), or per task once the running
accuracy on that task's masked answer tokens passes `threshold` (adaptive), since when
a task's mechanism forms cannot be planned in advance.

A level caps the sizes a task trains on, so the largest instances are never seen while
it climbs: a task stuck at a level the eval's full range is far above (multiply's
four-digit factors at level 0.6) learns nothing of that range.  `full_share` draws
that fraction of a climbing task's batches at the full range (one share for every
task, or one per task); their accuracy does not count toward the next level, which
stays earned at the level's own sizes.

A task can also train more on the hard part of whatever sizes it draws (`focus_share`):
multiply's products of two multi-digit factors (those under a two-digit multiplier are
a third of the eval's instances and where its errors are) or sort's longer lists.
Those batches do not earn levels either.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from lab.tasks import (ALL_TASKS, Addition, Brackets, Chain, Copy, Lookup, Multiply, PaddedWorkingSum, Recall,
                       Retrieval, Sort, Task, WorkingSum)
from lab.training.schedule import parse_shares


def task_at(name: str, level: float) -> Task:
    """The task with its sizes interpolated from small (level 0) to the full range (1)."""

    def grow(small: int, full: int) -> int:
        return round(small + (full - small) * min(1.0, max(0.0, level)))

    full = ALL_TASKS[name]
    if isinstance(full, Sort):
        return Sort(grow(2, full.min_count), grow(3, full.max_count), full.max_value)
    if isinstance(full, Multiply):
        return Multiply(grow(1, full.max_digits_a), grow(1, full.max_digits_b), working=full.working,
                        width=full.width)  # one width at every size: the sum's digits line up alike
    if isinstance(full, Chain):
        # One link and one value first, as retrieval starts with two pairs.
        return Chain(grow(2, full.min_pairs), grow(2, full.max_pairs))
    if isinstance(full, Brackets):
        return Brackets(grow(2, full.min_len), grow(6, full.max_len), grow(3, full.max_depth))
    if isinstance(full, Lookup):
        return Lookup(grow(2, full.min_pairs), grow(2, full.max_pairs))
    if isinstance(full, Recall):
        # Four pairs, two asked: the smallest with two queries where an answer seen
        # unmasked never settles the other by elimination.
        return Recall(grow(4, full.min_pairs), grow(4, full.max_pairs), full.max_queries)
    if isinstance(full, Retrieval):
        # Two pairs first: with one distractor the matching key is learned in a few
        # hundred steps; with 2-8 pairs it had not formed after 1400 (training log, run 5).
        return Retrieval(grow(2, full.min_pairs), grow(2, full.max_pairs))
    if isinstance(full, Addition):
        return Addition(grow(3, full.max_digits))
    if isinstance(full, WorkingSum):
        # At full size from the start it stayed near chance (0.10-0.17 per digit) for 300
        # steps from a model that adds the prompt's numbers (lab/training-log.md).
        if isinstance(full, PaddedWorkingSum):
            return PaddedWorkingSum(grow(1, full.max_digits), full.width)  # one width at every size
        return WorkingSum(grow(1, full.max_digits))
    if isinstance(full, Copy):
        return type(full)(grow(2, full.min_len), grow(8, full.max_len))
    return full


def hard_part(task: Task) -> Task | None:
    """The harder part of a task's sizes, or None where there is none: multiply with
    both factors of two digits or more (its carries sum two partial products), which
    sizes below a two-digit multiplier do not have; sort with the longer half of its
    list lengths, when they span more than one length; no other task."""
    if isinstance(task, Multiply):
        if min(task.max_digits_a, task.max_digits_b) < 2:
            return None
        return Multiply(task.max_digits_a, task.max_digits_b, min_digits=2, working=task.working, width=task.width)
    if isinstance(task, Sort):
        longer = (task.min_count + task.max_count + 1) // 2
        return Sort(longer, task.max_count, task.max_value) if longer > task.min_count else None
    return None


def fitting_task(full: Task, canvas: int) -> Task | None:
    """The task restricted to the instances whose answer fits a canvas of `canvas`
    positions (one token per answer character for the tasks it shortens: digits and
    capitals; the others fit by their gen_length), or None when
    none does (copy of 16-48 symbols on an 8-position canvas; multiply below 24 positions
    keeps its one-digit multipliers, whose answers write no working).  A fitting answer may
    fill the canvas exactly, with no room for <|eot_id|>."""
    if isinstance(full, Lookup):
        return full if canvas >= 1 else None
    if isinstance(full, Recall):
        return full if canvas >= full.max_queries else None
    if isinstance(full, Retrieval):
        return full if canvas >= 2 else None
    if isinstance(full, Addition):
        # The sum of two numbers below 10**d has at most d + 1 digits.
        if full.max_digits + 1 <= canvas:
            return full
        return Addition(canvas - 1) if canvas >= 2 else None
    if isinstance(full, Copy):
        if full.min_len > canvas:
            return None
        return type(full)(full.min_len, min(full.max_len, canvas))
    if isinstance(full, Multiply) and full.gen_length > canvas:
        # Below the written working's canvas, the one-digit multipliers (the product alone).
        one_digit = Multiply(full.max_digits_a, 1, working=full.working, width=full.width)
        return one_digit if one_digit.gen_length <= canvas else None
    return full if full.gen_length <= canvas else None


@dataclass(frozen=True)
class Draw:
    """One batch's task, and how it was drawn: at the full range, focused on its hard
    part, or (neither) at the curriculum's level, the only batches that earn levels."""

    task: Task
    full_size: bool = False
    focus: bool = False

    @property
    def at_level(self) -> bool:
        return not (self.full_size or self.focus)

    def log_fields(self) -> dict:
        return {k: True for k in ("full_size", "focus") if getattr(self, k)}


def _shares(names: list[str], share: float | Mapping[str, float], what: str) -> dict[str, float]:
    shares = dict(share) if isinstance(share, Mapping) else dict.fromkeys(names, share)
    for name, value in shares.items():
        if name not in names:
            raise ValueError(f"a {what} for '{name}', which is not trained")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"the {what} must be in [0, 1], not {value}")
    return {n: shares.get(n, 0.0) for n in names}


class Curriculum:
    """Adaptive levels follow a bias-corrected running mean of each task's batch
    accuracy (Adam's correction of an average started at zero), earned anew at each
    level over at least `min_observations` batches.  Uncorrected, a task that is
    already right at its new sizes (an old task in a model converted from one that
    knows it) waited 22 of its batches per tenth at smoothing 0.9; corrected, 8."""

    def __init__(self, names: list[str], *, linear_steps: int = 0, threshold: float = 0.0,
                 increment: float = 0.1, smoothing: float = 0.9, min_observations: int = 8,
                 full_share: float | Mapping[str, float] = 0.0, focus_share: float | Mapping[str, float] = 0.0):
        if linear_steps and threshold:
            raise ValueError("choose a linear or an adaptive curriculum, not both")
        self.full_shares = _shares(names, full_share, "full-size share")
        self.focus_shares = _shares(names, focus_share, "focus share")
        for name, share in self.focus_shares.items():
            if share and hard_part(task_at(name, 1.0)) is None:
                raise ValueError(f"a focus share for '{name}', which has no hard part to focus on "
                                 f"(multiply and sort have)")
        self.linear_steps, self.threshold = linear_steps, threshold
        self.increment, self.smoothing = increment, smoothing
        self.min_observations = min_observations
        adaptive = threshold > 0
        self.levels = {n: 0.0 if adaptive or linear_steps else 1.0 for n in names}
        self.running = {n: 0.0 for n in names}
        self.seen = {n: 0 for n in names}

    def level(self, name: str, step: int) -> float:
        if self.linear_steps:
            return min(1.0, step / self.linear_steps)
        return self.levels[name]

    def task(self, name: str, step: int) -> Task:
        return task_at(name, self.level(name, step))

    def draw(self, name: str, step: int, rng: random.Random) -> Draw:
        """One batch's task.  `rng` is read only for a task with a full-size share
        (while its level is below 1) or a focus share, so runs without them draw
        exactly the data they always drew.  A focused draw at sizes without a hard part
        (multiply below a two-digit multiplier) is an ordinary one."""
        level = self.level(name, step)
        full = level < 1.0 and bool(self.full_shares[name]) and rng.random() < self.full_shares[name]
        task = task_at(name, 1.0 if full else level)
        focus = bool(self.focus_shares[name]) and rng.random() < self.focus_shares[name]
        hard = hard_part(task) if focus else None
        return Draw(hard or task, full_size=full, focus=hard is not None)

    def observe(self, name: str, accuracy: float) -> bool:
        """Record a training batch's masked-answer accuracy; True when the level rose."""
        if not self.threshold or self.levels[name] >= 1.0:
            return False
        self.running[name] = self.smoothing * self.running[name] + (1 - self.smoothing) * accuracy
        self.seen[name] += 1
        if self.seen[name] < self.min_observations or self.estimate(name) < self.threshold:
            return False
        self.levels[name] = min(1.0, round(self.levels[name] + self.increment, 6))
        self.running[name], self.seen[name] = 0.0, 0  # earn the next level at the new sizes
        return True

    def after_batch(self, drawn: Draw, accuracy: float | None) -> dict:
        """Feed one trained batch to its task's level (only batches at the level earn the
        next one); the fields the training log records for it."""
        fields = drawn.log_fields()
        if accuracy is not None and drawn.at_level and self.observe(drawn.task.name, accuracy):
            fields["level"] = self.levels[drawn.task.name]
        return fields

    def estimate(self, name: str) -> float:
        """The running accuracy at the current level, corrected for its start at zero."""
        seen = self.seen[name]
        return self.running[name] / (1 - self.smoothing ** seen) if seen else 0.0

    def _settings(self) -> dict:
        return {"linear_steps": self.linear_steps, "threshold": self.threshold, "increment": self.increment}

    def state_dict(self) -> dict:
        return {"settings": self._settings(), "levels": dict(self.levels), "running": dict(self.running),
                "seen": dict(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("settings", self._settings())
        if saved != self._settings():
            # Levels earned under one schedule mean nothing under another (an adaptive
            # run resumed without its threshold would stay small forever).
            raise ValueError(f"the saved run used curriculum {saved}, this command asks for {self._settings()}")
        self.levels.update(state["levels"])
        self.running.update(state["running"])
        # States saved before counts were kept hold an uncorrected average: read it as
        # one long past (no correction) until the task's next raise.
        legacy = {n: 10**6 for n in state["running"]}
        self.seen.update(state.get("seen", legacy))


def curriculum_from_args(names: list[str], args, ap) -> "Curriculum":
    """The curriculum the training command lines ask for (their shared flags); a bad
    value is the parser's error."""
    try:
        full = parse_shares(args.full_size_share, names, "--full-size-share")
        focus = parse_shares(args.focus_share, names, "--focus-share")
    except ValueError as exc:
        ap.error(str(exc))
    try:
        return Curriculum(names, linear_steps=args.curriculum_steps, threshold=args.curriculum_threshold,
                          full_share=full, focus_share=focus)
    except ValueError as exc:
        ap.error(f"--curriculum-steps/--curriculum-threshold/--full-size-share/--focus-share: {exc}")
