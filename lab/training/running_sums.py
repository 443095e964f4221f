"""The running-sum auxiliary objective for multiplication (Bai et al. 2025, "Why Can't
Transformers Learn Multiplication?"): a linear probe reads the residual stream at each
product digit and regresses that digit's running column sum, the carry-laden quantity
the digit is taken from.  Fine-tuning on the digits alone settles in an optimum that
never forms the long-range sums of partial products; the probe's gradient asks the
model to hold them, which is how their 2-layer model learned 4x4 multiplication that
plain training could not.

Column k (from the least significant) of a x b sums its partial products a_i b_j with
i + j = k and the carry of the column below: c_k = sum a_i b_j + c_{k-1} // 10.  The
product's digit k is c_k mod 10; past the last column the carry alone runs on.

The probe is a training device: it is not part of the model and not in any checkpoint.
Its gradient joins multiply's in the model, so under `--balance-tasks` the term takes a
share of multiply's balanced gradient norm rather than adding to it; the logged loss
includes the weighted error (`running_sum_mse` is logged beside it).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lab.tasks import Instance, multiply_factors, multiply_product

# Sums run to about 180 (two partial products of 81 and a carry); a tenth keeps the
# regression's scale near the cross-entropy's, one unit per ten of carry.
TARGET_SCALE = 0.1


def column_sums(a: int, b: int) -> list[int]:
    """The running column sum behind each digit of a x b, most significant first (as
    the answer is written): element p belongs to str(a * b)[p]."""
    if a < 0 or b < 0:
        raise ValueError(f"factors must be non-negative, not {a} and {b}")
    da = [int(d) for d in reversed(str(a))]
    db = [int(d) for d in reversed(str(b))]
    width = len(str(a * b))
    sums, carry = [], 0
    for k in range(width):
        total = carry + sum(da[i] * db[k - i] for i in range(len(da)) if 0 <= k - i < len(db))
        sums.append(total)
        carry = total // 10
    return sums[::-1]


def running_sum_targets(instances: list[Instance], canvas_length: int) -> torch.Tensor:
    """float [B, canvas_length]: the scaled running sum at each product digit of a
    multiply row's canvas (whose first tokens are the answer's characters, one each: the
    product is the answer's end, after any written working), NaN at every other
    position and in every other task's rows."""
    targets = torch.full((len(instances), canvas_length), math.nan)
    for row, instance in enumerate(instances):
        factors = multiply_factors(instance.prompt)
        if factors is None:
            continue
        sums = column_sums(*factors)
        end = len(instance.answer)
        if len(multiply_product(instance.answer)) != len(sums):
            raise ValueError(f"'{instance.answer}' does not end with the product of '{instance.prompt}'")
        if end > canvas_length:
            raise ValueError(f"the answer to '{instance.prompt}' has {end} characters, past a canvas of {canvas_length}")
        targets[row, end - len(sums): end] = torch.tensor(sums, dtype=torch.float) * TARGET_SCALE
    return targets


class RunningSumProbe(nn.Module):
    """A linear regression from one layer's residual stream to the running sum."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, 1)
        # Zero weights: the model's stream gets no gradient from the probe until the
        # probe has found a direction in it.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        # The residual stream's scale grows with depth and training; unit RMS keeps one
        # probe learning rate right at any layer.
        return self.linear(nn.functional.rms_norm(states, states.shape[-1:])).squeeze(-1)


class RunningSumTerm:
    """The auxiliary term of a run: a probe that reads the stream after layer `layer`
    (0-based), whose mean squared error joins the loss times `weight`, and the probe's
    own optimizer (its weights are not the model's: no decay, and a rate of its own,
    since it starts from nothing while the model is already trained)."""

    PROBE_LR = 1e-3

    def __init__(self, hidden: int, layer: int, weight: float, device: str | torch.device = "cpu"):
        if not 0 < weight < math.inf:
            raise ValueError(f"a running-sum weight must be positive, not {weight}")
        self.probe = RunningSumProbe(hidden).to(device)
        self.layer, self.weight = layer, weight
        # Adam's own betas: a convex regression on a stream that moves slowly.
        self.optim = torch.optim.AdamW(self.probe.parameters(), lr=self.PROBE_LR, weight_decay=0.0)

    def loss(self, states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """states [N, H] at the N positions that have a target, targets [N]."""
        return nn.functional.mse_loss(self.probe(states).float(), targets.to(states.device))

    def step(self) -> None:
        """The probe's update, after the backward pass that gave it gradients."""
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"layer": self.layer, "probe": self.probe.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["layer"] != self.layer:
            raise ValueError(f"the saved probe reads layer {state['layer']}, not {self.layer}")
        self.probe.load_state_dict(state["probe"])
        self.optim.load_state_dict(state["optim"])
