"""HTTP front-end checks for `vllm serve`: a `vllm.endpoint_plugins` entry point.

Six gaps of vLLM 0.32's OpenAI server that request validation alone cannot close:

- Streaming status.  vLLM runs the logits processors' `validate_params` (our
  validation.py) inside `AsyncLLM.generate`, which a streaming response only
  iterates after it has sent `200 OK`; a refused streaming request then gets its
  error as the first `data:` event.  The middleware holds back the response start of
  a stream until its first event: if that event is an error, it answers with the
  error's status and the same JSON body a non-streaming request gets.
- Fields vLLM drops at temperature 0.  `SamplingParams.__post_init__` resets top_k,
  top_p and min_p to neutral values for greedy requests, so no plugin hook ever sees
  them.  They matter to diffusion decoding (Dream renormalises its confidences over
  the top-k/top-p set even at temperature 0; LLaDA and min_p are refused at any
  temperature), so the raw request body is checked here and answered with a 400
  saying how to pass the value instead.
- Beam search.  vLLM's beam search runs as requests of one generated token whose
  logprobs rank the beams; each is a valid one-position canvas, so nothing later
  refuses it, but it is not diffusion decoding: the body's `use_beam_search` is
  answered with a 400 here.
- The ELBO's prompt.  `vllm_xargs {"likelihood": "elbo", "context_tokens": N}` scores
  the prompt's tokens after the first N; validation never sees the prompt, and the
  engine's refusal of a prompt of N tokens or fewer would reach the client as a 500.
  So the prompt is checked here: one prompt of token ids (what evaluation clients
  send; a text or chat prompt's count is the tokenizer's), longer than N.
- Log noise.  vLLM's stream generators log any exception of the stream with
  `logger.exception` (a 30-line ERROR traceback), a refused request's
  VLLMValidationError too, where a refused non-streaming request logs only its
  access line.  A logging filter on those two loggers (installed by init_state,
  found through the serving objects vLLM puts in the app state) turns a client
  error's record into one INFO line; server errors keep their traceback.
- The default canvas.  Without max_tokens, vLLM gives a completion OpenAI's 16 and a
  chat the checkpoint's max_new_tokens, else the whole rest of the context (every
  position a denoising target); it has no default-only setting (an overridden
  max_new_tokens caps every request).  Here both get max_new_tokens, else 128 (the
  LLaDA reference's gen_length).

vLLM loads endpoint plugins only when `VLLM_PLUGINS` names them (`VLLM_PLUGINS=dllm`);
without it the engine-side checks still refuse every bad option, streaming errors
arrive as events, those temperature-0 fields are ignored as vLLM ignores them for
every model, and a request without max_tokens gets vLLM's defaults.
Only LLaDA / Dream servers are affected: for any other model the middleware passes
everything through.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from vllm_dllm.options import DREAM_FILTER_KEYS, LLADA, is_filter, llada_has_no_filter

GUARDED_PATHS = ("/v1/completions", "/v1/chat/completions")
STATE_KEY = "dllm_frontend"
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: below it, a request is greedy


@dataclass(frozen=True)
class ServedModel:
    kind: str  # LLADA or DREAM
    default_temperature: float  # what vLLM uses when a request omits temperature
    # The canvas of a request without max_tokens: generation_config.json's
    # max_new_tokens, else 128.  vLLM's own defaults differ per endpoint (completions:
    # OpenAI's 16, whatever the checkpoint says; chat: max_new_tokens, else the whole
    # rest of the context).  None: leave the body alone.
    default_max_tokens: int | None = None

    def with_default_max_tokens(self, body: Any) -> Any:
        """The body with max_tokens filled in if the request leaves it unset."""
        if (
            self.default_max_tokens is None
            or not isinstance(body, dict)
            or body.get("max_tokens") is not None
            or body.get("max_completion_tokens") is not None
        ):
            return body
        return {**body, "max_tokens": self.default_max_tokens}

    def dropped_field_problem(self, body: Any) -> tuple[str, str] | None:
        """(message, parameter) for a field vLLM would silently drop, or None."""
        if not isinstance(body, dict):
            return None  # vLLM's own parsing answers malformed bodies
        temperature = body.get("temperature")
        if temperature is None:
            temperature = self.default_temperature
        if not isinstance(temperature, (int, float)) or temperature >= GREEDY_BELOW:
            return None  # the fields reach validate_params unchanged
        xargs = body.get("vllm_xargs")
        xargs = xargs if isinstance(xargs, dict) else {}
        for key in DREAM_FILTER_KEYS:
            value = body.get(key)
            if not is_filter(key, value):
                continue
            if self.kind == LLADA:
                return llada_has_no_filter(key, value), key
            if key not in xargs:
                return (
                    f"'{key}'={value} would not reach Dream's decoding at temperature 0: vLLM "
                    f"resets '{key}' for greedy requests before any plugin sees it; pass it as "
                    f'vllm_xargs {{"{key}": {json.dumps(value)}}} instead',
                    key,
                )
        min_p = body.get("min_p")
        if isinstance(min_p, (int, float)) and not isinstance(min_p, bool) and min_p > 0:
            from vllm_dllm.serving.validation import unsupported

            return unsupported("min_p"), "min_p"
        return None


    @staticmethod
    def likelihood_prompt_problem(body: Any, path: str) -> tuple[str, str] | None:
        """An ELBO request whose prompt the engine could only refuse with a 500: not
        token ids on /v1/completions (`context_tokens` counts the prompt's tokens, which
        a text prompt or a chat template leaves to vLLM's tokenizer), several prompts,
        or one that `context_tokens` leaves no continuation.  Only here does a
        request's prompt meet its options before the engine."""
        if not isinstance(body, dict) or not isinstance(body.get("vllm_xargs"), dict):
            return None
        from vllm_dllm.options import OptionError
        from vllm_dllm.options.likelihood import likelihood_request, prompt_problem

        try:
            request = likelihood_request(body["vllm_xargs"])
        except OptionError:
            return None  # validate_params names it
        if request is None:
            return None
        if path != "/v1/completions":
            return ("'likelihood' scores a completions prompt: send it to /v1/completions as token ids "
                    "('context_tokens' counts them)", "vllm_xargs")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            if len(prompt) > 1:
                # vLLM's completions response carries kv_transfer_params once, its
                # first prompt's: the other estimates would be computed and dropped.
                return ("'likelihood' is returned once per response: send one prompt per request, "
                        f"not {len(prompt)}", "prompt")
            prompt = prompt[0]
        if not (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
            return ("'likelihood' needs the prompt as token ids: 'context_tokens' counts the prompt's tokens",
                    "prompt")
        problem = prompt_problem(request, len(prompt))
        return (problem, "vllm_xargs") if problem else None

    @staticmethod
    def beam_search_problem(body: Any) -> tuple[str, str] | None:
        """vLLM's beam search grows a prompt one token per request, each a canvas of
        one position: not diffusion decoding, so it is refused rather than run."""
        if isinstance(body, dict) and body.get("use_beam_search") is True:
            return ("beam search is not supported by diffusion decoding: a step denoises a whole canvas, "
                    "not one next token", "use_beam_search")
        return None


def _error_body(message: str, param: str | None, code: int = 400) -> bytes:
    # The shape of vLLM's ErrorResponse, so clients parse both the same way.
    error = {"message": message, "type": "BadRequestError", "param": param, "code": code}
    return json.dumps({"error": error}).encode()


async def _send_json(send, status: int, body: bytes) -> None:
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    })
    await send({"type": "http.response.body", "body": body, "more_body": False})


