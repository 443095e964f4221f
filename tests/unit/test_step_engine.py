"""The vLLM-free step engine: batched attention, vectorised phases, and a step whose
cost does not grow with per-request Python (counted torch ops per step)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm_dllm.attention.backends import TorchAttention, select_backend
from vllm_dllm.attention.metadata import attention_metadata
from vllm_dllm.decoding.base import SpecialIds
from vllm_dllm.engine.constraints import GrammarStep
from vllm_dllm.engine.engine import StepEngine
from vllm_dllm.engine.op_count import OpCounter
from vllm_dllm.engine.batch_phases import PhaseParams, batch_phases
from vllm_dllm.engine.step_inputs import SequenceLayout, build_step_inputs
from vllm_dllm.engine.torch_model import ModelShape, build_model
from vllm_dllm.options import CACHE_POLICIES, DreamOptions, LLaDA2Options, LLaDAOptions
from vllm_dllm.phases import block_phase, query_lead

BLOCK_SIZE = 16
SHAPE = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
IDS = SpecialIds(mask=63, eos=1, eot=2)

def llada(gen=32, steps=32, block=8, cache="dual", cfg=0.0, T=0.0, delay=0) -> LLaDAOptions:
    return LLaDAOptions(
        gen_length=gen, steps=steps, block_length=block, remasking="low_confidence", temperature=T,
        cfg_scale=cfg, logits_eos_inf=False, confidence_eos_eot_inf=False, cache=cache, delay_step=delay,
    )


def make_engine(capacity=16, max_len=128, backend=None, kind="llada", **engine_options):
    model = build_model(SHAPE, torch.float32, "cpu", seed=0)
    model.allocate_kv_pool(num_blocks=512, block_size=BLOCK_SIZE,
                           dtype=torch.float32, device="cpu")
    return StepEngine(
        model, kind=kind, ids=IDS, capacity=capacity, max_model_len=max_len, block_size=BLOCK_SIZE,
        max_num_logits=1024, backend=backend or TorchAttention(), device=torch.device("cpu"), **engine_options,
    )


def add_requests(engine, count, options, prompt_len=20, first_block=1):
    blocks_per_request = -(-2 * (prompt_len + options.gen_length) // BLOCK_SIZE)
    ids = []
    for i in range(count):
        req = f"r{i}"
        start = first_block + i * blocks_per_request
        prompt = [3 + (7 * i + j) % 50 for j in range(prompt_len)]
        engine.add(req, prompt, options, seed=i, block_ids=list(range(start, start + blocks_per_request)))
        ids.append(req)
    return ids


@pytest.mark.parametrize("options,warmup", [
    (llada(cache="dual"), 1),  # first step Refresh, the second a Reuse of every request
    (llada(cache="none"), 0),  # Refresh every step
    (llada(cache="dual", cfg=1.0), 1),  # classifier-free guidance: twin sequences
    # Parallel decoding: counts from confidences, a reranking rule, per-token credit.
    (dataclasses.replace(llada(cache="dual"), decoding="threshold", threshold=0.5), 1),
    (dataclasses.replace(llada(cache="dual"), decoding="hierarchy", threshold=0.5, low_threshold=0.1), 1),
    (dataclasses.replace(llada(cache="dual", T=0.7), decoding="credit"), 1),
    # Sparse KV: a Refresh that attends in flight and packs, then a Reuse over the packed.
    (dataclasses.replace(llada(cache="sparse"), retention=0.3), 0),
    (dataclasses.replace(llada(cache="sparse", cfg=1.0), retention=0.3, selection="uniform"), 1),
])
def test_step_op_count_does_not_grow_with_requests(options, warmup):
    counts = {}
    for requests in (1, 4, 16):
        engine = make_engine()
        ids = add_requests(engine, requests, options)
        for _ in range(warmup + 1):
            engine.step(ids)  # the first call also settles lazy initialisation
        with OpCounter() as counter:
            engine.step(ids)
        counts[requests] = (counter.total, counter.syncs)
    assert counts[1] == counts[4] == counts[16], counts
    # One counted sync: the candidates' nonzero, which sizes the LM-head work.  (The
    # other, the final device-to-host copy, dispatches nothing on a CPU.)
    assert counts[1][1] == 1, counts


def llada2(editing: float | None = None, T: float = 0.0) -> LLaDA2Options:
    # Threshold 1 is never exceeded: one token a step, so the phases are known ahead.
    return LLaDA2Options(
        max_tokens=27, block_length=8, steps=8, threshold=1.0, minimal_topk=1, eos_early_stop=False,
        editing_threshold=editing, max_post_steps=2, num_to_transfer=1, temperature=T, top_k=None, top_p=None,
    )


# Prompts of 13 tokens in blocks of 8: the first canvas block has 3 masks, so
# without editing its 3 steps end it and the 4th step is block 1's first.
@pytest.mark.parametrize("options,warmup", [
    (llada2(), 0),  # the first step: the prompt's whole block, then the first canvas block
    (llada2(), 1),  # inside a block: the active block's queries
    (llada2(), 3),  # a block's first step: the finished block's final K/V too
    (llada2(editing=0.5), 1),  # token editing reads every generated position of the block
    (llada2(editing=0.5, T=0.8), 4),
    # Parallel rules in place of the official choice of masks (threshold 1, low 1, a
    # tiny gamma: still one a step), with and without editing.
    (dataclasses.replace(llada2(), decoding="hierarchy", low_threshold=1.0), 1),
    (dataclasses.replace(llada2(editing=0.5, T=0.8), decoding="credit"), 1),
    (dataclasses.replace(llada2(editing=0.5), decoding="entropy_bound", gamma=1e-6), 1),
])
def test_block_causal_step_op_count_does_not_grow_with_requests(options, warmup):
    counts = {}
    for requests in (1, 4, 16):
        engine = make_engine(kind="llada2")
        ids = add_requests(engine, requests, options, prompt_len=13)
        for _ in range(warmup):
            engine.step(ids)  # the first step prefills the prompt's whole blocks too
        if options.editing_threshold is None and warmup == 3:
            slots = [engine.slots[i] for i in ids]
            assert (engine.host.block[slots] == 1).all() and (engine.host.block_step[slots] == 0).all()
            assert len(engine.layout(np.array(slots)).sequences.slot) == 2 * requests
        with OpCounter() as counter:
            engine.step(ids)
        counts[requests] = (counter.total, counter.syncs)
    assert counts[1] == counts[4] == counts[16], counts
    assert counts[1][1] == 1, counts


def test_engine_tokens_do_not_depend_on_batch_composition():
    """A request's tokens alone and batched with others of other shapes and phases."""
    alone = make_engine()
    add_requests(alone, 1, llada(gen=16, steps=16, block=8))
    out_alone = [alone.step(["r0"]).new_tokens[0] for _ in range(16)]

    batched = make_engine()
    add_requests(batched, 1, llada(gen=16, steps=16, block=8))
    batched.add("other", [5] * 33, llada(gen=32, steps=16, block=16, cache="none"), seed=9,
                block_ids=list(range(200, 200 + 9)))
    batched.add("cfg", [6] * 7, llada(gen=16, steps=8, block=16, cfg=0.5), seed=3,
                block_ids=list(range(300, 300 + 3)))
    out_batched = [batched.step(["other", "r0", "cfg"] if k < 8 else ["r0", "other"]).new_tokens for k in range(16)]
    assert [o[1] if k < 8 else o[0] for k, o in enumerate(out_batched)] == out_alone
    assert sum(len(t) for t in out_alone) == 16


