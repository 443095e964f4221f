"""Deepen a trained LLaDA2-format model without changing what it computes.

A tiny model that has learned its tasks' easy cases can run out of depth on the hard
ones (a 4-digit times 2-digit product's carries, say) long before its training data
runs out.  Training a deeper model from scratch repeats hours of learning; instead the
source's layers keep their order, spread evenly over the deeper stack, and each new
layer starts with its residual branches' output projections at zero (the attention's
`dense` and every `down_proj` of its MLP or experts), so it adds nothing: the grown
model's logits are the source's exactly, and training starts from there.  The zeroed
projections get gradients at once (their inputs are not zero), and the rest of a new
layer as soon as they move.
"""

from __future__ import annotations

import re

import torch

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Residual-branch outputs: zero makes a layer the identity.
BRANCH_OUTPUTS = ("attention.dense.weight", "down_proj.weight")


def layer_count(weights: dict[str, torch.Tensor]) -> int:
    return 1 + max((int(m.group(1)) for m in map(LAYER_KEY.match, weights) if m), default=-1)


def layer_placement(source_layers: int, target_layers: int) -> list[int]:
    """The target index of each source layer: in order, the first at 0, spread evenly
    (4 into 8: 0, 2, 4, 6), so every new layer follows a trained one."""
    if not 0 < source_layers <= target_layers:
        raise ValueError(f"cannot grow {source_layers} layers into {target_layers}")
    return [i * target_layers // source_layers for i in range(source_layers)]


def grown_state_dict(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`target` (a freshly initialised deeper model's state dict) with `source`'s
    weights in place: its layers at `layer_placement`, its embeddings, final norm and
    head as they are; the layers left over keep their initialisation with their branch
    outputs zeroed.  Shapes must agree key for key (a dense layer lands on a dense
    one: the first layers are dense in both)."""
    placement = layer_placement(layer_count(source), layer_count(target))
    grown = {name: value.clone() for name, value in target.items()}
    moved: set[str] = set()
    for name, value in source.items():
        match = LAYER_KEY.match(name)
        to = f"model.layers.{placement[int(match.group(1))]}.{match.group(2)}" if match else name
        if to not in target:
            raise ValueError(f"{name}: the deeper model has no {to} (a dense layer placed on an MoE one, or "
                             f"another architecture)")
        if target[to].shape != value.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} against the deeper model's {tuple(target[to].shape)} "
                             f"(only the layer count may differ)")
        grown[to] = value.to(target[to].dtype).clone()
        moved.add(to)
    placed = set(placement)
    for name in target:
        match = LAYER_KEY.match(name)
        if match and int(match.group(1)) not in placed:
            if name.endswith(BRANCH_OUTPUTS):
                grown[name].zero_()
        elif name not in moved:
            raise ValueError(f"the source has nothing for the deeper model's {name}")
    return grown
