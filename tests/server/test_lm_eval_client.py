"""vllm_dllm.lm_eval (lm-eval model "dllm-completions") against a stub completions server.

The stub implements the server's contract for a fake model: an ELBO request
(`vllm_xargs.likelihood == "elbo"`) gets loglikelihood = -0.5 per continuation token in
kv_transfer_params.likelihood; an echo/logprobs request gets vLLM's completions logprobs
with -0.25 per prompt token after the first and one generated token.  It records every
payload.  No vLLM, no model: the tokenizer is the shipped model's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from lm_eval.api.instance import Instance

from vllm_dllm import lm_eval as dllm_lm_eval
from vllm_dllm.default_model import PATH as TOKENIZER_DIR

ELBO_PER_TOKEN = -0.5
CHAIN_PER_TOKEN = -0.25


class StubServer:
    """POST /v1/completions on 127.0.0.1; queued `errors` (status, message) answer the next requests."""

    def __init__(self):
        self.payloads: list[dict] = []
        self.errors: list[tuple[int, str]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.payloads.append(payload)
                if stub.errors:
                    status, message = stub.errors.pop(0)
                    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
                else:
                    status, body = 200, stub.answer(payload)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/completions"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @staticmethod
    def answer(payload: dict) -> dict:
        response = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": payload["model"],
                    "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}}
        xargs = payload.get("vllm_xargs") or {}
        if xargs.get("likelihood") == "elbo":
            prompt, context = payload["prompt"], xargs["context_tokens"]
            continuation = len(prompt) - context
            response["choices"] = [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}]
            response["kv_transfer_params"] = {"likelihood": {
                "estimator": "elbo", "loglikelihood": ELBO_PER_TOKEN * continuation,
                "standard_error": 0.01 * continuation, "mc_samples": xargs.get("mc_samples", 128),
                "context_tokens": context, "continuation_tokens": continuation}}
            return response
        assert payload["echo"] and payload["logprobs"] == 1 and payload["max_tokens"] == 1
        prompts = payload["prompt"] if isinstance(payload["prompt"][0], list) else [payload["prompt"]]
        response["choices"] = []
        for index, prompt in enumerate(prompts):
            token_logprobs = [None] + [CHAIN_PER_TOKEN] * (len(prompt) - 1) + [-0.1]  # + the generated token
            top = [None] + [{f"t{t}": CHAIN_PER_TOKEN} for t in prompt[1:]] + [{"x": -0.1}]
            response["choices"].append({
                "index": index, "text": "x", "finish_reason": "length",
                "logprobs": {"tokens": [f"t{t}" for t in prompt] + ["x"], "token_logprobs": token_logprobs,
                             "top_logprobs": top, "text_offset": list(range(len(prompt) + 1))}})
        return response

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    server = StubServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def make_model(stub: StubServer, **model_args):
    return dllm_lm_eval.DiffusionCompletionsAPI(**{
        "base_url": stub.url, "model": "stub", "tokenizer_backend": "huggingface", "tokenizer": str(TOKENIZER_DIR),
        "max_retries": 1, **model_args})


PAIRS = [("The sum of 12 and 30 is", " 42"), ("Copy: abc ->", " abc abc"), ("x", " yz"),
         ("The sum of 12 and 30 is", " 43")]


def requests_for(pairs):
    return [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]


@pytest.mark.parametrize("batch_size,num_concurrent", [(1, 1), (4, 1), (1, 3)])
def test_elbo_payloads_and_results(stub, tokenizer, batch_size, num_concurrent):
    model = make_model(stub, mc_samples=64, mc_batch=16, seed=7, batch_size=batch_size,
                       num_concurrent=num_concurrent)
    results = model.loglikelihood(requests_for(PAIRS), disable_tqdm=True)

    assert len(stub.payloads) == len(PAIRS)  # one prompt per POST whatever batch_size says
    expected = {}
    for context, continuation in PAIRS:
        whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
        n_context = len(tokenizer(context, add_special_tokens=False).input_ids)
        expected[tuple(whole)] = n_context
    for payload in stub.payloads:
        assert isinstance(payload["prompt"][0], int)  # one flat prompt of token ids
        assert payload["vllm_xargs"] == {"likelihood": "elbo", "context_tokens": expected[tuple(payload["prompt"])],
                                         "mc_samples": 64, "mc_batch": 16}
        assert (payload["model"], payload["seed"], payload["max_tokens"], payload["temperature"]) == ("stub", 7, 1, 0)
        assert "echo" not in payload and "logprobs" not in payload
    assert {tuple(p["prompt"]) for p in stub.payloads} == set(expected)

    continuation_tokens = [len(tokenizer(c + k, add_special_tokens=False).input_ids)
                           - len(tokenizer(c, add_special_tokens=False).input_ids) for c, k in PAIRS]
    assert results == [(ELBO_PER_TOKEN * n, False) for n in continuation_tokens]
    assert sorted(e.standard_error for e in model.elbo_estimates) == sorted(0.01 * n for n in continuation_tokens)


def test_an_empty_continuation_needs_no_request(stub):
    model = make_model(stub, mc_samples=8)
    assert model.loglikelihood(requests_for([("The sum of 12 and 30 is", "")]), disable_tqdm=True) == [(0.0, False)]
    assert stub.payloads == []


def test_elbo_default_sample_count_and_no_mc_batch(stub):
    model = make_model(stub)
    model.loglikelihood(requests_for(PAIRS[:1]), disable_tqdm=True)
    [payload] = stub.payloads
    assert payload["vllm_xargs"]["mc_samples"] == 128 and "mc_batch" not in payload["vllm_xargs"]
    assert payload["seed"] == 1234  # local-completions' default seed


@pytest.mark.parametrize("batch_size", [1, 2])
def test_chain_is_stock_local_completions(stub, tokenizer, batch_size):
    model = make_model(stub, estimator="chain", batch_size=batch_size)
    results = model.loglikelihood(requests_for(PAIRS), disable_tqdm=True)

    assert len(stub.payloads) == len(PAIRS) // batch_size
    for payload in stub.payloads:
        assert payload["echo"] is True and payload["logprobs"] == 1 and payload["max_tokens"] == 1
        assert "vllm_xargs" not in payload and len(payload["prompt"]) == batch_size
    for (context, continuation), (loglikelihood, is_greedy) in zip(PAIRS, results):
        n = (len(tokenizer(context + continuation, add_special_tokens=False).input_ids)
             - len(tokenizer(context, add_special_tokens=False).input_ids))
        assert loglikelihood == pytest.approx(CHAIN_PER_TOKEN * n) and is_greedy is True


def test_server_refusal_names_the_problem(stub):
    stub.errors = [(400, "mc_batch (48) must divide mc_samples (128)")]
    model = make_model(stub, max_retries=3)
    with pytest.raises(dllm_lm_eval.LikelihoodRequestError, match=r"HTTP 400: mc_batch \(48\) must divide"):
        model.loglikelihood(requests_for(PAIRS[:1]), disable_tqdm=True)
    assert len(stub.payloads) == 1  # a 400 is not retried


def test_server_error_is_retried(stub):
    stub.errors = [(503, "overloaded")]
    model = make_model(stub, max_retries=2)
    assert model.loglikelihood(requests_for(PAIRS[2:3]), disable_tqdm=True) == [(2 * ELBO_PER_TOKEN, False)]
    assert len(stub.payloads) == 2
    stub.errors = [(503, "overloaded")]
    with pytest.raises(dllm_lm_eval.LikelihoodRequestError, match="HTTP 503: overloaded"):
        make_model(stub, max_retries=1).loglikelihood(requests_for(PAIRS[2:3]), disable_tqdm=True)


def test_response_without_estimate_is_an_error(stub, monkeypatch):
    monkeypatch.setattr(StubServer, "answer", staticmethod(lambda payload: {"choices": [], "model": "stub"}))
    model = make_model(stub)
    with pytest.raises(dllm_lm_eval.LikelihoodRequestError, match="without an ELBO estimate"):
        model.loglikelihood(requests_for(PAIRS[:1]), disable_tqdm=True)


def test_a_single_sample_estimate_has_no_error():
    # One Monte-Carlo sample (LLaDA's setting for single-token choices) has no
    # standard error: the server sends null.
    response = {"kv_transfer_params": {"likelihood": {
        "estimator": "elbo", "loglikelihood": -1.5, "standard_error": None, "mc_samples": 1,
        "context_tokens": 4, "continuation_tokens": 1}}}
    assert dllm_lm_eval.parse_elbo(response, 4) == (-1.5, None, 1, 4, 1)


@pytest.mark.parametrize("model_args,problem", [
    ({"estimator": "exact"}, "estimator='exact'"), ({"mc_samples": 0}, "mc_samples=0"),
    ({"mc_samples": 128, "mc_batch": 48}, "mc_batch=48"),
    ({"tokenizer_backend": "none"}, "needs a tokenizer")])
def test_bad_model_args(stub, model_args, problem):
    args = {"base_url": stub.url, "model": "stub", "tokenizer_backend": "huggingface",
            "tokenizer": str(TOKENIZER_DIR), **model_args}
    with pytest.raises(ValueError, match=problem):
        dllm_lm_eval.DiffusionCompletionsAPI(**args)


def test_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    assert get_model("dllm-completions") is dllm_lm_eval.DiffusionCompletionsAPI
    assert get_model("local-completions") is dllm_lm_eval.LocalCompletionsAPI  # stock models still found


def test_import_is_light_and_names_the_extra():
    light = subprocess.run([sys.executable, "-c", "import sys, vllm_dllm.lm_eval; "
                            "print([m for m in ('vllm', 'torch') if m in sys.modules])"],
                           capture_output=True, text=True, check=True)
    assert light.stdout.strip() == "[]"
    without = subprocess.run([sys.executable, "-c", "import sys; sys.modules['lm_eval'] = None; "
                              "import vllm_dllm.lm_eval"], capture_output=True, text=True)
    assert without.returncode and "pip install -e '.[eval]'" in without.stderr


def test_cli_arguments():
    argv = dllm_lm_eval.lm_eval_argv([
        "--base-url", "http://h:1/v1/completions", "--tasks", "a,b", "--mc-samples", "32",
        "--model_args", "model=m,tokenizer=t", "--limit", "4"])
    assert argv == ["run", "--model", "dllm-completions", "--model_args",
                    "base_url=http://h:1/v1/completions,mc_samples=32",
                    "--tasks", "a,b", "--model_args", "model=m,tokenizer=t", "--limit", "4"]
    argv = dllm_lm_eval.lm_eval_argv(["run", "--base-url", "u", "--estimator", "chain", "--tasks", "a"])
    assert argv[:5] == ["run", "--model", "dllm-completions", "--model_args", "base_url=u,estimator=chain"]
    assert argv[5:] == ["--tasks", "a"]
    with pytest.raises(SystemExit):
        dllm_lm_eval.lm_eval_argv(["--base-url", "u", "--model", "hf"])

    # lm-eval's own parser merges the two --model_args (the user's after ours).
    from lm_eval._cli.harness import HarnessCLI

    parsed = HarnessCLI()._parser.parse_args(dllm_lm_eval.lm_eval_argv(
        ["--base-url", "u", "--mc-batch", "8", "--model_args", "model=m,num_concurrent=4", "--tasks", "a"]))
    assert parsed.model == "dllm-completions"
    assert parsed.model_args == {"base_url": "u", "mc_batch": 8, "model": "m", "num_concurrent": 4}


MC_TASK = """task: stub_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


def test_cli_runs_an_evaluation(stub, tmp_path, monkeypatch):
    # The stub's ELBO prefers the shortest continuation: the right answer is always the shortest.
    docs = [{"question": "12 + 30 =", "choices": ["4200", "42", "420"], "label": 1},
            {"question": "1 + 1 =", "choices": ["2", "22", "222"], "label": 0}]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (tmp_path / "stub_mc.yaml").write_text(MC_TASK.format(data=data))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # main() hands lm-eval's CLI its argv there
    dllm_lm_eval.main(["--base-url", stub.url, "--mc-samples", "8", "--tasks", "stub_mc",
                       "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out"),
                       "--model_args", f"model=stub,tokenizer={TOKENIZER_DIR},tokenizer_backend=huggingface"])

    assert len(stub.payloads) == 6 and all(p["vllm_xargs"]["mc_samples"] == 8 for p in stub.payloads)
    [results_file] = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(results_file.read_text())["results"]["stub_mc"]["acc,none"] == 1.0
