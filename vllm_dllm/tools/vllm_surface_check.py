"""Check a vLLM source tree against the surface the plugin relies on.

The expectations live in `vllm_dllm/serving/vllm_surface/`.  The tree is read with `ast`
only, never imported, so any release can be judged from any machine (its torch pin
does not matter):

    python -m vllm_dllm.tools.vllm_surface_check --release X.Y.Z --report docs/vllm-X.Y-surface.md

downloads the release's wheel (`pip download vllm==X.Y.Z --no-deps`), unpacks its
Python files under .cache/ and checks them.  A path checks an unpacked tree (the
directory holding `vllm/`); with neither, the installed vLLM is checked.

Exit status: 0 when everything holds, 1 when something the plugin uses moved,
vanished or changed signature, 2 when the surface holds but a function whose
behaviour we depend on changed and needs a review (its notes say what to look at).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_dllm.serving import vllm_surface as surface
from vllm_dllm.tools.vllm_source import (
    SourceTree,
    binding_problem,
    defined_elsewhere,
    fingerprint,
    resolve_function,
    resolve_qualname,
    signature_text,
)

# ---- the check ---------------------------------------------------------------------

OK, BROKEN, REVIEW = "ok", "BROKEN", "REVIEW"


@dataclass
class Result:
    section: str
    item: str
    status: str
    detail: str = ""


def release(version_text: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.34.0+cpu" -> (0, 34)); None if unparsable."""
    try:
        major, minor = version_text.split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def check(tree: SourceTree, spec=surface) -> list[Result]:
    """Every expectation of `spec` (a module shaped like the package vllm_dllm.serving.vllm_surface) that
    applies to the tree's release against `tree` (all of them when the release is unknown)."""
    version = release(tree.version())
    sections = (
        (spec.NAMES, _check_name),
        (spec.OVERRIDES, _check_override),
        (spec.CALLS, _check_call),
        (spec.MEMBERS, _check_members),
        (spec.CONSTRUCTED, _check_constructed),
        (spec.LITERALS, _check_literal),
        (spec.REVIEWED, _check_reviewed),
        (spec.RUNNER_CALLS, _check_runner_calls),
    )
    return [
        result for items, check_one in sections for item in items
        if version is None or surface.applies(item, version)
        for result in check_one(tree, item)
    ]


def _check_name(tree: SourceTree, item) -> list[Result]:
    label = f"{item.module}.{item.name}"
    if tree.lookup(item.module, item.name) is None:
        return [Result("names", label, BROKEN, f"not found{defined_elsewhere(tree, item.name)}")]
    return [Result("names", label, OK)]


def _check_override(tree: SourceTree, item) -> list[Result]:
    label = f"{item.module}.{item.qualname}"
    node, problem = resolve_function(tree, item.module, item.qualname)
    if problem:
        return [Result("overrides", label, BROKEN, problem)]
    found = signature_text(node)
    if found != item.signature:
        return [Result("overrides", label, BROKEN, f"expected {item.signature}, found {found}")]
    return [Result("overrides", label, OK, found)]


def _check_call(tree: SourceTree, item) -> list[Result]:
    label = f"{item.module}.{item.qualname}"
    node, problem = resolve_function(tree, item.module, item.qualname)
    if not problem:
        problem = binding_problem(node, item.positional, item.keywords)
    found = "" if node is None else signature_text(node)
    return [Result("calls", label, BROKEN if problem else OK, problem or found)]


def _check_members(tree: SourceTree, item) -> list[Result]:
    cls = tree.lookup(item.module, item.cls)
    results = []
    for name in item.names:
        label = f"{item.module}.{item.cls}.{name}"
        if cls is None or not isinstance(cls.node, ast.ClassDef):
            results.append(Result("members", label, BROKEN, f"class {item.cls} not found"))
        elif tree.member(cls, name) is None:
            results.append(Result("members", label, BROKEN, "not found"))
        else:
            results.append(Result("members", label, OK))
    return results


def _check_constructed(tree: SourceTree, item) -> list[Result]:
    label = f"{item.module}.{item.cls}({', '.join(item.fields)})"
    cls = tree.lookup(item.module, item.cls)
    if cls is None or not isinstance(cls.node, ast.ClassDef):
        return [Result("constructed", label, BROKEN, f"class {item.cls} not found")]
    fields = tree.fields(cls)
    unknown = [f for f in item.fields if f not in fields]
    required = [f for f, has_default in fields.items() if not has_default and f not in item.fields]
    problems = []
    if unknown:
        problems.append(f"no field {', '.join(unknown)}")
    if required:
        problems.append(f"new required field {', '.join(required)}")
    return [Result("constructed", label, BROKEN if problems else OK, "; ".join(problems))]


def _check_literal(tree: SourceTree, item) -> list[Result]:
    label = f"{item.module}: {item.value!r}"
    module_tree = tree.parse(item.module)
    present = module_tree is not None and any(
        isinstance(n, ast.Constant) and n.value == item.value for n in ast.walk(module_tree)
    )
    return [Result("literals", label, OK if present else BROKEN, "" if present else "not read there any more")]


