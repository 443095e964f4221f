"""One gradient scale for every task of a multi-task run.

Each training step is one task's batch, and AdamW's second moments average the squared
gradients of the last ~1,000 steps over every task, so a task with small gradients moves
the weights less per step, whatever it still has to learn.  On the LLaDA2 run a
two-token retrieval answer in a 32-position canvas of end-of-text had under half of
copy's whole gradient and a fifth of its attention gradient (lab/training-log.md).  Rescaling each step's gradients by (mean over tasks of their running
norms) / (this task's running norm) gives every task the same typical whole-gradient
step (not the same per layer); a task's own steps keep their relative sizes, so its
schedule of easy and hard batches is not flattened.
"""

from __future__ import annotations

import math


class TaskGradientBalance:
    def __init__(self, decay: float = 0.98):
        if not 0.0 <= decay < 1.0:
            raise ValueError("decay must be in [0, 1)")
        self.decay = decay
        self.norms: dict[str, float] = {}

    def scale(self, task: str, norm: float) -> float:
        """Record the norm of `task`'s gradients this step; the factor to multiply them by.
        A non-finite or zero norm is not recorded (the step is left to gradient clipping)."""
        if not math.isfinite(norm) or norm <= 0.0:
            return 1.0
        running = self.norms.get(task)
        self.norms[task] = norm if running is None else self.decay * running + (1 - self.decay) * norm
        return sum(self.norms.values()) / len(self.norms) / self.norms[task]

    def state_dict(self) -> dict:
        return {"decay": self.decay, "norms": dict(self.norms)}

    def load_state_dict(self, state: dict) -> None:
        self.norms = dict(state["norms"])
