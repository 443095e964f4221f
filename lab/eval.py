"""Task accuracy of a model served through the plugin.

    python -m lab.eval --task retrieval|addition|copy|reverse|all|hard|every|NAME,NAME --n N
        [--max-tokens 8,16,32,56] [--model DIR] [--xargs JSON] [--base-url URL] [--out results.json]

Offline (vLLM's engine with the plugin) by default, or against a running server with
`--base-url`.  Prints exact-match accuracy with a 95% Wilson interval (multiply: the
product with its written working, or alone; `tasks.accepted_answers`), the fraction of
answer characters in place (partial credit), committed tokens per second and denoising
steps per token; writes JSON only to `--out`.  The default decoding is exact: steps =
generation length, one block, low-confidence remasking.  A LLaDA2.x checkpoint
decodes with its own defaults instead (LLaDA2.0's threshold rule, blocks of 32): steps
and block_length are not set for it, only what `--xargs` gives.  Against a server the
eval learns which it is from the server's vllm:diffusion_decoding_info series on
/metrics (a server without it is taken for an exact one).

`--task all` is the original four tasks (those the shipped model was trained on);
`hard` the four harder ones (sort, multiply, chain, brackets); `every` both; or a
comma-separated list of names.

Each task is decoded on its own canvas length (`Task.gen_length`), at least one block
on a block-diffusion checkpoint (below), unless `--max-tokens` lists canvas lengths:
then every task runs at each of them, on the held-out instances whose answer fits
(copy/reverse of 16-48 symbols on a 32-position canvas: 16-32 symbols; none on 8,
reported as n/a).  For lengths of 8, 16, 32 and 56 exact decoding
is also the server's default (steps = max_tokens; one block, since a 32-position block
either equals the canvas or does not divide it), so the sweep measures what a request
without diffusion options gets; 56 is the shipped model's `max_new_tokens`, the canvas
of a chat request without `max_tokens`.

A block-diffusion checkpoint (LLaDA2.x) is asked for at least one whole block
(`max(Task.gen_length, block_length)`, block_length as the request would resolve it):
LLaDA2.0's rule clamps its steps per block to `max_tokens // minimal_topk`, so a
request for 8 tokens commits a 32-position block in 8 steps, a quota of 4 a step that
the official defaults (gen_length 2048 >= block_length) never use.  The eval measures
the model at those defaults; `--max-tokens` still measures any other request size.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import time
from dataclasses import asdict, dataclass

from vllm_dllm.default_model import PATH as DEFAULT_MODEL
from lab.tasks import ALL_TASKS, TASK_GROUPS, TEST, Instance, Task, char_score, resolve_tasks, score
from lab.training.curriculum import fitting_task


@dataclass
class TaskResult:
    task: str
    n: int
    correct: int
    accuracy: float
    ci95: tuple[float, float]
    char_accuracy: float
    tokens_per_s: float
    steps_per_token: float | None
    denoising_steps: int | None
    wall_s: float
    max_tokens: int
    instances: str  # which held-out instances: the task's full range or the part that fits
    # "1"/"0" per instance, exact match or not, in draw order: two settings measured on
    # the same seed pair up instance by instance (`paired_difference`).
    outcomes: str = ""


def describe(task: Task) -> str:
    """The instance range a (possibly restricted) task draws from."""
    if hasattr(task, "min_count"):
        return f"{task.min_count}-{task.max_count} numbers below {task.max_value}"
    if hasattr(task, "max_digits_a"):
        return f"{task.max_digits_a}- by {task.max_digits_b}-digit operands at most"
    if hasattr(task, "max_depth"):
        return f"{task.min_len}-{task.max_len} brackets, depth up to {task.max_depth}"
    if hasattr(task, "min_pairs"):
        return f"{task.min_pairs}-{task.max_pairs} pairs"
    if hasattr(task, "max_digits"):
        return f"operands up to {task.max_digits} digits"
    if hasattr(task, "min_len"):
        return f"{task.min_len}-{task.max_len} symbols"
    return "all"


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_difference(first: str, second: str) -> tuple[int, int, float]:
    """Two settings' `outcomes` on the same instances: (right only under the first,
    right only under the second, exact two-sided McNemar p-value).  Instances both get
    right or both get wrong say nothing about which setting is better; the p-value is
    the chance of a split at least this lopsided among the discordant ones if either
    setting were equally likely to win each."""
    if len(first) != len(second):
        raise ValueError(f"outcomes of {len(first)} and {len(second)} instances do not pair up")
    only_first = sum(a == "1" and b == "0" for a, b in zip(first, second))
    only_second = sum(a == "0" and b == "1" for a, b in zip(first, second))
    discordant = only_first + only_second
    tail = sum(math.comb(discordant, k) for k in range(min(only_first, only_second) + 1)) / 2 ** discordant
    return only_first, only_second, min(1.0, 2 * tail)


def exact_xargs(gen_length: int, xargs: dict) -> dict:
    return {"steps": gen_length, "block_length": gen_length, **xargs}


def served_decoding(metrics_text: str, model: str) -> dict[str, str]:
    """The labels of `model`'s vllm:diffusion_decoding_info series on a server's
    /metrics page (metrics.DECODING_INFO), or {} where it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_dllm.serving.metrics import DECODING_INFO

    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == DECODING_INFO and sample.labels.get("model_name") == model:
                return dict(sample.labels)
    return {}


