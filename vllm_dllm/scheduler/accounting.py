"""`Request.num_computed_tokens` for diffusion requests, kept the same under every
supported vLLM.

Our scheduler plans steps itself and never runs vLLM's `_update_after_schedule`,
which advances the counter for autoregressive steps.  vLLM 0.33's and
0.34's `update_from_output` nevertheless edits it: on a stop it subtracts the tokens it
trims after the stop, assuming the counter "covers all new tokens but the last one".
Left at 0, the counter would go negative.  So, for every request a step ran, we set
vLLM's own convention before its update: the step processed the whole sequence, so
every token vLLM holds plus the step's new tokens but the last is computed.  After
the update (and any trim) that is `num_tokens - 1` once a request has output, or
`num_tokens` for a step that committed nothing.  vLLM 0.32 does not trim the counter,
so there we subtract the trimmed tokens ourselves.
"""

from __future__ import annotations

from vllm_dllm.serving.compat import output_rows, stop_trims_computed_tokens


def computed_before_update(num_tokens: int, num_new: int) -> int:
    """The counter vLLM's update expects for a request holding `num_tokens` tokens
    whose step returned `num_new` more."""
    return num_tokens + max(num_new - 1, 0)


class ComputedTokensAccounting:
    """Scheduler mixin (before vLLM's Scheduler in the bases) that keeps the counter."""

    # Whether the base class's update_from_output trims the counter at a stop.
    base_trims_on_stop: bool = stop_trims_computed_tokens()

    def update_from_output(self, scheduler_output, model_runner_output):
        ran, rows = {}, output_rows(model_runner_output)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            index = rows.get(req_id)
            if request is None or index is None or request.is_finished():
                continue
            num_new = len(model_runner_output.sampled_token_ids[index])
            request.num_computed_tokens = computed_before_update(request.num_tokens, num_new)
            ran[req_id] = (request, request.num_tokens, num_new)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if not self.base_trims_on_stop:
            for request, tokens_before, num_new in ran.values():
                trimmed = num_new - (request.num_tokens - tokens_before)
                if trimmed > 0:
                    request.num_computed_tokens -= trimmed
        return outputs
