"""Each model kind's decoding rule, by name: the engine asks for a kind's rule here."""

from __future__ import annotations

from vllm_dllm.decoding.base import BatchedRule, DecodeState
from vllm_dllm.decoding.dream import DreamRule
from vllm_dllm.decoding.llada import LLaDARule
from vllm_dllm.decoding.llada2 import LLaDA2Rule
from vllm_dllm.options import DREAM, LLADA, LLADA2

RULES: dict[str, type[BatchedRule]] = {LLADA: LLaDARule, DREAM: DreamRule, LLADA2: LLaDA2Rule}


def make_rule(kind: str, state: DecodeState) -> BatchedRule:
    try:
        cls = RULES[kind]
    except KeyError:
        raise ValueError(f"no decoding rule for model kind '{kind}'") from None
    return cls(state)
