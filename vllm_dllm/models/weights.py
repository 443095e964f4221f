"""Checkpoint names -> canonical parameter names, and loading through vLLM's loaders."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from vllm.model_executor.model_loader.weight_utils import default_weight_loader


@dataclass(frozen=True)
class NameRule:
    pattern: re.Pattern
    target: str  # may use \1 for the layer index
    shard: str | int | None = None  # shard id of a stacked (fused) parameter


def rules(*entries: tuple) -> list[NameRule]:
    return [NameRule(re.compile(p), t, *rest) for p, t, *rest in entries]


def map_name(name: str, name_rules: list[NameRule]) -> tuple[str, str | int | None] | None:
    for rule in name_rules:
        match = rule.pattern.fullmatch(name)
        if match:
            return match.expand(rule.target), rule.shard
    return None


def load_mapped(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    name_rules: list[NameRule],
    prefix: str = "",
) -> set[str]:
    """Load checkpoint tensors into `module`; unknown names are an error."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        mapped = map_name(ckpt_name, name_rules)
        if mapped is None:
            raise ValueError(f"unexpected tensor '{ckpt_name}' in checkpoint")
        target, shard = mapped
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
        loaded.add(prefix + target)
    return loaded


def layer(pattern: str) -> str:
    return pattern.replace("{i}", r"(\d+)")
