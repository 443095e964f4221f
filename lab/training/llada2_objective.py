"""LLaDA2's block-diffusion training objective (BD3-LM's two-copy layout, as dFactory
trains LLaDA2), with LLaDA2.1's token editing, multiply's running-sum term and
working-first masking: what a training step asks of the model in training/llada2.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def extend_to_block(canvas: list[int], prompt_len: int, block_length: int, pad: int) -> list[int]:
    """The canvas padded with `pad` to the end of its last block, as the decoder's
    window is (the reference's last block runs past `max_tokens`)."""
    end = -(-(prompt_len + len(canvas)) // block_length) * block_length
    return canvas + [pad] * (end - prompt_len - len(canvas))


def two_copy_layout(prompts: list[list[int]], canvases: list[list[int]], block_length: int, pad: int):
    """The block-diffusion training layout (BD3-LM's, as dFactory trains LLaDA2): each
    row is the clean sequence x0 (prompt and answer canvas) followed by a noisy copy of
    the blocks that hold canvas positions.  Attention (`mask`): clean queries are
    block-causal over clean keys; a noisy block sees the clean blocks before it and
    itself (its noisy copy), nothing else, so every block is trained as the decoder
    meets it: earlier blocks final, its own partly masked.  The prompt part of the
    first noisy block (the prompt's partial last block) stays clean.

    The clean copy stops before the last block: no noisy block reads it (each reads
    clean blocks before its own) and no earlier clean block does (block-causal), and
    the loss scores the noisy copy only, so the loss and its gradients are the same
    without it (only the experts' load counts, which `balance` reads, no longer see
    those duplicate tokens).  Where prompts are short that block is a third to a half
    of a row.

    Returns ids, positions, mask, valid, and per row the columns of its canvas
    positions in the noisy copy (`canvas_cols`, -1 past a row's canvas)."""
    rows = []
    width = 0
    for prompt, canvas in zip(prompts, canvases):
        seq = prompt + canvas
        if len(seq) % block_length:
            raise ValueError("canvases must reach a block end (extend_to_block)")
        first = len(prompt) // block_length * block_length  # the noisy copy's start
        context = len(seq) - block_length  # the clean copy's end
        tokens = seq[:context] + seq[first:]
        positions = list(range(context)) + list(range(first, len(seq)))
        noisy = [False] * context + [True] * (len(seq) - first)
        cols = [context + len(prompt) - first + j for j in range(len(canvas))]
        rows.append((tokens, positions, noisy, cols))
        width = max(width, len(tokens))
    b = len(rows)
    g_max = max(len(c) for c in canvases)
    ids = torch.full((b, width), pad, dtype=torch.long)
    pos = torch.zeros((b, width), dtype=torch.long)
    noisy = torch.zeros((b, width), dtype=torch.bool)
    valid = torch.zeros((b, width), dtype=torch.bool)
    canvas_cols = torch.full((b, g_max), -1, dtype=torch.long)
    for i, (tokens, positions, flags, cols) in enumerate(rows):
        n = len(tokens)
        ids[i, :n] = torch.tensor(tokens)
        pos[i, :n] = torch.tensor(positions)
        noisy[i, :n] = torch.tensor(flags)
        valid[i, :n] = True
        canvas_cols[i, : len(cols)] = torch.tensor(cols)
    blocks = pos // block_length
    same = blocks[:, None, :] == blocks[:, :, None]
    before = blocks[:, None, :] < blocks[:, :, None]
    q_noisy, k_noisy = noisy[:, :, None], noisy[:, None, :]
    mask = torch.where(q_noisy, (~k_noisy & before) | (k_noisy & same), ~k_noisy & (before | same))
    mask = (mask & valid[:, None, :]) | torch.eye(width, dtype=torch.bool)[None]
    return ids, pos, mask, valid, canvas_cols


def mask_counts(lengths: torch.Tensor, strata: torch.Tensor,
                mask_range: tuple[float, float] = (0.0, 1.0)) -> torch.Tensor:
    """How many of each row's G canvas positions to mask: the ratio t is the row's
    stratum in [0, 1) mapped onto [lo, hi), and k = floor(t G) + 1 capped at G, so k/G
    lies in (lo, hi + 1/G].  The whole range (the default) is k ~ U{1..G}; a narrower one
    trains those ratios alone, as dFactory's noise range does (its LLaDA2 configs default
    to 0.3-0.8)."""
    lo, hi = mask_range
    t = lo + (hi - lo) * strata
    return torch.minimum((t * lengths).long(), lengths - 1) + 1


def block_diffusion_loss(model, prompts, canvases, block_length: int, mask_id: int, gen: torch.Generator, *,
                         pad_id: int, edit_ratio: float = 0.0, edit_weight: float = 1.0,
                         mask_range: tuple[float, float] = (0.0, 1.0), running_sum=None,
                         working: torch.Tensor | None = None, given: torch.Tensor | None = None):
    """LLaDA2's block-diffusion SFT loss, with LLaDA2.1's token editing when
    `edit_ratio` > 0.  `canvases` reach their last block's end (extend_to_block).

    Masking (M2T): as the LLaDA path (diffusion_loss, training/llada_objective.py), each
    row masks exactly k ~ U{1..G} of its G canvas positions (k stratified over the batch;
    `mask_range` narrows the ratio, mask_counts) and weights the cross-entropy of each
    masked token by 1/k: 1/t over G positions.  One
    ratio per row, shared by its blocks (each block's own ratio is then spread around
    it); each noisy block is predicted from the clean blocks before it.

    Working first (`working`, long [B], or None): a row with working w > 0 masks its
    canvas positions from w on before any of its first w, so every row that asks for
    a result shows the whole working it is computed from (a multiply's sum beside both
    partial products: with each position masked on its own, about 3% of rows did), and
    the working is learned with the result hidden.  Rows with w = 0 mask at random.
    Ordered rows are not corrupted by editing: their result is the one the working as
    written gives, where a replaced working token would ask for the result of a working
    the row does not show (with a tenth of the tokens replaced, two in three 4x2 workings
    had one), and so teach the result from the prompt, past the written working.

    Given working (`given`, long [B], or None): a row's first `given` canvas positions
    are shown as written, never masked, replaced or scored, and its k is drawn over the
    positions after them: the result is asked for from a working the row does not teach
    (training/altered_working.py, whose working is wrong on purpose).

    Editing (T2T): of the canvas positions left unmasked, each is replaced with
    probability `edit_ratio` by another token drawn uniformly from the tokens the
    batch's canvases use (digits, capitals, EOS, ...: LLaDA2.1 corrupts with random
    vocabulary tokens; from a 2304-row vocabulary whose answers use a dozen tokens,
    nearly every such draw would be a token no answer holds, spotted without learning
    to fix anything), and the loss also asks every
    unmasked canvas position for its clean token, replaced or not, weighted
    `edit_weight` / G: the model learns to rewrite wrong tokens and to keep right ones,
    which is what LLaDA2.1's T2T step reads (an edit is made where the prediction
    differs from the token with probability above the editing threshold).

    Running sums (`running_sum`, a (RunningSumTerm, targets [B, G]) pair, training/
    running_sums.py): the term's probe reads the noisy copy's stream after its layer at
    every canvas position with a target (not NaN), and its weighted squared error joins
    the loss.

    Returns (loss, stats): stats has the argmax accuracy on masked answer positions
    (not `pad_id`; None when none was masked), with editing the share of replaced
    tokens the argmax restores and of kept ones it keeps, and with running sums the
    probe's squared error (None when the batch has no target)."""
    b = len(prompts)
    ids, positions, mask, valid, cols = two_copy_layout(prompts, canvases, block_length, pad_id)
    g = torch.tensor([len(c) for c in canvases])
    g_max = int(g.max())
    in_canvas = torch.arange(g_max)[None] < g[:, None]
    if given is None:
        given = torch.zeros(b, dtype=torch.long)
    if tuple(given.shape) != (b,) or bool((given >= g).any()) or bool((given < 0).any()):
        raise ValueError(f"given working lengths {given.tolist()} for canvases of {g.tolist()} positions")
    free = in_canvas & (torch.arange(g_max)[None] >= given[:, None])  # what the loss may mask, replace and score
    strata = ((torch.arange(b) + torch.rand(b, generator=gen)) / b)[torch.randperm(b, generator=gen)]
    k = mask_counts(g - given, strata, mask_range)
    keys = torch.rand(b, g_max, generator=gen)
    keys[~free] = 2.0
    if working is not None:
        if tuple(working.shape) != (b,):
            raise ValueError(f"working lengths of shape {tuple(working.shape)} for {b} canvases")
        result = (torch.arange(g_max)[None] >= working[:, None]) & (working[:, None] > 0) & in_canvas
        keys = keys - result.float()  # keys lie in [0, 1): a result's now precede every working key
    masked = (keys.argsort(1).argsort(1) < k[:, None]) & free
    clean = torch.zeros(b, g_max, dtype=torch.long)
    for i, c in enumerate(canvases):
        clean[i, : len(c)] = torch.tensor(c)
    noisy_tokens = torch.where(masked, mask_id, clean)
    replaced = torch.zeros_like(masked)
    if edit_ratio > 0:
        visible = free & ~masked
        pool = clean[in_canvas].unique()  # the tokens this batch's answers use, uniformly
        draws = pool[torch.randint(len(pool), (b, g_max), generator=gen)]
        replaced = visible & (torch.rand(b, g_max, generator=gen) < edit_ratio) & (draws != clean)
        if working is not None:
            replaced &= (working == 0)[:, None]
        noisy_tokens = torch.where(replaced, draws, noisy_tokens)
    rows = torch.arange(b)[:, None].expand(b, g_max)
    ids[rows[in_canvas], cols[in_canvas]] = noisy_tokens[in_canvas]
    device = next(model.parameters()).device
    term, sum_targets = running_sum if running_sum is not None else (None, None)
    if sum_targets is not None and tuple(sum_targets.shape) != (b, g_max):
        raise ValueError(f"running-sum targets of shape {tuple(sum_targets.shape)} for {b} canvases of up to {g_max}")
    inputs = (ids.to(device), positions.to(device), mask.to(device), valid.to(device))
    if term is None:
        hidden = model.hidden_states(*inputs)
    else:
        hidden, tapped = model.hidden_states_and_tap(*inputs, tap=term.layer)
    scored = masked | (free & (edit_ratio > 0))
    r, c = rows[scored], cols[scored]
    logits = model.logits(hidden[r.to(device), c.to(device)]).float()
    target = clean[scored].to(device)
    ce = F.cross_entropy(logits, target, reduction="none")
    was_masked = masked[scored].to(device)
    weights = torch.where(was_masked, 1.0 / k.float()[r].to(device), edit_weight / (g - given).float()[r].to(device))
    loss = (ce * weights).sum() / b
    sum_error = None
    if term is not None:
        probed = ~torch.isnan(sum_targets) & in_canvas
        if bool(probed.any()):
            sum_error = term.loss(tapped[rows[probed].to(device), cols[probed].to(device)], sum_targets[probed])
            loss = loss + term.weight * sum_error
    with torch.no_grad():
        hits = logits.argmax(-1) == target
        answer = was_masked & (target != pad_id)
        stats = {"answer_accuracy": hits[answer].float().mean().item() if bool(answer.any()) else None}
        if edit_ratio > 0:
            fixed = replaced[scored].to(device)
            kept = ~was_masked & ~fixed
            stats["edit_fixed"] = hits[fixed].float().mean().item() if bool(fixed.any()) else None
            stats["edit_kept"] = hits[kept].float().mean().item() if bool(kept.any()) else None
        if term is not None:
            stats["running_sum_mse"] = None if sum_error is None else sum_error.item()
    return loss, stats
