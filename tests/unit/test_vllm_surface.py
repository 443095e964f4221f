"""The vLLM surface check: the installed vLLM against vllm_dllm/serving/vllm_surface/, the
list against the plugin's own imports, and the checker against small synthetic trees
(so each kind of breakage is shown to be caught)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_dllm.serving import vllm_surface as surface
from vllm_dllm.tools import vllm_surface_check as checker
from vllm_dllm.tools.vllm_source import SourceTree, fingerprint, resolve_qualname, signature_text
from vllm_dllm.tools.vllm_surface_check import BROKEN, OK, REVIEW

PLUGIN = Path(__file__).resolve().parents[2] / "vllm_dllm"


def plugin_files() -> list[Path]:
    """The plugin's code, without the surface list (the package) and its checker (which
    name vLLM modules as data)."""
    surface_package = PLUGIN / "serving" / "vllm_surface"
    checker_file = PLUGIN / "tools" / "vllm_surface_check.py"
    return [
        f for f in sorted(PLUGIN.rglob("*.py")) if f != checker_file and surface_package not in f.parents
    ]


# ---- the installed vLLM ---------------------------------------------------------------


def test_installed_vllm_has_every_name_the_plugin_relies_on():
    tree = SourceTree(checker.installed_vllm_root())
    problems = [r for r in checker.check(tree) if r.status != OK]
    assert not problems, "\n".join(f"{r.status} {r.section}: {r.item}: {r.detail}" for r in problems)


def test_command_line_writes_a_report(tmp_path):
    report = tmp_path / "surface.md"
    assert checker.main(["--report", str(report)]) == 0
    text = report.read_text()
    assert "**Verdict: OK" in text and "vllm.v1.core.sched.scheduler.Scheduler" in text


# ---- the list cannot go stale ------------------------------------------------------------


def plugin_vllm_imports() -> set[tuple[str, str]]:
    """(module, name) of every `from vllm... import name` in vllm_dllm/, plus
    `vllm.<attr>` uses in files that `import vllm`."""
    found = set()
    for file in plugin_files():
        tree = ast.parse(file.read_text())
        imports_vllm = False
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module == "vllm" or node.module.startswith("vllm."):
                    found |= {(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name == "vllm" or not alias.name.startswith("vllm."), (
                        f"{file}: `import {alias.name}`: use `from ... import` so the surface list can name it"
                    )
                    imports_vllm |= alias.name == "vllm"
        if imports_vllm:
            found |= {
                ("vllm", node.attr) for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "vllm"
            }
    return found


def test_every_vllm_import_of_the_plugin_is_listed():
    listed = {(n.module, n.name) for n in surface.NAMES}
    unlisted = plugin_vllm_imports() - listed
    assert not unlisted, f"add these to NAMES in vllm_dllm/serving/vllm_surface/names.py: {sorted(unlisted)}"


def test_every_listed_name_is_still_used():
    stale = {(n.module, n.name) for n in surface.NAMES} - plugin_vllm_imports()
    # Named as strings rather than imported.
    stale.discard(("vllm.v1.core.sched.scheduler", "Scheduler"))
    assert not stale, (
        f"no longer imported by the plugin, remove from NAMES (vllm_dllm/serving/vllm_surface/names.py): "
        f"{sorted(stale)}"
    )


def test_vllm_paths_written_as_strings_are_listed():
    listed = {f"{n.module}.{n.name}" for n in surface.NAMES}
    strings = {
        node.value
        for file in plugin_files()
        for node in ast.walk(ast.parse(file.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and node.value.startswith("vllm.") and " " not in node.value
    }
    # Entry-point groups and env vars are checked as LITERALS.
    strings -= {lit.value for lit in surface.LITERALS}
    assert strings <= listed, f"unlisted vLLM paths in strings: {sorted(strings - listed)}"


def test_entry_point_groups_are_checked():
    text = (PLUGIN.parent / "pyproject.toml").read_text()
    groups = {line.split('"')[1] for line in text.splitlines() if line.startswith('[project.entry-points."vllm.')}
    assert groups and groups <= {lit.value for lit in surface.LITERALS}


# ---- the checker on synthetic trees -------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> SourceTree:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return SourceTree(root)


BASE = {
    "vllm/__init__.py": """
        import typing
        MODULE_ATTRS = {"Engine": ".core.engine:Engine"}
        if typing.TYPE_CHECKING:
            from vllm.core.engine import Engine
    """,
    "vllm/_version.py": "__version__ = version = '9.9.0'\n",
    "vllm/core/__init__.py": "from .engine import *\n",
    "vllm/core/engine.py": """
        from dataclasses import dataclass, field

        class Base:
            def __init__(self, config):
                self.config = config

            def step(self, batch, budget=4):
                '''Run one step.'''
                return batch  # the result

        class Engine(Base):
            MODE = "fast"

        @dataclass
        class Output:
            req_ids: list
            tokens: list = field(default_factory=list)
            seen: int = field(default=0, init=False)

        def helper(a, b=1, *, scale=2.0):
            return a
    """,
    "vllm/plugins.py": 'GROUP = "vllm.general_plugins"\n',
}


def spec(**lists) -> SimpleNamespace:
    empty = dict(NAMES=(), OVERRIDES=(), CALLS=(), MEMBERS=(), CONSTRUCTED=(), LITERALS=(), REVIEWED=(),
                 RUNNER_CALLS=())
    return SimpleNamespace(**{**empty, **lists})


def statuses(tree, **lists) -> list[tuple[str, str]]:
    return [(r.status, r.detail) for r in checker.check(tree, spec(**lists))]


def test_names_follow_lazy_maps_star_imports_and_report_moves(tmp_path):
    tree = write_tree(tmp_path, BASE)
    names = (
        surface.Name("vllm", "Engine"),  # lazy MODULE_ATTRS map, TYPE_CHECKING import ignored
        surface.Name("vllm.core", "Output"),  # star import
        surface.Name("vllm.core", "engine"),  # submodule
        surface.Name("vllm.core.other", "Output"),  # wrong module: reported with where it lives
    )
    results = statuses(tree, NAMES=names)
    assert [s for s, _ in results] == [OK, OK, OK, BROKEN]
    assert "defined in vllm.core.engine" in results[3][1]


def test_overrides_need_the_exact_signature(tmp_path):
    tree = write_tree(tmp_path, BASE)
    same = surface.Override("vllm.core.engine", "Engine.step", "(self, batch, budget=4)")  # inherited
    changed = surface.Override("vllm.core.engine", "Engine.step", "(self, batch)")
    gone = surface.Override("vllm.core.engine", "Engine.finish", "(self)")
    results = statuses(tree, OVERRIDES=(same, changed, gone))
    assert [s for s, _ in results] == [OK, BROKEN, BROKEN]
    assert "found (self, batch, budget=4)" in results[1][1]


def test_calls_must_still_bind(tmp_path):
    tree = write_tree(tmp_path, BASE)
    calls = (
        surface.Call("vllm.core.engine", "helper", 1, ("scale",)),
        surface.Call("vllm.core.engine", "helper", 3),
        surface.Call("vllm.core.engine", "helper", 1, ("factor",)),
        surface.Call("vllm.core.engine", "Engine.__init__", 0),  # config is required
        surface.Call("vllm.core.engine", "Engine.step", 1),
    )
    results = statuses(tree, CALLS=calls)
    assert [s for s, _ in results] == [OK, BROKEN, BROKEN, BROKEN, OK]
    assert "no parameter factor" in results[2][1]
    assert "new required parameter config" in results[3][1]


def test_members_and_constructed_fields(tmp_path):
    tree = write_tree(tmp_path, BASE)
    members = (surface.Members("vllm.core.engine", "Engine", ("MODE", "config", "step", "missing")),)
    constructed = (
        surface.Constructed("vllm.core.engine", "Output", ("req_ids",)),
        surface.Constructed("vllm.core.engine", "Output", ("tokens",)),  # req_ids required
        surface.Constructed("vllm.core.engine", "Output", ("req_ids", "seen")),  # seen is init=False
    )
    results = statuses(tree, MEMBERS=members, CONSTRUCTED=constructed)
    assert [s for s, _ in results] == [OK, OK, OK, BROKEN, OK, BROKEN, BROKEN]
    assert "new required field req_ids" in results[5][1]
    assert "no field seen" in results[6][1]


def test_literals(tmp_path):
    tree = write_tree(tmp_path, BASE)
    literals = (surface.Literal("vllm.plugins", "vllm.general_plugins"),
                surface.Literal("vllm.plugins", "vllm.stat_logger_plugins"))
    assert [s for s, _ in statuses(tree, LITERALS=literals)] == [OK, BROKEN]


def test_fingerprints_ignore_comments_and_docstrings_but_not_code(tmp_path):
    tree = write_tree(tmp_path / "a", BASE)
    digest = fingerprint(resolve_qualname(tree, "vllm.core.engine", "Base.step")[1])
    reviewed = (surface.Reviewed("vllm.core.engine", "Base.step", {"9.8": digest}, "note"),)
    assert [s for s, _ in statuses(tree, REVIEWED=reviewed)] == [OK]

    cosmetic = dict(BASE)
    cosmetic["vllm/core/engine.py"] = BASE["vllm/core/engine.py"].replace("'''Run one step.'''", "# no doc")
    cosmetic["vllm/core/engine.py"] = cosmetic["vllm/core/engine.py"].replace("  # the result", "")
    assert [s for s, _ in statuses(write_tree(tmp_path / "b", cosmetic), REVIEWED=reviewed)] == [OK]

    changed = dict(BASE)
    changed["vllm/core/engine.py"] = BASE["vllm/core/engine.py"].replace("return batch", "return batch[:budget]")
    results = statuses(write_tree(tmp_path / "c", changed), REVIEWED=reviewed)
    assert results[0][0] == REVIEW and "note" in results[0][1]


def test_expectations_of_other_releases_are_not_checked(tmp_path):
    """compat.py branches on the vLLM release: what one branch needs is checked only
    against the releases that take it (the synthetic tree is 9.9.0)."""
    tree = write_tree(tmp_path, BASE)
    names = (
        surface.Name("vllm", "Gone", versions=((0, 0), (9, 9))),  # an older branch: not checked
        surface.Name("vllm", "Engine", versions=((9, 9), (99, 0))),  # this release's branch
        surface.Name("vllm", "Missing", versions=((9, 9), (10, 0))),  # this release's branch, broken
    )
    results = [(r.item, r.status) for r in checker.check(tree, spec(NAMES=names))]
    assert results == [("vllm.Engine", OK), ("vllm.Missing", BROKEN)]
    assert checker.release("0.34.0+cpu") == (0, 34) and checker.release("unknown") is None


def test_every_release_range_in_the_surface_is_one_the_support_window_meets():
    from vllm_dllm.serving.compat import SUPPORTED

    low, high = SUPPORTED
    for section in (surface.NAMES, surface.OVERRIDES, surface.CALLS, surface.MEMBERS, surface.CONSTRUCTED,
                    surface.LITERALS, surface.REVIEWED):
        for item in section:
            since, until = item.versions
            assert since < until and since < high and until > low, item


def test_new_calls_on_the_model_runner_need_a_review(tmp_path):
    files = dict(BASE)
    files["vllm/worker.py"] = """
        class Worker:
            def run(self):
                self.model_runner.execute_model()
                self.model_runner.add_lora()
                self.model_runner.brand_new_hook()
    """
    tree = write_tree(tmp_path, files)
    calls = (surface.RunnerCalls(("vllm.worker",), frozenset({"execute_model"}), {"add_lora": "no LoRA"}),)
    results = [(r.item, r.status) for r in checker.check(tree, spec(RUNNER_CALLS=calls))]
    assert results == [("add_lora", OK), ("brand_new_hook", REVIEW), ("execute_model", OK)]


def test_exit_status_and_verdict(tmp_path):
    tree = write_tree(tmp_path, BASE)
    broken = spec(NAMES=(surface.Name("vllm", "Nope"),))
    text = checker.report(tree, checker.check(tree, broken))
    assert "vLLM 9.9.0" in text and "**Verdict: BROKEN" in text
    assert checker.main([str(tmp_path)], spec=broken) == 1
    digest = "0" * 12  # no code has this fingerprint
    review = spec(REVIEWED=(surface.Reviewed("vllm.core.engine", "helper", {"9.8": digest}, "note"),))
    assert checker.main([str(tmp_path)], spec=review) == 2
    assert checker.main([str(tmp_path)], spec=spec(NAMES=(surface.Name("vllm", "Engine"),))) == 0


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def f(self, a, /, b, *args, c=1, **kw): pass", "(self, a, /, b, *args, c=1, **kw)"),
        ("@staticmethod\ndef f(x, *, y=None): pass", "@staticmethod (x, *, y=None)"),
        ("@classmethod\ndef f(cls, x: int = 3) -> int: pass", "@classmethod (cls, x=3)"),
    ],
)
def test_signature_text(source, expected):
    assert signature_text(ast.parse(source).body[0]) == expected