@pytest.mark.parametrize("seed", range(5))
def test_batch_phases_match_the_scheduler_phase(seed):
    rng = random.Random(seed)
    rows, expected = [], []
    for _ in range(80):
        block = rng.choice([4, 8, 16])
        blocks = rng.randint(1, 4)
        spb = rng.randint(1, 6)
        cache = dict(cache=rng.choice(CACHE_POLICIES), refresh_interval=rng.randint(0, 3),
                     delay_step=rng.randint(0, spb - 1))
        if cache["cache"] == "vicinity":  # spans clipped at the prompt's start, the canvas's end, or neither
            cache["vicinity"] = rng.choice([0, 1, 5, 40])
        kind = rng.random()
        if kind < 0.4:
            options = LLaDAOptions(
                gen_length=block * blocks, steps=spb * blocks, block_length=block, remasking="low_confidence",
                temperature=0.0, cfg_scale=0.0, logits_eos_inf=False, confidence_eos_eot_inf=False, **cache,
            )
        elif kind < 0.8:  # Dream: a Reuse also runs the position before its block
            options = DreamOptions(
                gen_length=block * blocks, steps=spb * blocks, eps=1e-3, alg="maskgit_plus", alg_temp=None,
                temperature=0.0, top_p=None, top_k=None, block_length=block, **cache,
            )
        else:  # LLaDA2: block-causal segments, no cache policy
            options = LLaDA2Options(
                max_tokens=block * blocks - rng.randint(0, block - 1), block_length=block, steps=spb, threshold=0.9,
                minimal_topk=1, eos_early_stop=False, editing_threshold=None, max_post_steps=4, num_to_transfer=1,
                temperature=0.0, top_k=None, top_p=None,
            )
        causal = getattr(options, "block_causal", False)
        prompt_len, has_cache = rng.randint(1, 70 if causal else 30), rng.random() < (0.4 if causal else 0.7)
        options = options.placed(prompt_len)
        step = rng.randrange(options.steps_per_block * options.num_blocks)
        # A block-causal prefill may start at a cached prefix and run in chunks.
        whole = prompt_len - prompt_len % block
        prefilled = rng.randrange(0, whole + 1, block) if options.block_causal else 0
        chunk = rng.choice([0, block - 1, block, 2 * block + 3, 5 * block]) if options.block_causal else 0
        rows.append((options, prompt_len, step, has_cache, prefilled, chunk))
        expected.append(block_phase(options, step // options.steps_per_block, step % options.steps_per_block,
                                    prompt_len, has_cache, prefilled, chunk))
    t = lambda values: np.array(values)  # noqa: E731
    phases = batch_phases(PhaseParams(
        prompt_len=t([r[1] for r in rows]),
        gen_length=t([r[0].gen_length for r in rows]),
        block=t([r[2] // r[0].steps_per_block for r in rows]),
        block_step=t([r[2] % r[0].steps_per_block for r in rows]),
        has_cache=t([r[3] for r in rows]),
        policy=t([CACHE_POLICIES.index(r[0].cache) for r in rows]),
        block_length=t([r[0].block_length for r in rows]),
        lead=t([query_lead(r[0]) for r in rows]),
        vicinity=t([r[0].vicinity if r[0].cache == "vicinity" else 0 for r in rows]),
        delay_step=t([r[0].delay_step for r in rows]),
        refresh_interval=t([r[0].refresh_interval for r in rows]),
        segment=t([r[0].block_length if r[0].block_causal else 0 for r in rows]),
        prefilled=t([r[4] for r in rows]),
        chunk=t([r[5] for r in rows]),
    ))
    got = list(zip(phases.refresh.tolist(), phases.query_start.tolist(), phases.query_end.tolist(),
                   phases.decodes.tolist()))
    assert got == [(p.refresh, p.query_start, p.query_end, p.decodes) for p in expected]
    assert any(r[0].block_causal and not p.decodes for r, p in zip(rows, expected))
    assert any(r[0].block_causal and r[4] > 0 and p.refresh for r, p in zip(rows, expected))


def test_a_vicinity_reuse_runs_its_block_and_spans_on_both_sides():
    options = LLaDAOptions(gen_length=32, steps=16, block_length=8, remasking="low_confidence", temperature=0.0,
                           cfg_scale=0.0, logits_eos_inf=False, confidence_eos_eot_inf=False, cache="vicinity",
                           vicinity=5).placed(10)
    reuse = lambda block, options=options: block_phase(options, block, 1, 10, True)  # noqa: E731
    assert [(p.refresh, p.query_start, p.query_end) for p in map(reuse, range(4))] == [
        (False, 5, 23), (False, 13, 31), (False, 21, 39), (False, 29, 42),  # clipped at the canvas's end
    ]
    assert block_phase(options, 0, 0, 10, True).refresh  # a block's first step still refreshes
    whole = dataclasses.replace(options, vicinity=40)
    assert (reuse(2, whole).query_start, reuse(2, whole).query_end) == (0, 42)  # every position: nothing stale
    # Any span past the sequence is the sequence, in the engine's int64 arrays too.
    huge = dataclasses.replace(options, vicinity=10**30)
    assert (reuse(2, huge).query_start, reuse(2, huge).query_end) == (0, 42)
    engine = make_engine()
    ids = add_requests(engine, 1, dataclasses.replace(llada(cache="vicinity"), vicinity=10**30), prompt_len=10)
    engine.step(ids)  # the block's Refresh
    engine.step(ids, [reuse(0, huge).num_queries])  # a Reuse of the whole sequence, priced as the scheduler does


def naive_attention(q, cache, layout, query_start_loc, positions_per_seq, scale):
    """Per sequence: gather its K/V slot by slot, SDPA with repeated KV heads."""
    out = torch.empty_like(q)
    block_size = cache.shape[1]
    for s, slots in enumerate(positions_per_seq):
        rows = slice(int(query_start_loc[s]), int(query_start_loc[s + 1]))
        k = cache[slots // block_size, slots % block_size, 0].to(q.dtype)
        v = cache[slots // block_size, slots % block_size, 1].to(q.dtype)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale)
        out[rows] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float64])
def test_torch_backend_matches_a_per_sequence_loop(pool_dtype):
    """Ragged sequences, a CFG twin after its request in the same blocks, shuffled
    blocks, Refresh (all positions queries) and Reuse (a slice) in one call; a pool
    of another dtype than the queries' (its keys are read back, masked)."""
    torch.manual_seed(0)
    capacity, max_len, heads, kv_heads, dim = 3, 64, 4, 2, 8
    num_blocks = 40
    cache = torch.randn(num_blocks, BLOCK_SIZE, 2, kv_heads, dim, dtype=pool_dtype)
    block_table = torch.zeros(capacity, 8, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1)[:24] + 1
    block_table[:] = perm.view(capacity, 8).int()
    layout = SequenceLayout(
        slot=np.array([0, 1, 2, 1]),
        twin=np.array([False, False, False, True]),
        query_start=np.array([0, 20, 5, 20]),
        num_queries=np.array([37, 8, 1, 8]),
        seq_len=np.array([37, 45, 50, 45]),
        kv_start=np.array([0, 0, 0, 45]),
    )
    inputs = build_step_inputs(
        layout, prompt_tokens=torch.zeros(capacity, max_len, dtype=torch.long),
        prompt_len=torch.full((capacity,), 10), canvas=torch.zeros(capacity, max_len, dtype=torch.long),
        block_table=block_table, block_size=BLOCK_SIZE, mask_id=IDS.mask, backend=TorchAttention(),
    )
    total = int(layout.num_queries.sum())
    q = torch.randn(total, heads, dim)
    k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    expected_cache = cache.clone()
    slots = inputs.metadata.query_slots
    expected_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE, 0] = k.to(pool_dtype)
    expected_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE, 1] = v.to(pool_dtype)
    per_seq = []
    for s in range(4):
        logical = int(layout.kv_start[s]) + torch.arange(int(layout.seq_len[s]))
        table = block_table[int(layout.slot[s])].long()
        per_seq.append(table[logical // BLOCK_SIZE] * BLOCK_SIZE + logical % BLOCK_SIZE)
    expected = naive_attention(q, expected_cache, layout, inputs.query_start_loc, per_seq, 0.3)
    with attention_metadata(inputs.metadata):
        got = TorchAttention().attend(q, k, v, cache, inputs.metadata, 0.3)
    torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0)
    # Padded and unpadded SDPA accumulate in different orders: float32 rounding only.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # Every way of reading keys ran: the whole Refresh from its fresh rows, the lone
    # Reuse sliced to its keys in the pool (no mask), the request and its twin (one
    # length, two offsets) masked.
    groups = {int(g.seq_index[0]): g for g in inputs.metadata.groups}
    assert {s: g.dense_keys for s, g in groups.items()} == {0: (0, 37), 1: None, 2: (0, 50)}
    assert {s: g.keys_are_queries for s, g in groups.items()} == {0: True, 1: False, 2: False}
    # The twin's query slots follow its request's in the same blocks, never overlap.
    twin_rows = slice(int(inputs.query_start_loc[3]), int(inputs.query_start_loc[4]))
    cond_rows = slice(int(inputs.query_start_loc[1]), int(inputs.query_start_loc[2]))
    assert set(slots[twin_rows].tolist()).isdisjoint(slots[cond_rows].tolist())


def test_a_whole_refresh_with_its_twin_reads_fresh_keys_or_masks_the_pool():
    """A request and its CFG twin refreshing together: one length, two offsets in the
    blocks; their keys are their fresh rows, or (a pool of another dtype) the pool's
    pages under the mask."""
    torch.manual_seed(1)
    heads, kv_heads, dim = 4, 2, 8
    layout = SequenceLayout(slot=np.array([0, 0]), twin=np.array([False, True]), query_start=np.zeros(2, dtype=np.int64),
                            num_queries=np.array([20, 20]), seq_len=np.array([20, 20]), kv_start=np.array([0, 20]))
    block_table = (torch.arange(8) + 3).view(1, 8).int()
    for pool_dtype in (torch.float32, torch.float64):
        cache = torch.randn(40, BLOCK_SIZE, 2, kv_heads, dim, dtype=pool_dtype)
        inputs = build_step_inputs(
            layout, prompt_tokens=torch.zeros(1, 64, dtype=torch.long), prompt_len=torch.full((1,), 10),
            canvas=torch.zeros(1, 64, dtype=torch.long), block_table=block_table, block_size=BLOCK_SIZE,
            mask_id=IDS.mask, backend=TorchAttention(),
        )
        (group,) = inputs.metadata.groups
        assert group.keys_are_queries and group.dense_keys is None  # the offsets differ
        q, k, v = torch.randn(40, heads, dim), torch.randn(40, kv_heads, dim), torch.randn(40, kv_heads, dim)
        with attention_metadata(inputs.metadata):
            got = TorchAttention().attend(q, k, v, cache, inputs.metadata, 0.3)
        for rows in (slice(0, 20), slice(20, 40)):  # each sequence over its own keys only
            keys, values = (x[rows].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for x in (k, v))
            want = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values, scale=0.3).transpose(0, 1)
            torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-6)


