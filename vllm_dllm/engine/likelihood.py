"""The Monte-Carlo ELBO of a prompt's continuation, for requests that ask
(options/likelihood.py), run in the request's first step.

Each sample is a masked copy of the whole prompt (decoding/elbo.py draws which
positions); all samples of all asking requests of the step go through one forward
with in-flight attention (each copy attends over itself alone, no KV pool touched),
the masked rows through the chunked LM head, and each request's samples reduce to
its mean and standard error with one copy to the host.  With LLaDA's classifier-free
guidance every sample has a twin whose context is masked too, and the logits are
un + (cfg + 1)(cond - un), as eval_llada.py's `get_logits`.  A request's copies cost
mc_samples x prompt tokens (Dream: one more, its recipe's EOS; twice with guidance),
priced by the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_dllm.decoding.elbo import draw_samples, estimate
from vllm_dllm.engine.prompt_scoring import ScoringContext, forward_prompt_copies
from vllm_dllm.engine.step_inputs import to_device
from vllm_dllm.options.likelihood import RECIPE_OF_KIND, LikelihoodRequest, likelihood_request


@dataclass(frozen=True)
class ElboTask:
    recipe: str  # decoding/elbo.py RECIPES: the model family's evaluation recipe
    request: LikelihoodRequest
    seed: int
    cfg_scale: float = 0.0  # LLaDA's guidance (its eval's `cfg`); 0: none

    @property
    def copies(self) -> int:
        return 2 if self.cfg_scale > 0 else 1


def elbo_task(kind: str, options, extra_args: dict | None, seed: int) -> ElboTask | None:
    """The ELBO a request asks for (checked beforehand by the front end and the
    scheduler), or None."""
    request = likelihood_request(extra_args)
    if request is None:
        return None
    return ElboTask(RECIPE_OF_KIND[kind], request, seed, float(getattr(options, "cfg_scale", 0.0)))


def scored_length(recipe: str, prompt_len: int) -> int:
    """The length of each sample's copy: Dream's recipe scores the prompt followed by
    an EOS (eval/eval.py's `_encode_pair`), which it never masks."""
    return prompt_len + 1 if recipe == "dream" else prompt_len


def elbo_tokens(recipe: str, prompt_len: int, request: LikelihoodRequest, cfg: bool) -> int:
    """Query tokens of a request's ELBO samples."""
    return request.mc_samples * scored_length(recipe, prompt_len) * (2 if cfg else 1)


def summary(task: ElboTask, prompt_len: int, values: torch.Tensor) -> dict:
    """What the response carries (its `kv_transfer_params["likelihood"]`)."""
    mean, error = estimate(values)
    request = task.request
    return {
        "estimator": request.estimator,
        "loglikelihood": mean,
        "standard_error": error,
        "mc_samples": request.mc_samples,
        "mc_batch": request.mc_batch,
        "context_tokens": request.context_tokens,
        "continuation_tokens": prompt_len - request.context_tokens,
    }


class ElboScorer:
    def __init__(self):
        self.tasks: dict[int, ElboTask] = {}  # by slot, until its first step

    def admit(self, slot: int, task: ElboTask | None) -> None:
        if task is None:
            self.tasks.pop(slot, None)
        else:
            self.tasks[slot] = task

    def release(self, slot: int) -> None:
        self.tasks.pop(slot, None)

    def asks(self, slots_host: np.ndarray) -> bool:
        """Whether a request of the step waits for its estimate."""
        return bool(self.tasks) and any(int(s) in self.tasks for s in slots_host.tolist())

    def step_tokens(self, slots_host: np.ndarray, prompt_len: np.ndarray) -> np.ndarray:
        if not self.tasks:
            return np.zeros(len(slots_host), dtype=np.int64)
        return np.array([
            elbo_tokens(t.recipe, int(n), t.request, t.copies == 2) if (t := self.tasks.get(int(s))) else 0
            for s, n in zip(slots_host.tolist(), prompt_len.tolist())
        ], dtype=np.int64)

    def score(self, ctx: ScoringContext, req_ids: list[str], slots_host: np.ndarray) -> dict[str, dict]:
        """The estimates of the step's requests that asked and are not scored yet."""
        todo = [(req_id, slot, self.tasks.pop(slot)) for req_id, slot in zip(req_ids, slots_host.tolist())
                if slot in self.tasks]
        if not todo:
            return {}
        lengths = [int(ctx.host_prompt_len[slot]) for _, slot, _ in todo]
        values = self._run(ctx, [slot for _, slot, _ in todo], lengths, [task for _, _, task in todo])
        return {req_id: summary(task, length, v)
                for (req_id, _, task), length, v in zip(todo, lengths, values)}

    @torch.inference_mode()
    def _run(self, ctx: ScoringContext, slots: list[int], lengths: list[int], tasks: list[ElboTask]) -> list[torch.Tensor]:
        device = ctx.device
        scored = [scored_length(t.recipe, n) for t, n in zip(tasks, lengths)]
        draws = [draw_samples(t.recipe, t.seed, n, t.request.context_tokens, t.request.mc_samples, t.request.mc_batch)
                 for t, n in zip(tasks, scored)]
        # Copies in order: each request's samples, then (with guidance) their twins,
        # whose context is masked as well; Dream's copies end with the EOS its recipe
        # appends (never masked).
        masks, eos, seq_slot, seq_len = [], [], [], []
        for slot, n, length, task, draw in zip(slots, lengths, scored, tasks, draws):
            samples = task.request.mc_samples
            twin = draw.masked.clone()
            twin[:, : task.request.context_tokens] = True
            for copy in (draw.masked, twin)[: task.copies]:
                masks.append(copy.reshape(-1))
                eos.append((torch.arange(length) >= n).repeat(samples))
                seq_slot += [slot] * samples
                seq_len += [length] * samples
        masked, at_eos = to_device(torch.cat(masks), device), to_device(torch.cat(eos), device)

        def tokens(positions, input_ids):
            return torch.where(masked, ctx.ids.mask, torch.where(at_eos, ctx.ids.eos, input_ids))

        hidden, starts = forward_prompt_copies(ctx, np.array(seq_slot, dtype=np.int64), tokens,
                                               seq_len=np.array(seq_len, dtype=np.int64))

        # The scored rows: every masked position of each sample, as (sample, position),
        # and where the conditional copy (and its guided twin) reads it.
        sample_rows, positions, row_slot, cond_rows, uncond_rows, row_cfg = [], [], [], [], [], []
        first_copy = first_sample = 0
        for slot, task, draw in zip(slots, tasks, draws):
            samples = task.request.mc_samples
            sample, position = torch.nonzero(draw.masked, as_tuple=True)
            read = position - 1 if ctx.logits_shift else position
            cond = torch.as_tensor(starts[first_copy : first_copy + samples])[sample] + read
            uncond = (torch.as_tensor(starts[first_copy + samples : first_copy + 2 * samples])[sample] + read
                      if task.copies == 2 else cond)
            sample_rows.append(sample + first_sample)
            positions.append(position)
            row_slot.append(torch.full_like(position, slot))
            cond_rows.append(cond)
            uncond_rows.append(uncond)
            row_cfg.append(torch.full((len(sample),), task.cfg_scale, dtype=torch.float32))
            first_copy += samples * task.copies
            first_sample += samples
        cond_rows, uncond_rows = to_device(torch.cat(cond_rows), device), to_device(torch.cat(uncond_rows), device)
        cfg = to_device(torch.cat(row_cfg), device)
        targets = ctx.prompt_tokens[to_device(torch.cat(row_slot), device), to_device(torch.cat(positions), device)]
        logprobs = torch.empty(len(cond_rows), dtype=torch.float64, device=device)
        guided = any(task.copies == 2 for task in tasks)
        step = max(ctx.max_num_logits // 2, 1) if guided else ctx.max_num_logits
        project, vocab = ctx.lm_head.project, ctx.lm_head.vocab
        for start in range(0, len(cond_rows), step):
            chunk = slice(start, start + step)
            logits = project(hidden[cond_rows[chunk]]).float()
            if guided:
                uncond = project(hidden[uncond_rows[chunk]]).float()
                scale = cfg[chunk, None]
                logits = torch.where(scale > 0, uncond + (scale + 1) * (logits - uncond), logits)
            logprobs[chunk] = vocab.at(vocab.log_softmax(logits), targets[chunk]).double()
        totals = torch.zeros(first_sample, dtype=torch.float64, device=device)
        totals.index_add_(0, to_device(torch.cat(sample_rows), device), logprobs)
        weights = torch.cat([d.weight for d in draws])
        return list((totals.cpu() * weights).split([t.request.mc_samples for t in tasks]))