def leading_error(chunk: bytes) -> dict | None:
    """The error object if a stream's first chunk is a `data: {"error": ...}` event."""
    if not chunk.startswith(b"data:"):
        return None
    line = chunk[len(b"data:"):].split(b"\n", 1)[0].strip()
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if isinstance(event, dict) and isinstance(event.get("error"), dict):
        return event
    return None


class _ErrorStreamAsStatus:
    """An ASGI `send` that turns a stream whose first event is an error into an
    ordinary error response (status from the error's `code`)."""

    def __init__(self, send):
        self.send = send
        self.held_start: dict | None = None
        self.mode = "hold"  # hold -> pass, or hold -> drop (the rest of an error stream)

    async def __call__(self, message: dict) -> None:
        if self.mode == "pass":
            return await self.send(message)
        if self.mode == "drop":
            return None
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or [])
            if message["status"] == 200 and headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                self.held_start = message
                return None
            self.mode = "pass"
            return await self.send(message)
        if message["type"] == "http.response.body" and self.held_start is not None:
            chunk = message.get("body", b"")
            if not chunk and message.get("more_body", False):
                return None
            event = leading_error(chunk)
            if event is None:
                self.mode = "pass"
                await self.send(self.held_start)
                return await self.send(message)
            self.mode = "drop"
            code = event["error"].get("code")
            status = code if isinstance(code, int) and 400 <= code <= 599 else 500
            return await _send_json(self.send, status, json.dumps(event).encode())
        return await self.send(message)


