"""Parallel decoding rules (decoding/parallel.py): commit counts against plain-Python
implementations of their published definitions, designed confidences where the
rules differ, and whole generations through the batched LLaDA rule against a
straightforward per-request loop, with blocks that end when they have no masks."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.decoding_harness import MASK, TableModel, admit, llada_opts, logits_table, run_step
from vllm_dllm.decoding import parallel


def reference_count(rule: str, values: list[float], floor: int, *, threshold=0.9, factor=1.0, gamma=1.0, cap=0) -> int:
    """From the definitions, one request: `values` are its candidates' confidences
    (entropies for entropy_bound)."""
    if rule == "fixed":
        return floor
    if rule == "threshold":
        n = sum(v >= threshold for v in values)
    elif rule == "factor":
        c = sorted(values, reverse=True)
        n = 0
        while n < len(c) and all(c[i - 1] >= 1 - factor / (i + 1) for i in range(1, n + 2)):
            n += 1
    else:
        e = sorted(values)
        n = 0
        while n < len(e) and sum(e[: n + 1]) <= gamma:
            n += 1
    n = max(n, 1)
    if cap > 0:
        n = min(n, cap)
    return min(max(n, floor), len(values))


@pytest.mark.parametrize("seed", range(4))
def test_commit_counts_match_the_definitions(seed):
    rng = random.Random(seed)
    width, rows = 12, 40
    cases = []
    for _ in range(rows):
        # hierarchy is a set (tested below); credit is the threshold rule on fused logits.
        rule = rng.choice([r for r in parallel.DECODING_RULES if r not in ("hierarchy", "credit")])
        n = rng.randint(1, width)
        if rule == "entropy_bound":
            values = [rng.uniform(0, 1.5) for _ in range(n)]
        else:
            values = [rng.choice([rng.random(), 1 - rng.random() ** 4]) for _ in range(n)]
        cases.append(dict(rule=rule, values=values, floor=rng.randint(0, 3), threshold=rng.uniform(0.3, 0.99),
                          factor=rng.uniform(0.1, 2.0), gamma=rng.uniform(0.05, 3.0), cap=rng.choice([0, 1, 2, 5])))
    ordered = torch.full((rows, width), float("-inf"), dtype=torch.float64)
    for r, c in enumerate(cases):
        keys = [-v for v in c["values"]] if c["rule"] == "entropy_bound" else c["values"]
        ordered[r, : len(keys)] = torch.tensor(sorted(keys, reverse=True), dtype=torch.float64)
    t = lambda key, dtype=torch.float32: torch.tensor([c[key] for c in cases], dtype=dtype)  # noqa: E731
    got = parallel.commit_counts(
        ordered,
        torch.tensor([parallel.DECODING_RULES.index(c["rule"]) for c in cases]),
        t("floor", torch.long),
        torch.tensor([len(c["values"]) for c in cases]),
        parallel.RowParameters(threshold=t("threshold"), factor=t("factor"), gamma=t("gamma"),
                               low_threshold=torch.zeros(rows)),
        t("cap", torch.long),
    )
    expected = [
        reference_count(c["rule"], c["values"], c["floor"], threshold=float(torch.tensor(c["threshold"], dtype=torch.float32)),
                        factor=float(torch.tensor(c["factor"], dtype=torch.float32)),
                        gamma=float(torch.tensor(c["gamma"], dtype=torch.float32)), cap=c["cap"])
        for c in cases
    ]
    assert got.tolist() == expected


def test_rules_differ_on_designed_confidences():
    """Confidences 0.95, 0.80, 0.78, 0.10: the threshold 0.9 commits one; the factor
    rule (f = 1: bounds 0.5, 0.67, 0.75, 0.8) three; a floor of two lifts the first."""
    ordered = torch.tensor([[0.95, 0.80, 0.78, 0.10]] * 3, dtype=torch.float64)
    one = torch.ones(3)
    rows = parallel.RowParameters(threshold=0.9 * one, factor=one, gamma=one, low_threshold=0 * one)
    counts = parallel.commit_counts(
        ordered, torch.tensor([parallel.THRESHOLD, parallel.FACTOR, parallel.THRESHOLD]), torch.tensor([1, 1, 2]),
        torch.tensor([4, 4, 4]), rows, torch.zeros(3, dtype=torch.long),
    )
    assert counts.tolist() == [1, 3, 2]
    # Entropies 0.1, 0.3, 0.5, 0.9 (keys are their negations): gamma 0.5 admits two.
    entropies = -torch.tensor([[0.1, 0.3, 0.5, 0.9]], dtype=torch.float64)
    one = torch.ones(1)
    count = parallel.commit_counts(
        entropies, torch.tensor([parallel.ENTROPY_BOUND]), torch.tensor([1]), torch.tensor([4]),
        parallel.RowParameters(threshold=one, factor=one, gamma=0.5 * one, low_threshold=0 * one),
        torch.zeros(1, dtype=torch.long),
    )
    assert count.tolist() == [2]


def test_rules_are_found_by_name():
    assert [parallel.rule_named(name).name for name in parallel.DECODING_RULES[1:]] == list(parallel.DECODING_RULES[1:])
    assert parallel.rule_named("entropy_bound").ranks_by_entropy and parallel.rule_named("credit").carries_credit


def parallel_opts(decoding, gen=16, block=8, steps=None, **params):
    return dataclasses.replace(llada_opts(gen=gen, steps=steps, block=block), decoding=decoding, **params)


def reference_hierarchy(masked: list[int], confidence: dict[int, float], threshold: float, low: float) -> set[int]:
    """dInfer's hierarchy rule from its definition: runs of consecutive masked positions."""
    runs, run = [], []
    for p in masked:
        if run and p != run[-1] + 1:
            runs.append(run)
            run = []
        run.append(p)
    if run:
        runs.append(run)
    selected = {p for p in masked if confidence[p] > threshold}
    for run in runs:
        best = max(confidence[p] for p in run)
        selected |= {p for p in run if confidence[p] == best and best > low}
    return selected


