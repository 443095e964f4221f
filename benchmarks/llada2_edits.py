"""How often LLaDA2.1's token edits fix or break a token, against the answer,
on an LLaDA2-format task model.

    python -m lab.train --arch llada2 --out runs/llada2-run1 --export /tmp/llada2-model
    python benchmarks/llada2_edits.py --model /tmp/llada2-model --n 30 --out benchmarks/results/llada2-edits

An edit rewrites a committed token.  Each one is classed against the answer's token at
that canvas position (the training canvas: the answer, then EOS to the end of its
block): *fixed* (wrong before, right after), *broke* (right before, wrong after) or
*wrong to wrong*.  The served engine reports only how many tokens a step edited, so
the edits are traced by the reference decoding loop of tests/oracle_llada2.py, which
the plugin matches token for token (tests/engine/test_llada2_decoding.py), on held-out
instances of every task at the length lab.eval asks for (at least one block),
greedy, for LLaDA2.1's quality and speed modes and a sweep of the editing threshold
over threshold 0.7.  Also reported: exact match, edits per
request and forwards per request.  Writes results.json, table.md and edits.png (fixed,
broke and wrong to wrong per setting; edits per request per task); `--from-results
results.json` redraws the table and the figure of an earlier run without decoding.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the reference loop lives with the tests

from tests.oracle_llada2 import llada2_generate, load_llada2_oracle  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # lab/ sits at the repository root
from lab.eval import canvas_for, instances  # noqa: E402
from vllm_dllm.options import LLADA2, resolve  # noqa: E402
from vllm_dllm.serving.server_defaults import ServerDefaults  # noqa: E402
from lab.tasks import closest_answer, resolve_tasks, score  # noqa: E402
from lab.training.batches import Llada2Encoder  # noqa: E402
from lab.training.llada2_objective import extend_to_block  # noqa: E402

SETTINGS = {
    "2.1 quality": {"mode": "quality"},
    "2.1 speed": {"mode": "speed"},
    **{f"edit {e} / threshold 0.7": {"threshold": 0.7, "editing_threshold": e} for e in (0.9, 0.7, 0.5, 0.3)},
}


def classify(edits: list[tuple[int, int, int]], target: list[int]) -> dict[str, int]:
    """Counts of fixed / broke / wrong-to-wrong edits; `target[j]` is the answer's
    token at canvas position j."""
    counts = {"fixed": 0, "broke": 0, "wrong_to_wrong": 0}
    for position, before, after in edits:
        want = target[position] if position < len(target) else None
        if before != want and after == want:
            counts["fixed"] += 1
        elif before == want and after != want:
            counts["broke"] += 1
        else:
            counts["wrong_to_wrong"] += 1
    return counts


def run_setting(oracle, encoder, ids: dict, defaults, xargs: dict, tasks, n: int, seed: int) -> list[dict]:
    rows = []
    for task in tasks:
        def resolved(max_tokens: int):
            return resolve(defaults, max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0,
                           extra_args=dict(xargs))

        # The request size lab.eval asks for: at least one block.
        gen_length = canvas_for(task, resolved(task.gen_length))
        options = resolved(gen_length)
        totals = {"fixed": 0, "broke": 0, "wrong_to_wrong": 0}
        correct = forwards = edited = 0
        items = instances(task, n, seed)
        for item in items:
            prompt = encoder.prompt(item.prompt)
            log: list[tuple[int, int, int]] = []
            result = llada2_generate(
                oracle, prompt, gen_length=gen_length, mask_id=ids["mask"], eos_id=ids["eos"],
                block_length=options.block_length, steps=options.steps, threshold=options.threshold,
                minimal_topk=options.minimal_topk, editing_threshold=options.editing_threshold,
                max_post_steps=options.max_post_steps, num_to_transfer=options.num_to_transfer, edit_log=log)
            text = encoder.decode(result.tokens)
            # Edits are judged against the accepted answer the output wrote (a multiply
            # product with or without its working).
            target = extend_to_block(encoder.canvas(closest_answer(item, text), gen_length), len(prompt),
                                     options.block_length, ids["eos"])
            for kind, count in classify(log, target).items():
                totals[kind] += count
            correct += score(item, text)
            forwards += result.forwards
            edited += len(log)
        rows.append({"task": task.name, "n": len(items), "accuracy": correct / len(items),
                     "edits_per_request": edited / len(items), "forwards_per_request": forwards / len(items),
                     **totals})
    return rows


def write_table(results: dict[str, list[dict]], out: pathlib.Path, header: str) -> str:
    lines = [header, "", "| setting | task | exact match | edits / request | fixed | broke | wrong to wrong "
             "| forwards / request |", "|---|---|---|---|---|---|---|---|"]
    for setting, rows in results.items():
        for r in rows:
            lines.append(f"| {setting} | {r['task']} | {r['accuracy']:.0%} | {r['edits_per_request']:.2f} | "
                         f"{r['fixed']} | {r['broke']} | {r['wrong_to_wrong']} | {r['forwards_per_request']:.1f} |")
        total = {k: sum(r[k] for r in rows) for k in ("fixed", "broke", "wrong_to_wrong")}
        lines.append(f"| {setting} | **all** | - | - | {total['fixed']} | {total['broke']} | "
                     f"{total['wrong_to_wrong']} | - |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    return table


def plot(results: dict[str, list[dict]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(results)
    tasks = list(dict.fromkeys(r["task"] for rows in results.values() for r in rows))
    fig, (totals, per_task) = plt.subplots(1, 2, figsize=(13, 4.2))
    width = 0.27
    for i, kind in enumerate(("fixed", "broke", "wrong_to_wrong")):
        counts = [sum(r[kind] for r in results[s]) for s in settings]
        totals.bar([x + (i - 1) * width for x in range(len(settings))], counts, width, label=kind.replace("_", " "))
    totals.set_xticks(range(len(settings)), settings, rotation=30, ha="right", fontsize=8)
    totals.set(title="edits against the answer, all tasks", ylabel="tokens")
    totals.legend(fontsize=8)
    for setting in settings:
        by_task = {r["task"]: r["edits_per_request"] for r in results[setting]}
        per_task.plot(tasks, [by_task.get(t, 0.0) for t in tasks], marker="o", label=setting, alpha=0.8)
    per_task.set(title="edits per request", ylabel="tokens edited")
    per_task.tick_params(axis="x", labelsize=8)
    per_task.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def header_for(model: pathlib.Path, n: int) -> str:
    return (f"Edits of LLaDA2.1 decoding against the answer: {n} held-out instances per task, greedy, "
            f"model {model.name}; traced by the reference loop (tests/oracle_llada2.py).")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=pathlib.Path, default=None, help="an exported LLaDA2-format checkpoint")
    ap.add_argument("--n", type=int, default=30, help="held-out instances per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default="every")
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "llada2-edits")
    ap.add_argument("--from-results", type=pathlib.Path, default=None,
                    help="an earlier run's results.json: redraw its table and figure into --out, no decoding")
    args = ap.parse_args(argv)
    if args.from_results:
        earlier = json.loads(args.from_results.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        print(write_table(earlier["results"], args.out, header_for(pathlib.Path(earlier["model"]), earlier["n"])))
        plot(earlier["results"], args.out / "edits.png")
        return 0
    if args.model is None:
        ap.error("--model is required (or --from-results)")
    generation = json.loads((args.model / "generation_config.json").read_text())
    ids = {"mask": generation["mask_token_id"], "eos": generation["eos_token_id"]}
    encoder = Llada2Encoder(args.model, ids)
    defaults = ServerDefaults.build(LLADA2, generation, {})
    oracle = load_llada2_oracle(str(args.model))
    tasks = resolve_tasks(args.tasks)
    results = {}
    for setting, xargs in SETTINGS.items():
        results[setting] = run_setting(oracle, encoder, ids, defaults, xargs, tasks, args.n, args.seed)
        fixed = sum(r["fixed"] for r in results[setting])
        broke = sum(r["broke"] for r in results[setting])
        print(f"{setting}: {fixed} fixed, {broke} broke", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"model": str(args.model), "n": args.n, "results": results},
                                                      indent=2) + "\n")
    print(write_table(results, args.out, header_for(args.model, args.n)))
    plot(results, args.out / "edits.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
