"""Unit and property tests for vllm_dllm/scheduler/plan.py `plan_step`.

Pure: random request mixes from seeded `random.Random` loops, no engine.
"""

from __future__ import annotations

import random

import pytest

from vllm_dllm.scheduler.plan import Candidate, StepPlan, plan_step

NUM_CASES = 3000


def random_case(rng: random.Random):
    n_run = rng.choice([0, 0, 1, 2, 3, 5, 8, 12])
    n_wait = rng.choice([0, 1, 2, 4, 7, 12])
    big = rng.random() < 0.3  # sometimes requests larger than the whole budget
    max_tok = rng.choice([8, 40, 120])
    running = [
        Candidate(f"r{i}", rng.randint(1, max_tok * (3 if big else 1)), 0) for i in range(n_run)
    ]
    waiting = [
        Candidate(
            f"w{i}",
            rng.randint(1, max_tok * (3 if big else 1)),
            rng.randint(0, rng.choice([1, 4, 12])),
        )
        for i in range(n_wait)
    ]
    kwargs = dict(
        token_budget=rng.choice([0, 1, rng.randint(1, 60), rng.randint(1, 400), 10_000]),
        max_seqs=rng.choice([1, 2, 3, 4, 8, 16, 256]),
        free_blocks=rng.choice([0, 1, rng.randint(0, 10), rng.randint(0, 60), 10_000]),
    )
    return running, waiting, kwargs


def check_invariants(plan: StepPlan, running, waiting, *, token_budget, max_seqs, free_blocks):
    by_id = {c.req_id: c for c in running + waiting}
    run_ids = [c.req_id for c in running]
    wait_ids = [c.req_id for c in waiting]

    # Accounting.
    assert set(plan.num_tokens) == set(plan.scheduled) | set(plan.admitted)
    assert len(plan.num_tokens) == len(plan.scheduled) + len(plan.admitted)
    for rid, n in plan.num_tokens.items():
        assert n == by_id[rid].tokens
    assert len(set(plan.scheduled)) == len(plan.scheduled)
    assert len(set(plan.admitted)) == len(plan.admitted)

    # Budgets.
    assert plan.total_tokens <= token_budget
    assert len(plan.scheduled) + len(plan.admitted) <= max_seqs
    # A running request keeps its sequence slot even when it sits out a step.
    assert len(plan.admitted) <= max(0, max_seqs - len(running))
    assert sum(by_id[r].blocks for r in plan.admitted) <= free_blocks

    # Running requests are scheduled, in arrival order; waiting ones only admitted.
    assert set(plan.scheduled) <= set(run_ids)
    assert plan.scheduled == [r for r in run_ids if r in plan.scheduled]
    assert set(plan.admitted) <= set(wait_ids)

    # Every running request that fits (at its turn, in arrival order) is scheduled.
    budget, count = token_budget, 0
    for cand in running:
        fits = count < max_seqs and cand.tokens <= budget
        assert (cand.req_id in plan.scheduled) == fits, cand
        if fits:
            budget -= cand.tokens
            count += 1

    # FCFS admission: the admitted requests are a prefix of the waiting queue ...
    assert plan.admitted == wait_ids[: len(plan.admitted)]
    # ... and the first one left out genuinely did not fit (nothing is admitted past it).
    blocks = free_blocks - sum(by_id[r].blocks for r in plan.admitted)
    budget = token_budget - plan.total_tokens
    if len(plan.admitted) < len(waiting):
        head = waiting[len(plan.admitted)]
        assert (
            len(running) + len(plan.admitted) >= max_seqs
            or head.tokens > budget
            or head.blocks > blocks
        ), (head, budget, blocks)


def test_invariants_random_mixes():
    rng = random.Random(1234)
    for _ in range(NUM_CASES):
        running, waiting, kwargs = random_case(rng)
        plan = plan_step(running, waiting, **kwargs)
        check_invariants(plan, running, waiting, **kwargs)


