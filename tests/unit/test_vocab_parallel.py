"""The vocabulary-parallel LM head (decoding/vocab.py): each tensor-parallel rank
reduces its own vocabulary columns and only a few numbers per row cross ranks.

Ranks are threads here (tests/vocab_shards.py), over uneven shards of a prime
vocabulary.  Every rule of every model family, the logprobs and the filters must
give the tokens one device gives; confidences and logprobs agree to float rounding
(the shards sum in another order: relative 1e-5, absolute 1e-6 for probabilities
near 0).  A near-tie is a case whose whole-vocabulary tokens change when the logits
move by one part in 10^5: such cases may flip under any summation order, so they are
drawn again, and they must stay rare.  The engine on two real ranks is
tests/engine/test_tensor_parallel.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.decoding_harness import _one_thread  # noqa: F401 (an autouse fixture: a thread per simulated rank)
from tests.vocab_shards import Exchange, run_sharded
from vllm_dllm.decoding.base import DecodeState, SpecialIds
from vllm_dllm.decoding.rules import make_rule
from vllm_dllm.decoding.dream import filter_top_p_top_k
from vllm_dllm.decoding.grammar_mask import mask_rows
from vllm_dllm.decoding.llada2 import filter_top_k_top_p
from vllm_dllm.decoding.logprobs import candidate_logprobs
from vllm_dllm.decoding.vocab import WHOLE, VocabShard
from vllm_dllm.options import DREAM, LLADA, LLADA2, resolve
from vllm_dllm.serving.server_defaults import ServerDefaults

V = 61  # prime: shards of 31/30 (two ranks) and 21/21/19 (three)
IDS = SpecialIds(mask=V - 1, eos=2, eot=7)
CPU = torch.device("cpu")
# The rules' sharded reductions also run on CUDA where there is one (benchmarks/gpu_session.sh check).
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
RTOL, ATOL = 1e-5, 1e-6


def options(kind, temperature=0.0, top_p=1.0, top_k=0, **extra):
    defaults = ServerDefaults.build(kind, {}, {})
    extra = {"steps": 16, "block_length": 8, **extra} if kind == LLADA else extra
    if kind == LLADA2:
        extra = {"block_length": 8, "steps": 8, **extra}
    return resolve(defaults, max_tokens=16, temperature=temperature, top_p=top_p, top_k=top_k, extra_args=extra)


# (name, kind, options of the batch's requests): every vocabulary-wide operation of
# every rule is reached by some case.
CASES = [
    ("llada greedy", LLADA, [dict()]),
    ("llada sampled, eos/eot edits", LLADA, [dict(temperature=0.8, logits_eos_inf=True,
                                                  confidence_eos_eot_inf=True)]),
    ("llada random remasking beside greedy", LLADA, [dict(remasking="random"), dict()]),
    ("llada entropy_bound and credit", LLADA, [dict(decoding="entropy_bound", gamma=0.5),
                                               dict(decoding="credit", temperature=0.5)]),
    ("dream greedy maskgit_plus", DREAM, [dict()]),
    ("dream sampled top-p then top-k, entropy", DREAM, [dict(temperature=0.9, top_p=0.8, top_k=12, alg="entropy")]),
    ("dream top-k margin beside top-p", DREAM, [dict(temperature=0.7, top_k=3, alg="topk_margin"),
                                                dict(temperature=1.2, top_p=0.6)]),
    ("llada2 greedy", LLADA2, [dict()]),
    ("llada2 sampled top-k then top-p", LLADA2, [dict(temperature=0.8, top_k=9, top_p=0.85)]),
    ("llada2 editing, entropy_bound, credit", LLADA2, [dict(mode="quality", temperature=0.6),
                                                       dict(decoding="entropy_bound", gamma=0.4),
                                                       dict(decoding="credit", top_p=0.9, temperature=1.0)]),
]


class Batch:
    """A rule with requests admitted, as one rank (or one device) holds it."""

    def __init__(self, kind, requests, vocab, device=CPU):
        self.state = DecodeState(len(requests), 32, IDS, torch.device(device), vocab)
        self.rule = make_rule(kind, self.state)
        for slot, (opts, seed) in enumerate(requests):
            self.state.admit(slot, opts, seed)
            self.rule.admit(slot, opts)

    def reduce(self, logits, slots, positions):
        self.rule.prepare(np.arange(self.state.capacity))
        return self.rule.reduce(logits, slots, positions)


def draw_case(kind, specs, rng: random.Random):
    requests = [(options(kind, **spec), rng.randrange(1 << 62)) for spec in specs]
    rows = rng.randrange(3, 12)
    slots = torch.tensor([rng.randrange(len(requests)) for _ in range(rows)])
    positions = torch.tensor([rng.randrange(8) for _ in range(rows)])
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    logits = torch.randn(rows, V, generator=gen) * rng.choice([1.0, 3.0, 6.0])
    return requests, slots, positions, logits


def whole_reduce(kind, requests, slots, positions, logits):
    return Batch(kind, requests, WHOLE, logits.device).reduce(logits.clone(), slots, positions)


def near_tie(kind, requests, slots, positions, logits) -> bool:
    tokens = whole_reduce(kind, requests, slots, positions, logits)[0]
    for scale in (1 + 1e-5, 1 - 1e-5):
        if not torch.equal(whole_reduce(kind, requests, slots, positions, logits * scale)[0], tokens):
            return True
    return False


def sharded_reduce(kind, requests, slots, positions, logits, world, exchange=None):
    def rank(vocab, start, end):
        return Batch(kind, requests, vocab, logits.device).reduce(logits[:, start:end].clone(), slots, positions)

    return run_sharded(rank, V, world, exchange)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name,kind,specs", CASES, ids=[c[0] for c in CASES])
def test_every_rule_reduces_sharded_as_on_one_device(name, kind, specs, world, device):
    rng = random.Random(f"{name}/{world}")
    tie_free, ties = 0, 0
    while tie_free < 12:
        requests, slots, positions, logits = (t.to(device) if isinstance(t, torch.Tensor) else t
                                              for t in draw_case(kind, specs, rng))
        if near_tie(kind, requests, slots, positions, logits):
            ties += 1
            assert ties <= 4, f"{name}: near-ties are not rare ({ties} against {tie_free} tie-free cases)"
            continue
        tokens, confidence = whole_reduce(kind, requests, slots, positions, logits)
        for rank_tokens, rank_confidence in sharded_reduce(kind, requests, slots, positions, logits, world):
            assert torch.equal(rank_tokens, tokens), name
            torch.testing.assert_close(rank_confidence, confidence, rtol=RTOL, atol=ATOL)
        tie_free += 1


def test_credit_state_is_the_same_on_every_rank():
    """Credit rules keep per-position state between steps: each rank must hold the
    same, or their next steps part."""
    rng = random.Random(5)
    requests, slots, positions, logits = draw_case(LLADA, [dict(decoding="credit")], rng)
    positions = torch.arange(len(slots)) % 8
    slots = torch.zeros_like(slots)
    positions = torch.unique(positions)
    slots, logits = slots[: len(positions)], logits[: len(positions)]
    whole = Batch(LLADA, requests, WHOLE)
    whole.reduce(logits.clone(), slots, positions)

    def rank(vocab, start, end):
        batch = Batch(LLADA, requests, vocab)
        batch.reduce(logits[:, start:end].clone(), slots, positions)
        return batch.rule.parallel.credit_tokens.clone(), batch.rule.parallel.credit_values.clone()

    for tokens, values in run_sharded(rank, V, 2):
        assert torch.equal(tokens, whole.rule.parallel.credit_tokens)
        torch.testing.assert_close(values, whole.rule.parallel.credit_values, rtol=RTOL, atol=ATOL)


def test_filters_cut_where_one_device_cuts():
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for trial in range(40):
        x = torch.randn(8, V, generator=gen, dtype=torch.float64) * (1 + trial % 4)
        top_p = torch.rand(8, generator=gen) * 0.9 + 0.05
        top_k = torch.randint(0, 20, (8,), generator=gen)
        # A near-tie: a cumulative mass within 1e-9 of top_p (the shards sum it in
        # another order).
        cumulative = torch.softmax(x, dim=-1).sort(descending=True).values.cumsum(dim=-1)
        if ((cumulative - top_p[:, None].double()).abs() < 1e-9).any():
            continue
        for fn in (filter_top_p_top_k, filter_top_k_top_p):
            want = fn(x, top_p, top_k) if fn is filter_top_p_top_k else fn(x, top_k, top_p)
            k_max = int(top_k.max())

            def rank(vocab, start, end, fn=fn):
                local = x[:, start:end]
                if fn is filter_top_p_top_k:
                    return fn(local, top_p, top_k, vocab, k_max)
                return fn(local, top_k, top_p, vocab, k_max)

            got = torch.cat(run_sharded(rank, V, 3), dim=1)
            assert torch.equal(got, want), fn.__name__
        checked += 1
    assert checked >= 35


def test_logprobs_and_grammar_masks_on_shards():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(9, V, generator=gen) * 4
    tokens = torch.randint(0, V, (9,), generator=gen)
    bitmask = torch.randint(-(1 << 31), 1 << 31, (3, 2), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([0, 1, 2, -1, 0, 1, 2, -1, 0])
    masked = mask_rows(logits, bitmask, rows)
    want = candidate_logprobs(masked, tokens, 5)

    def rank(vocab, start, end):
        local = mask_rows(logits[:, start:end], bitmask, rows, vocab.columns(logits[:, start:end]))
        return local, candidate_logprobs(local, tokens, 5, vocab)

    results = run_sharded(rank, V, 2)
    assert torch.equal(torch.cat([local for local, _ in results], dim=1), masked)
    for _, got in results:
        assert torch.equal(got.ids, want.ids) and torch.equal(got.rank, want.rank)
        torch.testing.assert_close(got.values, want.values, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name,kind,specs", CASES, ids=[c[0] for c in CASES])
def test_cross_rank_traffic_grows_with_rows_not_vocabulary(name, kind, specs, monkeypatch):
    """What one LM-head chunk sends across ranks: the same for a vocabulary of 61 and
    of 4,099, and at most a few hundred numbers per row (the top-p search's rounds
    included), where gathering the logits would send rows x vocabulary."""
    rng = random.Random(name)
    requests, slots, positions, logits = draw_case(kind, specs, rng)
    sent = []
    for vocab in (61, 4099):
        monkeypatch.setattr(f"{__name__}.V", vocab)
        wide = torch.randn(len(slots), vocab, generator=torch.Generator().manual_seed(1)) * 3
        exchange = Exchange(2)
        sharded_reduce(kind, requests, slots, positions, wide, 2, exchange)
        sent.append(exchange.elements)
    assert sent[0] == sent[1], f"{name}: traffic depends on the vocabulary size"
    assert sent[0] <= 600 * len(slots), f"{name}: {sent[0] / len(slots):.0f} numbers per row"


def test_a_shard_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"shard \[30, 70\) does not lie in a vocabulary of 61"):
        VocabShard(30, 70, 61, 1, lambda t: t[None])


@pytest.mark.parametrize("kind,spec", [(DREAM, dict(temperature=0.01)), (LLADA, dict(temperature=0.01)),
                                       (LLADA2, dict(temperature=0.01, top_k=5))])
def test_a_shard_without_a_finite_logit_weighs_nothing(kind, spec):
    """A grammar (or top-k) that leaves one rank's columns all at -inf, at a low
    temperature that puts the other ranks' logits far below 0 (-800): the softmax is
    the one device's, not -inf over -inf."""
    requests = [(options(kind, **spec), 123)]
    logits = torch.full((2, V), float("-inf"))
    logits[:, 3:6] = torch.tensor([-8.0, -9.0, -8.5])  # all on rank 0 of two
    slots, positions = torch.tensor([0, 0]), torch.tensor([0, 1])
    tokens, confidence = whole_reduce(kind, requests, slots, positions, logits)
    assert tokens.tolist() == [3, 3] and torch.isfinite(confidence).all()
    for rank_tokens, rank_confidence in sharded_reduce(kind, requests, slots, positions, logits, 2):
        assert torch.equal(rank_tokens, tokens)
        torch.testing.assert_close(rank_confidence, confidence, rtol=RTOL, atol=ATOL)