@pytest.mark.parametrize("seed", range(3))
def test_hierarchy_selection_matches_the_definition(seed):
    g = torch.Generator().manual_seed(seed)
    rows, width = 30, 16
    candidates = torch.rand(rows, width, generator=g) < 0.6
    confidence = torch.rand(rows, width, generator=g).double()
    confidence[:, 5] = confidence[:, 4]  # equal maxima of a run: both are its best
    high, low = torch.rand(rows, generator=g) * 0.5 + 0.5, torch.rand(rows, generator=g) * 0.5
    got = parallel.hierarchy_selection(candidates, confidence, high, low)
    for r in range(rows):
        masked = candidates[r].nonzero().flatten().tolist()
        expected = reference_hierarchy(masked, {p: float(confidence[r, p]) for p in masked},
                                       float(high[r].double()), float(low[r].double()))
        assert set(got[r].nonzero().flatten().tolist()) == expected


def reference_generation(table: torch.Tensor, opts) -> tuple[list[int], int]:
    """A straightforward loop from the definitions (Fast-dLLM's threshold loop and its
    siblings) for one request whose logits depend only on the position: per block,
    while it has masks, score its masked positions and commit the rule's count."""
    canvas = [MASK] * opts.gen_length
    probs = torch.softmax(table, dim=-1)
    tokens = probs.argmax(dim=-1).tolist()
    confidence = probs.max(dim=-1).values.tolist()
    entropy = parallel.entropy(probs).tolist()
    steps = 0
    spb = opts.steps_per_block
    for block in range(opts.num_blocks):
        positions = range(block * opts.block_length, (block + 1) * opts.block_length)
        masked_at_start = sum(canvas[p] == MASK for p in positions)
        for k in range(spb):
            masked = [p for p in positions if canvas[p] == MASK]
            if not masked:
                break
            floor = masked_at_start // spb + (k < masked_at_start % spb)
            if opts.decoding == "entropy_bound":
                ranked = sorted(masked, key=lambda p: (entropy[p], p))
                values = [entropy[p] for p in masked]
            elif opts.decoding == "hierarchy":
                chosen = reference_hierarchy(masked, dict(enumerate(confidence)), opts.threshold, opts.low_threshold)
                ranked = sorted(masked, key=lambda p: (p not in chosen, -confidence[p], p))
                n = max(len(chosen), 1)
                if opts.max_tokens_per_step:
                    n = min(n, opts.max_tokens_per_step)
                n = min(max(n, min(floor, len(masked))), len(masked))
            else:
                ranked = sorted(masked, key=lambda p: (-confidence[p], p))
                values = [confidence[p] for p in masked]
            if opts.decoding != "hierarchy":
                n = reference_count(opts.decoding, values, min(floor, len(masked)), threshold=opts.threshold,
                                    factor=opts.factor, gamma=opts.gamma, cap=opts.max_tokens_per_step)
            for p in ranked[:n]:
                canvas[p] = tokens[p]
            steps += 1
    return canvas, steps


