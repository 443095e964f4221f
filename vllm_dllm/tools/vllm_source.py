"""Reading a vLLM source tree without importing it: names, class members, dataclass
fields, signatures and code fingerprints, all from `ast`.  Used by
vllm_dllm.tools.vllm_surface_check."""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from pathlib import Path

# ---- reading a source tree -------------------------------------------------------


@dataclass(frozen=True)
class Found:
    module: str
    node: ast.AST | None  # None for a whole module or a lazily created name


class SourceTree:
    """A `vllm` package on disk: the directory that holds `vllm/`, or `vllm/` itself."""

    def __init__(self, path: Path):
        path = Path(path)
        self.root = path.parent if (path / "__init__.py").exists() and path.name == "vllm" else path
        if not (self.root / "vllm" / "__init__.py").exists():
            raise FileNotFoundError(f"no vllm package under {path}")
        self._asts: dict[str, ast.Module | None] = {}

    def version(self) -> str:
        version_file = self.root / "vllm" / "_version.py"
        if version_file.exists():
            for node in ast.parse(version_file.read_text()).body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                    if any(isinstance(t, ast.Name) and t.id == "__version__" for t in _targets(node)):
                        return str(node.value.value)
        return "unknown"

    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.exists():
                return candidate
        return None

    def parse(self, module: str) -> ast.Module | None:
        if module not in self._asts:
            file = self.module_file(module)
            self._asts[module] = ast.parse(file.read_text(), str(file)) if file else None
        return self._asts[module]

    def is_package(self, module: str) -> bool:
        file = self.module_file(module)
        return file is not None and file.name == "__init__.py"

    # -- names ----------------------------------------------------------------

    def lookup(self, module: str, name: str, depth: int = 0) -> Found | None:
        """Where `from module import name` finds its object, following re-exports
        and vLLM's lazy `__getattr__` maps."""
        tree = self.parse(module)
        if tree is None or depth > 12:
            return None
        for stmt in _runtime_statements(tree.body):
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return Found(module, stmt)
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                if any(isinstance(t, ast.Name) and t.id == name for t in _targets(stmt)):
                    return Found(module, stmt)
            if isinstance(stmt, ast.ImportFrom):
                if stmt.names[0].name == "*":
                    hit = self.lookup(self._absolute(module, stmt), name, depth + 1)
                    if hit is not None:
                        return hit
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        source = self._absolute(module, stmt)
                        return self.lookup(source, alias.name, depth + 1) or self._submodule(source, alias.name)
        lazy = self._lazy_target(module, tree, name)
        if lazy is not None:
            return self.lookup(*lazy, depth=depth + 1)
        if _getattr_mentions(tree, name):
            return Found(module, None)
        return self._submodule(module, name)

    def _submodule(self, module: str, name: str) -> Found | None:
        return Found(f"{module}.{name}", None) if self.module_file(f"{module}.{name}") else None

    def _absolute(self, module: str, stmt: ast.ImportFrom) -> str:
        if not stmt.level:
            return stmt.module or ""
        package = module.split(".")
        if not self.is_package(module):
            package = package[:-1]
        if stmt.level > 1:
            package = package[: -(stmt.level - 1)]
        return ".".join(package + ([stmt.module] if stmt.module else []))

    def _lazy_target(self, module: str, tree: ast.Module, name: str) -> tuple[str, str] | None:
        """`MODULE_ATTRS = {"Name": ".sub.module:Name"}` style maps of lazy packages."""
        for node in ast.walk(tree):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values):
                if (
                    isinstance(key, ast.Constant) and key.value == name
                    and isinstance(value, ast.Constant) and isinstance(value.value, str)
                    and ":" in value.value
                ):
                    target, attr = value.value.split(":", 1)
                    if target.startswith("."):
                        target = module + target if self.is_package(module) else module.rsplit(".", 1)[0] + target
                    return target, attr
        return None

    # -- classes --------------------------------------------------------------

    def member(self, cls: Found, name: str, depth: int = 0) -> tuple[Found, ast.AST] | None:
        """A class member: a def, a class-level (annotated) assignment, or an
        attribute its methods assign on `self`; searched through vLLM base classes."""
        node = cls.node
        if not isinstance(node, ast.ClassDef) or depth > 12:
            return None
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return cls, stmt
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                if any(isinstance(t, ast.Name) and t.id == name for t in _targets(stmt)):
                    return cls, stmt
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(stmt):
                    if isinstance(sub, (ast.Assign, ast.AnnAssign)) and any(
                        _is_self_attr(t, name) for t in _targets(sub)
                    ):
                        return cls, sub
        for base in self.bases(cls):
            hit = self.member(base, name, depth + 1)
            if hit is not None:
                return hit
        return None

    def bases(self, cls: Found) -> list[Found]:
        found = []
        for base in cls.node.bases:
            if isinstance(base, ast.Name):
                hit = self.lookup(cls.module, base.id)
                if hit is not None and isinstance(hit.node, ast.ClassDef):
                    found.append(hit)
        return found

    def fields(self, cls: Found) -> dict[str, bool]:
        """Constructor fields of a dataclass / msgspec / pydantic class, base classes
        first: name -> whether it has a default."""
        fields: dict[str, bool] = {}
        for base in reversed(self.bases(cls)):
            fields.update(self.fields(base))
        for stmt in cls.node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            annotation = ast.unparse(stmt.annotation)
            if "ClassVar" in annotation or "InitVar" in annotation or annotation == "KW_ONLY":
                continue
            init, has_default = _field_options(stmt.value)
            if init:
                fields[stmt.target.id] = has_default
            else:
                fields.pop(stmt.target.id, None)
        return fields