@pytest.mark.parametrize("seed", range(5))
def test_running_scheduled_before_any_admission(seed):
    """The running requests' schedule does not depend on who is waiting."""
    rng = random.Random(seed)
    for _ in range(400):
        running, waiting, kwargs = random_case(rng)
        alone = plan_step(running, [], **kwargs)
        assert alone.admitted == []
        plan = plan_step(running, waiting, **kwargs)
        assert plan.scheduled == alone.scheduled
        # Admission only uses what the running requests left.
        assert plan.total_tokens - alone.total_tokens == sum(
            plan.num_tokens[r] for r in plan.admitted
        )


@pytest.mark.parametrize("seed", range(5))
def test_admission_is_monotone_in_resources(seed):
    """More budget, seats or blocks never admit fewer requests (FCFS prefix grows)."""
    rng = random.Random(100 + seed)
    for _ in range(300):
        running, waiting, kwargs = random_case(rng)
        plan = plan_step(running, waiting, **kwargs)
        bigger = dict(kwargs)
        key = rng.choice(["token_budget", "max_seqs", "free_blocks"])
        bigger[key] += rng.randint(1, 50)
        more = plan_step(running, waiting, **bigger)
        check_invariants(more, running, waiting, **bigger)
        if key != "token_budget":
            # With the same token budget the running schedule is unchanged unless
            # max_seqs grew; admitted can only extend.
            assert more.admitted[: len(plan.admitted)] == plan.admitted


def test_inputs_not_mutated():
    rng = random.Random(7)
    for _ in range(200):
        running, waiting, kwargs = random_case(rng)
        r0, w0 = list(running), list(waiting)
        plan_step(running, waiting, **kwargs)
        assert running == r0 and waiting == w0


# ---------------------------------------------------------------------------
# Hand cases
# ---------------------------------------------------------------------------


def C(rid, tokens, blocks=0):
    return Candidate(rid, tokens, blocks)


def test_empty():
    plan = plan_step([], [], token_budget=100, max_seqs=4, free_blocks=10)
    assert plan.scheduled == [] and plan.admitted == [] and plan.total_tokens == 0


def test_all_fit():
    plan = plan_step(
        [C("a", 10), C("b", 20)],
        [C("c", 30, 2), C("d", 5, 1)],
        token_budget=100,
        max_seqs=8,
        free_blocks=10,
    )
    assert plan.scheduled == ["a", "b"]
    assert plan.admitted == ["c", "d"]
    assert plan.num_tokens == {"a": 10, "b": 20, "c": 30, "d": 5}
    assert plan.total_tokens == 65


def test_exact_fit_is_admitted():
    plan = plan_step([C("a", 60)], [C("b", 40, 3)], token_budget=100, max_seqs=2, free_blocks=3)
    assert plan.scheduled == ["a"] and plan.admitted == ["b"] and plan.total_tokens == 100


def test_running_that_does_not_fit_is_skipped_later_ones_still_run():
    plan = plan_step(
        [C("a", 60), C("b", 50), C("c", 30)], [], token_budget=100, max_seqs=8, free_blocks=0
    )
    assert plan.scheduled == ["a", "c"]
    assert plan.total_tokens == 90


def test_head_of_line_big_request_blocks_smaller_ones_behind_it():
    # 'big' does not fit this step; 'small' would, but FCFS must not let it jump ahead.
    plan = plan_step(
        [C("r", 50)], [C("big", 80, 1), C("small", 1, 1)],
        token_budget=100, max_seqs=8, free_blocks=10,
    )
    assert plan.scheduled == ["r"]
    assert plan.admitted == []


def test_admission_stops_on_blocks():
    plan = plan_step(
        [], [C("a", 10, 2), C("b", 10, 5), C("c", 10, 1)],
        token_budget=1000, max_seqs=8, free_blocks=6,
    )
    assert plan.admitted == ["a"]  # b needs 5 of the 4 left; c must wait behind b


def test_admission_stops_on_max_seqs_counting_unscheduled_running():
    # 'b' is running but sits out (budget); it still holds a sequence slot.
    plan = plan_step(
        [C("a", 90), C("b", 50)], [C("w", 5, 0)], token_budget=100, max_seqs=2, free_blocks=9
    )
    assert plan.scheduled == ["a"]
    assert plan.admitted == []


