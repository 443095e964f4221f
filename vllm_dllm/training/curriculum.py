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
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from vllm_dllm.tasks import ALL_TASKS, Addition, Brackets, Chain, Copy, Lookup, Multiply, Recall, Retrieval, Sort, Task


def task_at(name: str, level: float) -> Task:
    """The task with its sizes interpolated from small (level 0) to the full range (1)."""

    def grow(small: int, full: int) -> int:
        return round(small + (full - small) * min(1.0, max(0.0, level)))

    full = ALL_TASKS[name]
    if isinstance(full, Sort):
        return Sort(grow(2, full.min_count), grow(3, full.max_count), full.max_value)
    if isinstance(full, Multiply):
        return Multiply(grow(1, full.max_digits_a), grow(1, full.max_digits_b))
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
    if isinstance(full, Copy):
        return type(full)(grow(2, full.min_len), grow(8, full.max_len))
    return full


def fitting_task(full: Task, canvas: int) -> Task | None:
    """The task restricted to the instances whose answer fits a canvas of `canvas`
    positions (one token per answer character for the tasks it shortens: digits and
    capitals; the others fit by their gen_length), or None when
    none does (copy of 16-48 symbols on an 8-position canvas).  A fitting answer may
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
    return full if full.gen_length <= canvas else None


class Curriculum:
    """Adaptive levels follow a bias-corrected running mean of each task's batch
    accuracy (Adam's correction of an average started at zero), earned anew at each
    level over at least `min_observations` batches.  Uncorrected, a task that is
    already right at its new sizes (an old task in a model converted from one that
    knows it) waited 22 of its batches per tenth at smoothing 0.9; corrected, 8."""

    def __init__(self, names: list[str], *, linear_steps: int = 0, threshold: float = 0.0,
                 increment: float = 0.1, smoothing: float = 0.9, min_observations: int = 8,
                 full_share: float | Mapping[str, float] = 0.0):
        if linear_steps and threshold:
            raise ValueError("choose a linear or an adaptive curriculum, not both")
        shares = dict(full_share) if isinstance(full_share, Mapping) else dict.fromkeys(names, full_share)
        for name, share in shares.items():
            if name not in names:
                raise ValueError(f"a full-size share for '{name}', which is not trained")
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"the full-size share must be in [0, 1], not {share}")
        self.full_shares = {n: shares.get(n, 0.0) for n in names}
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

    def draw(self, name: str, step: int, rng: random.Random) -> tuple[Task, bool]:
        """The task of one batch, and whether it is at the curriculum's level (only those
        batches earn the next level).  `rng` is read only when a full-size share is set,
        so runs without one draw exactly the data they always drew."""
        level = self.level(name, step)
        share = self.full_shares[name]
        if level < 1.0 and share and rng.random() < share:
            return task_at(name, 1.0), False
        return task_at(name, level), True

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

    def after_batch(self, name: str, at_level: bool, accuracy: float | None) -> dict:
        """Feed one trained batch to its task's level (only batches at the level earn the
        next one); the fields the training log records for it."""
        fields: dict = {} if at_level else {"full_size": True}
        if accuracy is not None and at_level and self.observe(name, accuracy):
            fields["level"] = self.levels[name]
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