def _targets(stmt: ast.AST) -> list[ast.AST]:
    if isinstance(stmt, ast.Assign):
        return [elt for t in stmt.targets for elt in (t.elts if isinstance(t, ast.Tuple) else [t])]
    if isinstance(stmt, ast.AnnAssign):
        return [stmt.target]
    return []


def _is_self_attr(target: ast.AST, name: str) -> bool:
    return (
        isinstance(target, ast.Attribute) and target.attr == name
        and isinstance(target.value, ast.Name) and target.value.id == "self"
    )


def _runtime_statements(body: list[ast.stmt]):
    """Top-level statements, descending into try/if blocks but not `if TYPE_CHECKING:`."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            if "TYPE_CHECKING" in ast.unparse(stmt.test):
                yield from _runtime_statements(stmt.orelse)
                continue
            yield from _runtime_statements(stmt.body)
            yield from _runtime_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from _runtime_statements(block)
        else:
            yield stmt


def _getattr_mentions(tree: ast.Module, name: str) -> bool:
    """A module-level `__getattr__` that handles `name` explicitly (vllm.platforms)."""
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__getattr__":
            return any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(stmt))
    return False


def _field_options(value: ast.expr | None) -> tuple[bool, bool]:
    """(init, has_default) of a field's assigned value."""
    if value is None:
        return True, False
    if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in ("field", "Field"):
        keywords = {k.arg: k.value for k in value.keywords}
        init = keywords.get("init")
        if isinstance(init, ast.Constant) and init.value is False:
            return False, True
        has_default = bool(value.args) or "default" in keywords or "default_factory" in keywords
        return True, has_default
    return True, True


# ---- signatures and fingerprints -----------------------------------------------


