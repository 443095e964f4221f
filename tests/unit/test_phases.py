"""Which steps refresh, and which positions are queries, under each cache policy."""

from __future__ import annotations

import pytest

from vllm_dllm.options import DreamOptions, LLaDAOptions
from vllm_dllm.phases import step_phase


def llada(cache="none", refresh_interval=0, delay_step=0, gen=16, steps=8, block=8):
    return LLaDAOptions(
        gen_length=gen, steps=steps, block_length=block, remasking="low_confidence", temperature=0.0,
        cfg_scale=0.0, logits_eos_inf=False, confidence_eos_eot_inf=False,
        cache=cache, refresh_interval=refresh_interval, delay_step=delay_step,
    )


def phases(options, prompt_len=5):
    out, has_cache = [], False
    for step in range(options.steps):
        phase = step_phase(options, step, prompt_len, has_cache)
        out.append(("R" if phase.refresh else "U", phase.query_start, phase.query_end))
        has_cache = has_cache or phase.refresh
    return out


def test_none_always_refreshes_everything():
    assert phases(llada()) == [("R", 0, 21)] * 8


def test_dual_reuses_the_active_block_after_each_block_start():
    # 2 blocks of 8 tokens, 4 steps per block, prompt of 5.
    assert phases(llada("dual")) == [("R", 0, 21)] + [("U", 5, 13)] * 3 + [("R", 0, 21)] + [("U", 13, 21)] * 3


def test_prefix_reuses_from_the_block_start_to_the_end():
    assert phases(llada("prefix")) == [("R", 0, 21)] + [("U", 5, 21)] * 3 + [("R", 0, 21)] + [("U", 13, 21)] * 3


def test_refresh_interval_and_delay():
    got = phases(llada("dual", refresh_interval=2, delay_step=1))
    # Steps 0..1 of each block run in full (delay), then every 2 steps after (step 3).
    assert [p[0] for p in got] == ["R", "R", "U", "R", "R", "R", "U", "R"]
    assert got[6] == ("U", 13, 21)


def test_resume_after_preemption_refreshes():
    options = llada("dual")
    assert step_phase(options, 2, 5, has_cache=False).refresh
    assert not step_phase(options, 2, 5, has_cache=True).refresh


def test_dream_has_no_reuse():
    options = DreamOptions(gen_length=8, steps=8, eps=1e-3, alg="origin", alg_temp=None, temperature=0.0, top_p=None, top_k=None)
    assert all(step_phase(options, s, 3, True).refresh for s in range(8))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_reuse_queries_cover_the_active_block(cache):
    options = llada(cache, gen=32, steps=32, block=8)
    for step in range(32):
        phase = step_phase(options, step, 7, True)
        block_start = 7 + (step // 8) * 8
        assert phase.query_start <= block_start and block_start + 8 <= phase.query_end
