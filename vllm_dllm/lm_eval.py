"""lm-evaluation-harness model "dllm-completions": a diffusion model's own likelihood.

lm-eval's stock `local-completions` scores a loglikelihood request (context,
continuation) by sending context + continuation with `echo=true, logprobs=1` and summing
the continuation's prompt logprobs; the plugin computes those by a left-to-right chain
rule.  The diffusion models' own evaluation codes (LLaDA's eval_llada.py, Dream's
eval/eval.py) score with a Monte-Carlo estimate of the ELBO instead: random masks over
the continuation, the context kept clean.  This model asks the server for that estimate
(`vllm_xargs: {"likelihood": "elbo", "context_tokens": N, "mc_samples": M}` on
/v1/completions; it answers in kv_transfer_params.likelihood), one prompt per POST, and
returns it.  Everything else is `local-completions` unchanged
(generate_until, loglikelihood_rolling's windows, tokenization, truncation).

Model args: those of local-completions, plus
    estimator   "elbo" (default) or "chain" (exactly local-completions' loglikelihood)
    mc_samples  Monte-Carlo samples per request (default 128)
    mc_batch    optional; samples per stratified batch of mask ratios (the official
                codes' batch_size; server default 32), must divide mc_samples
    seed        local-completions' own (default 1234), sent with every request: the seed
                of the server's Monte-Carlo masks, the same for all requests

With estimator=elbo a loglikelihood answer is (ELBO estimate, False): like the official
LLaDA and Dream codes, the ELBO says nothing about greedy decoding, so is_greedy is
always False (metrics built on it, such as lambada's acc, are meaningless).  The
standard error of each estimate is kept in `elbo_estimates` and logged at debug level.

batch_size applies to generate_until (and estimator=chain) only: vLLM returns per-request
engine data (kv_transfer_params, where the estimate comes back) once per response, so
ELBO requests go one prompt per POST; `num_concurrent` sends several at a time.  The
prompt goes as token ids (context_tokens counts them), so the ELBO needs a tokenizer
(tokenizer_backend huggingface or remote) and tokenized_requests=True (the defaults).

    python -m vllm_dllm.lm_eval --base-url http://127.0.0.1:8000/v1/completions \\
        --model_args model=NAME,tokenizer=DIR,num_concurrent=4 --tasks TASKS [lm-eval args]

runs `lm-eval run --model dllm-completions` with base_url (and --estimator,
--mc-samples, --mc-batch if given) added to the model args.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from vllm_dllm.log import get_logger

try:
    import requests
    from lm_eval.api.registry import register_model
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from tqdm import tqdm
except ModuleNotFoundError as error:
    if error.name and error.name.split(".")[0] in ("lm_eval", "requests", "tqdm"):
        raise ModuleNotFoundError(
            f"vllm_dllm.lm_eval needs lm-evaluation-harness with its API extra ({error.name} is missing): "
            "pip install -e '.[eval]'", name=error.name) from error
    raise

MODEL_NAME = "dllm-completions"
ESTIMATORS = ("elbo", "chain")

logger = get_logger(__name__)


class LikelihoodRequestError(RuntimeError):
    """The server refused an ELBO request or answered without an estimate."""


class ElboEstimate(NamedTuple):
    loglikelihood: float
    standard_error: float | None  # None from a single sample
    mc_samples: int
    context_tokens: int
    continuation_tokens: int


def parse_elbo(response: dict, context_tokens: int) -> ElboEstimate:
    """The estimate in a completions response (kv_transfer_params.likelihood)."""
    likelihood = (response.get("kv_transfer_params") or {}).get("likelihood")
    if not isinstance(likelihood, dict) or likelihood.get("estimator") != "elbo":
        raise LikelihoodRequestError(
            "the server answered without an ELBO estimate (no kv_transfer_params.likelihood): is it "
            "`vllm serve` with VLLM_PLUGINS=dllm and a plugin version that has the estimator?")
    error = likelihood.get("standard_error")
    estimate = ElboEstimate(float(likelihood["loglikelihood"]), None if error is None else float(error),
                            int(likelihood["mc_samples"]), int(likelihood["context_tokens"]),
                            int(likelihood["continuation_tokens"]))
    if estimate.context_tokens != context_tokens:
        raise LikelihoodRequestError(f"sent context_tokens={context_tokens}, the server scored "
                                     f"{estimate.context_tokens} context tokens")
    return estimate


def error_message(response: requests.Response) -> str:
    """vLLM's error JSON ({"error": {"message": ...}}) as one line, else the body."""
    try:
        body = response.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        message = response.text[:1000]
    return f"POST {response.url} -> HTTP {response.status_code}: {message}"