def signature_text(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Parameter names, kinds and defaults (annotations left out), plus the
    static/class/property decorator: what an override or a call depends on."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts = []
    for index, (arg, default) in enumerate(zip(positional, defaults)):
        parts.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
        if args.posonlyargs and index == len(args.posonlyargs) - 1:
            parts.append("/")
    if args.vararg:
        parts.append(f"*{args.vararg.arg}")
    elif args.kwonlyargs:
        parts.append("*")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        parts.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if args.kwarg:
        parts.append(f"**{args.kwarg.arg}")
    kinds = [ast.unparse(d) for d in fn.decorator_list if ast.unparse(d) in ("staticmethod", "classmethod", "property")]
    return "".join(f"@{k} " for k in kinds) + f"({', '.join(parts)})"


def fingerprint(node: ast.AST) -> str:
    """A digest of a function's code, blind to comments, docstrings and layout (and to
    the empty AST fields newer Pythons add or omit)."""
    return hashlib.sha256(_canonical(node).encode()).hexdigest()[:12]


def _canonical(node) -> str:
    if isinstance(node, list):
        if node and _is_docstring(node[0]):
            node = node[1:]
        return "[" + ",".join(_canonical(n) for n in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    parts = [
        f"{name}={_canonical(value)}"
        for name, value in ast.iter_fields(node)
        if value is not None and value != [] and name not in ("type_comment", "kind")
    ]
    return f"{type(node).__name__}({','.join(parts)})"


def _is_docstring(stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


# ---- resolving expectations ----------------------------------------------------------


def resolve_qualname(tree: SourceTree, module: str, qualname: str) -> tuple[Found | None, ast.AST | None, str]:
    """(class or module-level object, member node, problem) for `Cls.member` or `name`."""
    head, _, rest = qualname.partition(".")
    found = tree.lookup(module, head)
    if found is None:
        return None, None, f"{head} not found in {module}{defined_elsewhere(tree, head)}"
    if not rest:
        return found, found.node, ""
    if not isinstance(found.node, ast.ClassDef):
        return found, None, f"{head} in {module} is not a class"
    hit = tree.member(found, rest)
    if hit is None:
        return found, None, f"{head}.{rest} not found (class in {found.module})"
    return hit[0], hit[1], ""


def resolve_function(tree: SourceTree, module: str, qualname: str):
    """(function node, problem) for `Cls.method` or `function`."""
    _, node, problem = resolve_qualname(tree, module, qualname)
    if not problem and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        problem = "no longer a function"
    return (None if problem else node), problem


def binding_problem(fn: ast.FunctionDef | ast.AsyncFunctionDef, positional: int, keywords: tuple[str, ...]) -> str:
    """Why a call with `positional` arguments and these keywords no longer binds."""
    args = fn.args
    params = [*args.posonlyargs, *args.args]
    decorators = {ast.unparse(d) for d in fn.decorator_list}
    if params and "staticmethod" not in decorators and params[0].arg in ("self", "cls"):
        params = params[1:]
    num_defaults = len(args.defaults)
    required = [p.arg for p in params[: len(params) - num_defaults]]
    if positional > len(params) and args.vararg is None:
        return f"takes {len(params)} positional arguments, we pass {positional}"
    named = {p.arg for p in params[len(args.posonlyargs):]} | {p.arg for p in args.kwonlyargs}
    unknown = [k for k in keywords if k not in named and args.kwarg is None]
    if unknown:
        return f"no parameter {', '.join(unknown)}"
    bound = {p.arg for p in params[:positional]} | set(keywords)
    missing = [p for p in required if p not in bound]
    missing += [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None and a.arg not in keywords]
    if missing:
        return f"new required parameter {', '.join(missing)}"
    return ""


def defined_elsewhere(tree: SourceTree, name: str) -> str:
    """Where a vanished top-level class or function is defined now, if anywhere."""
    hits = []
    for file in sorted((tree.root / "vllm").rglob("*.py")):
        try:
            text = file.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if f"class {name}" not in text and f"def {name}" not in text:
            continue
        for stmt in ast.parse(text).body:
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef)) and stmt.name == name:
                hits.append(".".join(file.relative_to(tree.root).with_suffix("").parts).removesuffix(".__init__"))
    return f"; defined in {', '.join(hits)}" if hits else ""
