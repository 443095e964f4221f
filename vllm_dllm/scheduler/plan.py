"""The step plan: which requests run this denoising step, and which are admitted.

A pure function of request costs and budgets, so its invariants are unit-tested
without an engine.  The currency is query tokens: a request's cost is what its next
step packs into the batch (a full-sequence Refresh costs prompt + canvas, times two
with classifier-free guidance).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    req_id: str
    tokens: int  # query tokens of its next step
    blocks: int = 0  # KV blocks it must be given to start (0 once running)
    # Query tokens of this and every later step, if it ran every step to the end
    # (lookahead and reserve admission read it).
    profile: tuple[int, ...] = ()


@dataclass
class StepPlan:
    scheduled: list[str] = field(default_factory=list)  # running requests, in order
    admitted: list[str] = field(default_factory=list)  # waiting requests to start
    num_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())


def _fits_ahead(load: list[int], profile: tuple[int, ...], budget: int) -> bool:
    return all((load[t] if t < len(load) else 0) + cost <= budget for t, cost in enumerate(profile))


def _add_load(load: list[int], profile: tuple[int, ...]) -> None:
    if len(profile) > len(load):
        load.extend([0] * (len(profile) - len(load)))
    for t, cost in enumerate(profile):
        load[t] += cost


def plan_step(
    running: list[Candidate],
    waiting: list[Candidate],
    *,
    token_budget: int,
    max_seqs: int,
    free_blocks: int,
    admission: str = "greedy",
) -> StepPlan:
    """Plan one step, first come first served.

    Running requests go first, in arrival order, while they fit; one that does not
    fit sits this step out (its Refresh peak met others' peaks).  Waiting requests are
    admitted in arrival order into what is left; admission stops at the first one that
    does not fit, so a large request is never starved by smaller ones behind it.

    Admission modes:
      greedy     the newcomer's next step fits what this step leaves (the default;
                 Reuse steps of running requests release headroom for newcomers)
      lookahead  also, for every future step, the planned costs of all running and
                 admitted requests together stay within the budget, so future Refresh
                 peaks never push a step over the cap
      reserve    every request is charged its peak (Refresh) cost for as long as it
                 runs: request-level scheduling, the baseline phase multiplexing beats
      static     a new batch is admitted only when no request is running
    """
    plan = StepPlan()
    budget = token_budget
    for cand in running:
        if len(plan.num_tokens) >= max_seqs or cand.tokens > budget:
            continue
        plan.scheduled.append(cand.req_id)
        plan.num_tokens[cand.req_id] = cand.tokens
        budget -= cand.tokens
    num_running = len(running)
    if admission == "static" and running:
        return plan
    load: list[int] = []
    if admission == "lookahead":
        for cand in running:
            _add_load(load, cand.profile)
    reserved = sum(max(c.profile, default=c.tokens) for c in running)
    for cand in waiting:
        if num_running + len(plan.admitted) >= max_seqs:
            break
        if cand.tokens > budget or cand.blocks > free_blocks:
            break
        if admission == "lookahead":
            if not _fits_ahead(load, cand.profile, token_budget):
                break
            _add_load(load, cand.profile)
        elif admission == "reserve":
            peak = max(cand.profile, default=cand.tokens)
            if reserved + peak > token_budget:
                break
            reserved += peak
        plan.admitted.append(cand.req_id)
        plan.num_tokens[cand.req_id] = cand.tokens
        budget -= cand.tokens
        free_blocks -= cand.blocks
    return plan


@dataclass(frozen=True)
class Holder:
    """A running request that holds KV blocks; `rank` orders by priority (lower first)."""

    req_id: str
    rank: tuple
    blocks: int


def choose_preemptions(needed_blocks: int, free_blocks: int, newcomer_rank: tuple, holders: list[Holder]) -> list[str]:
    """Running requests to preempt so a higher-priority newcomer gets its KV.

    Only requests that rank strictly below the newcomer are taken, lowest first, and
    only if taking them makes room; otherwise nothing is preempted (the newcomer
    waits).
    """
    if needed_blocks <= free_blocks:
        return []
    victims, freed = [], free_blocks
    for holder in sorted(holders, key=lambda h: h.rank, reverse=True):
        if holder.rank <= newcomer_rank:
            break
        victims.append(holder.req_id)
        freed += holder.blocks
        if freed >= needed_blocks:
            return victims
    return []
