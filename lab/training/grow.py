"""Deepen or widen a trained LLaDA2-format model without changing what it computes.

A tiny model that has learned its tasks' easy cases can run out of depth on the hard
ones (a 4-digit times 2-digit product's carries, say) long before its training data
runs out.  Training a deeper model from scratch repeats hours of learning; instead the
source's layers keep their order, spread evenly over the deeper stack, and each new
layer starts with its residual branches' output projections at zero (the attention's
`dense` and every `down_proj` of its MLP or experts), so it adds nothing: the grown
model's logits are the source's exactly, and training starts from there.  The zeroed
projections get gradients at once (their inputs are not zero), and the rest of a new
layer as soon as they move.

Widening by attention heads works the same way: the source's heads keep their places
(query, key and value rows first in each group, so every source query head still reads
its own key/value head), the new heads' projections keep their fresh initialisation,
and the output projection's columns that read them start at zero.  QK-norm gains are
per head dimension, shared by all heads, so they carry over as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable

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


def attention_heads(weights: dict[str, torch.Tensor], layer: int) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of one layer's attention weights."""
    prefix = f"model.layers.{layer}.attention."
    head_dim = weights[prefix + "query_layernorm.weight"].shape[0]
    heads = weights[prefix + "dense.weight"].shape[1] // head_dim
    kv_heads = (weights[prefix + "query_key_value.weight"].shape[0] // head_dim - heads) // 2
    return heads, kv_heads, head_dim


def widened_heads(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`source` with each layer's attention widened to `target`'s head counts (the
    same layers otherwise): the source's heads first, the new heads' query/key/value
    rows taken from `target` (a fresh initialisation), and the output projection's
    columns for them zero.  The head width and the query heads per key/value head must
    agree, so every source query head keeps reading its own key/value head."""
    (heads, kv_heads, head_dim), (to_heads, to_kv, to_dim) = attention_heads(source, 0), attention_heads(target, 0)
    if to_dim != head_dim:
        raise ValueError(f"heads of {head_dim} cannot widen into heads of {to_dim} (give the source's --head-dim)")
    if to_heads < heads or to_kv < kv_heads:
        raise ValueError(f"cannot grow {heads} query / {kv_heads} key-value heads into {to_heads} / {to_kv}")
    if heads * to_kv != to_heads * kv_heads:
        raise ValueError(f"{heads} query heads per {kv_heads} key-value heads cannot widen into {to_heads} per "
                         f"{to_kv}: a source query head would read another head's keys")
    widened = dict(source)
    for layer in range(layer_count(source)):
        prefix = f"model.layers.{layer}.attention."
        qkv, fresh = source[prefix + "query_key_value.weight"], target[prefix + "query_key_value.weight"]
        old = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        new = fresh.split([to_heads * head_dim, to_kv * head_dim, to_kv * head_dim])
        widened[prefix + "query_key_value.weight"] = torch.cat(
            [torch.cat([o, n[o.shape[0]:].to(o.dtype)]) for o, n in zip(old, new)])
        dense = source[prefix + "dense.weight"]
        widened[prefix + "dense.weight"] = torch.cat(
            [dense, dense.new_zeros(dense.shape[0], (to_heads - heads) * head_dim)], dim=1)
    return widened


Reshape = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def reshape_for_growth(depth: bool, heads: bool) -> Reshape | None:
    """The source-to-target weight mapping of `train --init-from` with --grow-depth
    and/or --grow-heads (None: the shapes must agree as they are).  Heads widen first,
    on the source's own layers; the deeper stack's new layers keep their initialisation
    at the target's width."""
    if not heads:
        return grown_state_dict if depth else None

    def reshape(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if depth:
            layer_placement(layer_count(source), layer_count(target))  # refuses a shallower target
            return grown_state_dict(widened_heads(source, target), target)
        if layer_count(source) != layer_count(target):
            raise ValueError(f"{layer_count(source)} layers against {layer_count(target)} (add --grow-depth)")
        return widened_heads(source, target)

    return reshape
