"""AdamW for the LLaDA2-format model: weight decay on matrices, none on gains and biases.

With QK-norm the query and key RMSNorm gains are the attention's temperature: decayed
(0.1 at lr 2e-3), they fell from 1.0 to ~0.2 over 15,800 steps of the first LLaDA2 run,
every content match flattened to near-uniform attention, and retrieval's lookup never
formed (lab/training-log.md).  Vectors (norm gains, biases) are left undecayed, as
large-model recipes do.
"""

from __future__ import annotations

import torch

WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """Group 0: matrices, decayed; group 1: vectors, not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr, betas=BETAS,
    )


def load_adamw_state(optim: torch.optim.AdamW, model: torch.nn.Module, saved: dict) -> None:
    """Load a saved optimizer state into `adamw(model, ...)`.  A state saved by the
    earlier single-group optimizer (every parameter decayed, in `model.parameters()`
    order) has its moments moved to the same parameters in the two groups."""
    if len(saved["param_groups"]) == len(optim.param_groups):
        optim.load_state_dict(saved)
        return
    if len(saved["param_groups"]) != 1:
        raise ValueError(f"a saved optimizer with {len(saved['param_groups'])} parameter groups; expected 1 or "
                         f"{len(optim.param_groups)}")
    old_index = {id(p): i for i, p in enumerate(model.parameters())}
    if len(old_index) != len(saved["param_groups"][0]["params"]):
        raise ValueError("the saved optimizer holds a different number of parameters than this model")
    settings = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
    state, groups, new_index = {}, [], 0
    for group in optim.param_groups:
        indices = []
        for p in group["params"]:
            old = saved["param_groups"][0]["params"][old_index[id(p)]]
            if old in saved["state"]:
                state[new_index] = saved["state"][old]
            indices.append(new_index)
            new_index += 1
        groups.append({**settings, "weight_decay": group["weight_decay"], "params": indices})
    optim.load_state_dict({"state": state, "param_groups": groups})
