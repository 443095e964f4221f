"""LLaDA2.0 and LLaDA2.1 decoding through vLLM's engine, token for token against the
oracle's generate() (tests/oracle_llada2.py: a plain whole-window forward with the
block-causal mask at every step, no cache), batched and one at a time, under the
official rule and the parallel rules (`decoding`); and no forward is spent on the K/V
of a finished block: a request runs exactly the reference's forwards.  One setting
(2.1's speed mode at block 32, a prompt one past a block boundary) is also checked
against a loop laid out as the release's generate() (release_generate), so the oracle's
reading of the block window, the post steps and EOS is checked too.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from vllm import SamplingParams

from tests.conftest import random_prompt
from tests.oracle_llada2 import llada2_generate, load_llada2_oracle
from tests.tie_free import compare_each_case
from lab import eval as task_eval
from vllm_dllm.options import LLADA2_MODES


@dataclass
class Case:
    name: str
    prompt_len: int
    max_tokens: int
    extra: dict = field(default_factory=dict)
    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed,
                              top_k=self.top_k, top_p=self.top_p, extra_args=dict(self.extra))

    def reference_options(self) -> dict:
        options = dict(self.extra)
        # The oracle returns up to the first EOS either way, as a request ends there.
        options.pop("eos_early_stop", None)
        mode = options.pop("mode", None)
        if mode is not None:
            options = {**LLADA2_MODES[mode], **options}
        return options


# Block length 8 on the tiny model; prompts shorter than a block, exactly one, one
# past one, and several blocks long.
CASES = [
    Case("2.0, short prompt, threshold 0.95, a token per step", 5, 24, {"block_length": 8, "steps": 8}),
    Case("2.0, one-block prompt, threshold 0.5, steps < block", 8, 16, {"block_length": 8, "steps": 4, "threshold": 0.5}),
    Case("2.0, one past a block, steps > block", 9, 20, {"block_length": 8, "threshold": 0.5}),
    Case("2.0, defaults (block 32, steps 32, threshold 0.95)", 19, 30, {}),
    Case("2.0, several prompt blocks", 27, 12, {"block_length": 8, "steps": 8, "threshold": 0.7}),
    Case("2.0, threshold 0: a block's masks commit at once", 6, 16, {"block_length": 8, "steps": 8, "threshold": 0.0}),
    Case("2.1, quality mode", 13, 20, {"block_length": 8, "mode": "quality"}),
    Case("2.1, speed mode", 3, 12, {"block_length": 8, "mode": "speed"}),
    Case("2.1, the signature's defaults", 8, 16, {"block_length": 8, "editing_threshold": 0.9}),
    Case("2.1, no post steps", 9, 16, {"block_length": 8, "mode": "quality", "max_post_steps": 0}),
    Case("2.1, two post steps, two per step", 17, 16,
         {"block_length": 8, "mode": "quality", "max_post_steps": 2, "num_to_transfer": 2}),
    Case("2.0 sampled, top-k and top-p", 6, 16, {"block_length": 8, "steps": 8}, temperature=0.8, seed=3,
         top_k=20, top_p=0.9),
    Case("2.1 sampled", 10, 16, {"block_length": 8, "mode": "quality"}, temperature=0.7, seed=5),
    # IterSmooth: the block's masked positions fed their expected embeddings, the
    # official threshold falling from 1.
    Case("2.0, IterSmooth, threshold 0.5", 6, 24, {"block_length": 8, "steps": 8, "threshold": 0.5,
                                                   "iter_smooth": True}),
    Case("2.1 quality, IterSmooth at weight 0.5", 11, 16,
         {"block_length": 8, "mode": "quality", "iter_smooth": True, "smooth_weight": 0.5}),
]


@pytest.fixture(scope="module")
def served(tiny_dirs):
    model_dir = tiny_dirs("llada2")
    runner = task_eval.OfflineRunner(
        model_dir,
        dict(dtype="float32", max_model_len=256, max_num_seqs=16, kv_cache_memory_bytes=64 << 20,
             enforce_eager=True, gpu_memory_utilization=0.3, seed=0),
    )
    yield model_dir, runner
    runner.engine.engine_core.shutdown()


def run(runner, prompts: list[list[int]], cases: list[Case]) -> list[list[int]]:
    order = []
    for prompt, case in zip(prompts, cases):
        req_id = f"llada2-{runner._next_id}"
        runner._next_id += 1
        order.append(req_id)
        runner.engine.add_request(req_id, {"prompt_token_ids": prompt}, case.params())
    done = {}
    while runner.engine.has_unfinished_requests():
        for out in runner.engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[req_id] for req_id in order]


def counter(runner, name: str) -> float:
    import prometheus_client

    return prometheus_client.REGISTRY.get_sample_value(f"vllm:diffusion_num_{name}_total", runner.labels) or 0.0


def reference(oracle, ids, case: Case, prompt: list[int], **overrides):
    options = {**case.reference_options(), **overrides}
    return llada2_generate(
        oracle, prompt, gen_length=case.max_tokens, mask_id=ids["mask_token_id"], eos_id=ids["eos_token_id"],
        temperature=case.temperature, top_k=case.top_k or None, top_p=case.top_p if case.top_p < 1 else None,
        seed=case.seed, **options,
    )


def compare_cases(served, cases: list[Case], seed: int, check=None) -> set[str]:
    """Every case batched with the others (fresh prompts per draw) and alone, against
    the reference token for token, with its forwards and edits; `check(case, prompt,
    want)` runs on each tie-free comparison.  Returns the cases that edited."""
    model_dir, runner = served
    ids = json.loads((Path(model_dir) / "generation_config.json").read_text())
    oracle = load_llada2_oracle(model_dir)
    edited = set()

    def compare_draw(draw: int, pending: list[Case]) -> list[Case]:
        rng = random.Random(seed + draw)
        prompts = [random_prompt(rng, case.prompt_len) for case in pending]
        batched = run(runner, prompts, pending)
        tied = []
        for case, prompt, got in zip(pending, prompts, batched):
            before, edits_before = runner._steps(), counter(runner, "edited_tokens")
            alone = run(runner, [prompt], [case])[0]
            forwards, edits = runner._steps() - before, counter(runner, "edited_tokens") - edits_before
            assert alone == got, f"{case.name}: batching changed the output"
            want = reference(oracle, ids, case, prompt)
            if want.ties:
                tied.append(case)
                continue
            assert got == want.tokens, f"{case.name}: plugin {got} != reference {want.tokens}"
            # Every step of the plugin is one of the reference's forwards (the K/V of a
            # finished block are written by the next block's first step), and it stops
            # as soon as its output is final.
            assert forwards == want.forwards_to_output <= want.forwards, (
                f"{case.name}: {forwards} steps, the reference's output was final after "
                f"{want.forwards_to_output} of its {want.forwards} forwards"
            )
            assert edits == want.edits, f"{case.name}: {edits} edits counted, the reference made {want.edits}"
            if want.edits:
                edited.add(case.name)
            if check is not None:
                check(case, prompt, want, lambda **overrides: reference(oracle, ids, case, prompt, **overrides))
        return tied

    compare_each_case(cases, compare_draw)
    return edited


def test_plugin_matches_the_reference_batched_and_alone_with_its_forwards(served):
    smoothed = set()

    def check(case, prompt, want, reference_with):
        # IterSmooth's embeddings do reach the model: without them the reference decodes otherwise.
        if case.extra.get("iter_smooth"):
            plain = reference_with(iter_smooth=False, smooth_weight=0.3)
            if (want.tokens, want.forwards) != (plain.tokens, plain.forwards):
                smoothed.add(case.name)

    edited = compare_cases(served, CASES, 11, check)
    # The 2.1 cases do exercise token editing on this model.
    assert len(edited) >= 4, sorted(edited)
    assert smoothed, "IterSmooth changed no reference run"


def release_generate(model, prompt: list[int], *, gen_length: int, block_length: int, threshold: float,
                     editing_threshold: float, max_post_steps: int, num_to_transfer: int, eos_early_stop: bool,
                     mask_id: int, eos_id: int) -> list[int]:
    """LLaDA2.1's generate() at temperature 0, laid out as the release lays it out and
    kept apart from the oracle's bookkeeping: absolute positions, blocks aligned to
    multiples of `block_length` from position 0 (so the prompt's partial last block is
    the first one decoded), each step one forward over the window up to the active
    block's end; the prompt's positions in that block are never edited, the previous
    block's never again (it is outside the active block), and the next block's are
    not in the window.  A step that begins without masks is a post step; the loop
    leaves the block before the forward of post step max_post_steps + 1, or after a
    step that began without masks and edited nothing.  With eos_early_stop it stops
    after a block once the generated part has no masks and holds an EOS; the answer
    is cut after its first EOS either way.  The plugin's one departure is kept: the
    mask id is never the predicted token."""
    import torch

    from tests.oracle_llada2 import block_causal_mask

    length = len(prompt)
    num_blocks = -(-(length + gen_length) // block_length)
    x = torch.full((num_blocks * block_length,), mask_id, dtype=torch.long)
    x[:length] = torch.tensor(prompt)
    attend = block_causal_mask(len(x), block_length)
    for block in range(length // block_length, num_blocks):
        start, end = block * block_length, (block + 1) * block_length
        in_prompt = torch.arange(start, end) < length
        post_steps = 0
        while True:
            before = x[start:end].clone()
            masked = before == mask_id
            if not masked.any():
                post_steps += 1
            if post_steps > max_post_steps:
                break
            logits = model.forward(x[:end], attend[:end, :end])[start:end]
            predicted = logits.masked_fill(torch.arange(logits.shape[1]) == mask_id, float("-inf")).argmax(-1)
            p = torch.softmax(logits, -1).gather(1, predicted[:, None]).squeeze(1)
            fill = torch.zeros_like(masked)
            if masked.any():
                confidence = torch.where(masked, p, torch.tensor(float("-inf")))
                sure = masked & (confidence > threshold)
                if int(sure.sum()) >= num_to_transfer:
                    fill = sure
                else:
                    fill[confidence.topk(min(num_to_transfer, int(masked.sum()))).indices] = True
            edit = ~masked & ~in_prompt & (p > editing_threshold) & (predicted != before)
            x[start:end] = torch.where(fill | edit, predicted, before)
            if not masked.any() and not edit.any():
                break
        generated = x[length:end]
        if eos_early_stop and not (generated == mask_id).any() and (generated == eos_id).any():
            break
    answer = x[length:length + gen_length].tolist()
    return answer[:answer.index(eos_id) + 1] if eos_id in answer else answer


# LLaDA2.1's speed mode at block 32 with a prompt one past a block boundary: the
# prompt's last token shares the first decoded block, the output's 32nd token is the
# first position of the third block, and every block runs post steps with editing at
# threshold 0 (any changed prediction is rewritten).
BOUNDARY_CASES = [
    Case("2.1 speed, block 32, prompt one past a block, 32 tokens", 33, 32, {"block_length": 32, "mode": "speed"}),
    Case("2.1 speed, block 32, prompt one past a block, 96 tokens", 33, 96, {"block_length": 32, "mode": "speed"}),
    Case("2.1 speed, block 32, prompt one past a block, 96 tokens, eos_early_stop", 33, 96,
         {"block_length": 32, "mode": "speed", "eos_early_stop": True}),
]


def test_speed_mode_one_past_a_block_boundary_matches_the_release_loop(served):
    model_dir, _ = served
    ids = json.loads((Path(model_dir) / "generation_config.json").read_text())
    oracle = load_llada2_oracle(model_dir)
    reached = []

    def check(case, prompt, want, reference_with):
        options = case.reference_options()
        for stop in (False, True):
            release = release_generate(
                oracle, prompt, gen_length=case.max_tokens, block_length=options["block_length"],
                threshold=options["threshold"], editing_threshold=options["editing_threshold"],
                max_post_steps=options["max_post_steps"], num_to_transfer=1, eos_early_stop=stop,
                mask_id=ids["mask_token_id"], eos_id=ids["eos_token_id"])
            assert release == want.tokens, f"{case.name}, eos_early_stop {stop}: release loop {release} != oracle"
        if len(want.tokens) >= 32:
            reached.append(case.name)

    edited = compare_cases(served, BOUNDARY_CASES, 47, check)
    assert edited == {case.name for case in BOUNDARY_CASES}, sorted(edited)
    # The third block's first position is part of the compared output.
    assert len(reached) >= 2, reached


# The parallel rules (decoding/parallel.py) in place of the official choice of masks,
# with and without 2.1's editing, batched with requests of the official rule.
PARALLEL_CASES = [
    Case("threshold", 5, 24, {"block_length": 8, "steps": 8, "decoding": "threshold", "threshold": 0.3}),
    Case("threshold, at most 2 a step", 9, 16,
         {"block_length": 8, "steps": 8, "decoding": "threshold", "threshold": 0.05, "max_tokens_per_step": 2}),
    Case("factor, steps > block (the quota's trailing zeros)", 8, 16,
         {"block_length": 8, "steps": 16, "decoding": "factor", "factor": 1.5}),
    Case("entropy_bound", 13, 16, {"block_length": 8, "steps": 8, "decoding": "entropy_bound", "gamma": 3.0}),
    Case("hierarchy", 3, 20, {"block_length": 8, "steps": 8, "decoding": "hierarchy", "threshold": 0.5,
                              "low_threshold": 0.05}),
    Case("credit", 10, 16, {"block_length": 8, "steps": 4, "decoding": "credit", "threshold": 0.3}),
    Case("credit sampled, top-k and top-p", 6, 16,
         {"block_length": 8, "steps": 8, "decoding": "credit", "threshold": 0.2, "credit_alpha": 1.0},
         temperature=0.8, seed=3, top_k=20, top_p=0.9),
    Case("entropy_bound sampled", 11, 16, {"block_length": 8, "steps": 8, "decoding": "entropy_bound", "gamma": 4.0},
         temperature=0.7, seed=5),
    Case("2.1 quality, threshold", 13, 16, {"block_length": 8, "mode": "quality", "decoding": "threshold"}),
    Case("2.1 speed, hierarchy", 4, 16, {"block_length": 8, "mode": "speed", "decoding": "hierarchy",
                                         "low_threshold": 0.05, "max_post_steps": 4}),
    Case("2.1, factor, two a step at least", 9, 16, {"block_length": 8, "editing_threshold": 0.5, "decoding": "factor",
                                                    "factor": 1.5, "num_to_transfer": 2, "max_post_steps": 2}),
    Case("2.1, entropy_bound", 16, 16, {"block_length": 8, "mode": "quality", "decoding": "entropy_bound",
                                        "gamma": 3.0}),
    Case("2.1 sampled, credit", 7, 16, {"block_length": 8, "mode": "quality", "decoding": "credit", "threshold": 0.4},
         temperature=0.7, seed=9),
    Case("threshold, IterSmooth with the threshold flat", 7, 16,
         {"block_length": 8, "steps": 8, "decoding": "threshold", "threshold": 0.3, "iter_smooth": True,
          "smooth_threshold_decay": 0.0}),
    # The official rule in the same batches.
    CASES[0],
    CASES[5],
]


def test_parallel_rules_match_the_reference_batched_and_alone(served):
    differs = set()

    def check(case, prompt, want, reference_with):
        # The rules do choose otherwise than the official rule on this model (the
        # threshold rule is the official one up to >= for > and its one-a-step floor,
        # so it may agree).
        official = reference_with(decoding="fixed")
        if (want.tokens, want.forwards_to_output) != (official.tokens, official.forwards_to_output):
            differs.add(case.name)

    edited = compare_cases(served, PARALLEL_CASES, 31, check)
    assert len(differs) >= 7, sorted(differs)
    assert {"2.1 quality, threshold", "2.1 speed, hierarchy"} <= edited, sorted(edited)
    # A parameter the chosen rule does not read is refused (vLLM's validation error:
    # HTTP 400 on the server).
    from vllm.exceptions import VLLMValidationError

    _, runner = served
    bad = Case("bad", 4, 8, {"decoding": "factor", "threshold": 0.8}).params()
    with pytest.raises(VLLMValidationError, match="'threshold' only applies with decoding 'fixed', 'threshold'"):
        runner.engine.add_request("llada2-bad", {"prompt_token_ids": [5, 6, 7, 8]}, bad)


def test_preempted_mid_block_resumes_with_the_same_tokens(tiny_dirs, monkeypatch):
    """Under priority scheduling a higher-priority request takes the only KV block of
    a running one mid-block; the preempted request's next step recomputes its prefix
    (prompt and finished blocks) with its active block, and it decodes exactly as
    if never preempted, with and without token editing."""
    from tests.conftest import close_engine, make_engine

    model_dir = tiny_dirs("llada2")
    ids = json.loads((Path(model_dir) / "generation_config.json").read_text())
    # The engine core in this process: one core step per engine.step(), so "mid-block"
    # is a number of calls (a separate core runs ahead of the client, and with token
    # editing a block's steps stream nothing until it ends).
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # One 128-token CPU block per request (2 layers x 1 KV head of 64, float32: 128 KiB)
    # and a pool of two, one of them vLLM's null block: one request holds KV at a time.
    # One denoising step per call, so that a number of calls is a number of steps.
    llm = make_engine(model_dir, scheduling_policy="priority", max_model_len=128, kv_cache_memory_bytes=2 * 131072,
                      additional_config={"dllm": {"max_steps_per_call": 1}})
    engine = llm.llm_engine
    rng = random.Random(23)
    oracle = load_llada2_oracle(model_dir)
    cases = [Case("2.0", 12, 32, {"block_length": 8, "steps": 8, "threshold": 0.9}),
             Case("2.1", 12, 32, {"block_length": 8, "mode": "quality", "max_post_steps": 2})]
    try:
        for case in cases:
            low_prompt, high_prompt = random_prompt(rng, case.prompt_len), random_prompt(rng, 7)
            engine.add_request(f"low-{case.name}", {"prompt_token_ids": low_prompt}, case.params(), priority=5)
            streamed = 0
            for _ in range(14):  # into its third canvas block (blocks of 8, the first has 4 masks)
                for out in engine.step():
                    streamed = len(out.outputs[0].token_ids)
            assert engine.has_unfinished_requests() and 0 < streamed < case.max_tokens
            high = Case("high", 7, 16, {"block_length": 8, "steps": 8})
            engine.add_request(f"high-{case.name}", {"prompt_token_ids": high_prompt}, high.params(), priority=0)
            finished, outputs = [], {}
            for _ in range(400):
                if not engine.has_unfinished_requests():
                    break
                for out in engine.step():
                    if out.finished:
                        finished.append(out.request_id)
                        outputs[out.request_id] = list(out.outputs[0].token_ids)
            assert not engine.has_unfinished_requests(), f"{case.name}: still running after 400 steps"
            assert finished == [f"high-{case.name}", f"low-{case.name}"]
            for name, prompt, c in ((f"low-{case.name}", low_prompt, case), (f"high-{case.name}", high_prompt, high)):
                want = llada2_generate(oracle, prompt, gen_length=c.max_tokens, mask_id=ids["mask_token_id"],
                                       eos_id=ids["eos_token_id"], **c.reference_options())
                assert want.ties or outputs[name] == want.tokens, f"{name}: {outputs[name]} != {want.tokens}"
    finally:
        close_engine(llm)


@pytest.fixture(scope="module")
def eos_prone_dir(tmp_path_factory):
    """A tiny LLaDA2 whose LM head predicts EOS where it used to predict one common
    token, so EOS shows up mid-canvas."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.oracle_llada2 import block_causal_mask
    from vllm_dllm.tools.make_tiny import make_tiny

    model_dir = make_tiny("llada2", tmp_path_factory.mktemp("llada2-eos") / "llada2", seed=7)
    ids = json.loads((model_dir / "generation_config.json").read_text())
    tokens = torch.tensor(random_prompt(random.Random(0), 8) + [ids["mask_token_id"]] * 24)
    logits = load_llada2_oracle(str(model_dir)).forward(tokens, block_causal_mask(32, 8))[8:]
    logits[:, ids["mask_token_id"]] = float("-inf")
    common = int(torch.bincount(logits.argmax(dim=-1)).argmax())
    weights = load_file(model_dir / "model.safetensors")
    weights["lm_head.weight"][ids["eos_token_id"]] = weights["lm_head.weight"][common] * 1.3
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return str(model_dir)


