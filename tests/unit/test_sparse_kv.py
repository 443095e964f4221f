"""Head-centric sparse KV cache: the footprint, the options, the selection and packing
against the plain reference (tests/sparse_reference.py), and whole generations
through the vLLM-free engine (retention 1 keeps everything: the dual cache's tokens).
The plugin == oracle cases through vLLM are in test_exact_decoding.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests import oracle, oracle_model, sparse_reference
from tests.unit.test_step_engine import BLOCK_SIZE, IDS, SHAPE, add_requests, llada, make_engine
from vllm_dllm.attention import sparse
from vllm_dllm.attention.backends import TorchAttention
from vllm_dllm.engine.engine import StepEngine
from vllm_dllm.engine.step_inputs import SequenceLayout, FillLayout, build_step_inputs
from vllm_dllm.engine.torch_model import build_model
from vllm_dllm.kv_footprint import block_span, kept_positions, request_slots, sequence_slots
from vllm_dllm.options import DREAM, LLADA, DreamOptions, LLaDAOptions, OptionError, resolve
from vllm_dllm.serving.server_defaults import ServerDefaults

SCALE = 2 ** -0.5  # the attention scale of the 2-wide heads below


def sparse_llada(gen=32, block=32, retention=0.3, cfg=0.0, **kw) -> LLaDAOptions:
    return dataclasses.replace(llada(gen=gen, steps=gen, block=block, cache="sparse", cfg=cfg, delay=1),
                               retention=retention, **kw)


# ---- footprint ------------------------------------------------------------------

def test_footprint_is_kept_positions_plus_the_block():
    # The example: L = 512, b = 32, r = 0.3 keeps ceil(0.3 x 480) = 144 per head.
    options = sparse_llada(gen=64, block=32, retention=0.3)
    assert block_span(options) == 32
    assert kept_positions(options, prompt_len=448) == 144
    assert sequence_slots(options, prompt_len=448) == 176
    # A pool of 176 x 29 slots admits 29 sparse requests, 9 dual ones (512 each): ~2.9x.
    dual = dataclasses.replace(options, cache="dual")
    assert sequence_slots(dual, 448) == 512 and kept_positions(dual, 448) == 0
    assert (176 * 29) // sequence_slots(options, 448) == 29 and (176 * 29) // 512 == 9
    # Rounding up, and never more than the context: r = 1 keeps all of it.
    assert kept_positions(dataclasses.replace(options, retention=0.1), 1) == 4  # ceil(3.3)
    assert sequence_slots(dataclasses.replace(options, retention=1.0), 448) == 512
    # A CFG twin holds its own copy.
    assert request_slots(sparse_llada(gen=64, block=32, retention=0.3, cfg=1.0), 448) == 352


def test_dream_span_includes_the_position_before_the_block():
    options = DreamOptions(gen_length=24, steps=24, eps=1e-3, alg="maskgit_plus", alg_temp=None, temperature=0.0,
                           top_p=None, top_k=None, block_length=8, cache="sparse", retention=0.5)
    assert block_span(options) == 9
    assert kept_positions(options, prompt_len=10) == 13  # ceil(0.5 x (34 - 9))


# ---- options --------------------------------------------------------------------

def _resolve(kind, extra, max_tokens=32, server=None):
    defaults = ServerDefaults.build(kind, {}, server or {})
    return resolve(defaults, max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, extra_args=extra)


def test_sparse_options_defaults_and_delay():
    options = _resolve(LLADA, {"cache": "sparse", "block_length": 8, "steps": 32})
    assert (options.retention, options.pool_kernel, options.selection, options.scoring, options.delay_step) == (
        0.5, 3, "head", "weight", 1)
    # Unless set, uniform selection pools over 3 positions and scores by the largest logit
    # (Sparse-dLLM's pooling); head-centric scores by attention weight and pools over 3
    # positions from retention 0.4 on, over none below it.
    uniform = _resolve(LLADA, {"cache": "sparse", "selection": "uniform", "block_length": 8})
    assert (uniform.pool_kernel, uniform.scoring) == (3, "max")
    for retention, kernel in ((0.1, 1), (0.39, 1), (0.4, 3), (0.7, 3), (1, 3)):
        head = _resolve(LLADA, {"cache": "sparse", "retention": retention, "block_length": 8})
        assert head.pool_kernel == kernel, retention
        assert _resolve(LLADA, {"cache": "sparse", "retention": retention, "selection": "uniform",
                                "block_length": 8}).pool_kernel == 3
        assert _resolve(LLADA, {"cache": "sparse", "retention": retention, "pool_kernel": 5,
                                "block_length": 8}).pool_kernel == 5
    # A server's retention decides the default as a request's does.
    assert _resolve(LLADA, {"block_length": 8}, server={"cache": "sparse", "retention": 0.3}).pool_kernel == 1
    given = _resolve(LLADA, {"cache": "sparse", "pool_kernel": 3, "scoring": "max", "block_length": 8})
    assert (given.pool_kernel, given.scoring) == (3, "max")
    assert _resolve(LLADA, {"cache": "sparse", "selection": "uniform", "scoring": "weight",
                            "block_length": 8}).scoring == "weight"
    # Sparse-dLLM's delay only where a block has a second step; set explicitly, it stays.
    assert _resolve(LLADA, {"cache": "sparse", "block_length": 8, "steps": 4}).delay_step == 0
    assert _resolve(LLADA, {"cache": "sparse", "block_length": 8, "steps": 32, "delay_step": 0}).delay_step == 0
    assert _resolve(LLADA, {"cache": "dual", "block_length": 8, "steps": 32}).delay_step == 0
    dream = _resolve(DREAM, {"cache": "sparse", "block_length": 8, "retention": 0.2, "selection": "uniform",
                             "pool_kernel": 5}, max_tokens=24)
    assert (dream.retention, dream.selection, dream.pool_kernel, dream.delay_step) == (0.2, "uniform", 5, 1)
    # A server default applies to every request.
    served = _resolve(LLADA, {"block_length": 8}, server={"cache": "sparse", "retention": 0.3})
    assert (served.cache, served.retention) == ("sparse", 0.3)


@pytest.mark.parametrize("extra,message", [
    ({"cache": "sparse", "retention": 0}, "diffusion option 'retention' must lie in (0, 1], got 0"),
    ({"cache": "sparse", "retention": 1.5}, "diffusion option 'retention' must lie in (0, 1], got 1.5"),
    ({"cache": "sparse", "pool_kernel": 4}, "diffusion option 'pool_kernel' must be an odd integer from 1 to 63, got 4"),
    ({"cache": "sparse", "pool_kernel": 65},
     "diffusion option 'pool_kernel' must be an odd integer from 1 to 63, got 65"),
    ({"cache": "sparse", "selection": "random"},
     "unknown selection 'random': diffusion option 'selection' must be head or uniform"),
    ({"cache": "sparse", "scoring": "sum"},
     "unknown scoring 'sum': diffusion option 'scoring' must be max, mean or weight"),
    ({"cache": "sparse", "retention": "0.3"}, "diffusion option 'retention' must be int or float, got str '0.3'"),
    ({"cache": "dual", "retention": 0.3},
     "diffusion option 'retention'=0.3 only applies with cache 'sparse', but 'cache' is 'dual'"),
    ({"selection": "uniform"},
     "diffusion option 'selection'='uniform' only applies with cache 'sparse', but 'cache' is 'none'"),
    ({"cache": "sparse", "block_length": 8, "steps": 4, "delay_step": 1},
     "delay_step=1 must be smaller than the steps per block (1)"),
])
def test_sparse_options_refusals(extra, message):
    with pytest.raises(OptionError) as info:
        _resolve(LLADA, extra)
    assert str(info.value) == message


def test_server_sparse_knob_without_sparse_cache_is_refused():
    with pytest.raises(OptionError) as info:
        ServerDefaults.build(LLADA, {}, {"cache": "dual", "pool_kernel": 5})
    assert str(info.value) == (
        "--additional-config dllm: diffusion option 'pool_kernel'=5 only applies with cache 'sparse', "
        "but 'cache' is 'dual'"
    )


# ---- selection and packing against the reference ----------------------------------

def _naive_attention(q, k, v, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          scale=scale).transpose(0, 1)


def test_sparse_refresh_attends_in_flight_and_packs_what_the_reference_keeps():
    """A dense Reuse and three sparse Refreshes in one call: ragged lengths, GQA, a
    Dream-like span (block + one), a CFG twin packing after its request in the same
    blocks, per-head and uniform selections, pooling windows 3, 5 and 1, scoring by
    the largest logit, the largest attention weight and the mean query."""
    torch.manual_seed(0)
    heads, kv_heads, dim, scale = 4, 2, 8, 0.35
    num_blocks = 64
    cache = torch.randn(num_blocks, BLOCK_SIZE, 2, kv_heads, dim)
    block_table = torch.zeros(3, 8, dtype=torch.int32)
    block_table[:] = (torch.randperm(num_blocks - 1)[:24] + 1).view(3, 8).int()
    retention = [0.5, 0.3, 0.5]
    # sparse sequences: (slot, length, Reuse queries [lo, hi), pool kernel, uniform)
    spec = [(1, 40, 24, 32, 3, False), (2, 33, 15, 24, 5, True), (1, 40, 24, 32, 1, False)]
    keep = [sparse_reference.kept_count(r, L - (hi - lo)) for r, (_, L, lo, hi, _, _) in zip(retention, spec)]
    footprint_1 = keep[0] + 8
    layout = SequenceLayout(
        slot=np.array([0, 1, 2, 1]),
        twin=np.array([False, False, False, True]),
        query_start=np.array([20, 0, 0, 0]),
        num_queries=np.array([8, 40, 33, 40]),
        seq_len=np.array([45, 40, 33, 40]),
        kv_start=np.array([0, 0, 0, footprint_1]),
    )
    plan = FillLayout(
        reuse_start=np.array([s[2] for s in spec]), reuse_end=np.array([s[3] for s in spec]),
        keep=np.array(keep), radius=np.array([s[4] // 2 for s in spec]), uniform=np.array([s[5] for s in spec]),
        mean_scoring=np.array([False, False, True]), weight_scoring=np.array([False, True, False]),
        dense=np.zeros(3, dtype=bool),
    )
    inputs = build_step_inputs(
        layout, prompt_tokens=torch.zeros(3, 64, dtype=torch.long), prompt_len=torch.full((3,), 10),
        canvas=torch.zeros(3, 64, dtype=torch.long), block_table=block_table, block_size=BLOCK_SIZE,
        mask_id=IDS.mask, backend=TorchAttention(), fill=plan,
    )
    cu = inputs.query_start_loc.tolist()
    total = cu[-1]
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    before = cache.clone()
    out = sparse.attend(q, k, v, cache, inputs.metadata, scale)

    expected_cache = before.clone()
    # The dense Reuse writes its queries' K/V at their positions and attends over its 45.
    table0 = block_table[0].long()
    dense_slots = table0[torch.arange(20, 28) // BLOCK_SIZE] * BLOCK_SIZE + torch.arange(20, 28) % BLOCK_SIZE
    expected_cache[dense_slots // BLOCK_SIZE, dense_slots % BLOCK_SIZE] = torch.stack([k[:8], v[:8]], dim=1)
    seq0 = table0[torch.arange(45) // BLOCK_SIZE] * BLOCK_SIZE + torch.arange(45) % BLOCK_SIZE
    kv0 = expected_cache[seq0 // BLOCK_SIZE, seq0 % BLOCK_SIZE]
    torch.testing.assert_close(out[:8], _naive_attention(q[:8], kv0[:, 0], kv0[:, 1], scale), rtol=1e-5, atol=1e-6)

    for i, ((slot, length, lo, hi, kernel, uniform), r) in enumerate(zip(spec, retention)):
        rows = slice(cu[i + 1], cu[i + 2])
        # The Refresh itself: full attention over its own in-flight K/V.
        torch.testing.assert_close(out[rows], _naive_attention(q[rows], k[rows], v[rows], scale),
                                   rtol=1e-5, atol=1e-6)
        kept = sparse_reference.kept_positions(
            q[rows][lo:hi].transpose(0, 1), k[rows].transpose(0, 1), lo, hi, r, kernel,
            "uniform" if uniform else "head", ("max", "weight", "mean")[i], scale,
        )
        start = int(layout.kv_start[i + 1])
        table = block_table[slot].long()
        for h in range(kv_heads):
            assert len(kept[h]) == keep[i]
            logical = start + torch.arange(keep[i])
            slots = table[logical // BLOCK_SIZE] * BLOCK_SIZE + logical % BLOCK_SIZE
            source = cu[i + 1] + torch.tensor(kept[h])
            expected_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE, 0, h] = k[source, h]
            expected_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE, 1, h] = v[source, h]
        if uniform:
            assert all(kept[h] == kept[0] for h in range(kv_heads))
    # Exactly the dense queries' slots and every head's kept slots changed, to exactly
    # the reference's K/V: nothing else of the pool was touched.
    torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0)
    assert not torch.equal(cache, before)


def _one_sequence_plan(q, k, lo, hi, keep, radius, uniform, scoring="max"):
    length = k.shape[0]
    layout = SequenceLayout(slot=np.array([0]), twin=np.array([False]), query_start=np.array([0]),
                            num_queries=np.array([length]), seq_len=np.array([length]), kv_start=np.array([0]))
    plan = FillLayout(reuse_start=np.array([lo]), reuse_end=np.array([hi]), keep=np.array([keep]),
                        radius=np.array([radius]), uniform=np.array([uniform]),
                        mean_scoring=np.array([scoring == "mean"]), weight_scoring=np.array([scoring == "weight"]),
                        dense=np.array([False]))
    inputs = build_step_inputs(
        layout, prompt_tokens=torch.zeros(1, 64, dtype=torch.long), prompt_len=torch.full((1,), 4),
        canvas=torch.zeros(1, 64, dtype=torch.long), block_table=torch.arange(1, 5, dtype=torch.int32)[None],
        block_size=BLOCK_SIZE, mask_id=IDS.mask, backend=TorchAttention(), fill=plan,
    )
    return inputs.metadata.cache_fill


def test_head_and_uniform_differ_where_heads_disagree():
    """Head 0 attends to position 0, head 1 to position 7: each head keeps its own;
    the shared ranking (summed over heads) keeps position 7 for both."""
    length, lo, hi = 12, 8, 12
    q = torch.zeros(length, 2, 2)
    q[lo:hi, :, 0] = 1.0  # every block query of both heads reads the first coordinate
    k = torch.zeros(length, 2, 2)
    k[:lo, 0, 0] = torch.tensor([10.0, 1, 1, 1, 1, 1, 1, 0])
    k[:lo, 1, 0] = torch.tensor([-20.0, 0, 0, 0, 0, 0, 0, 3])
    expected = {"head": [[0], [7]], "uniform": [[7], [7]]}
    for selection, kept in expected.items():
        assert sparse_reference.kept_positions(q[lo:hi].transpose(0, 1), k.transpose(0, 1), lo, hi, 1 / 8, 1,
                                               selection) == kept
        plan = _one_sequence_plan(q, k, lo, hi, keep=1, radius=0, uniform=selection == "uniform")
        assert sparse.kept_context(q, k, plan, SCALE)[0].tolist() == kept


def test_pooling_spreads_a_peak_and_ties_go_to_the_lower_position():
    """With a window of 3 a peak at context index 4 scores its neighbours too: the
    three tie and the lowest two are kept."""
    length, lo, hi = 10, 8, 10
    q = torch.zeros(length, 1, 2)
    q[lo:hi, 0, 0] = 1.0
    k = torch.zeros(length, 1, 2)
    k[:lo, 0, 0] = torch.tensor([0.0, 0.1, 0.2, 0.1, 5.0, 0.1, 0.0, 0.3])
    plan = _one_sequence_plan(q, k, lo, hi, keep=2, radius=1, uniform=False)
    assert sparse.kept_context(q, k, plan, SCALE)[0].tolist() == [[3, 4]]
    assert sparse_reference.kept_positions(q[lo:hi].transpose(0, 1), k.transpose(0, 1), lo, hi, 2 / 8, 3,
                                           "head") == [[3, 4]]


# ---- whole generations (vLLM-free engine) ---------------------------------------------

def _generate(engine, ids, steps):
    tokens = [[] for _ in ids]
    for _ in range(steps):
        for i, new in enumerate(engine.step(ids).new_tokens):
            tokens[i] += new
    return tokens


@pytest.mark.parametrize("cfg", [0.0, 1.0])
def test_full_retention_is_the_dual_cache(cfg):
    dual = dataclasses.replace(llada(gen=32, steps=32, block=8, cache="dual", cfg=cfg), delay_step=1)
    full = dataclasses.replace(dual, cache="sparse", retention=1.0)
    engine = make_engine()
    want = _generate(engine, add_requests(engine, 3, dual), 32)
    engine = make_engine()
    got = _generate(engine, add_requests(engine, 3, full), 32)
    assert got == want and all(len(t) == 32 for t in got)
    # Lower retention changes what Reuse steps see, so (on this random model) tokens.
    engine = make_engine()
    assert _generate(engine, add_requests(engine, 3, dataclasses.replace(full, retention=0.2)), 32) != want


def test_dream_full_retention_is_the_dual_cache():
    def dream(cache, **kw):
        return DreamOptions(gen_length=24, steps=24, eps=1e-3, alg="maskgit_plus", alg_temp=None, temperature=0.0,
                            top_p=None, top_k=None, block_length=8, cache=cache, delay_step=1, **kw)

    def run(options):
        model = build_model(SHAPE, torch.float32, "cpu", seed=0)
        model.logits_shift = True  # Dream predicts position j from row j - 1
        model.allocate_kv_pool(num_blocks=512, block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu")
        engine = StepEngine(model, kind="dream", ids=IDS, capacity=4, max_model_len=128, block_size=BLOCK_SIZE,
                            max_num_logits=1024, backend=TorchAttention(), device=torch.device("cpu"))
        return _generate(engine, add_requests(engine, 3, options), 24)

    assert run(dream("sparse", retention=1.0)) == run(dream("dual"))


def test_sparse_requests_batch_with_others_and_keep_their_tokens():
    """A sparse request's tokens alone and next to dense and sparse requests of other
    shapes (its Refresh attends in flight while theirs Reuse from the pool)."""
    target = sparse_llada(gen=16, block=8, retention=0.4)
    alone = make_engine()
    add_requests(alone, 1, target)
    want = _generate(alone, ["r0"], 16)[0]
    mixed = make_engine()
    add_requests(mixed, 1, target)
    mixed.add("dense", [5] * 30, llada(gen=32, steps=32, block=8, cache="dual"), seed=4,
              block_ids=list(range(200, 204)))
    mixed.add("other", [6] * 9, sparse_llada(gen=16, block=16, retention=0.2, selection="uniform", cfg=0.5), seed=2,
              block_ids=list(range(300, 303)))
    out = [mixed.step(["dense", "r0", "other"]).new_tokens[1] for _ in range(16)]
    assert sum(out, []) == want


def test_oracle_sparse_differs_from_dual_and_full_retention_equals_it(tiny_dirs):
    """The reference itself: retention 1 is the dual cache; 0.2 is not (so the
    plugin == oracle cases are not dual in disguise)."""
    model_dir = tiny_dirs("llada")
    model = oracle_model.load_oracle(model_dir)
    from tests.engine.test_exact_decoding import _special

    ids = _special(model_dir)
    prompt = [5 + (3 * i) % 40 for i in range(20)]
    common = dict(gen_length=32, steps=32, block_length=8, mask_id=ids["mask"], eos_id=ids["eos"],
                  eot_id=ids["eot"], delay_step=1)
    dual = oracle.llada_generate(model, prompt, cache="dual", **common).tokens
    full = oracle.llada_generate(model, prompt, cache="sparse",
                                 sparse={"retention": 1.0, "pool_kernel": 3, "selection": "head"}, **common).tokens
    low = oracle.llada_generate(model, prompt, cache="sparse",
                                sparse={"retention": 0.2, "pool_kernel": 3, "selection": "head"}, **common).tokens
    assert full == dual
    assert low != dual


# ---- preemption: an evicted cache is rebuilt, not refreshed -------------------------------

@pytest.mark.parametrize("cache", ["dual", "prefix", "sparse"])
def test_resumed_request_rebuilds_its_cache_and_decodes_as_if_never_preempted(cache):
    options = dataclasses.replace(llada(gen=32, steps=32, block=8, cache=cache, delay=1), retention=0.3) \
        if cache == "sparse" else llada(gen=32, steps=32, block=8, cache=cache)
    engine = make_engine()
    ids = add_requests(engine, 2, options)
    want = _generate(engine, ids, 32)

    def preempted(forget: bool):
        engine = make_engine()
        ids = add_requests(engine, 2, options)
        got = _generate(engine, ids, 5)  # r0 stops mid-block, its next step a Reuse
        engine.drop_cache("r0")
        for layer in engine.model.attention_layers():  # its old blocks are someone else's now
            layer.kv_cache[1:7] = 7.0
        engine.set_blocks("r0", list(range(100, 106)))
        if forget:  # what resuming did before: refresh from the current canvas
            engine.evicted[:] = False
        tokens = engine.step(["r0", "r1"], planned_tokens=None)
        rebuilt = engine.layout(np.array([engine.slots["r0"]])).rebuild
        for i, new in enumerate(tokens.new_tokens):
            got[i] += new
        rest = _generate(engine, ids, 26)
        return [a + b for a, b in zip(got, rest)], rebuilt

    got, rebuilt_after = preempted(forget=False)
    assert got == want
    assert not rebuilt_after.any()  # once rebuilt, the cache is whole again
    assert preempted(forget=True)[0] != want  # (the rebuild is what keeps the tokens)


def test_scheduler_prices_the_rebuild_step():
    from vllm_dllm.scheduler.track import RequestTrack

    options = llada(gen=32, steps=32, block=8, cache="dual")
    track = RequestTrack(options, prompt_len=10, blocks=1, block=0, block_step=5, has_cache=True)
    assert track.tokens == 8
    track.evicted, track.has_cache = True, False  # preempted mid-block
    assert track.needs_rebuild and track.tokens == 42 + 8 and track.profile()[:2] == (50, 8)
    track.block_step = 0  # a block's first step refreshes anyway: nothing to rebuild
    assert not track.needs_rebuild and track.tokens == 42


def test_max_scoring_keeps_what_single_queries_need_and_mean_blurs_it():
    """Two block queries read different positions (0 and 2); the mean query sees them
    at half strength and prefers position 1, which both read a little."""
    length, lo, hi = 10, 8, 10
    q = torch.zeros(length, 1, 2)
    q[8, 0] = torch.tensor([1.0, 0.0])
    q[9, 0] = torch.tensor([0.0, 1.0])
    k = torch.zeros(length, 1, 2)
    k[0, 0], k[1, 0], k[2, 0] = torch.tensor([4.0, -3.0]), torch.tensor([1.0, 1.0]), torch.tensor([-3.0, 4.0])
    for scoring, kept in {"max": [[0, 2]], "mean": [[0, 1]]}.items():
        plan = _one_sequence_plan(q, k, lo, hi, keep=2, radius=0, uniform=False, scoring=scoring)
        assert sparse.kept_context(q, k, plan, SCALE)[0].tolist() == kept
        assert sparse_reference.kept_positions(q[lo:hi].transpose(0, 1), k.transpose(0, 1), lo, hi, 2 / 8, 1,
                                               "head", scoring) == kept


def test_weight_scoring_ranks_a_sharp_read_above_a_query_whose_logits_all_run_high():
    """Query A's logits are high at every position, highest at 7; query B reads
    position 2 sharply from logits near 0.  The largest logit keeps A's 7; the largest
    attention weight keeps B's 2, which B gives almost all its attention while A
    spreads its own over the eight."""
    length, lo, hi = 10, 8, 10
    q = torch.zeros(length, 1, 2)
    q[8, 0] = torch.tensor([1.0, 0.0])
    q[9, 0] = torch.tensor([0.0, 1.0])
    k = torch.zeros(length, 1, 2)
    k[:lo, 0, 0] = torch.tensor([10.0, 10, 10, 10, 10, 10, 10, 10.5])
    k[2, 0, 1] = 6.0
    for scoring, kept in {"max": [[7]], "weight": [[2]]}.items():
        plan = _one_sequence_plan(q, k, lo, hi, keep=1, radius=0, uniform=False, scoring=scoring)
        assert sparse.kept_context(q, k, plan, SCALE)[0].tolist() == kept
        assert sparse_reference.kept_positions(q[lo:hi].transpose(0, 1), k.transpose(0, 1), lo, hi, 1 / 8, 1,
                                               "head", scoring, SCALE) == kept