def test_top_k_wider_than_a_shard_returns_real_tokens_only():
    """Top logprobs wider than a rank's columns, in a row mostly at -inf: every id
    returned is a real token, as on one device."""
    logits = torch.full((1, V), float("-inf"))
    logits[0, [0, 4, 7]] = torch.tensor([2.0, 1.0, 0.5])
    k = 25  # three ranks hold 21, 21 and 19 columns
    want_values = WHOLE.topk(logits, k)[0]
    for values, ids in run_sharded(lambda vocab, start, end: vocab.topk(logits[:, start:end], k), V, 3):
        assert torch.equal(values, want_values)
        assert ids[0, :3].tolist() == [0, 4, 7] and (ids >= 0).all() and len(set(ids[0].tolist())) == k



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_whole_vocabulary_argmax_is_torchs_first_maximum(device, dtype):
    # The whole-vocabulary argmax takes max(dim)'s indices on the CPU (faster there):
    # they must be torch.argmax's on ties, NaN, +-inf and strided rows.
    gen = torch.Generator().manual_seed(5)
    for case in range(60):
        rows, columns = int(torch.randint(1, 24, (1,), generator=gen)), int(torch.randint(1, 700, (1,), generator=gen))
        x = torch.randint(-2, 3, (rows, columns), generator=gen).to(dtype)  # many ties
        special = torch.rand(rows, columns, generator=gen)
        x[special < 0.02 * (case % 3)] = float("nan")
        x[special > 1 - 0.2 * (case % 2)] = float("-inf")
        x[(special > 0.5) & (special < 0.505) & (case % 4 == 0)] = float("inf")
        if case % 10 == 0:
            x[:] = float("-inf")
        x = x.to(device)
        for view in (x, x.t().contiguous().t()):
            assert torch.equal(WHOLE.argmax(view), view.argmax(dim=-1)), case
    # LLaDA-8B's vocabulary on two threads: the vectorised, parallel reduction paths.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        wide = torch.randint(-3, 4, (16, 126_464), generator=gen).to(dtype).to(device)
        wide[3, 100_000:] = float("nan")
        wide[5] = wide[5].max()
        assert torch.equal(WHOLE.argmax(wide), wide.argmax(dim=-1))
    finally:
        torch.set_num_threads(threads)
