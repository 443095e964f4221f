"""The README's example requests to the shipped task model get right answers.

Every `curl .../v1/chat/completions` body and every OpenAI-client snippet in README.md
that names the served task model (`vllm-dllm-task`) is sent, as written, to one
`vllm serve` of vllm_dllm/default_model started the way `make serve` starts it, and the
reply must be the task's correct answer, computed here from the prompt alone.  A
README example the model gets wrong fails this test: change the example or the model.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import httpx
import pytest

from tests.server_utils import ServerProcess
from vllm_dllm.default_model import PATH

README = Path(__file__).resolve().parent.parent / "README.md"
SERVED_NAME = "vllm-dllm-task"


def expected_answer(prompt: str) -> str:
    """The correct answer of a task prompt (vllm_dllm/tasks.py formats), from its text."""
    prompt = prompt.strip()
    if m := re.fullmatch(r"add (\d+)\+(\d+)=", prompt):
        return str(int(m[1]) + int(m[2]))
    if m := re.fullmatch(r"copy ([A-Z]+)", prompt):
        return m[1]
    if m := re.fullmatch(r"reverse ([A-Z]+)", prompt):
        return m[1][::-1]
    if m := re.fullmatch(r"lookup\n((?:;[a-z]{2}=[A-Z]{2})+)\nvalue of;([a-z]{2})=", prompt):
        pairs = dict(re.findall(r";([a-z]{2})=([A-Z]{2})", m[1]))
        return pairs[m[2]]
    raise ValueError(f"not a task prompt: {prompt!r}")


def test_expected_answer_reads_every_task_format():
    assert expected_answer("add 4821+975=") == "5796"
    assert expected_answer("copy QWERTY") == "QWERTY"
    assert expected_answer("reverse ABC") == "CBA"
    assert expected_answer("lookup\n;ab=CD;ef=GH\nvalue of;ef=") == "GH"
    with pytest.raises(ValueError):
        expected_answer("hello")


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def curl_bodies(text: str) -> list[dict]:
    """JSON bodies (`-d '...'`) of the chat-completion curl commands for the task model."""
    bodies = []
    for block in _code_blocks(text, "bash"):
        if "curl" not in block or "/v1/chat/completions" not in block:
            continue
        words = shlex.split(block.replace("\\\n", " "), comments=True)
        for flag, value in zip(words, words[1:]):
            if flag != "-d":
                continue
            body = json.loads(value)
            if body.get("model") == SERVED_NAME:
                bodies.append(body)
    return bodies


def client_snippets(text: str) -> list[str]:
    return [b for b in _code_blocks(text, "python") if "OpenAI(" in b and SERVED_NAME in b]


def test_readme_has_task_model_examples():
    text = README.read_text()
    bodies = curl_bodies(text)
    # The quickstart's request, one without max_tokens (the server's default canvas)
    # and one with diffusion options: the default canvas and the options must reach the model.
    assert len(bodies) >= 3
    assert any("max_tokens" not in b for b in bodies)
    assert any("vllm_xargs" in b for b in bodies)
    assert len(client_snippets(text)) >= 1
    for body in bodies:
        expected_answer(body["messages"][-1]["content"])


@pytest.fixture(scope="module")
def server():
    # As `make serve`: the shipped model under its served name, 512 positions.
    srv = ServerProcess(str(PATH), "--served-model-name", SERVED_NAME, "--max-model-len", "512")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_readme_curl_examples_answer_correctly(server):
    bodies = curl_bodies(README.read_text())
    wrong = []
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for body in bodies:
            resp = client.post("/v1/chat/completions", json=body)
            if resp.status_code != 200:
                server.fail(f"{body} -> HTTP {resp.status_code}: {resp.text}")
            got = resp.json()["choices"][0]["message"]["content"]
            want = expected_answer(body["messages"][-1]["content"])
            if got.strip() != want:
                wrong.append((body, got, want))
    assert not wrong, "README examples answered wrongly:\n" + "\n".join(
        f"  {json.dumps(b)}\n    got {g!r}, want {w!r}" for b, g, w in wrong
    )


def test_readme_client_snippets_answer_correctly(server):
    for snippet in client_snippets(README.read_text()):
        code = snippet.replace("http://127.0.0.1:8000/v1", f"{server.base_url}/v1")
        assert code != snippet, "the snippet should talk to the README's 127.0.0.1:8000"
        prompts = re.findall(r'"content":\s*"([^"]*)"', snippet)
        assert len(prompts) == 1, snippet
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
        assert printed.getvalue().strip() == expected_answer(prompts[0].encode().decode("unicode_escape"))