def test_select_backend_defaults_and_refusals():
    assert select_backend(torch.device("cpu")).name == "torch"
    assert select_backend(torch.device("cpu"), "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'bogus'; choose one of torch, triton, flash"):
        select_backend(torch.device("cpu"), "bogus")
    for name in ("triton", "flash"):
        with pytest.raises(ValueError, match=f"'{name}' runs on CUDA devices, not cpu"):
            select_backend(torch.device("cpu"), name)


def test_engine_grows_past_its_capacity_and_frees_slots():
    engine = make_engine(capacity=2)
    ids = add_requests(engine, 5, llada(gen=16, steps=16, block=8))
    assert engine.capacity >= 5
    out = engine.step(ids)
    assert len(out.new_tokens) == 5
    engine.remove("r0")
    assert "r0" not in engine
    engine.add("again", [4] * 20, llada(gen=16, steps=16, block=8), seed=1, block_ids=list(range(400, 406)))
    assert engine.step(["again"]).logits_rows == 8


def test_block_causal_request_fits_by_its_placed_canvas():
    # max_tokens 27 in blocks of 8 after a 13-token prompt: the canvas is 27 positions
    # (the prompt's 5-token tail shares the first block), 40 with the prompt; padded
    # without the prompt's tail it would be 32 + 13 = 45.
    make_engine(kind="llada2", max_len=40).add("r", [5] * 13, llada2(), seed=0, block_ids=[1, 2])
    with pytest.raises(ValueError, match="exceed the model length 39"):
        make_engine(kind="llada2", max_len=39).add("r", [5] * 13, llada2(), seed=0, block_ids=[1, 2])


