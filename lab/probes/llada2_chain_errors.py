"""What a LLaDA2-format task model answers on chain (two-hop retrieval), by kind of error,
through the plugin at the eval's default decoding.

    python -m lab.probes.llada2_chain_errors --model DIR [--n 200] [--out DIR]

A chain answer is the queried link's hub, "=", and the hub's two-capital value
("C=XY"): the hub is the first hop (retrieval's lookup), the value the second (find
the hub in the hub table, read the two capitals after it).  Each answer is classed:
correct; a wrong hub (another hub, or no hub at all); or, with the right hub, the value
of another hub, a first letter from the link table, the second letter alone wrong, or
another value.

"A first letter from the link table" tests one hypothesis about why the second hop
stalls (lab/training-log.md).  The value's first capital X is the token
two after the hub in the hub table (";" "C" "=" "X" "Y"), and the answer repeats that
shape ("C" "=" "X" "Y").  But in the link table (";ab=" "C" ";cd=" "E") the capital
two after a link's hub is the next link's hub: a capital, where the model's answer
reads capitals, two after C.  A second hop that matches "two after the hub" alone,
without the "=" between, reads those.  The benchmark counts wrong first letters that
are such link-table capitals, and how many a wrong capital drawn at random would be
(the sum over those answers of the share of the other 25 capitals they make up).
"Another hub's value" answers are split by which hub they read: the row next to the
right hub in the hub table (a second hop that lands one row off), the hub of a link
next to the queried one in the link table (a value read from a first hop that landed
one link off, not from the hub the answer wrote), or another hub; beside each, how
many a hub drawn at random from the others would give.

The instances are answered twice: as the eval asks them, and with the right hub and its
"=" already written where the answer starts (appended to the chat-framed prompt, so the
canvas opens at the value, in the same block as the hub: what decoding sees once it has
committed the hub).  If the hub-given run fixes most wrong values, they came from the
decoding order (the value committed before its hub); if not, from the second hop itself.
Writes results.json and table.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import string
import sys
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # report.py

from report import print_and_write

from lab.eval import OFFLINE_ENGINE, OfflineRunner, instances
from lab.tasks import ALL_TASKS, Instance

CLASSES = (
    "correct",
    "wrong hub: another hub",
    "wrong hub: not a hub",
    "right hub, malformed value",
    "right hub, another hub's value",
    "right hub, first letter from the link table",
    "right hub, second letter alone wrong",
    "right hub, other value",
)
RELATIONS = ("next row in the hub table", "hub of a neighbouring link", "another hub")
SIZES = ((20, 34), (35, 47), (48, 60))  # pairs per instance, the eval's range in thirds


def parse(prompt: str) -> tuple[list[tuple[str, str]], dict[str, str], str]:
    """(links in order as (key, hub), hub -> value, queried key) of a chain prompt."""
    _, link_line, hub_line, query_line = prompt.split("\n")
    links = re.findall(r";([a-z]{2})=([A-Z])", link_line)
    hubs = dict(re.findall(r";([A-Z])=([A-Z]{2})", hub_line))
    return links, hubs, query_line.removeprefix("follow;").rstrip("=")


def link_table_capitals(links: list[tuple[str, str]], hub: str) -> set[str]:
    """The capitals two tokens after `hub` in the link table: the next link's hub,
    wherever a link names `hub`."""
    return {links[i + 1][1] for i in range(len(links) - 1) if links[i][1] == hub}


def classify(instance: Instance, predicted: str) -> tuple[str, float]:
    """(class, chance): the answer's class, and for a wrong first letter the chance a
    random other capital is a link-table capital (0 otherwise)."""
    links, hubs, query = parse(instance.prompt)
    hub = dict(links)[query]
    value = hubs[hub]
    predicted = predicted.strip()
    if predicted == instance.answer:
        return "correct", 0.0
    if not predicted.startswith(hub):
        return ("wrong hub: another hub" if predicted[:1] in hubs else "wrong hub: not a hub"), 0.0
    match = re.fullmatch(r"=([A-Z]{2})", predicted[len(hub):])
    if match is None:
        return "right hub, malformed value", 0.0
    given = match.group(1)
    if given in {v for h, v in hubs.items() if h != hub} and given != value:
        return "right hub, another hub's value", 0.0
    if given[0] != value[0]:
        distractors = link_table_capitals(links, hub) - {value[0]}
        chance = len(distractors) / (len(string.ascii_uppercase) - 1)
        if given[0] in distractors:
            return "right hub, first letter from the link table", chance
        return "right hub, other value", chance
    return "right hub, second letter alone wrong", 0.0


def other_hub_relation(instance: Instance, given: str) -> tuple[str, dict[str, float]]:
    """For an answer with the right hub and another hub's value: how the hub it read
    relates to the right one, and the chance of each relation for a random other hub."""
    links, hubs, query = parse(instance.prompt)
    order = list(hubs)
    hub = dict(links)[query]
    row = order.index(hub)
    next_rows = {order[i] for i in (row - 1, row + 1) if 0 <= i < len(order)} - {hub}
    at = [k for k, _ in links].index(query)
    neighbour_links = {links[i][1] for i in (at - 1, at + 1) if 0 <= i < len(links)} - {hub}
    others = [h for h in order if h != hub]
    read = {h for h in others if hubs[h] == given}
    chance = {
        RELATIONS[0]: len(next_rows) / len(others),
        RELATIONS[1]: len(neighbour_links - next_rows) / len(others),
    }
    chance[RELATIONS[2]] = 1.0 - chance[RELATIONS[0]] - chance[RELATIONS[1]]
    if read & next_rows:
        return RELATIONS[0], chance
    if read & neighbour_links:
        return RELATIONS[1], chance
    return RELATIONS[2], chance


def size_bucket(instance: Instance) -> str:
    links, hubs, _ = parse(instance.prompt)
    pairs = len(links) + len(hubs)
    return next(f"{lo}-{hi}" for lo, hi in SIZES if lo <= pairs <= hi)


def tally(items: list[Instance], texts: list[str]) -> dict:
    by_size: dict[str, Counter] = {f"{lo}-{hi}": Counter() for lo, hi in SIZES}
    overall: Counter = Counter()
    relations: Counter = Counter()
    relations_by_chance = dict.fromkeys(RELATIONS, 0.0)
    expected = 0.0
    for item, text in zip(items, texts):
        kind, chance = classify(item, text)
        overall[kind] += 1
        by_size[size_bucket(item)][kind] += 1
        expected += chance
        if kind == "right hub, another hub's value":
            relation, chances = other_hub_relation(item, text.strip().split("=")[1])
            relations[relation] += 1
            for name, p in chances.items():
                relations_by_chance[name] += p
    return {"n": len(items), "classes": {k: overall[k] for k in CLASSES},
            "by_pairs": {size: {k: c[k] for k in CLASSES} for size, c in by_size.items()},
            "wrong_first_letters_from_the_link_table_by_chance": round(expected, 2),
            "another_hubs_value_read_from": {k: relations[k] for k in RELATIONS},
            "another_hubs_value_read_from_by_chance": {k: round(v, 2) for k, v in relations_by_chance.items()}}


def table(result: dict) -> str:
    sizes = list(result["by_pairs"])
    lines = [f"| class | all (n = {result['n']}) | " + " | ".join(f"{s} pairs" for s in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for kind in CLASSES:
        cells = [str(result["by_pairs"][s][kind]) for s in sizes]
        lines.append(f"| {kind} | {result['classes'][kind]} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Wrong first letters that a random other capital would put in the link table: "
                 f"{result['wrong_first_letters_from_the_link_table_by_chance']} expected, "
                 f"{result['classes']['right hub, first letter from the link table']} observed.")
    given = result.get("hub_given")
    if given is not None:
        lines += ["", f"With the right hub written first: {given['correct']} of {result['n']} correct; "
                  f"{given['fixed']} of the {result['n'] - result['classes']['correct']} wrong answers above are "
                  f"right then, {given['broken']} right answers above are wrong then."]
    lines += ["", "| another hub's value, read from | observed | a random other hub |", "|---|---|---|"]
    for name in RELATIONS:
        lines.append(f"| {name} | {result['another_hubs_value_read_from'][name]} | "
                     f"{result['another_hubs_value_read_from_by_chance'][name]} |")
    return "\n".join(lines) + "\n"


def hub_given(runner, items: list[Instance], texts: list[str], canvas: int, xargs: dict) -> dict:
    """The same instances with each right hub and "=" written after the prompt: how many
    are right, and how many the plain run got wrong (fixed) or right (broken)."""
    heads = [item.answer.split("=")[0] + "=" for item in items]
    prompts = [runner.prompt_ids(item.prompt) + list(runner.tokenizer.encode(head, add_special_tokens=False))
               for item, head in zip(items, heads)]
    outs = runner.complete(prompts, canvas, xargs)
    return compare_hub_given(items, texts, [head + out.text for head, out in zip(heads, outs)])


def compare_hub_given(items: list[Instance], texts: list[str], given_texts: list[str]) -> dict:
    plain = [classify(i, t)[0] == "correct" for i, t in zip(items, texts)]
    given = [classify(i, t)[0] == "correct" for i, t in zip(items, given_texts)]
    return {"correct": sum(given), "fixed": sum(g and not p for p, g in zip(plain, given)),
            "broken": sum(p and not g for p, g in zip(plain, given))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="the eval's instances for the same seed")
    ap.add_argument("--xargs", default="{}", help="decoding options, as lab.eval's")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    xargs = json.loads(args.xargs)
    chain = ALL_TASKS["chain"]
    runner = OfflineRunner(args.model, OFFLINE_ENGINE)
    items = instances(chain, args.n, args.seed)
    canvas = runner.default_canvas(chain, xargs)
    texts, _, _ = runner.run(items, canvas, xargs)
    result = {"model": args.model, "seed": args.seed, "xargs": xargs, **tally(items, texts),
              "hub_given": hub_given(runner, items, texts, canvas, xargs)}
    print_and_write(result, table(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