def test_more_running_than_max_seqs():
    running = [C(f"r{i}", 1) for i in range(5)]
    plan = plan_step(running, [C("w", 1)], token_budget=100, max_seqs=3, free_blocks=9)
    assert plan.scheduled == ["r0", "r1", "r2"]
    assert plan.admitted == []


def test_zero_budget_schedules_nothing():
    plan = plan_step([C("a", 1)], [C("b", 1)], token_budget=0, max_seqs=4, free_blocks=4)
    assert plan.scheduled == [] and plan.admitted == []


def test_admission_uses_budget_left_by_skipped_running():
    # 'a' (120) exceeds the budget this step; the budget goes to the next in line.
    plan = plan_step([C("a", 120)], [C("w", 40, 1)], token_budget=100, max_seqs=4, free_blocks=4)
    assert plan.scheduled == []
    assert plan.admitted == ["w"]


def test_preemption_takes_lowest_priority_first_and_only_when_it_makes_room():
    from vllm_dllm.scheduler.plan import Holder, choose_preemptions

    holders = [Holder("a", (0, 1.0), 2), Holder("b", (5, 2.0), 2), Holder("c", (5, 3.0), 1)]
    # Enough free blocks: nobody is preempted.
    assert choose_preemptions(2, 2, (1, 9.0), holders) == []
    # Lowest priority (largest rank) goes first: c, then b.
    assert choose_preemptions(2, 1, (1, 9.0), holders) == ["c"]
    assert choose_preemptions(4, 1, (1, 9.0), holders) == ["c", "b"]
    # Never a request of equal or higher priority ("a"); if that cannot make room, nothing.
    assert choose_preemptions(6, 1, (1, 9.0), holders) == []
    assert choose_preemptions(2, 0, (5, 0.5), holders) == ["c", "b"]
    assert choose_preemptions(2, 0, (9, 0.5), holders) == []


def _profile(rng, budget):
    """A request's per-step query tokens: Refresh peaks at block starts, Reuse between."""
    prompt, block, blocks, steps_per_block = rng.randint(4, 60), rng.choice([4, 8, 16]), rng.randint(1, 4), rng.randint(1, 4)
    full, reuse = prompt + block * blocks, block
    profile = []
    for _ in range(blocks):
        profile += [full] + [reuse] * (steps_per_block - 1)
    return tuple(min(c, budget) for c in profile)


def _simulate(rng, admission, budget=256, max_seqs=6):
    arrivals = sorted((rng.randint(0, 30), i, _profile(rng, budget)) for i in range(rng.randint(3, 14)))
    progress, running, waiting, delays, done = {}, [], [], 0, set()
    profiles = {f"r{i}": prof for _, i, prof in arrivals}
    for t in range(2000):
        waiting += [f"r{i}" for at, i, _ in arrivals if at == t]
        run_c = [Candidate(r, profiles[r][progress[r]], 0, profiles[r][progress[r]:]) for r in running]
        wait_c = [Candidate(r, profiles[r][0], 1, profiles[r]) for r in waiting]
        plan = plan_step(run_c, wait_c, token_budget=budget, max_seqs=max_seqs, free_blocks=100, admission=admission)
        if admission == "static" and running:
            assert not plan.admitted
        assert plan.total_tokens <= budget
        delays += len(running) - len(plan.scheduled)
        for r in plan.admitted:
            waiting.remove(r)
            running.append(r)
            progress[r] = 0
        for r in list(plan.scheduled) + plan.admitted:
            progress[r] += 1
            if progress[r] == len(profiles[r]):
                running.remove(r)
                done.add(r)
        if len(done) == len(arrivals):
            return delays
    raise AssertionError("simulation did not finish")


def test_lookahead_admission_never_delays_a_running_request():
    rng = random.Random(17)
    greedy_delays = 0
    for _ in range(300):
        seed = rng.randrange(1 << 30)
        assert _simulate(random.Random(seed), "lookahead") == 0
        assert _simulate(random.Random(seed), "reserve") == 0
        assert _simulate(random.Random(seed), "static") == 0
        greedy_delays += _simulate(random.Random(seed), "greedy")
    # The problem lookahead solves is real: greedy admission does delay requests.
    assert greedy_delays > 0