def test_multi_segment_steps_project_each_candidate_once():
    # A block-causal first step runs several segments of one request; none is a CFG
    # twin, so each masked position of the active block is one LM-head row.
    engine = make_engine(kind="llada2")
    ids = add_requests(engine, 2, llada2(), prompt_len=13)
    assert len(engine.layout(np.array([engine.slots[i] for i in ids])).sequences.slot) == 2 * len(ids)
    projected, project = [], engine.lm_head.project
    engine.lm_head = dataclasses.replace(engine.lm_head, project=lambda hidden: (projected.append(len(hidden)),
                                                                                 project(hidden))[1])
    out = engine.step(ids)
    # The first canvas block holds 3 masks after a 13-token prompt.
    assert out.logits_rows == sum(projected) == 2 * 3


# ---- structured outputs (engine/constraints.py) ----------------------------------


def test_constrain_returns_forces_and_masks_the_frontier():
    engine = make_engine()
    options = llada(gen=32, steps=4, block=8, cache="none")  # one step per block: all 8 commit at once
    (req,) = add_requests(engine, 1, options)
    slot = engine.slots[req]
    first = engine.step([req]).new_tokens[0]
    assert len(first) == 8 and engine.host.block[slot] == 1
    # Tokens from position 2 broke the grammar: back to the mask, block 0 restarts;
    # the grammar forces two tokens there and allows only token 11 after them.
    bitmask = np.zeros((1, 2), dtype=np.int32)
    bitmask[0, 0] = 1 << 11
    engine.constrain(GrammarStep(returned={req: 2}, forced={req: [7, 9]}, masked=[req], bitmask=bitmask))
    canvas = engine.decode.canvas[slot, :32].tolist()
    assert canvas[:2] == first[:2] and canvas[2:4] == [7, 9] and canvas[4:] == [IDS.mask] * 28
    assert engine.host.block[slot] == 0 and engine.host.block_step[slot] == 0 and engine.emitted[req] == 2
    out = engine.step([req]).new_tokens[0]
    assert out[:3] == [7, 9, 11] and len(out) == 6  # positions 2..7: the restarted block ends
    # The mask was for this step only.
    assert engine._masks is None