def test_a_request_ends_at_its_first_final_eos_with_or_without_eos_early_stop(eos_prone_dir):
    from tests.conftest import close_engine, make_engine

    ids = json.loads((Path(eos_prone_dir) / "generation_config.json").read_text())
    oracle = load_llada2_oracle(eos_prone_dir)
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (4, 9, 15, 22)]
    settings = [{"block_length": 8, "steps": 8}, {"block_length": 8, "mode": "quality"}]
    llm = make_engine(eos_prone_dir)
    try:
        outputs = {}
        for stop in (False, True):
            params = [SamplingParams(max_tokens=32, temperature=0.0, extra_args={**s, "eos_early_stop": stop})
                      for s in settings for _ in prompts]
            outs = llm.generate([{"prompt_token_ids": p} for _ in settings for p in prompts], params, use_tqdm=False)
            outputs[stop] = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
    finally:
        close_engine(llm)
    assert outputs[False] == outputs[True]
    ended_early = 0
    for (got, finish), (setting, prompt) in zip(outputs[True], [(s, p) for s in settings for p in prompts]):
        want = llada2_generate(oracle, prompt, gen_length=32, mask_id=ids["mask_token_id"], eos_id=ids["eos_token_id"],
                               **Case("", 0, 0, setting).reference_options())
        assert want.ties or got == want.tokens, f"{setting}: {got} != {want.tokens}"
        if len(got) < 32:
            assert got[-1] == ids["eos_token_id"] and ids["eos_token_id"] not in got[:-1] and finish == "stop"
            ended_early += 1
    assert ended_early >= 2