@register_model(MODEL_NAME)
class DiffusionCompletionsAPI(LocalCompletionsAPI):
    """local-completions whose loglikelihood is the diffusion model's Monte-Carlo ELBO (module docstring)."""

    def __init__(self, estimator: str = "elbo", mc_samples: int = 128, mc_batch: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.estimator = str(estimator).lower()
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator={estimator!r}: expected one of {', '.join(ESTIMATORS)}")
        self.mc_samples = int(mc_samples)
        self.mc_batch = None if mc_batch in (None, "") else int(mc_batch)
        if self.mc_samples < 1:
            raise ValueError(f"mc_samples={mc_samples}: must be at least 1")
        if self.mc_batch is not None and (self.mc_batch < 1 or self.mc_samples % self.mc_batch):
            raise ValueError(f"mc_batch={mc_batch}: must be a positive divisor of mc_samples={self.mc_samples}")
        if self.estimator == "elbo" and (self.tokenizer is None or not self.tokenized_requests):
            raise ValueError("estimator=elbo sends token ids (context_tokens counts them): it needs a tokenizer "
                             "(tokenizer_backend huggingface or remote) and tokenized_requests=True")
        self.elbo_estimates: list[ElboEstimate] = []

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None,
                        context_tokens: int | None = None, **kwargs) -> dict:
        if generate or self.estimator == "chain":
            return super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos,
                                           **kwargs)
        if context_tokens is None:
            raise TypeError("an ELBO payload needs context_tokens")
        xargs = {"likelihood": "elbo", "context_tokens": context_tokens, "mc_samples": self.mc_samples}
        if self.mc_batch is not None:
            xargs["mc_batch"] = self.mc_batch
        return {"model": self.model, "prompt": messages, "max_tokens": 1, "temperature": 0, "seed": seed,
                "vllm_xargs": xargs}

    def _loglikelihood_tokens(self, token_requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(cache key, context ids, continuation ids) triples -> (loglikelihood, is_greedy), in order."""
        if self.estimator == "chain":
            return super()._loglikelihood_tokens(token_requests, disable_tqdm=disable_tqdm, **kwargs)
        if self._batch_size > 1:
            logger.info("ELBO requests go one prompt per POST (batch_size=%d is for generate_until); "
                        "num_concurrent=%d at a time", self._batch_size, self._concurrent)
        # local-completions' own left truncation to max_length and context length.
        prompts, context_lengths, cache_keys = self.batch_loglikelihood_requests([token_requests])
        # Left truncation can eat into the continuation (lm-eval's context length then
        # goes negative): what is left is scored with no context.  An empty
        # continuation has log-likelihood 0 and needs no request.
        context_lengths = [max(n, 0) for n in context_lengths]
        with ThreadPoolExecutor(max_workers=max(1, self._concurrent)) as pool:
            futures = [pool.submit(self._request_elbo, prompt, n) if n < len(prompt) else None
                       for prompt, n in zip(prompts, context_lengths)]
            try:
                estimates = [None if future is None else future.result() for future in
                             tqdm(futures, desc="Requesting ELBO", disable=disable_tqdm)]
            except BaseException:
                for future in futures:
                    if future is not None:
                        future.cancel()
                raise
        self.elbo_estimates.extend(e for e in estimates if e is not None)
        answers = [(0.0 if estimate is None else estimate.loglikelihood, False) for estimate in estimates]
        for answer, cache_key in zip(answers, cache_keys):
            if cache_key is not None:  # None: a loglikelihood_rolling window
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return answers

    def _request_elbo(self, prompt: list[int], context_tokens: int) -> ElboEstimate:
        """One POST, retried (max_retries attempts in all) on connection errors and 5xx, not on 4xx."""
        payload = self._create_payload(prompt, generate=False, seed=self._seed, context_tokens=context_tokens)
        for attempt in range(1, max(1, self.max_retries) + 1):
            last = attempt >= self.max_retries
            try:
                response = requests.post(self.base_url, json=payload, headers=self.header,
                                         verify=self.verify_certificate, timeout=self.timeout)
            except (requests.ConnectionError, requests.Timeout):
                if last:
                    raise
            else:
                if response.ok:
                    estimate = parse_elbo(response.json(), context_tokens)
                    logger.debug("ELBO %.4f +- %s (%d samples, %d + %d tokens)", *estimate)
                    return estimate
                if response.status_code < 500 or last:
                    raise LikelihoodRequestError(error_message(response))
            time.sleep(min(0.5 * 2 ** (attempt - 1), 10))
        raise AssertionError("unreachable")


def lm_eval_argv(argv: Sequence[str]) -> list[str]:
    """`lm-eval run` arguments for this module's command line (python -m vllm_dllm.lm_eval --help)."""
    parser = argparse.ArgumentParser(
        prog="python -m vllm_dllm.lm_eval", allow_abbrev=False,
        description="lm-eval's CLI with --model dllm-completions (the diffusion model's own ELBO for "
                    "loglikelihood tasks) against a vllm-dllm server.",
        epilog="Every other argument goes to `lm-eval run` as given (see `lm-eval run --help`), e.g. --tasks, "
               "--include_path, --limit, --output_path and --model_args (model, tokenizer, num_concurrent, "
               "seed, max_retries, ...; merged after base_url and the options above, so it wins).")
    parser.add_argument("--base-url", required=True,
                        help="the server's completions endpoint, e.g. http://127.0.0.1:8000/v1/completions")
    parser.add_argument("--estimator", choices=ESTIMATORS,
                        help="loglikelihood estimator (model default: elbo; chain = stock local-completions)")
    parser.add_argument("--mc-samples", type=int, help="Monte-Carlo samples per ELBO request (model default: 128)")
    parser.add_argument("--mc-batch", type=int,
                        help="samples per stratified batch of mask ratios; must divide --mc-samples")
    ours, rest = parser.parse_known_args(argv)
    if rest[:1] == ["run"]:
        rest = rest[1:]
    if any(arg in ("--model", "-M") or arg.startswith("--model=") for arg in rest):
        parser.error(f"--model is {MODEL_NAME} here; pass its settings with --model_args")
    model_args = [f"base_url={ours.base_url}"] + [
        f"{key}={value}" for key, value in
        (("estimator", ours.estimator), ("mc_samples", ours.mc_samples), ("mc_batch", ours.mc_batch))
        if value is not None]
    return ["run", "--model", MODEL_NAME, "--model_args", ",".join(model_args), *rest]


def main(argv: Sequence[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    # lm-eval's CLI reads sys.argv; the model is registered (this module is imported).
    sys.argv = ["lm-eval", *lm_eval_argv(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
