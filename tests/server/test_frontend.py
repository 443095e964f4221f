"""The HTTP front-end middleware (vllm_dllm/serving/frontend.py) on a stand-in app.

No engine: a small Starlette app answers like vLLM's routes do (a JSON 400, or an
SSE stream whose first event may be an error).  The real server path is covered by
tests/server/test_server_validation.py (LLaDA); Dream's temperature-0 field refusals are tested here.
"""

from __future__ import annotations

import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from vllm_dllm.serving.frontend import STATE_KEY, DiffusionRequestGuard, ServedModel, leading_error
from vllm_dllm.options import DREAM, LLADA

ERROR_EVENT = {"error": {"message": "diffusion option 'steps' must be a positive integer, got 0",
                         "type": "BadRequestError", "param": None, "code": 400}}


async def fake_completions(request):
    body = await request.json()
    bad = (body.get("vllm_xargs") or {}).get("steps") == 0

    async def events():
        if bad:
            yield f"data: {json.dumps(ERROR_EVENT)}\n\n"
        else:
            yield 'data: {"choices": [{"text": "hi"}]}\n\n'
        yield "data: [DONE]\n\n"

    if body.get("stream"):
        return StreamingResponse(events(), media_type="text/event-stream")
    if bad:
        return JSONResponse(ERROR_EVENT, status_code=400)
    return JSONResponse({"choices": [{"text": "hi", "echo": body}]})


def client_for(served: ServedModel | None, **client_kwargs) -> TestClient:
    app = Starlette(routes=[
        Route("/v1/completions", fake_completions, methods=["POST"]),
        Route("/v1/chat/completions", fake_completions, methods=["POST"]),
        Route("/other", fake_completions, methods=["POST"]),
    ])
    if served is not None:
        setattr(app.state, STATE_KEY, served)
    app.add_middleware(DiffusionRequestGuard, state=app.state)
    return TestClient(app, **client_kwargs)


DREAM_GREEDY = ServedModel(DREAM, default_temperature=0.0)
LLADA_GREEDY = ServedModel(LLADA, default_temperature=0.0)


def test_error_as_first_event_becomes_the_status():
    client = client_for(DREAM_GREEDY)
    body = {"prompt": "x", "vllm_xargs": {"steps": 0}}
    plain = client.post("/v1/completions", json=body)
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    assert plain.status_code == streamed.status_code == 400
    assert streamed.headers["content-type"] == "application/json"
    assert streamed.json() == plain.json() == ERROR_EVENT  # [DONE] is not appended


def test_good_streams_pass_through_unchanged():
    client = client_for(DREAM_GREEDY)
    streamed = client.post("/v1/chat/completions", json={"prompt": "x", "stream": True})
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text == 'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'


def test_request_body_still_reaches_the_route():
    body = {"prompt": "x", "max_tokens": 4, "vllm_xargs": {"top_k": 50}}
    assert client_for(DREAM_GREEDY).post("/v1/completions", json=body).json()["choices"][0]["echo"] == body


@pytest.mark.parametrize("body, message", [
    ({"top_k": 50},
     "'top_k'=50 would not reach Dream's decoding at temperature 0: vLLM resets 'top_k' for greedy "
     'requests before any plugin sees it; pass it as vllm_xargs {"top_k": 50} instead'),
    ({"temperature": 0, "top_p": 0.9},
     "'top_p'=0.9 would not reach Dream's decoding at temperature 0: vLLM resets 'top_p' for greedy "
     'requests before any plugin sees it; pass it as vllm_xargs {"top_p": 0.9} instead'),
    ({"min_p": 0.1}, "'min_p' is not supported by diffusion decoding"),
])
def test_dream_fields_vllm_drops_at_temperature_0_are_refused(body, message):
    for path in ("/v1/completions", "/v1/chat/completions"):
        for stream in (False, True):
            resp = client_for(DREAM_GREEDY).post(path, json={"prompt": "x", **body, "stream": stream})
            assert resp.status_code == 400
            assert resp.json()["error"]["message"] == message
            assert resp.json()["error"]["param"] == next(iter(k for k in body if k != "temperature"))