def _check_reviewed(tree: SourceTree, item) -> list[Result]:
    label = f"{item.module}.{item.qualname}"
    _, node, problem = resolve_qualname(tree, item.module, item.qualname)
    if problem:
        return [Result("reviewed behaviour", label, BROKEN, problem)]
    digest = fingerprint(node)
    known = [version for version, known_digest in item.fingerprints.items() if known_digest == digest]
    if not known:
        return [Result("reviewed behaviour", label, REVIEW, f"code {digest} is new: {item.note}")]
    others = [version for version, known_digest in item.fingerprints.items() if known_digest != digest]
    changed = f" (changed from {', '.join(others)})" if others else ""
    return [Result("reviewed behaviour", label, OK, f"as in {', '.join(known)}{changed}: {item.note}")]


def _check_runner_calls(tree: SourceTree, item) -> list[Result]:
    results, calls = [], set()
    for module in item.modules:
        module_tree = tree.parse(module)
        if module_tree is None:
            results.append(Result("runner calls", module, BROKEN, "module not found"))
            continue
        calls |= {
            n.attr for n in ast.walk(module_tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "model_runner"
        }
    for name in sorted(calls):
        if name in item.provided:
            results.append(Result("runner calls", name, OK, "provided by DiffusionModelRunner"))
        elif name in item.not_needed:
            results.append(Result("runner calls", name, OK, item.not_needed[name]))
        else:
            results.append(Result("runner calls", name, REVIEW, "new call on the model runner by vLLM's workers"))
    return results


def report(tree: SourceTree, results: list[Result]) -> str:
    counts = {status: sum(r.status == status for r in results) for status in (OK, BROKEN, REVIEW)}
    verdict = (
        "BROKEN: the plugin will not work as is" if counts[BROKEN]
        else "REVIEW: the surface holds; changed behaviour needs a look" if counts[REVIEW]
        else "OK: every expectation holds"
    )
    lines = [
        f"# vLLM {tree.version()} against the vllm-dllm surface",
        "",
        "Generated by `python -m vllm_dllm.tools.vllm_surface_check` from the expectations in",
        "`vllm_dllm/serving/vllm_surface/` (source read with `ast`, never imported).",
        "",
        f"**Verdict: {verdict}** ({counts[OK]} ok, {counts[BROKEN]} broken, {counts[REVIEW]} to review)",
        "",
    ]
    problems = [r for r in results if r.status != OK]
    if problems:
        lines += ["## Problems", "", "| section | item | status | detail |", "|---|---|---|---|"]
        lines += [f"| {r.section} | `{r.item}` | {r.status} | {_cell(r.detail)} |" for r in problems]
        lines.append("")
    changed = [r for r in results if r.section == "reviewed behaviour" and "(changed from" in r.detail]
    if changed:
        lines += [
            "## Reviewed behaviour that differs between supported versions",
            "",
            "Each is handled as its note says.",
            "",
            "| item | detail |",
            "|---|---|",
        ]
        lines += [f"| `{r.item}` | {_cell(r.detail)} |" for r in changed]
        lines.append("")
    lines += ["## Everything checked", ""]
    section = None
    for r in results:
        if r.section != section:
            section = r.section
            lines += ["", f"### {section}", "", "| item | status | detail |", "|---|---|---|"]
        lines.append(f"| `{r.item}` | {r.status} | {_cell(r.detail)} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def installed_vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed; pass the path of a vLLM source tree")
    return Path(list(spec.submodule_search_locations)[0])


def unpack_release(release: str, cache: Path) -> Path:
    """The Python sources of vLLM `release` from its wheel on the package index."""
    target = cache / f"vllm-{release}-src"
    if (target / "vllm" / "__init__.py").exists():
        return target
    wheels = cache / f"vllm-{release}-wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", f"vllm=={release}", "--no-deps", "--only-binary", ":all:",
         "-q", "-d", str(wheels)],
        check=True,
    )
    wheel = next(wheels.glob(f"vllm-{release}-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        members = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        archive.extractall(target, members)
    return target


def main(argv: list[str] | None = None, spec=surface) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", nargs="?", help="directory holding vllm/ (default: the installed vLLM)")
    parser.add_argument("--release", help="download and check this vLLM release, e.g. 0.33.0")
    parser.add_argument("--cache", default=".cache", help="where --release keeps wheels and sources")
    parser.add_argument("--report", help="also write the markdown report here")
    args = parser.parse_args(argv)
    if args.release:
        root = unpack_release(args.release, Path(args.cache))
    else:
        root = Path(args.tree) if args.tree else installed_vllm_root()
    tree = SourceTree(root)
    results = check(tree, spec)
    text = report(tree, results)
    if args.report:
        Path(args.report).write_text(text)
    for r in results:
        if r.status != OK:
            print(f"{r.status:7} {r.section}: {r.item}: {r.detail}")
    print(text.splitlines()[5])
    if any(r.status == BROKEN for r in results):
        return 1
    return 2 if any(r.status == REVIEW for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
