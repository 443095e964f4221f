"""lab/probes/llada2_attention_probe.py: the attention it reads is the model's, it finds
the queried pair, and a matching head scores 1 where a uniform one scores chance."""

from __future__ import annotations

import importlib
import random

import torch

from lab.tasks import TEST, Retrieval
from lab.training.batches import Llada2Encoder
from lab.training import llada2



def _probe():
    return importlib.import_module("lab.probes.llada2_attention_probe")


def test_attention_weights_are_what_the_forward_attends_with():
    torch.manual_seed(0)
    attention = llada2.Attention(hidden=32, heads=4, kv_heads=2, theta=10000.0)
    x = torch.randn(2, 12, 32)
    positions = torch.arange(12)[None].expand(2, 12)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 9:] = False
    mask = llada2.block_causal_mask(positions // 4, valid)
    _, _, v = attention.project(x, positions)
    by_weights = attention.dense((attention.weights(x, positions, mask) @ v).transpose(1, 2).reshape(2, 12, -1))
    assert torch.allclose(by_weights, attention(x, positions, mask), atol=1e-5)


def test_layout_finds_the_queried_pair(tmp_path):
    probe = _probe()
    ids = llada2.build_llada2_tokenizer(tmp_path, 512)
    encoder = Llada2Encoder(tmp_path, ids)
    rng = random.Random(1)
    for pairs in (2, 5, 9):
        instance = Retrieval(pairs, pairs).sample(rng, TEST)
        case = probe.layout(encoder, instance.prompt, 32)
        pieces = [encoder.tok.decode([t]) for t in case["ids"]]
        assert len(case["keys"]) == pairs and len(case["ids"]) % 32 == 0
        queried = instance.prompt.rsplit(";", 1)[1]
        assert pieces[case["query"]] == pieces[case["keys"][case["match"]]] == f";{queried}"
        assert "".join(pieces[case["keys"][case["match"]] + 1: case["keys"][case["match"]] + 3]) == instance.answer
        assert pieces[case["answer"]:] == [encoder.tok.decode([ids["mask"]])] * (len(pieces) - case["answer"])


def test_a_matching_head_scores_one_and_a_uniform_head_chance():
    probe = _probe()
    keys, match, query = [2, 5, 8, 11], 2, 14
    weights = torch.zeros(2, 16, 16)
    weights[0, query, keys[match]] = 0.5  # head 0 attends to the queried key ...
    weights[0, query, keys[match] + 1: keys[match] + 3] = 0.25  # ... and its value
    weights[1, query, :query] = 1 / query  # head 1: uniform over what precedes it
    shares = probe.shares(weights, {"query": query}, keys, match)
    assert shares["query->key"].tolist() == [1.0, 0.25]
    assert torch.allclose(shares["query->value"], torch.tensor([1.0, 0.25]))
