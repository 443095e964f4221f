"""The LLaDA-format model's training loss (masked diffusion, as LLaDA's SFT) and its
held-out evaluation by exact decoding."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from vllm_dllm.decoding.base import DecodeState, SpecialIds
from vllm_dllm.decoding.rules import make_rule
from vllm_dllm.options import LLADA, LLaDAOptions
from lab.tasks import TEST, Task, score
from lab.training.batches import Encoder, pack


def diffusion_loss(model, ids, lengths, starts, gen_length, mask_id: int, gen: torch.Generator,
                   pad_id: int | None = None) -> tuple[torch.Tensor, float | None]:
    """LLaDA's masked-diffusion SFT loss, in the estimator LLaDA itself uses for likelihoods.

    Each row masks exactly k ~ U{1..G} of its G canvas positions (mask ratio t = k/G,
    k stratified over the batch) and weights the cross-entropy of its masked positions
    by 1/t.  In expectation this is the 1/t-weighted loss with t ~ U(0, 1), but the
    weight never exceeds G: with t drawn continuously, rows with t near 0 carry weights
    of hundreds on a single token, and after gradient clipping one such row decides the
    whole step (the first training run stalled on exactly that).

    Returns the loss and the argmax accuracy on masked positions other than `pad_id`
    (the answer and its end-of-turn, not the EOS padding; None when none was masked).
    The end-of-turn counts: placing it is knowing the answer's length.

    `gen_length` is one canvas length for the batch or a [B] tensor of per-row lengths
    (each row's canvas ends at its own `lengths`).  The loss is the mean over rows of
    each row's 1/t-weighted sum divided by its canvas length, as in LLaDA's SFT.
    """
    b = ids.shape[0]
    g = torch.as_tensor(gen_length, dtype=torch.long).expand(b)
    g_max = int(g.max())
    strata = ((torch.arange(b) + torch.rand(b, generator=gen)) / b)[torch.randperm(b, generator=gen)]
    k = torch.minimum((strata * g).long(), g - 1) + 1
    keys = torch.rand(b, g_max, generator=gen)
    keys[torch.arange(g_max)[None] >= g[:, None]] = 2.0  # beyond a row's canvas: never masked
    order = keys.argsort(1).argsort(1)
    masked = order < k[:, None]
    canvas_pos = starts[:, None] + torch.arange(g_max)[None]  # [B, G]
    rows = torch.arange(b)[:, None].expand_as(canvas_pos)
    row_m, pos_m = rows[masked], canvas_pos[masked]
    noisy = ids.clone()
    noisy[row_m, pos_m] = mask_id
    device = next(model.parameters()).device
    hidden = model.hidden_states(noisy.to(device), lengths.to(device))
    # Logits only where the loss is taken: the prompt never needs them.
    picked = model.logits(hidden[row_m.to(device), pos_m.to(device)]).float()
    target = ids[row_m, pos_m].to(device)
    ce = F.cross_entropy(picked, target, reduction="none")
    # Weight G/k on each masked token, over G positions per row: 1/k.
    weights = (1.0 / k.float())[row_m].to(device)
    answer = target != pad_id if pad_id is not None else torch.ones_like(target, dtype=torch.bool)
    with torch.no_grad():
        hits = (picked.argmax(-1) == target)[answer]
        accuracy = hits.float().mean().item() if hits.numel() else None
    return (ce * weights).sum() / b, accuracy


@torch.no_grad()
def evaluate(model, task: Task, encoder: Encoder, n: int, seed: int, gen_length: int | None = None) -> float:
    """Exact decoding (steps = canvas length, one block, low confidence) on the test split,
    at the task's own canvas length or `gen_length`."""
    rng = random.Random(seed)
    ids = encoder.ids
    special = SpecialIds(mask=ids["mask"], eos=ids["eos"], eot=ids["eot"])
    gen_length = gen_length or task.gen_length
    options = LLaDAOptions(
        gen_length=gen_length, steps=gen_length, block_length=gen_length,
        remasking="low_confidence", temperature=0.0, cfg_scale=0.0,
        logits_eos_inf=False, confidence_eos_eot_inf=False,
    )
    instances = [task.sample(rng, TEST) for _ in range(n)]
    prompts = [encoder.prompt(i.prompt) for i in instances]
    state = DecodeState(n, options.gen_length, special, torch.device("cpu"))
    rule = make_rule(LLADA, state)
    for slot in range(n):
        state.admit(slot, options, seed=0)
        rule.admit(slot, options)
    slots = torch.arange(n)
    device = next(model.parameters()).device
    for _ in range(options.steps):
        batch, lengths, starts = pack(prompts, state.canvas.tolist(), ids["eos"])
        logits = model(batch.to(device), lengths.to(device)).float().cpu()
        rule.denoise(
            slots, slots, options.gen_length,
            lambda rows, positions: rule.reduce(logits[rows, starts[rows] + positions].clone(), slots[rows], positions),
        )
    correct = 0
    for inst, out in zip(instances, state.canvas.tolist()):
        cut = [i for i, tok in enumerate(out) if tok in (ids["eot"], ids["eos"])]
        correct += score(inst, encoder.decode(out[: cut[0]] if cut else out))
    return correct / n