@pytest.mark.parametrize("decoding,params", [
    ("threshold", dict(threshold=0.5)),
    ("threshold", dict(threshold=0.2, max_tokens_per_step=2)),
    ("factor", dict(factor=1.0)),
    ("entropy_bound", dict(gamma=1.5)),
    ("hierarchy", dict(threshold=0.6, low_threshold=0.2)),
    ("hierarchy", dict(threshold=0.9, low_threshold=0.3, max_tokens_per_step=2)),
    ("fixed", {}),
])
def test_generations_match_a_straightforward_loop(decoding, params):
    """Three requests of different rules and block shapes batched together, run until
    each one's last block ends; every canvas and step count equals the loop's."""
    options = [parallel_opts(decoding, **params), parallel_opts(decoding, gen=24, block=8, **params),
               parallel_opts("threshold", gen=16, block=16, threshold=0.3)]
    tables = {i: logits_table(o.gen_length, seed=10 + i, scale=4.0) for i, o in enumerate(options)}
    batch = admit([(o, i) for i, o in enumerate(options)])
    model = TableModel(tables)
    steps = {i: 0 for i in range(len(options))}
    while len(live := batch.unfinished()):
        run_step(batch, live, model)
        for slot in live.tolist():
            steps[slot] += 1
    for i, o in enumerate(options):
        canvas, expected_steps = reference_generation(tables[i], o)
        assert batch.canvas(i) == canvas
        assert steps[i] == expected_steps
        assert int(batch.state.num_final(torch.tensor([i]), o.gen_length)[0]) == o.gen_length
    if decoding != "fixed":
        assert steps[0] < options[0].steps  # blocks ended early: fewer steps than the schedule


def test_credit_generation_matches_a_dense_credit_loop():
    """Logits that change with the canvas (three tables, by how many positions are
    committed), so a position's top token changes between steps and credit moves
    between tokens; the reference keeps dInfer's dense [position, vocabulary] credit."""
    params = dict(threshold=0.5, credit_alpha=0.7, credit_decay=0.8, credit_boost=0.2)
    opts = parallel_opts("credit", gen=16, block=8, **params)
    tables = [logits_table(16, seed=s, scale=2.0) for s in (21, 22, 23)]
    batch = admit([(opts, 0)])

    def model(cand_slots, positions):
        committed = int((torch.tensor(batch.canvas(0)) != MASK).sum())
        return tables[committed % 3][positions]

    steps = 0
    while len(batch.unfinished()):
        run_step(batch, batch.slots, model)
        steps += 1

    canvas, credit, expected_steps = [MASK] * 16, torch.zeros(16, tables[0].shape[1]), 0
    for block in range(2):
        positions = range(8 * block, 8 * block + 8)
        while masked := [p for p in positions if canvas[p] == MASK]:
            table = tables[sum(t != MASK for t in canvas) % 3]
            token, confidence = {}, {}
            for p in masked:
                probs = torch.softmax(table[p], dim=-1)
                credit[p] *= params["credit_decay"]
                credit[p, int(probs.argmax())] += float(probs.max()) ** params["credit_boost"]
                fused = torch.softmax(table[p] + params["credit_alpha"] * torch.log1p(credit[p]), dim=-1)
                token[p], confidence[p] = int(fused.argmax()), float(fused.max())
            ranked = sorted(masked, key=lambda p: (-confidence[p], p))
            n = max(1, sum(confidence[p] >= params["threshold"] for p in masked))
            for p in ranked[:n]:
                canvas[p] = token[p]
            expected_steps += 1
    assert batch.canvas(0) == canvas
    assert steps == expected_steps < 16


def test_a_restarted_block_forgets_the_credit_of_returned_positions():
    """Structured outputs return rejected tokens to the mask and restart their block:
    the credit that chose them (from the returned position on) starts over, the
    credit before it stays."""
    opts = parallel_opts("credit", gen=16, block=8, threshold=0.99, credit_alpha=0.7, credit_decay=0.8,
                         credit_boost=0.2)
    batch = admit([(opts, 0), (opts, 1)])
    table = logits_table(16, seed=5, scale=2.0)
    run_step(batch, batch.slots, lambda cand_slots, positions: table[positions])
    credit = batch.rule.parallel
    before_tokens, before_values = credit.credit_tokens.clone(), credit.credit_values.clone()
    assert (before_values[:, :8] > 0).any(dim=-1).all()  # every position of the first block has credit
    batch.rule.restart_block(torch.tensor([1]), torch.tensor([3]))
    assert torch.equal(credit.credit_tokens[0], before_tokens[0])  # another request: untouched
    assert torch.equal(credit.credit_values[1, :3], before_values[1, :3])
    assert (credit.credit_tokens[1, 3:] == -1).all() and (credit.credit_values[1, 3:] == 0).all()


def test_a_block_ends_when_it_has_no_masks_and_the_next_one_starts():
    opts = parallel_opts("threshold", gen=16, block=8, threshold=0.0)  # everything is confident enough
    batch = admit([(opts, 0)])
    model = TableModel({0: logits_table(16, seed=3)})
    record = run_step(batch, batch.slots, model)
    assert record.newly() == list(range(8))  # the whole first block in one step
    assert (int(batch.state.block[0]), int(batch.state.block_step[0])) == (1, 0)
    run_step(batch, batch.slots, model)
    assert int(batch.state.block[0]) == 2 and len(batch.unfinished()) == 0  # 16 tokens in 2 steps
    assert MASK not in batch.canvas(0)


