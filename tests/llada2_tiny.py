"""A tiny LLaDA2-format model and rows for the training tests: the shape the trainer's
CLI is given (SIZES) and the same shape built directly (SHAPE, MOE)."""

from __future__ import annotations

import random

import torch

from lab.training import llada2, llada2_objective

MOE = dict(num_experts=8, experts_per_token=2, n_group=4, topk_group=2, moe_intermediate=32, shared_experts=1,
           dense_layers=1)
SHAPE = dict(hidden=64, layers=3, heads=4, kv_heads=2, intermediate=96, rope_theta=10000.0)
SIZES = ["--hidden", "64", "--layers", "3", "--heads", "4", "--kv-heads", "2", "--intermediate", "96",
         "--experts", "8", "--experts-per-token", "2", "--expert-groups", "4", "--topk-groups", "2",
         "--moe-intermediate", "32", "--rope-theta", "10000", "--block-length", "8", "--threads", "1"]
VOCAB = 2304


def tiny_model(seed: int = 0) -> llada2.TrainableLLaDA2:
    torch.manual_seed(seed)
    model = llada2.TrainableLLaDA2(VOCAB, **{k: SHAPE[k] for k in ("hidden", "layers", "heads", "kv_heads",
                                                                   "intermediate")},
                                   theta=SHAPE["rope_theta"], moe=MOE)
    for moe in model.moe_layers():
        moe.gate.expert_bias.normal_(0, 0.1)  # selection differs from the scores' own order
    return model.eval()


def canvas_rows(rng: random.Random, n: int, block: int):
    """`n` random prompts and their canvases, each canvas padded so the row ends on a
    block boundary (pad id 7)."""
    prompts = [[rng.randrange(2000) for _ in range(rng.randint(3, 20))] for _ in range(n)]
    canvases = [llada2_objective.extend_to_block([rng.randrange(2000) for _ in range(rng.randint(1, 12))], len(p),
                                                 block, 7)
                for p in prompts]
    return prompts, canvases


def prefix_lengths(rng: random.Random, canvases: list[list[int]]) -> torch.Tensor:
    """A leading span per row (a working, or a given working): every other row of more
    than one position gets 1..len-1 of its canvas, the rest none."""
    return torch.tensor([rng.randint(1, len(c) - 1) if i % 2 == 0 and len(c) > 1 else 0
                         for i, c in enumerate(canvases)])


class CharTokens:
    """A tokenizer of one token per character, for rows whose token counts are read off."""

    def encode(self, text, add_special_tokens=False):
        return list(text)


class CharEncoder:
    tok = CharTokens()

    def canvas(self, answer, length):
        return list(answer) + ["<eos>"] * (length - len(answer))
