"""Dream's batched rule on designed logits: schedule truncation, confidence algs,
origin flips, top-p/top-k, sampling and alg_temp (helpers: decoding_harness.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.decoding_harness import (
    LOWEST32,
    NEG_INF,
    TableModel,
    V,
    _one_thread,  # noqa: F401  (autouse: one intra-op thread)
    admit,
    commit_values,
    draws,
    dream_opts,
    expected_top,
    inverse_cdf_token,
    logits_table,
    plan_for,
    reduce_rows,
    run_step,
    single,
)
from vllm_dllm.decoding import sampling
from vllm_dllm.decoding.dream import filter_top_p_top_k, unmask_fractions
from vllm_dllm.options import DreamOptions

# ---------------------------------------------------------------------------
# Dream
# ---------------------------------------------------------------------------


def spec_dream_count(num_masked: int, step: int, opts: DreamOptions) -> int:
    ts = torch.linspace(1, opts.eps, opts.steps + 1)
    if step == opts.steps - 1:
        return num_masked
    n = torch.tensor([num_masked]).sum() / 1  # int64 tensor / int -> float32, as the reference
    return int(n * (1 - ts[step + 1] / ts[step]))


def test_unmask_fractions_are_the_reference_float32_schedule():
    for steps, eps in ((16, 1e-3), (5, 0.25), (1, 1e-3)):
        ts = torch.linspace(1, eps, steps + 1)
        expected = [float(1 - ts[i + 1] / ts[i]) for i in range(steps)]
        got = unmask_fractions(steps, eps)
        assert got.dtype == torch.float32 and got.tolist() == expected


@pytest.mark.parametrize(
    "gen, alg",
    [(16, "maskgit_plus"), (256, "maskgit_plus"), (512, "maskgit_plus"),
     (16, "topk_margin"), (16, "entropy"), (64, "entropy")],
)
def test_dream_steps_equal_gen_truncation(gen, alg):
    opts = dream_opts(gen=gen, alg=alg)
    batch = single(opts)
    table = logits_table(gen, seed=gen)
    model = TableModel({0: table})
    committed = []
    for step in range(opts.steps):
        before = int(batch.masked(0).sum())
        if gen <= 64:
            rec = run_step(batch, batch.slots, model)
            assert len(rec.positions) == before  # a confidence alg needs every masked position
            n = len(rec.newly())
            assert rec.plan.count.tolist() == [n]
        else:  # the count does not depend on the confidences: skip the softmaxes
            plan = plan_for(batch)
            assert int(plan.candidates.sum()) == before
            commit_values(batch, plan, table.argmax(-1), table.max(-1).values)
            n = before - int(batch.masked(0).sum())
        assert n == spec_dream_count(before, step, opts), step
        committed.append(n)
    assert committed[0] == 0  # int() truncation: (1 - eps) < 1
    assert committed[-1] == 2  # MODEL_SPEC.md: 2 on the last step for these lengths
    assert sum(committed) == gen
    assert not batch.masked(0).any()
    assert batch.state.num_final(batch.slots, gen).tolist() == [gen]


def test_dream_confidence_alg_commits_most_confident():
    gen = 8
    table = logits_table(gen, seed=1)
    probs = torch.softmax(table, -1)
    for alg in ("maskgit_plus", "topk_margin", "entropy"):
        opts = dream_opts(gen=gen, steps=2, alg=alg)  # step 0 commits int(8*(1-s/t)) = 3
        batch = single(opts)
        rec = run_step(batch, batch.slots, TableModel({0: table}))
        assert rec.tokens.tolist() == table.argmax(-1).tolist()
        if alg == "maskgit_plus":
            expected = probs.max(-1).values
        elif alg == "topk_margin":
            top2 = probs.topk(2, -1).values
            expected = top2[:, 0] - top2[:, 1]
        else:
            expected = (probs * torch.log(probs + 1e-10)).sum(-1)
        assert torch.allclose(rec.conf, expected, rtol=1e-6, atol=1e-7)
        n = spec_dream_count(gen, 0, opts)
        assert n == 3 and rec.plan.count.tolist() == [3]
        assert rec.newly() == expected_top(expected, list(range(gen)), n)
        assert rec.newly() == sorted(torch.topk(expected, n).indices.tolist())
        run_step(batch, batch.slots, TableModel({0: table}))
        assert batch.canvas(0) == table.argmax(-1).tolist()


@pytest.mark.parametrize("gen, steps, eps", [(16, 16, 1e-3), (16, 4, 1e-3), (7, 3, 1e-3), (32, 1, 1e-3),
                                             (16, 2, 0.5)])  # last fraction 1/3: flips alone would not fill
def test_dream_origin_t0_fills_all_by_last_step(gen, steps, eps):
    for seed in range(3):
        batch = single(dream_opts(gen=gen, steps=steps, alg="origin", eps=eps), seed=seed)
        table = logits_table(gen, seed=seed)
        for step in range(steps):
            masked = batch.masked(0).nonzero().flatten().tolist()
            rec = run_step(batch, batch.slots, TableModel({0: table}))
            rows = rec.positions.tolist()
            assert set(rows) <= set(masked)
            if step == steps - 1:
                assert rows == masked
            # origin writes exactly the flipped positions, with their argmax at T=0.
            assert rec.newly() == rows
            assert rec.after[0, rows].tolist() == table[rows].argmax(-1).tolist()
        assert batch.canvas(0) == table.argmax(-1).tolist()


def test_dream_origin_flips_follow_contract():
    gen, steps, seed = 40, 4, 21
    ts = torch.linspace(1, 1e-3, steps + 1)
    batch = single(dream_opts(gen=gen, steps=steps, alg="origin"), seed=seed)
    table = logits_table(gen, seed=2)
    for step in range(2):
        masked = batch.masked(0)
        p = 1 - ts[step + 1] / ts[step]  # float32, as the reference
        u = draws(seed, step, range(gen), sampling.FLIP, torch.float32)[:, 0]
        expected = [pos for pos in range(gen) if masked[pos] and u[pos] < p]
        rec = run_step(batch, batch.slots, TableModel({0: table}))
        assert rec.positions.tolist() == expected
        assert rec.plan.count.tolist() == [len(expected)]
        assert 0 < len(expected) < int(masked.sum())  # p ~ 0.25, 0.33: not a vacuous draw


def test_filter_top_p_known_logits():
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0]])  # probs sorted ~ .644 .237 .087 .032
    lo = LOWEST32

    def top_p(x, p):
        return filter_top_p_top_k(x, torch.full((len(x),), p), torch.zeros(len(x), dtype=torch.long))

    assert top_p(logits, 0.5).tolist() == [[lo, 3.0, lo, lo]]  # keeps at least the top token
    assert top_p(logits, 1e-9).tolist() == [[lo, 3.0, lo, lo]]
    assert top_p(logits, 0.7).tolist() == [[lo, 3.0, lo, 2.0]]
    assert top_p(logits, 0.9).tolist() == [[1.0, 3.0, lo, 2.0]]
    assert top_p(logits, 0.999).tolist() == logits.tolist()
    assert top_p(logits, 1.0).tolist() == logits.tolist()  # 1: off
    # Rows are independent, with their own top_p.
    two = torch.tensor([[1.0, 3.0, 0.0, 2.0], [10.0, 0.0, 0.0, 0.0]])
    assert top_p(two, 0.7).tolist() == [[lo, 3.0, lo, 2.0], [10.0, lo, lo, lo]]
    out = filter_top_p_top_k(two, torch.tensor([0.7, 1.0]), torch.zeros(2, dtype=torch.long))
    assert out.tolist() == [[lo, 3.0, lo, 2.0], two[1].tolist()]  # one filtered, one not
    out = filter_top_p_top_k(two, torch.tensor([1.0, 0.7]), torch.zeros(2, dtype=torch.long))
    assert out.tolist() == [two[0].tolist(), [10.0, lo, lo, lo]]


def test_filter_top_k_known_logits():
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0], [5.0, 4.0, 3.0, 6.0]])
    lo = LOWEST32

    def top_k(x, k):
        return filter_top_p_top_k(x, torch.ones(len(x)), torch.full((len(x),), k))

    assert top_k(logits, 1).tolist() == [[lo, 3.0, lo, lo], [lo, lo, lo, 6.0]]
    assert top_k(logits, 2).tolist() == [[lo, 3.0, lo, 2.0], [5.0, lo, lo, 6.0]]
    assert top_k(logits, 4).tolist() == logits.tolist()
    assert top_k(logits, 100).tolist() == logits.tolist()  # k clipped to vocab
    assert top_k(logits, 0).tolist() == logits.tolist()  # 0: off
    # Per-row k in one batch: one row filtered, one not.
    out = filter_top_p_top_k(logits, torch.ones(2), torch.tensor([1, 0]))
    assert out.tolist() == [[lo, 3.0, lo, lo], logits[1].tolist()]
    out = filter_top_p_top_k(logits, torch.ones(2), torch.tensor([0, 2]))
    assert out.tolist() == [logits[0].tolist(), [5.0, lo, lo, 6.0]]
    # Ties at the k-th value are all kept (the reference removes only `< kth`).
    tied = torch.tensor([[2.0, 1.0, 2.0, 2.0]])
    assert top_k(tied, 1).tolist() == [[2.0, lo, 2.0, 2.0]]
    # k kept on random rows.
    x = torch.randn(20, 50, generator=torch.Generator().manual_seed(0))
    for k in (1, 3, 17):
        assert ((top_k(x, k) > lo).sum(-1) == k).all()


def test_filter_top_p_then_top_k_per_row():
    # top_p 0.9 keeps {3, 2, 1}; top_k 2 then keeps {3, 2}.  Row 2: top_k only.
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0], [1.0, 3.0, 0.0, 2.0], [1.0, 3.0, 0.0, 2.0]])
    lo = LOWEST32
    out = filter_top_p_top_k(logits, torch.tensor([0.9, 0.9, 1.0]), torch.tensor([2, 0, 3]))
    assert out.tolist() == [[lo, 3.0, lo, 2.0], [1.0, 3.0, lo, 2.0], [1.0, 3.0, lo, 2.0]]


def test_dream_top_k_renormalises_confidence_at_t0():
    row = torch.tensor([[4.0, 3.0, 1.0] + [0.0] * (V - 3)])
    batch = single(dream_opts(gen=1, top_k=2))
    tokens, conf = reduce_rows(batch, row, [0])
    assert int(tokens) == 0
    assert conf.item() == pytest.approx(math.exp(4) / (math.exp(4) + math.exp(3)), rel=1e-6)
    batch = single(dream_opts(gen=1, top_p=0.5))
    tokens, conf = reduce_rows(batch, row, [0])
    assert int(tokens) == 0 and conf.item() == pytest.approx(1.0)
    batch = single(dream_opts(gen=1))
    _, conf = reduce_rows(batch, row, [0])
    assert conf.item() == pytest.approx(float(torch.softmax(row[0], -1)[0]), rel=1e-6)
    # Unfiltered and filtered requests in one batch keep their own confidences.
    batch = admit([(dream_opts(gen=1), 0), (dream_opts(gen=1, top_k=2), 0)])
    batch.rule.prepare(batch.slots)
    _, conf = batch.rule.reduce(torch.cat([row, row]), batch.slots, torch.tensor([0, 0]))
    assert conf[0].item() == pytest.approx(float(torch.softmax(row[0], -1)[0]), rel=1e-6)
    assert conf[1].item() == pytest.approx(math.exp(4) / (math.exp(4) + math.exp(3)), rel=1e-6)


def test_dream_sampling_t_positive_follows_contract_and_is_chunk_invariant():
    gen, seed, T, top_p = 12, 4, 0.8, 0.95
    table = logits_table(gen, seed=2, scale=1.0)
    model = TableModel({0: table})
    records = []
    for max_rows in (1, 5, 1024):
        batch = single(dream_opts(gen=gen, T=T, top_p=top_p), seed=seed)
        records.append(run_step(batch, batch.slots, model, max_rows=max_rows))
    rec = records[0]
    u = draws(seed, 0, range(gen), sampling.SAMPLE, torch.float64)[:, 0]
    probs = torch.softmax(
        filter_top_p_top_k(table / T, torch.full((gen,), top_p), torch.zeros(gen, dtype=torch.long)), -1)
    for pos in range(gen):
        token = inverse_cdf_token(probs[pos], float(u[pos]))
        assert int(rec.tokens[pos]) == token
        assert rec.conf[pos].item() == pytest.approx(float(probs[pos, token]), rel=1e-6)
    assert rec.tokens.tolist() != table.argmax(-1).tolist()  # sampling did happen
    for other in records[1:]:
        assert torch.equal(other.tokens, rec.tokens) and torch.equal(other.conf, rec.conf)
        assert torch.equal(other.after, rec.after)
    batch = single(dream_opts(gen=gen, T=T, top_p=top_p), seed=seed)
    t, c = reduce_rows(batch, table[[7, 0]], [7, 0])
    assert t.tolist() == rec.tokens[[7, 0]].tolist() and torch.equal(c, rec.conf[[7, 0]])
    # top_k=1 at T > 0: the sample is the argmax.
    batch = single(dream_opts(gen=gen, T=1.5, top_k=1), seed=seed)
    t, c = reduce_rows(batch, table, range(gen))
    assert t.tolist() == table.argmax(-1).tolist() and torch.equal(c, torch.ones(gen))


def test_dream_alg_temp_selection_is_gumbel_top_k():
    """alg_temp picks `count` positions by the largest confidence / alg_temp + G,
    G = -log(-log u), u the float64 SELECT draw of (seed, step, canvas position)."""
    gen, steps, seed, alg_temp = 20, 4, 3, 0.5
    table = logits_table(gen, seed=8)
    opts = dream_opts(gen=gen, steps=steps, alg="entropy", alg_temp=alg_temp)
    runs, noise_mattered = [], False
    for _ in range(2):
        batch = single(opts, seed=seed)
        hist = []
        for step in range(steps):
            before = int(batch.masked(0).sum())
            rec = run_step(batch, batch.slots, TableModel({0: table}))
            n = spec_dream_count(before, step, opts)
            assert len(rec.newly()) == n == int(rec.plan.count[0])
            u = draws(seed, step, range(gen), sampling.SELECT, torch.float64)[:, 0]
            conf = torch.full((gen,), NEG_INF)
            conf[rec.positions] = rec.conf
            keys = (conf / alg_temp).double() - torch.log(-torch.log(u))
            assert rec.newly() == expected_top(keys, rec.positions.tolist(), n)
            noise_mattered |= rec.newly() != expected_top(conf, rec.positions.tolist(), n)
            hist.append(rec.after.clone())
        assert not batch.masked(0).any()
        runs.append(hist)
    assert noise_mattered  # plain confidence ranking would have picked otherwise
    assert all(torch.equal(a, b) for a, b in zip(*runs))  # deterministic given the seed
    other = single(opts, seed=seed + 1)
    run_step(other, other.slots, TableModel({0: table}))
    rec = run_step(other, other.slots, TableModel({0: table}))
    assert not torch.equal(rec.after, runs[0][1])  # the seed matters