# ---- options ---------------------------------------------------------------

from tests.unit.test_options import dream, llada, res  # noqa: E402
from vllm_dllm.options import OptionError  # noqa: E402


def test_decoding_options_resolve_per_request_and_as_server_defaults():
    options = res(llada(), {"decoding": "threshold", "threshold": 0.7, "max_tokens_per_step": 4})
    assert (options.decoding, options.threshold, options.max_tokens_per_step) == ("threshold", 0.7, 4)
    assert res(llada()).decoding == "fixed"  # the default stays the exact schedule
    server = llada(server={"decoding": "entropy_bound", "gamma": 0.5})
    assert (res(server).decoding, res(server).gamma) == ("entropy_bound", 0.5)
    # A request may choose another rule than the server's; the server's parameter is not blamed.
    assert res(server, {"decoding": "factor", "factor": 2}).factor == 2.0


@pytest.mark.parametrize("extra,message", [
    ({"decoding": "greedy"},
     "unknown decoding rule 'greedy': diffusion option 'decoding' must be fixed, threshold, factor, entropy_bound, "
     "hierarchy or credit"),
    ({"decoding": "threshold", "threshold": 1.5}, "diffusion option 'threshold' must lie in (0, 1], got 1.5"),
    ({"decoding": "factor", "factor": 0}, "diffusion option 'factor' must be > 0, got 0"),
    ({"decoding": "factor", "threshold": 0.8},
     "diffusion option 'threshold' only applies with decoding 'threshold', 'hierarchy' or 'credit', "
     "but 'decoding' is 'factor'"),
    ({"decoding": "credit", "credit_decay": 1.5}, "diffusion option 'credit_decay' must lie in [0, 1], got 1.5"),
    ({"decoding": "threshold", "low_threshold": 0.2},
     "diffusion option 'low_threshold' only applies with decoding 'hierarchy', but 'decoding' is 'threshold'"),
    ({"decoding": "hierarchy", "threshold": 0.5, "low_threshold": 0.6},
     "diffusion option 'low_threshold'=0.6 must not exceed 'threshold'=0.5 (decoding 'hierarchy')"),
    ({"max_tokens_per_step": 2},
     "diffusion option 'max_tokens_per_step' only applies with a parallel decoding rule "
     "(threshold, factor, entropy_bound, hierarchy or credit), but 'decoding' is 'fixed'"),
    ({"decoding": "threshold", "remasking": "random"},
     "decoding 'threshold' ranks positions by the model's confidence; it cannot be combined with remasking 'random'"),
])
def test_bad_decoding_options_are_refused_with_one_clear_sentence(extra, message):
    with pytest.raises(OptionError) as info:
        res(llada(), extra, max_tokens=16)
    assert str(info.value) == message


def test_dream_decodes_in_parallel_over_confidence_ranking_algs_only():
    options = res(dream(), {"decoding": "threshold", "alg": "maskgit_plus", "threshold": 0.5}, max_tokens=16)
    assert (options.decoding, options.threshold) == ("threshold", 0.5)
    with pytest.raises(OptionError, match="cannot be combined with alg 'origin'"):
        res(dream(), {"decoding": "threshold"}, max_tokens=16)  # origin is Dream's default alg
    assert res(dream(), {"decoding": "credit", "alg": "maskgit_plus", "credit_alpha": 1.0}, max_tokens=16).credit_alpha == 1.0
    with pytest.raises(OptionError, match="cannot be combined with alg_temp"):
        res(dream(), {"decoding": "factor", "alg": "entropy", "alg_temp": 0.5}, max_tokens=16)


# ---- scheduler pricing under data-dependent progress -----------------------


def test_scheduler_prices_the_reported_progress_and_bounds_the_rest_by_the_schedule():
    from vllm_dllm.scheduler.track import RequestTrack

    options = res(llada(), {"decoding": "threshold", "block_length": 8, "cache": "dual"}, max_tokens=32)
    track = RequestTrack(options, prompt_len=10, blocks=1)
    assert track.tokens == 42  # no cache yet: a Refresh of prompt + canvas
    assert len(track.profile()) == options.steps  # the fixed schedule: 4 blocks x 8 steps
    track.advance(track.phase(), (0, 1))
    assert track.has_cache and track.tokens == 8  # the Refresh filled the cache: a Reuse of the first block
    track.advance(track.phase(), (1, 0))  # the block had no masks left after two steps
    assert track.tokens == 42  # the next block starts with a Refresh
    profile = track.profile()
    assert len(profile) == 3 * 8 and profile[0] == 42 and profile[1] == 8
    track.advance(track.phase(), None)  # no report (an engine without one): the fixed schedule's next step
    assert (track.block, track.block_step) == (1, 1)