@pytest.mark.parametrize("options", [
    llada(cache="dual"),
    dataclasses.replace(llada(cache="dual", cfg=1.0), decoding="threshold", threshold=0.5),
])
def test_constrained_step_op_count_does_not_grow_with_requests(options):
    counts = {}
    for requests in (1, 4, 16):
        engine = make_engine()
        ids = add_requests(engine, requests, options)
        engine.step(ids)
        step = GrammarStep(returned={r: 0 for r in ids}, forced={r: [5] for r in ids}, masked=list(ids),
                           bitmask=np.full((requests, 2), 0x0F0F0F0F, dtype=np.int32))
        with OpCounter() as counter:
            engine.constrain(step)
            engine.step(ids)
        counts[requests] = (counter.total, counter.syncs)
    assert counts[1] == counts[4] == counts[16], counts
    assert counts[1][1] == 1, counts


def test_returned_tokens_under_token_editing_stream_once():
    """LLaDA2.1 streams a block when it ends; a return inside it restarts the block
    with its streamed part fixed: editing leaves that part alone and only the
    positions from the return on stream again."""
    engine = make_engine(kind="llada2")
    options = llada2(editing=0.5)
    (req,) = add_requests(engine, 1, options, prompt_len=13)  # blocks of 8: canvas blocks [0, 3), [3, 11), ...
    slot = engine.slots[req]
    streamed = []
    while len(streamed) < 11:  # the first two canvas blocks end
        streamed += engine.step([req]).new_tokens[0]
    assert len(streamed) == 11 and engine.host.block[slot] == 2
    engine.constrain(GrammarStep(returned={req: 6}))
    assert engine.host.block[slot] == 1 and engine.host.block_step[slot] == 0 and engine.emitted[req] == 6
    again = []
    for _ in range(40):
        before = engine.decode.canvas[slot, :6].tolist()
        again += engine.step([req]).new_tokens[0]
        assert engine.decode.canvas[slot, :6].tolist() == before == streamed[:6]
        assert engine.emitted[req] >= 6
        if engine.host.block[slot] == 2:
            break
    assert again == engine.decode.canvas[slot, 6:11].tolist()