def test_lookahead_admission_over_a_small_pool_keeps_every_output_exact(tiny_dirs):
    # Lookahead admission prices each request's future block steps (editing's bound
    # included); a pool of three usable blocks makes requests wait for each other.
    from tests.conftest import close_engine, make_engine

    model_dir = tiny_dirs("llada2")
    ids = json.loads((Path(model_dir) / "generation_config.json").read_text())
    llm = make_engine(model_dir, max_model_len=128, kv_cache_memory_bytes=4 * 131072,
                      additional_config={"dllm": {"admission": "lookahead"}})
    rng = random.Random(3)
    cases = [Case("2.1", rng.randint(3, 20), 24, {"block_length": 8, "mode": "quality"}) if i % 2 else
             Case("2.0", rng.randint(3, 20), 24, {"block_length": 8, "steps": 8}) for i in range(6)]
    prompts = [random_prompt(rng, case.prompt_len) for case in cases]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [c.params() for c in cases], use_tqdm=False)
    finally:
        close_engine(llm)
    oracle = load_llada2_oracle(model_dir)
    for case, prompt, out in zip(cases, prompts, outs):
        want = llada2_generate(oracle, prompt, gen_length=case.max_tokens, mask_id=ids["mask_token_id"],
                               eos_id=ids["eos_token_id"], **case.reference_options())
        assert want.ties or list(out.outputs[0].token_ids) == want.tokens, case.name
