"""What one engine call of the step engine returns to its runner.  Imports no vLLM."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from vllm_dllm.engine.prompt_scoring import PromptLogprobs


@dataclass
class StepOutput:
    new_tokens: list[list[int]]  # per scheduled request, in order
    logits_rows: int  # LM-head rows this step computed
    progress: list[tuple[int, int]]  # per scheduled request: (block, step in block) of its next step
    edits: int = 0  # committed tokens the step rewrote (token editing)
    steps: int = 1  # denoising steps the call ran
    query_tokens: int = 0  # query tokens its forwards ran
    # For the requests that asked for logprobs, a row per new token, in request
    # order: (token ids [T, k + 1], logprobs [T, k + 1], ranks [T]) and each
    # request's first row (requests that did not ask take no rows).
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    logprobs_start: list[int] | None = None
    # Prompt logprobs of requests streaming their first tokens (engine/prompt_scoring.py).
    prompt_logprobs: dict[str, PromptLogprobs] = dataclasses.field(default_factory=dict)
    # ELBO estimates of requests scored this step (engine/likelihood.py).
    likelihoods: dict[str, dict] = dataclasses.field(default_factory=dict)