def canvas_for(task: Task, options) -> int:
    """`max_tokens` for `task` under a request's resolved options: at least one block
    when decoding is block-causal."""
    if options.block_causal:
        return max(task.gen_length, options.block_length)
    return task.gen_length


def instances(task: Task, n: int, seed: int) -> list[Instance]:
    rng = random.Random(seed)
    return [task.sample(rng, TEST) for _ in range(n)]


# The engine the eval (and the benchmarks that answer its instances) runs offline: a
# 32-request batch of the tasks' short prompts fits a 512 MB cache on any machine.
OFFLINE_ENGINE = dict(max_model_len=512, max_num_seqs=32, kv_cache_memory_bytes=512 << 20, gpu_memory_utilization=0.3)


class OfflineRunner:
    """vLLM's engine in this process, with the plugin's metrics logger attached so the
    denoising steps can be counted."""

    def __init__(self, model: str, engine_kwargs: dict):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from vllm_dllm.serving.metrics import DiffusionStatLogger

        args = EngineArgs(model=model, disable_log_stats=False, **engine_kwargs)
        self.engine = LLMEngine.from_engine_args(args, stat_loggers=[DiffusionStatLogger])
        self.tokenizer = self.engine.get_tokenizer()
        self.labels = {"model_name": self.engine.vllm_config.model_config.served_model_name, "engine": "0"}
        architectures = getattr(self.engine.vllm_config.model_config.hf_config, "architectures", None) or []
        # LLaDA2.x decodes with the model's own defaults; LLaDA and Dream exactly.
        self.exact = "LLaDA2MoeModelLM" not in architectures
        self._next_id = 0

    def default_canvas(self, task: Task, xargs: dict) -> int:
        """The task's own length, or on a block-diffusion checkpoint at least the block
        its requests resolve to (the module's docstring says why)."""
        if self.exact:
            return task.gen_length
        from vllm_dllm.options.registry import resolve
        from vllm_dllm.serving.server_config import server_defaults

        options = resolve(server_defaults(self.engine.vllm_config), max_tokens=task.gen_length,
                          temperature=0.0, top_p=1.0, top_k=0, extra_args=xargs)
        return canvas_for(task, options)

    def _steps(self) -> float:
        import prometheus_client

        value = prometheus_client.REGISTRY.get_sample_value("vllm:diffusion_num_denoising_steps_total", self.labels)
        return value or 0.0

    def prompt_ids(self, text: str) -> list[int]:
        chat = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        # The template already holds the special tokens (LLaDA's convention).
        return list(self.tokenizer.encode(chat, add_special_tokens=False))

    def generate(self, prompts: list[list[int]], params) -> list:
        """Completion outputs of `prompts` (token ids), in order."""
        order = []
        for prompt in prompts:
            req_id = f"eval-{self._next_id}"
            self._next_id += 1
            order.append(req_id)
            self.engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
        done: dict[str, object] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[req_id].outputs[0] for req_id in order]

    def complete(self, prompts: list[list[int]], max_tokens: int, xargs: dict) -> list:
        """Greedy completions of token-id prompts under the eval's decoding options."""
        from vllm import SamplingParams

        extra = exact_xargs(max_tokens, xargs) if self.exact else dict(xargs)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
        return self.generate(prompts, params)

    def run(self, items: list[Instance], max_tokens: int, xargs: dict) -> tuple[list[str], int, int | None]:
        before = self._steps()
        outs = self.complete([self.prompt_ids(item.prompt) for item in items], max_tokens, xargs)
        tokens = sum(len(o.token_ids) for o in outs)
        return [o.text for o in outs], tokens, int(self._steps() - before)