class DiffusionRequestGuard:
    """ASGI middleware: the checks of the module docstring on the guarded paths."""

    def __init__(self, app, state):
        self.app = app
        self.state = state  # the FastAPI app's state; filled by init_state

    async def __call__(self, scope, receive, send):
        served: ServedModel | None = getattr(self.state, STATE_KEY, None)
        if (
            served is None
            or scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in GUARDED_PATHS
        ):
            return await self.app(scope, receive, send)
        raw, receive = await _buffer_body(receive)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None  # vLLM answers malformed JSON itself
        problem = (served.dropped_field_problem(body) or served.beam_search_problem(body)
                   or served.likelihood_prompt_problem(body, scope["path"]))
        if problem is not None:
            return await _send_json(send, 400, _error_body(*problem))
        filled = served.with_default_max_tokens(body)
        if filled is not body:
            raw = json.dumps(filled).encode()
            receive = _replay(raw, receive)
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        if isinstance(body, dict) and body.get("stream") is True:
            send = _ErrorStreamAsStatus(send)
        return await self.app(scope, receive, send)


async def _buffer_body(receive):
    """Read the whole request body; return it and a `receive` that replays it, then
    passes through (disconnect notices still reach vLLM's handlers)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            # A disconnect before the body was read: let the app see it.
            pending = [message]

            async def replay_disconnect():
                return pending.pop() if pending else await receive()

            return b"".join(chunks), replay_disconnect
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    return body, _replay(body, receive)


def _replay(body: bytes, receive):
    """A `receive` that yields `body` once, then passes through to `receive`."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class ClientErrorLogFilter(logging.Filter):
    """Turns an ERROR record whose exception is a client error (vLLM's
    VLLMClientError: answered 4xx) into one INFO line without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from vllm.exceptions import VLLMClientError

        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno >= logging.ERROR and isinstance(exc, VLLMClientError):
            first_line = (str(exc).splitlines() or [""])[0]
            record.msg, record.args = "Refused streaming request (%s): %s", (type(exc).__name__, first_line)
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.exc_info = record.exc_text = record.stack_info = None
        return True


# The app-state attributes holding vLLM's OpenAI serving objects whose stream
# generators log a refused request's exception (vLLM 0.32; absent ones are skipped).
STREAMING_SERVERS = ("openai_serving_completion", "openai_serving_chat")


def install_log_filter(state) -> list[str]:
    """Put ClientErrorLogFilter on the loggers of the serving objects in `state`
    (vLLM's loggers are named after their modules); returns the logger names."""
    names = []
    for attr in STREAMING_SERVERS:
        serving = getattr(state, attr, None)
        if serving is None:
            continue
        log = logging.getLogger(type(serving).__module__)
        if not any(isinstance(f, ClientErrorLogFilter) for f in log.filters):
            log.addFilter(ClientErrorLogFilter())
        names.append(log.name)
    return names


class DiffusionEndpoints:
    """The `vllm.endpoint_plugins` entry point (vLLM's EndpointPlugin protocol)."""

    name = "dllm"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        # No routes of its own: a middleware in front of vLLM's routes.  It must be
        # added here, before the app starts (Starlette refuses it afterwards).
        app.add_middleware(DiffusionRequestGuard, state=app.state)

    async def init_state(self, engine_client, state, args) -> None:
        from vllm_dllm.serving.server_config import served_kind

        if engine_client is None:
            return
        model_config = engine_client.model_config
        kind = served_kind(model_config)
        if kind is None:
            return  # not a diffusion model: the middleware passes everything through
        from vllm_dllm.serving.server_config import DEFAULT_GEN_LENGTH

        defaults = model_config.get_diff_sampling_param()
        served = ServedModel(
            kind,
            default_temperature=float(defaults.get("temperature", 1.0)),
            default_max_tokens=int(defaults.get("max_tokens", DEFAULT_GEN_LENGTH)),
        )
        setattr(state, STATE_KEY, served)
        install_log_filter(state)
