"""The documentation's example requests to the shipped task model get right answers.

Every `curl .../v1/chat/completions` body and every OpenAI-client snippet in README.md
and the user pages under docs/ (all but the vLLM surface reports)
that names the served task model (`vllm-dllm-task`) is sent, as written, to one
`vllm serve` of vllm_dllm/default_model started the way `make serve` starts it, and the
reply must be the task's correct answer, computed here from the prompt alone.  An
example the model gets wrong fails this test: change the example or the model.
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

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SERVED_NAME = "vllm-dllm-task"
# Pages that are records, not user documentation: no examples are read from them.
NOT_USER_DOCS = re.compile(r"vllm-[0-9.]+-surface\.md")


def doc_pages() -> list[Path]:
    """README.md and every user page under docs/."""
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if not NOT_USER_DOCS.fullmatch(p.name))
    return [README, *docs]


def doc_examples(extract) -> list[tuple[str, object]]:
    """(page, example) for every example `extract` finds in every page."""
    return [(page.relative_to(ROOT).as_posix(), ex) for page in doc_pages() for ex in extract(page.read_text())]


def expected_answer(prompt: str) -> str:
    """The correct answer of a task prompt (lab/tasks.py formats), from its text."""
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


def test_docs_pages_are_read_and_their_examples_are_task_prompts():
    pages = [page.name for page in doc_pages()]
    assert "README.md" in pages and "serving.md" in pages and "structured-outputs.md" in pages
    assert not any(NOT_USER_DOCS.fullmatch(name) for name in pages)
    # README's three requests and two client snippets, and those the docs pages repeat or add.
    assert len(doc_examples(curl_bodies)) >= 4
    assert len(doc_examples(client_snippets)) >= 3
    for _, body in doc_examples(curl_bodies):
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
    examples = doc_examples(curl_bodies)
    assert examples
    wrong = []
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for page, body in examples:
            resp = client.post("/v1/chat/completions", json=body)
            if resp.status_code != 200:
                server.fail(f"{page}: {body} -> HTTP {resp.status_code}: {resp.text}")
            got = resp.json()["choices"][0]["message"]["content"]
            want = expected_answer(body["messages"][-1]["content"])
            if got.strip() != want:
                wrong.append((page, body, got, want))
    assert not wrong, "documented examples answered wrongly:\n" + "\n".join(
        f"  {p}: {json.dumps(b)}\n    got {g!r}, want {w!r}" for p, b, g, w in wrong
    )


def test_readme_client_snippets_answer_correctly(server):
    examples = doc_examples(client_snippets)
    assert examples
    for page, snippet in examples:
        code = snippet.replace("http://127.0.0.1:8000/v1", f"{server.base_url}/v1")
        assert code != snippet, f"the snippet in {page} should talk to the README's 127.0.0.1:8000"
        prompts = re.findall(r'"content":\s*"([^"]*)"', snippet)
        assert len(prompts) == 1, (page, snippet)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, page, "exec"), {"__name__": "readme_example"})
        want = expected_answer(prompts[0].encode().decode("unicode_escape"))
        assert printed.getvalue().strip() == want, (page, printed.getvalue(), want)