class ServerRunner:
    """OpenAI chat completions against a running server; steps from its /metrics."""

    def __init__(self, base_url: str, model: str | None):
        import requests

        self.session = requests.Session()
        self.base = base_url.rstrip("/")
        self.model = model or self.session.get(f"{self.base}/v1/models").json()["data"][0]["id"]
        info = served_decoding(self.session.get(f"{self.base}/metrics").text, self.model)
        # A server that does not describe its decoding is taken for an exact one (LLaDA,
        # Dream), as every server was before the description existed.
        self.exact = info.get("block_causal") != "true"
        self.block_length = int(info["block_length"]) if info.get("block_length") else None

    def default_canvas(self, task: Task, xargs: dict) -> int:
        """As OfflineRunner's: at least one block from a block-diffusion server, the
        request's `block_length` if it sets one, else the server's default."""
        if self.exact:
            return task.gen_length
        block_length = xargs.get("block_length", self.block_length)
        return max(task.gen_length, block_length) if block_length else task.gen_length

    def body(self, item: Instance, max_tokens: int, xargs: dict) -> dict:
        """The chat completion request for one instance."""
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": item.prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "vllm_xargs": exact_xargs(max_tokens, xargs) if self.exact else dict(xargs),
        }

    def _steps(self) -> float | None:
        text = self.session.get(f"{self.base}/metrics").text
        total = 0.0
        found = False
        for line in text.splitlines():
            if line.startswith("vllm:diffusion_num_denoising_steps_total"):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        return total if found else None

    def run(self, items: list[Instance], max_tokens: int, xargs: dict) -> tuple[list[str], int, int | None]:
        from concurrent.futures import ThreadPoolExecutor

        before = self._steps()

        def one(item: Instance):
            body = self.body(item, max_tokens, xargs)
            resp = self.session.post(f"{self.base}/v1/chat/completions", json=body, timeout=600)
            resp.raise_for_status()
            data = resp.json()
            return data["choices"][0]["message"]["content"] or "", data["usage"]["completion_tokens"]

        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(one, items))
        after = self._steps()
        steps = None if before is None or after is None else int(after - before)
        return [r[0] for r in results], sum(r[1] for r in results), steps