@pytest.mark.parametrize("body", [
    {"top_k": 50, "vllm_xargs": {"top_k": 50}},  # the route that works
    {"top_k": 50, "temperature": 0.7},  # reaches the plugin (validate_params)
    {"top_k": -1, "top_p": 1.0, "min_p": 0},  # vLLM's neutral values
    {"top_k": 50, "temperature": "hot"},  # vLLM's own validation answers
])
def test_dream_fields_that_reach_the_plugin_pass(body):
    assert client_for(DREAM_GREEDY).post("/v1/completions", json={"prompt": "x", **body}).status_code == 200


def test_sampled_default_temperature_lets_fields_through():
    client = client_for(ServedModel(DREAM, default_temperature=1.0))
    assert client.post("/v1/completions", json={"prompt": "x", "top_k": 50}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "x", "top_k": 50, "temperature": 0}).status_code == 400


def test_llada_refuses_filters_at_temperature_0_as_at_any_other():
    resp = client_for(LLADA_GREEDY).post("/v1/completions", json={"prompt": "x", "top_k": 50})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        "'top_k'=50 is not supported for LLaDA: its reference decoding has no top-k/top-p filter "
        "(leave 'top_k' unset)"
    )


def test_other_models_and_paths_are_untouched():
    body = {"prompt": "x", "top_k": 50, "vllm_xargs": {"steps": 0}, "stream": True}
    for client, path in ((client_for(None), "/v1/completions"), (client_for(DREAM_GREEDY), "/other")):
        resp = client.post(path, json=body)
        assert resp.status_code == 200 and resp.text.startswith("data: {\"error\"")


def test_malformed_bodies_are_left_to_vllm():
    client = client_for(DREAM_GREEDY, raise_server_exceptions=False)
    # The stand-in's own failure (vLLM would answer its 400 here), not a guard answer.
    assert client.post("/v1/completions", content=b"{not json").status_code == 500
    assert leading_error(b"data: [DONE]\n\n") is None
    assert leading_error(b": keep-alive\n\n") is None


def test_default_max_tokens_is_filled_in_when_unset():
    served = ServedModel(LLADA, default_temperature=0.0, default_max_tokens=128)
    client = client_for(served)
    echo = client.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["echo"]
    assert echo == {"prompt": "x", "max_tokens": 128}
    for body in ({"prompt": "x", "max_tokens": 300}, {"prompt": "x", "max_completion_tokens": 9}):
        assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["echo"] == body
    # None: the body is left alone (vLLM's defaults).
    echo = client_for(LLADA_GREEDY).post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["echo"]
    assert echo == {"prompt": "x"}


def test_client_error_logs_one_info_line_server_errors_keep_their_traceback():
    """The filter init_state puts on vLLM's stream-generator loggers."""
    import logging
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError

    from vllm_dllm.serving.frontend import ClientErrorLogFilter, install_log_filter

    class Serving:  # stands in for vLLM's serving object; its module names the logger
        pass

    log = logging.getLogger(Serving.__module__)
    state = SimpleNamespace(openai_serving_completion=Serving(), openai_serving_chat=None)
    try:
        assert install_log_filter(state) == [Serving.__module__] == install_log_filter(state)
        assert sum(isinstance(f, ClientErrorLogFilter) for f in log.filters) == 1  # idempotent
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        for exc in (VLLMValidationError("unknown diffusion option 'foo'\nsecond line"), RuntimeError("boom")):
            try:
                raise exc
            except Exception:
                log.exception("Error in completion stream generator.")
        refused, crashed = records
        assert refused.levelno == logging.INFO and refused.exc_info is None
        assert refused.getMessage() == "Refused streaming request (VLLMValidationError): unknown diffusion option 'foo'"
        assert crashed.levelno == logging.ERROR and crashed.exc_info is not None
    finally:
        log.filters.clear()
        log.handlers.clear()
