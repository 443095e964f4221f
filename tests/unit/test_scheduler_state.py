"""The scheduler's bookkeeping beside its queues stays consistent under load.

Our scheduler replaces vLLM's `schedule()`; vLLM keeps state beside `waiting` and
`running` that its own `schedule()` maintains (a request waiting for its grammar sits in
`deferred_waiting` until it is admitted).  After a run of structured and plain
requests, some aborted, every gauge vLLM reports must read 0 again and no finished
request may still be referenced by the scheduler.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from tests.conftest import ENGINE_DEFAULTS

REQUESTS = 1000
REGEX = r"[0-9]{2,4}"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    # The engine core in this process, so its scheduler can be inspected.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        args = EngineArgs(model=tiny_dirs("llada"), disable_log_stats=False,
                          **{**ENGINE_DEFAULTS, "max_num_seqs": 32})
        llm_engine = LLMEngine.from_engine_args(args)
    yield llm_engine
    llm_engine.engine_core.shutdown()


def scheduler_of(llm_engine):
    return llm_engine.engine_core.engine_core.scheduler


def params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["regex", "json", "plain", "plain"])
    structured = {"regex": StructuredOutputsParams(regex=REGEX),
                  "json": StructuredOutputsParams(json=SCHEMA), "plain": None}[kind]
    # An unseeded sampled request draws its own noise (a seed from its id).
    return SamplingParams(max_tokens=rng.choice([8, 16]), temperature=rng.choice([0.0, 1.0]),
                          extra_args={"steps": 4, "block_length": 8}, structured_outputs=structured)


def test_gauges_and_references_return_to_zero_after_mixed_structured_load(engine):
    scheduler = scheduler_of(engine)
    rng = random.Random(0)
    refs: list[weakref.ref] = []
    structured = aborted = finished = 0
    pending: set[str] = set()
    for i in range(REQUESTS):
        req_id = f"load-{i}"
        sampling = params(rng)
        structured += sampling.structured_outputs is not None
        internal_id = engine.add_request(
            req_id, {"prompt_token_ids": [rng.randrange(3, 250) for _ in range(rng.randrange(2, 12))]}, sampling)
        pending.add(req_id)
        refs.append(weakref.ref(scheduler.requests[internal_id or req_id]))
        if rng.random() < 0.05:  # some abort before they finish, as clients disconnect
            engine.abort_request([req_id])
            pending.discard(req_id)
            aborted += 1
        # Arrivals interleave with steps, so requests wait for grammars while others run.
        if i % 16 == 15 or i == REQUESTS - 1:
            for _ in range(rng.randrange(1, 4)):
                for output in engine.step():
                    if output.finished:
                        pending.discard(output.request_id)
                        finished += 1
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                pending.discard(output.request_id)
                finished += 1
    assert structured > 400 and aborted > 20 and finished + aborted == REQUESTS and not pending

    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_skipped_waiting_reqs) == (0, 0, 0)
    assert not scheduler.deferred_waiting and not scheduler.requests
    assert not scheduler.running and not len(scheduler.waiting)
    gc.collect()
    alive = [ref() for ref in refs if ref() is not None]
    assert not alive, f"{len(alive)} finished requests still referenced, e.g. {alive[0].request_id}"
