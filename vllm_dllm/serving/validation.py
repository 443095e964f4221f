"""Request validation at admission, in the API/LLM process.

vLLM calls `validate_params` of every configured logits processor on each request
before it reaches the engine, and turns its ValueError into an HTTP 400 (or an
exception from `LLM.generate`).  The class is a logits processor only in shape: its
`apply` is the identity and our runner never calls it.

It also bounds the whitespace of a structural tag's JSON under the server's compact
JSON (structural_tags.py): the one change it makes to a request.  vLLM clones the
parameters for the engine only after this hook, so the change is made on the
caller's own SamplingParams (idempotent: a second engine with compact JSON changes
nothing more, one that allows whitespace gets the bounded tag); vLLM compiles the
grammar before the scheduler sees a request, so a request that bypasses this
process keeps its tag as sent.

The scheduler resolves the options again at admission (the engine-side second line,
for requests that bypass this process).  For a streaming request vLLM runs this
check only after it has sent `200 OK`; frontend.py turns that into a 400.

vLLM hands `validate_params` the request alone, not the engine it is for, so each
engine names its own validator class: `validator_for(defaults)` registers the
server defaults the config hook resolved and returns a class path that names them
by a digest.  Two offline engines with different defaults in one process (a LLaDA
and a Dream `LLM`) each validate against their own.  The class is made on first
lookup (the module's `__getattr__`), in whichever process vLLM loads it; where no
defaults were registered under its digest it validates nothing.
"""

from __future__ import annotations

import hashlib
import json

import torch
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind

from vllm_dllm.serving.compat import logits_processor_base
from vllm_dllm.options import OptionError, resolve_params
from vllm_dllm.options.likelihood import likelihood_request, model_problem
from vllm_dllm.serving.server_defaults import ServerDefaults
from vllm_dllm.serving.structural_tags import bound_whitespace

# SamplingParams fields vLLM honours for autoregressive models that a masked
# diffusion step cannot: the request is refused rather than silently changed.
_UNSUPPORTED = {
    "logit_bias": lambda p: bool(p.logit_bias),
    # Logprobs over the whole vocabulary per token (vLLM's logprobs=-1).
    "logprobs=-1": lambda p: p.logprobs is not None and p.logprobs < 0,
    "prompt_logprobs=-1": lambda p: p.prompt_logprobs is not None and p.prompt_logprobs < 0,
    "allowed_token_ids": lambda p: bool(p.allowed_token_ids),
    "bad_words": lambda p: bool(p.bad_words),
    "min_p": lambda p: p.min_p > 0,
    "presence_penalty": lambda p: p.presence_penalty != 0,
    "frequency_penalty": lambda p: p.frequency_penalty != 0,
    "repetition_penalty": lambda p: p.repetition_penalty != 1,
    # EOS may be committed anywhere in the canvas; a floor on the length is not honoured.
    "min_tokens": lambda p: p.min_tokens > 0,
}


def unsupported(name: str) -> str:
    return f"'{name}' is not supported by diffusion decoding"


def _check_likelihood(sampling_params, kind: str) -> None:
    """The ELBO option (options/likelihood.py): its values, and that its one answer
    has somewhere to go (the final response of one completion)."""
    try:
        request = likelihood_request(sampling_params.extra_args)
    except OptionError as err:
        raise VLLMValidationError(str(err), parameter="vllm_xargs") from err
    if request is None:
        return
    problem = model_problem(kind)
    if problem:
        raise VLLMValidationError(problem, parameter="vllm_xargs")
    if sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
        raise VLLMValidationError("'likelihood' is returned with the final response: it cannot be streamed",
                                  parameter="stream")
    if sampling_params.n != 1:
        raise VLLMValidationError("'likelihood' is estimated once per request: n must be 1", parameter="n")


CLASS_PREFIX = "DiffusionParamsValidator_"
_REGISTERED: dict[str, ServerDefaults] = {}


def validator_for(defaults: ServerDefaults) -> str:
    """The class path (vLLM's `module:Class`) of the validator bound to `defaults`."""
    digest = hashlib.sha256(json.dumps(defaults.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
    _REGISTERED[digest] = defaults
    return f"{__name__}:{CLASS_PREFIX}{digest}"


def is_validator(path) -> bool:
    return isinstance(path, str) and path.startswith(f"{__name__}:{CLASS_PREFIX}")


class DiffusionParamsValidator(logits_processor_base()):
    digest: str | None = None  # set on each engine's subclass (validator_for)

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        defaults = _REGISTERED.get(cls.digest)
        if defaults is None:
            return
        for name, is_set in _UNSUPPORTED.items():
            if is_set(sampling_params):
                raise VLLMValidationError(unsupported(name), parameter=name)
        try:
            options = resolve_params(defaults, sampling_params)
        except OptionError as err:
            raise VLLMValidationError(str(err)) from err
        problem = defaults.deployment_problem(options)
        if problem:
            raise VLLMValidationError(problem, parameter="cache")
        _check_likelihood(sampling_params, defaults.kind)
        structured = sampling_params.structured_outputs
        if structured is not None and structured.structural_tag and not defaults.any_whitespace:
            # The one change made to a request here (see the module docstring).
            structured.structural_tag = bound_whitespace(structured.structural_tag)

    def __init__(self, vllm_config, *args):
        # vLLM's stock runners instantiate every configured processor (V1: with the
        # device and pinning, V2: with the request state); as one it is an identity.
        pass

    def apply(self, logits: torch.Tensor, *context) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        return None


def __getattr__(name: str):
    """`DiffusionParamsValidator_<digest>`: the validator subclass for those defaults."""
    if not name.startswith(CLASS_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = type(name, (DiffusionParamsValidator,), {"digest": name[len(CLASS_PREFIX):], "__module__": __name__})
    globals()[name] = cls
    return cls
