"""lm-evaluation-harness's stock `local-completions` client against `vllm serve` with
the plugin, on the shipped task model: a generation task and a multiple-choice
(loglikelihood) task built from its addition task as local files (no downloads).

    pip install -e ".[eval]"   # lm-eval[api]
    python benchmarks/lm_eval_client.py --out benchmarks/results/lm-eval

The shipped model answers only in a chat frame, so each document's text is the
chat-formatted prompt (the template applied here; lm-eval then sends it as plain
text).  Generation: `generate_until` with the model's canvas of 8 and its end-of-turn
token as stop; exact match.  Multiple choice: the correct sum against three near
misses (one more, ten more, a digit swapped or one less); lm-eval's loglikelihood
request sends context + continuation with `echo=true, logprobs=1, max_tokens=1` and
sums the continuation's prompt logprobs, which the plugin computes by the chain rule
(README: Decoding options).  Chance is 25%.

`--client dllm-completions` runs the same two tasks through `python -m vllm_dllm.lm_eval`
instead: generation is unchanged, and the multiple-choice task is scored by the models'
own Monte-Carlo ELBO (`--mc-samples` per choice, one request per choice); results go to
results/lm-eval-elbo by default.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # lab/ sits at the repository root

HERE = pathlib.Path(__file__).resolve().parent
BIN = pathlib.Path(sys.executable).parent
MODEL_NAME = "vllm-dllm-task"
CLIENTS = ("local-completions", "dllm-completions")
LOGLIKELIHOOD = {"local-completions": "loglikelihood: chain rule", "dllm-completions": "loglikelihood: ELBO"}


def documents(tokenizer, n: int, seed: int) -> list[dict]:
    from lab.tasks import TASKS, TEST

    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        instance = TASKS["addition"].sample(rng, TEST)
        answer = int(instance.answer)
        wrong = {answer + 1, answer + 10, max(answer - 1, 0)} - {answer}
        while len(wrong) < 3:
            wrong.add(answer + rng.randint(2, 99))
        choices = [str(answer), *sorted(map(str, wrong))[:3]]
        rng.shuffle(choices)
        text = tokenizer.apply_chat_template([{"role": "user", "content": instance.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        docs.append({"prompt": text, "answer": instance.answer, "choices": choices,
                     "label": choices.index(str(answer))})
    return docs


TASK_YAML = {
    "dllm_addition_gen": """task: dllm_addition_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["<|eot_id|>"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
""",
    "dllm_addition_mc": """task: dllm_addition_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, port: int, log: pathlib.Path) -> subprocess.Popen:
    cmd = [str(BIN / "vllm"), "serve", model, "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "512", "--max-num-batched-tokens", "16384",
           "--kv-cache-memory-bytes", str(256 << 20), "--gpu-memory-utilization", "0.3", "--shutdown-timeout", "10"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_PLUGINS": "dllm"})
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy; see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="default: results/lm-eval (stock client) or results/lm-eval-elbo (dllm-completions)")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client", choices=CLIENTS, default="local-completions",
                    help="lm-eval's stock client (chain-rule loglikelihood) or vllm_dllm.lm_eval (ELBO)")
    ap.add_argument("--mc-samples", type=int, default=128, help="ELBO samples per choice (dllm-completions)")
    args = ap.parse_args()
    if args.out is None:
        args.out = HERE / "results" / ("lm-eval" if args.client == "local-completions" else "lm-eval-elbo")

    from transformers import AutoTokenizer

    from vllm_dllm.default_model import PATH

    model = str(PATH)
    out = args.out.resolve()
    tasks_dir = out / "tasks"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    data = tasks_dir / "addition.jsonl"
    docs = documents(AutoTokenizer.from_pretrained(model), args.n, args.seed)
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    for name, text in TASK_YAML.items():
        (tasks_dir / f"{name}.yaml").write_text(text.format(data=data))

    port = free_port()
    server = start_server(model, port, out / "server.log")
    try:
        started = time.time()
        base_url = f"http://127.0.0.1:{port}/v1/completions"
        model_args = (f"model={MODEL_NAME},tokenizer={model},tokenizer_backend=huggingface,"
                      "num_concurrent=4,max_retries=1")
        if args.client == "local-completions":
            cmd = [str(BIN / "lm_eval"), "--model", "local-completions",
                   "--model_args", f"{model_args},base_url={base_url}"]
        else:
            cmd = [sys.executable, "-m", "vllm_dllm.lm_eval", "--base-url", base_url, "--mc-samples",
                   str(args.mc_samples), "--model_args", model_args]
        cmd += ["--tasks", ",".join(TASK_YAML), "--include_path", str(tasks_dir), "--output_path", str(out / "raw"),
                "--seed", str(args.seed)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        (out / "lm_eval.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            raise SystemExit(f"lm_eval failed; see {out / 'lm_eval.log'}")
        wall = time.time() - started
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    [result_file] = sorted((out / "raw").rglob("results_*.json"))[-1:]
    results = json.loads(result_file.read_text())["results"]
    summary = {
        "model": "the shipped task model (vllm_dllm/default_model)", "client": f"lm-eval {args.client}",
        "loglikelihood": LOGLIKELIHOOD[args.client], "n": args.n, "wall_s": round(wall, 1), "chance_mc": 0.25,
        "generate_until_exact_match": results["dllm_addition_gen"]["exact_match,none"],
        "multiple_choice_acc": results["dllm_addition_mc"]["acc,none"],
    }
    if args.client == "dllm-completions":
        summary["mc_samples"] = args.mc_samples
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = (f"| task (lm-eval {args.client}, shipped model) | metric | score | chance |\n|---|---|---|---|\n"
             f"| addition, generate_until | exact_match | {summary['generate_until_exact_match']:.3f} | 0 |\n"
             f"| addition, multiple choice ({summary['loglikelihood']}) | acc | {summary['multiple_choice_acc']:.3f} "
             "| 0.25 |\n")
    (out / "table.md").write_text(f"{args.n} held-out documents each; {summary['wall_s']} s in all.\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