def evaluate_task(runner, task: Task, n: int, seed: int, xargs: dict, max_tokens: int | None = None) -> TaskResult:
    """`task` on `n` held-out instances with a canvas of `max_tokens` (default: the
    runner's `default_canvas`, else the task's own length); `task` should be one whose
    answers fit (see `fitting_task`)."""
    if max_tokens is None:
        default_canvas = getattr(runner, "default_canvas", None)
        max_tokens = default_canvas(task, xargs) if default_canvas else task.gen_length
    items = instances(task, n, seed)
    start = time.perf_counter()
    texts, tokens, steps = runner.run(items, max_tokens, xargs)
    wall = time.perf_counter() - start
    right = [bool(score(item, text)) for item, text in zip(items, texts)]
    correct = sum(right)
    return TaskResult(
        task=task.name,
        n=n,
        correct=correct,
        accuracy=correct / n if n else 0.0,
        ci95=wilson(correct, n),
        char_accuracy=sum(char_score(i, t) for i, t in zip(items, texts)) / n if n else 0.0,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        steps_per_token=(steps / tokens) if steps is not None and tokens else None,
        denoising_steps=steps,
        wall_s=wall,
        max_tokens=max_tokens,
        instances=describe(task),
        outcomes="".join("1" if r else "0" for r in right),
    )


def weights_digest(model: str) -> str | None:
    """sha256 of a local checkpoint's model.safetensors: which weights were measured."""
    path = pathlib.Path(model) / "model.safetensors"
    if not path.is_file():
        return None
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_lengths(text: str) -> list[int]:
    lengths = [int(part) for part in text.split(",") if part.strip()]
    if not lengths or min(lengths) < 1:
        raise ValueError(text)
    return lengths


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="all",
                    help=f"a task ({', '.join(ALL_TASKS)}), a group ({', '.join(TASK_GROUPS)}: all is the original "
                         "four), or a comma-separated list")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--max-tokens", default=None,
                    help="canvas lengths to sweep, e.g. 8,16,32,56 (default: each task's own length)")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model); with --base-url, the served model name")
    ap.add_argument("--xargs", default="{}", help="diffusion options as JSON, e.g. '{\"steps\": 4}'")
    ap.add_argument("--base-url", default=None, help="evaluate a running server instead")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="write the results as JSON here (nothing is written without it)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    xargs = json.loads(args.xargs)
    if not isinstance(xargs, dict):
        ap.error("--xargs must be a JSON object")
    lengths: list[int | None] = [None]
    if args.max_tokens is not None:
        try:
            lengths = parse_lengths(args.max_tokens)
        except ValueError:
            ap.error(f"--max-tokens: '{args.max_tokens}' is not a comma-separated list of positive lengths")
    try:
        tasks = resolve_tasks(args.task)
    except ValueError as exc:
        ap.error(f"--task: {exc}")
    for task in tasks:
        if task.working_given:
            ap.error(f"--task: {task.name} is a training aid whose prompt does not hold the working its answer "
                     f"starts with: a generated answer cannot be scored on it")
    if args.base_url:
        runner = ServerRunner(args.base_url, args.model)
        model = runner.model
    else:
        model = args.model or str(DEFAULT_MODEL)
        runner = OfflineRunner(model, OFFLINE_ENGINE)
    results = []
    skipped = []
    for length in lengths:
        for full in tasks:
            task = full if length is None else fitting_task(full, length)
            if task is None:
                skipped.append({"task": full.name, "max_tokens": length, "reason": "no answer fits"})
                print(f"{full.name:10s} max_tokens {length:3d}: n/a (no {describe(full)} answer fits)", flush=True)
                continue
            result = evaluate_task(runner, task, args.n, args.seed, xargs, max_tokens=length)
            results.append(result)
            steps = f"{result.steps_per_token:.2f}" if result.steps_per_token is not None else "n/a"
            print(
                f"{task.name:10s} max_tokens {result.max_tokens:3d} ({result.instances})  "
                f"accuracy {result.accuracy:6.1%}  95% CI [{result.ci95[0]:.1%}, {result.ci95[1]:.1%}]"
                f"  chars {result.char_accuracy:6.1%}  n={result.n}  {result.tokens_per_s:7.1f} tok/s  {steps} steps/token",
                flush=True,
            )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"model": model, "weights_sha256": weights_digest(model), "xargs": xargs, "seed": args.seed,
                   "results": [asdict(r) for r in results], "not_applicable": skipped}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
