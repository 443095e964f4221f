"""Host time of structured outputs per engine step, against the step itself.

    python benchmarks/grammar_overhead.py --out benchmarks/results/grammar-overhead

The scheduler plans every constrained request's frontier before the step
(scheduler/grammar.py: fill its grammar's mask, find what the grammar forces and
commit it, fill again) and validates the step's new final tokens after it.  vLLM
overlaps its own bitmask fill with the forward; ours cannot be, since what the grammar
forces goes into the forward's input and the fill that stops the forcing is the
frontier's mask.  This measures what that costs: per step, the planning and
validation of N constrained requests (xgrammar, LLaDA's real 126,464-row vocabulary,
half JSON schema and half regex, each grammar advanced by one token a step as a
frontier commit would; after each step, what the grammar needs to complete its
document is worked out as the scheduler does, and the frontiers carry it), and in the
same invocation an unconstrained Reuse step of N requests on step_bench's small model
(CPU) at 512 positions.  Medians of 20 steps.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,12}$"},
                   "count": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}}},
    "required": ["name", "count", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{3}-[0-9]{4}( [a-z]{2,8})*"
STEPS = 20


def grammars(count: int, tokenizer, vocab: int):
    import xgrammar as xgr
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    json_ctx = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    regex_ctx = compiler.compile_regex(REGEX)
    return [XgrammarGrammar(vocab_size=vocab, matcher=xgr.GrammarMatcher(json_ctx if i % 2 else regex_ctx),
                            ctx=None) for i in range(count)]


def first_allowed(row) -> int | None:
    words = row.numpy().view("uint32")
    for w, word in enumerate(words.tolist()):
        if word:
            return w * 32 + (word & -word).bit_length() - 1
    return None


def grammar_ms(count: int, tokenizer, vocab: int) -> dict:
    import xgrammar as xgr

    from vllm_dllm.scheduler.completion import alphabet_of, need
    from vllm_dllm.scheduler.grammar import Frontier, jump_tokens, plan_frontiers

    items = grammars(count, tokenizer, vocab)
    bitmask = xgr.allocate_token_bitmask(count, vocab)
    scratch = xgr.allocate_token_bitmask(1, vocab)
    alphabet = alphabet_of(tokenizer).with_stops({tokenizer.eos_token_id})
    canvas = 256
    needs: dict[str, int | None] = {}
    plan_times, validate_times, forced = [], [], 0
    for step_index in range(STEPS):
        frontiers = [Frontier(f"r{i}", g, 32, frozenset({tokenizer.eos_token_id}), jump_tokens(g, tokenizer),
                              left=canvas - g.num_processed_tokens, alphabet=alphabet, need=needs.get(f"r{i}"))
                     for i, g in enumerate(items) if not g.is_terminated()]
        start = time.perf_counter()
        step = plan_frontiers(frontiers, bitmask)
        plan_times.append((time.perf_counter() - start) * 1e3)
        # The step's new final tokens: the forced ones and one frontier commit each.
        new = {}
        for i, frontier in enumerate(frontiers):
            token = first_allowed(torch.from_numpy(step.bitmask[step.masked.index(frontier.req_id)]))
            new[frontier.req_id] = step.forced.get(frontier.req_id, []) + ([] if token is None else [token])
        forced += sum(len(t) for t in step.forced.values())
        start = time.perf_counter()
        for frontier in frontiers:
            tokens = frontier.grammar.validate_tokens(new[frontier.req_id])
            grammar = frontier.grammar
            if tokens and grammar.accept_tokens(frontier.req_id, tokens):
                needs[frontier.req_id] = need(grammar, frontier.req_id, alphabet, frontier.left - len(tokens), scratch,
                                              frontier.jump)  # the grammar's forced strings, as the scheduler
                grammar.rollback(len(tokens))
        validate_times.append((time.perf_counter() - start) * 1e3)
        for frontier in frontiers:
            frontier.grammar.accept_tokens(frontier.req_id, new[frontier.req_id])
    return {"plan_ms": round(statistics.median(plan_times), 3),
            "validate_ms": round(statistics.median(validate_times), 3), "forced_tokens": forced}


def step_ms(count: int) -> float:
    import step_bench

    device = torch.device("cpu")
    torch.set_grad_enabled(False)
    model = step_bench.build_model(step_bench.SMALL, torch.float32, device)
    return round(step_bench.ours_reuse(model, count, 512, step_bench.Timer(device), 5, device), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--requests", default="1,16,64")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from vllm_dllm.families import register_hf_classes
    from vllm_dllm.tools.make_tiny import make_tiny

    register_hf_classes()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_tiny("llada", pathlib.Path(scratch) / "llada-real", vocab="real", seed=0)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        vocab = json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"]
    rows = []
    for count in (int(n) for n in args.requests.split(",")):
        grammar = grammar_ms(count, tokenizer, vocab)
        step = step_ms(count)
        rows.append({"requests": count, **grammar, "reuse_step_ms": step,
                     "host_over_step": round((grammar["plan_ms"] + grammar["validate_ms"]) / step, 3)})
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"vocab": vocab, "steps": STEPS, "torch": torch.__version__, "rows": rows}
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| constrained requests | plan ms | validate ms | forced tokens (20 steps) | Reuse step ms | host / step |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['requests']} | {r['plan_ms']} | {r['validate_ms']} | {r['forced_tokens']} | {r['reuse_step_ms']} "
              f"| {r['host_over_step']} |" for r in rows]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
