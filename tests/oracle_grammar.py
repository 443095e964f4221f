"""Grammar-constrained LLaDA decoding written from its definition, a plain
loop over the oracle model that shares no code with the plugin.

LLaDA's `generate` (no cache, fixed schedule, low-confidence remasking, T = 0) over
one request, with an xgrammar matcher standing at the accepted prefix:

1. Before a step, tokens rejected after the last step (from position p on) go back to
   the mask and the block holding p restarts its schedule (step 0 of that block).
2. While the matcher forces a string at the frontier (the first position after the
   accepted prefix), its tokens (the tokenizer's, of the string alone; those the
   matcher accepts) are written there; else while it allows a single token, or
   only stop tokens (then the lowest), that one; up to the end of the frontier's
   block.
3. One forward; the frontier's logits keep only what the matcher allows; every
   masked position of the active block is ranked by its confidence and the block's
   quota of them committed (ties towards the lower position).
4. The canvas's new final tokens (up to the first mask, or all of it once its last
   block ended) are fed to the matcher one by one: the accepted ones stream; from
   the first rejected one on, step 1 returns them to the mask.
"""

from __future__ import annotations

import torch

from tests.oracle import get_num_transfer_tokens
from tests.oracle_rules import cut_is_tied, max_is_tied


def allowed_ids(matcher, xgr, vocab: int) -> list[int]:
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return [v for v in range(vocab) if (words[v // 32] >> (v % 32)) & 1]


@torch.no_grad()
def constrained_llada(model, matcher, xgr, tokenizer, prompt: list[int], *, gen_length: int, steps: int,
                      block_length: int, mask_id: int, stop_ids: set[int], vocab: int):
    """(streamed tokens, ties, forced count, returned count); streaming stops at an
    accepted stop token (included) or when the canvas is all streamed."""
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    p = len(prompt)
    x = torch.tensor([prompt + [mask_id] * gen_length])
    streamed: list[int] = []
    block = block_step = 0
    quotas = None
    returned_at = None
    ties = forced_count = returned_count = 0
    for _ in range(8 * steps * gen_length):  # bounded: every restart streams one more token
        if returned_at is not None:
            canvas = x[0, p:]
            canvas[returned_at:] = mask_id
            block, block_step, returned_at = returned_at // block_length, 0, None
        frontier = len(streamed)
        room = min((frontier // block_length + 1) * block_length, gen_length) - frontier
        while room > 0:
            jump = matcher.find_jump_forward_string()
            tokens = tokenizer.encode(jump, add_special_tokens=False)[:room] if jump else []
            accepted = 0
            for token in tokens:
                if not matcher.accept_token(token):
                    break
                accepted += 1
            matcher.rollback(accepted)
            tokens = tokens[:accepted]
            if not tokens:
                allowed = allowed_ids(matcher, xgr, vocab)
                if len(allowed) == 1 or (allowed and all(a in stop_ids for a in allowed)):
                    tokens = [min(allowed)]
                else:
                    break
            for token in tokens:
                x[0, p + frontier] = token
                assert matcher.accept_token(token)
                streamed.append(token)
                forced_count += 1
                frontier, room = frontier + 1, room - 1
                if token in stop_ids:
                    return streamed, ties, forced_count, returned_count
        if block < num_blocks:
            logits = model.forward(x)[0, p:].double()
            lo, hi = block * block_length, (block + 1) * block_length
            masked = (x[0, p:] == mask_id).nonzero().flatten().tolist()
            candidates = [j for j in masked if lo <= j < hi]
            if block_step == 0:
                quotas = get_num_transfer_tokens(torch.tensor([[True] * len(candidates)]), steps_per_block)[0]
            quota = min(int(quotas[block_step]), len(candidates))
            confidence = torch.full((gen_length,), float("-inf"), dtype=torch.float64)
            tokens = {}
            allowed = set(allowed_ids(matcher, xgr, vocab)) if frontier < gen_length else set()
            for j in candidates:
                row = logits[j].clone()
                if j == frontier:
                    keep = torch.zeros_like(row, dtype=torch.bool)
                    keep[list(allowed)] = True
                    row[~keep] = float("-inf")
                ties += max_is_tied(row)
                tokens[j] = int(row.argmax())
                confidence[j] = torch.softmax(row, dim=0)[tokens[j]]
            ties += cut_is_tied(confidence, quota)
            order = sorted(candidates, key=lambda j: (-float(confidence[j]), j))
            for j in order[:quota]:
                x[0, p + j] = tokens[j]
            block_step += 1
            if block_step == steps_per_block:
                block, block_step = block + 1, 0
        canvas = x[0, p:].tolist()
        final = gen_length if block >= num_blocks else next(
            (j for j, t in enumerate(canvas) if t == mask_id), gen_length)
        for j in range(len(streamed), final):
            if not matcher.accept_token(canvas[j]):
                returned_at = j
                returned_count += final - j
                break
            streamed.append(canvas[j])
            if canvas[j] in stop_ids:
                return streamed, ties, forced_count, returned_count
        if len(streamed) == gen_length:
            return streamed, ties, forced_count, returned_count
    raise AssertionError("constrained decoding did not finish")
