"""Whether a new request can ever run here, and what it costs: its resolved options,
its sequence against the model length, one step's query tokens against the token
budget, its KV blocks against the pool, and its first step's prompt scoring.

Pure: the scheduler hands in the request's sampling parameters, its prompt length
and the deployment's limits, and gets the request's track or the reason it is
refused (scheduler.py rejects it with that reason).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_dllm.engine.likelihood import elbo_tokens
from vllm_dllm.engine.prompt_scoring import scoring_tokens
from vllm_dllm.kv_footprint import request_slots
from vllm_dllm.options import DecodeOptions, OptionError, ServerSettings, resolve_params, sequence_copies
from vllm_dllm.options.likelihood import RECIPE_OF_KIND, likelihood_request
from vllm_dllm.options.likelihood import model_problem as likelihood_model_problem
from vllm_dllm.options.likelihood import prompt_problem as likelihood_prompt_problem
from vllm_dllm.phases import is_block_causal, max_block_causal_queries
from vllm_dllm.scheduler.track import RequestTrack


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_num_scheduled_tokens: int  # the step's token budget
    block_size: int
    pool_blocks: int  # KV blocks a request may hold: the whole pool
    prefill_chunk: int  # most tokens a block-causal prefill step runs (0: the whole prefix)


def price_request(params, prompt_len: int, defaults, limits: Limits) -> RequestTrack | str:
    """The request's track, or why it cannot run (`defaults`: the server's
    ServerDefaults, with its `deployment_problem`)."""
    if params is None:
        return "diffusion models only serve generation requests"
    try:
        options = resolve_params(defaults, params)
    except OptionError as err:
        return str(err)
    problem = defaults.deployment_problem(options)
    if problem:
        return problem
    options = options.placed(prompt_len)
    seq_len = prompt_len + options.gen_length
    if seq_len > limits.max_model_len:
        padded = f", padded to whole blocks of {options.block_length}" if options.block_causal else ""
        return (
            f"prompt ({prompt_len} tokens) plus generation length "
            f"({options.gen_length}{padded}) exceeds max_model_len {limits.max_model_len}"
        )
    causal = is_block_causal(options)
    chunk = limits.prefill_chunk if causal else 0
    most_queries = max_block_causal_queries(options.block_length, seq_len, chunk) if causal else seq_len
    tokens = most_queries * sequence_copies(options)
    scoring = _scoring_tokens(params, prompt_len, options, tokens, defaults, limits)
    if isinstance(scoring, str):
        return scoring
    slots = request_slots(options, prompt_len)
    if slots > limits.max_model_len:
        # vLLM's KV cache manager caps one request's slots at max_model_len; the
        # prompt-masked twin of classifier-free guidance needs its own.
        return (
            f"with cfg_scale > 0 the prompt ({prompt_len} tokens) plus "
            f"generation length ({options.gen_length}) must fit twice into max_model_len "
            f"{limits.max_model_len}"
        )
    if tokens > limits.max_num_scheduled_tokens:
        return (
            f"one denoising step of this request needs {tokens} tokens, more than "
            f"max_num_batched_tokens {limits.max_num_scheduled_tokens}"
        )
    blocks = -(-slots // limits.block_size)
    if blocks > limits.pool_blocks:
        return f"request needs {blocks} KV blocks, the whole pool has {limits.pool_blocks}"
    scores = params.prompt_logprobs is not None or bool(scoring)
    return RequestTrack(options, prompt_len, blocks, chunk=chunk, scoring=scoring, scores=scores)


def _scoring_tokens(params, prompt_len: int, options: DecodeOptions, step_tokens: int, defaults: ServerSettings,
                    limits: Limits) -> int | str:
    """Query tokens of the request's prompt scoring (prompt_logprobs' copies, the
    ELBO's samples), run with its first step, or why it cannot run."""
    scoring, parts = 0, []
    if params.prompt_logprobs is not None:
        block = options.block_length if is_block_causal(options) else 0
        copies = int(scoring_tokens(np.array([prompt_len]), block)[0])
        scoring += copies
        parts.append(f"prompt_logprobs of a {prompt_len}-token prompt run {prompt_len - 1} masked copies "
                     f"of it ({copies} tokens)")
    try:
        likelihood = likelihood_request(params.extra_args)
    except OptionError as err:
        return str(err)
    if likelihood is not None:
        problem = likelihood_model_problem(defaults.kind) or likelihood_prompt_problem(likelihood, prompt_len)
        if problem:
            return problem
        samples = elbo_tokens(RECIPE_OF_KIND[defaults.kind], prompt_len, likelihood, options.uses_cfg)
        scoring += samples
        twins = " and their guided twins" if options.uses_cfg else ""
        parts.append(f"the ELBO of a {prompt_len}-token prompt runs {likelihood.mc_samples} masked copies "
                     f"of it{twins} ({samples} tokens)")
    if scoring and step_tokens + scoring > limits.max_num_scheduled_tokens:
        return (
            f"{'; '.join(parts)} in its first step, more than max_num_batched_tokens "
            f"{limits.max_num_scheduled_tokens} with the step itself; raise --max-num-batched-tokens"
            + (", lower mc_samples" if likelihood is not None else "") + " or shorten the prompt"
        )
    return scoring
