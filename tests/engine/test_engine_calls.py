"""Engine calls of several denoising steps, through vLLM's engine: how many steps a
call runs, and a waiting request that the token budget could admit at the next step
is never kept waiting longer than one step."""

from __future__ import annotations

from vllm import SamplingParams

from tests.conftest import close_engine, make_engine

PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                        extra_args={"steps": 32, "block_length": 8, "cache": "dual"})


def internal_id(scheduler, req_id: str) -> str:
    """The engine core's id of a request (vLLM may add a suffix to the one given)."""
    (found,) = [r for r in scheduler.requests if r == req_id or r.startswith(f"{req_id}-")]
    return found


def progress(scheduler, req_id: str) -> tuple[int, int]:
    track = scheduler._costs[internal_id(scheduler, req_id)]
    return track.block, track.block_step


def test_calls_run_a_blocks_steps_and_yield_to_an_admissible_arrival(tiny_dirs):
    # A Refresh of a 12-token prompt and its 32-token canvas costs 44 query tokens, a
    # Reuse 8: two Refreshes (88) exceed the budget of 64, a Refresh and a Reuse fit.
    llm = make_engine(tiny_dirs("llada"), max_model_len=64, max_num_batched_tokens=64)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # the engine core runs in this process
    prompt = {"prompt_token_ids": list(range(10, 22))}
    try:
        engine.add_request("a", prompt, PARAMS)
        engine.add_request("b", prompt, PARAMS)
        engine.step()
        # "b" did not fit beside "a"'s Refresh but fits beside its Reuse: one step.
        assert progress(scheduler, "a") == (0, 1) and progress(scheduler, "b") == (0, 0)
        assert [r.request_id for r in scheduler.running] == [internal_id(scheduler, "a")]
        engine.step()
        # "b" started, nothing waits: the rest of "a"'s block in one call (7 steps).
        assert progress(scheduler, "a") == (1, 0) and progress(scheduler, "b") == (0, 7)
        engine.step()
        # "b" has one step left in its block: the call runs one.
        assert progress(scheduler, "a") == (1, 1) and progress(scheduler, "b") == (1, 0)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        close_engine(llm)
    # Both run to the end (their tokens against one step per call: test_multi_step_calls.py).
    assert len(outputs["a"]) == len(outputs["b"]) == 32
