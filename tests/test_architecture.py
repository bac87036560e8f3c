"""The package's architecture, checked from its source (design, "Architecture").

The import graph of ``gradforensics`` is built with :mod:`ast` from every
``gradforensics/**/*.py`` (nothing is imported), and three rules are checked:

* no import cycle between modules, at module level and, stricter, counting the
  imports inside functions too (imports under ``if TYPE_CHECKING:`` never run and
  are left out of both);
* no module imports a private name (leading underscore) of another module;
* the layers import in one direction: capture/replay -> store -> analysis -> report.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "gradforensics"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


@dataclass(frozen=True)
class Import:
    """One import statement's target, as seen in module ``source``."""

    source: str          # importing module
    target: str          # imported module (``from pkg import mod`` resolves to ``pkg.mod``)
    names: tuple[str, ...]  # names taken by ``from target import ...`` (empty for ``import target``)
    line: int
    in_function: bool
    type_checking: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    is_pkg = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(module: str) -> list[Import]:
    """Every import of *module* into ``gradforensics`` or a third-party top-level package."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, type_checking)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    visit(ast.Module(body=[sub], type_ignores=[]), in_function, True)
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), in_function, type_checking)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    out.append(Import(module, alias.name, (), child.lineno, in_function, type_checking))
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(module, child)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    if sub in MODULES:        # from pkg import mod: the module itself
                        out.append(Import(module, sub, (), child.lineno, in_function, type_checking))
                    else:
                        out.append(Import(module, base, (alias.name,), child.lineno, in_function, type_checking))
            else:
                visit(child, in_function, type_checking)

    visit(tree, False, False)
    return out


ALL_IMPORTS: list[Import] = [imp for m in MODULES for imp in imports_of(m)]


def _internal(target: str) -> bool:
    return target == PACKAGE or target.startswith(PACKAGE + ".")


def import_graph(*, functions: bool, type_checking: bool = False) -> dict[str, set[str]]:
    """``{module: {gradforensics modules it imports}}``: at module level, and with *functions* those inside
    functions too; with *type_checking* also those under ``if TYPE_CHECKING:`` (a cycle of types)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in ALL_IMPORTS:
        if (imp.type_checking and not type_checking) or (imp.in_function and not functions) or \
                not _internal(imp.target):
            continue
        if imp.target in MODULES and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of *graph* as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}          # 1 on the stack, 2 done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path = [start]
        state[start] = 1
        while stack:
            node, todo = stack[-1]
            if not todo:
                state[node] = 2
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop(0)
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, sorted(graph[nxt])))
    return None


# ----------------------------------------------------------------------- cycles
def test_graph_sees_the_package():
    graph = import_graph(functions=False)
    assert "gradforensics.analysis.engine.run" in graph
    assert "gradforensics.analysis.contract.model" in graph["gradforensics.analysis.engine.run"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_at_module_level():
    cycle = find_cycle(import_graph(functions=False))
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_counting_imports_inside_functions():
    cycle = find_cycle(import_graph(functions=True))
    assert cycle is None, "import cycle (counting imports inside functions): " + " -> ".join(cycle or [])


def test_no_import_cycle_counting_type_checking_imports():
    """Not even the types form a cycle: the contract (``analysis.contract``) names no type of the pass or
    the toolkit, and one module's result type lives where both its maker and its reader import it."""
    cycle = find_cycle(import_graph(functions=True, type_checking=True))
    assert cycle is None, "import cycle (counting TYPE_CHECKING and function imports): " + " -> ".join(cycle or [])


def test_analysis_in_three_parts():
    """``analysis/`` is the contract (types, registry), the pass (``engine``) and the toolkit the kinds
    import; the contract imports nothing else of analysis, the toolkit no part of the pass."""
    parts = {m.split(".")[2] for m in MODULES if m.startswith(f"{PACKAGE}.analysis.") and m.count(".") >= 2}
    assert parts == {"contract", "engine", "toolkit", "kinds"}, parts
    bad = [f"{imp.source}:{imp.line} imports {imp.target}" for imp in ALL_IMPORTS
           if _under(imp.source, "analysis.contract") and _under(imp.target, "analysis")
           and not _under(imp.target, "analysis.contract")]
    bad += [f"{imp.source}:{imp.line} imports {imp.target}" for imp in ALL_IMPORTS
            if _under(imp.source, "analysis.toolkit") and _under(imp.target, "analysis.engine", "analysis.kinds")]
    assert not bad, "analysis layering broken:\n" + "\n".join(bad)


# ---------------------------------------------------------------- private names
def _private_attribute_uses(module: str) -> list[str]:
    """``alias._name`` where *alias* is a gradforensics module imported into *module*."""
    tree = ast.parse(MODULES[module].read_text())
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _internal(a.name):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and aliases[node.value.id] != module):
            out.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return out


def test_no_private_name_imported_across_modules():
    bad = [f"{imp.source}:{imp.line} imports {name} from {imp.target}"
           for imp in ALL_IMPORTS if _internal(imp.target) and imp.target != imp.source
           for name in imp.names if name.startswith("_") and not name.startswith("__")]
    bad += [f"{imp.source}:{imp.line} imports private module {imp.target}"
            for imp in ALL_IMPORTS if _internal(imp.target) and imp.names == ()
            and any(p.startswith("_") and not p.startswith("__") for p in imp.target.split(".")[1:])
            and not imp.target.startswith(imp.source.rsplit(".", 1)[0] + "._")]
    bad += [use for m in MODULES for use in _private_attribute_uses(m)]
    assert not bad, "private names used across modules (make them public or move them):\n" + "\n".join(bad)


# ----------------------------------------------------------------------- layers
def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _violations(layers: tuple[str, ...], allowed: object) -> list[str]:
    """Imports from a module of *layers* that ``allowed(imp)`` refuses."""
    return [f"{imp.source}:{imp.line} imports {imp.target}" for imp in ALL_IMPORTS
            if _layer(imp.source) in layers and not allowed(imp)]  # type: ignore[operator]


def _top(target: str) -> str:
    return target.split(".")[0]


def _under(target: str, *layers: str) -> bool:
    return any(target == f"{PACKAGE}.{layer}" or target.startswith(f"{PACKAGE}.{layer}.") for layer in layers)


def test_analyses_import_no_other_analysis():
    """A ``kinds`` module imports the engine and shared maths, never another analysis (an analysis that is a
    package imports its own modules); the engine, the signal maths and the series import no analysis at all."""
    kinds = f"{PACKAGE}.analysis.kinds"
    below = (f"{PACKAGE}.analysis.contract", f"{PACKAGE}.analysis.engine", f"{PACKAGE}.analysis.toolkit")

    def analysis(module: str) -> str:           # gradforensics.analysis.kinds.<name>
        return ".".join(module.split(".")[:4])

    bad = [f"{imp.source}:{imp.line} imports {imp.target}" for imp in ALL_IMPORTS
           if imp.target.startswith(kinds + ".") and analysis(imp.target) != analysis(imp.source)
           and (imp.source.startswith(kinds + ".") or imp.source.startswith(below))]
    assert not bad, "an analysis imported from kinds/ (move the shared part to analysis/toolkit):\n" + \
        "\n".join(bad)


@pytest.mark.parametrize(("layers", "rule", "allowed"), [
    (("recording", "replay"), "recording and replay never import analysis or reporting (they write stores, analysis reads them)",
     lambda imp: not _under(imp.target, "analysis", "reporting")),
    (("importing",), "importing writes stores like recording and replay: it never imports analysis, reporting, "
                     "runs or the CLI",
     lambda imp: not _under(imp.target, "analysis", "reporting", "runs", "commands", "cli", "demo")),
    (("analysis",), "analysis never imports torch, recording, replay or importing (it reads stores, framework-free)",
     lambda imp: _top(imp.target) != "torch" and not _under(imp.target, "recording", "replay", "importing")),
    (("store",), "store imports nothing from recording, replay, analysis, reporting, commands or testing "
                 "(the format is the bottom layer)",
     lambda imp: not _under(imp.target, "recording", "replay", "importing", "analysis", "reporting", "commands",
                            "testing", "cli", "demo")),
    (("reporting",), "reporting imports from analysis only its contract (analysis.contract: the types and the "
                     "registry) and gradforensics.analysis",
     lambda imp: not _under(imp.target, "analysis") or imp.target == f"{PACKAGE}.analysis"
     or _under(imp.target, "analysis.contract")),
    (("reporting", "analysis", "store"), "reporting, analysis and store never import torch, recording, replay or the CLI",
     lambda imp: _top(imp.target) != "torch" and not _under(imp.target, "recording", "replay", "commands", "cli",
                                                            "demo")),
])
def test_layering(layers, rule, allowed):
    bad = _violations(layers, allowed)
    assert not bad, f"layering rule broken: {rule}:\n" + "\n".join(bad)


def test_only_the_command_line_imports_commands():
    """``gradforensics.commands`` is the CLI's: the verbs call the libraries (``replay``, ``runs``,
    ``testing``, ``demo``, ...), never the other way; only ``cli.py`` and ``commands/`` import it
    (imports under ``TYPE_CHECKING`` and inside functions count too)."""
    def cli_side(module: str) -> bool:
        return module == f"{PACKAGE}.cli" or _under(module, "commands")

    bad = [f"{imp.source}:{imp.line} imports {imp.target}" for imp in ALL_IMPORTS
           if _under(imp.target, "commands") and not cli_side(imp.source)]
    assert not bad, "layering rule broken: only cli.py and commands/ import gradforensics.commands:\n" + "\n".join(bad)
    for layer in ("runs", "testing", "demo", "replay", "recording", "importing"):
        assert any(_layer(m) == layer for m in MODULES), layer       # the rule sees the libraries it names


# ----------------------------------------------------------------------- naming
def _classes(module: str) -> list[ast.ClassDef]:
    return [n for n in ast.parse(MODULES[module].read_text()).body if isinstance(n, ast.ClassDef)]


def test_every_error_and_warning_lives_in_errors():
    """One home for what the package raises or warns: a class deriving from an exception, a warning or
    another such class of the package is defined in ``gradforensics.errors`` (and listed in its ``__all__``)."""
    known = {"Exception", "BaseException", "KeyboardInterrupt", "Warning", "UserWarning", "RuntimeWarning"}
    known |= {c.name for c in _classes(f"{PACKAGE}.errors")}
    bad = [f"{m}:{c.lineno} defines {c.name}" for m in MODULES if m != f"{PACKAGE}.errors" for c in _classes(m)
           if any((isinstance(b, ast.Name) and (b.id in known or b.id.endswith(("Error", "Warning"))))
                  or (isinstance(b, ast.Attribute) and b.attr.endswith(("Error", "Warning"))) for b in c.bases)]
    assert not bad, "exception classes outside gradforensics/errors.py (move them there):\n" + "\n".join(bad)
    import gradforensics.errors as errors

    assert set(errors.__all__) >= {c.name for c in _classes(f"{PACKAGE}.errors")}


def test_no_module_is_named_like_a_public_function():
    """``gf.report``, ``gf.capture``, ``gf.compare``, ``gf.whatif``, ... are functions: no subpackage or module
    directly under ``gradforensics`` has one of their names (importing it would rebind the name on the
    package), and no module makes itself callable by swapping its class."""
    import gradforensics as gf

    public = {n for n in gf.__all__ if callable(getattr(gf, n)) and not isinstance(getattr(gf, n), type)}
    assert {"analyze", "capture", "compare", "report", "whatif", "open_store"} <= public
    clash = sorted(m for m in MODULES if m.count(".") == 1 and m.split(".")[1] in public)
    assert not clash, f"modules named like public functions: {clash}"
    swaps = [m for m in MODULES if "__class__ =" in MODULES[m].read_text()]
    assert not swaps, f"callable-module class swaps: {swaps}"
    for name in sorted(public):            # the function survives importing every subpackage
        assert callable(getattr(gf, name)) and not isinstance(getattr(gf, name), type(gf)), name


def test_public_result_types_are_exported():
    import gradforensics as gf

    for name in ("Findings", "Flag", "Store", "Location", "Comparison", "WhatIf", "BatchSpec", "RecordSpec",
                 "ModelSpec"):
        assert name in gf.__all__ and isinstance(getattr(gf, name), type), name
    own = {n for n in dir(gf) if not n.startswith("_") and not isinstance(getattr(gf, n), type(gf))} - set(gf.__all__)
    assert own <= {"Any", "TYPE_CHECKING", "annotations"}, own     # besides subpackages, only the module's own imports
    assert {n for n in gf.__all__ if getattr(gf, n, None) is None} == set()


def test_every_module_declares_its_public_names():
    """``__all__`` in every module, naming only what the module binds (defined or imported there)."""
    missing, unbound = [], []
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        declared = next((n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in (n.targets if isinstance(n, ast.Assign)
                                                                     else [n.target]))), None)
        if declared is None:
            missing.append(m)
            continue
        bound = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in n.names}
        bound |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        bound |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        bound |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        names = ast.literal_eval(declared.value) if declared.value is not None else []
        lazy = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
        unbound += [f"{m}: {x}" for x in names if x not in bound and not lazy]
    assert not missing, f"modules without __all__: {missing}"
    assert not unbound, "__all__ names a name the module does not bind:\n" + "\n".join(unbound)


# ------------------------------------------------------------- other libraries' private doors
LIBRARIES = ("numpy", "scipy", "zarr", "numcodecs", "dask", "torch", "transformers")
COMPAT = ROOT / "_compat.py"
COMPAT_MAX_ENTRIES = 4
# Private attributes of library objects reached through an instance (``model.config._attn_implementation``),
# which no import names: listed by name.
PRIVATE_ATTRIBUTES = frozenset({"_attn_implementation"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(source: str) -> list[str]:
    """Where the module *source* reaches into numpy, scipy, zarr, numcodecs, dask, torch or transformers by a private door:
    a ``_``-prefixed module, name or attribute of theirs (imported, or read from a name bound by importing
    them), or any import from ``zarr.core``.  The same rule as ``tools/lean-metrics``'s ``private_reach``."""
    tree = ast.parse(source)
    roots: set[str] = set()             # local names bound to the libraries or to something taken from them
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {(a.asname or a.name).split(".")[0] for a in node.names if _top(a.name) in LIBRARIES}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _top(node.module) in LIBRARIES:
            roots |= {a.asname or a.name for a in node.names}
    hits: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hits += [f"{node.lineno}: import {a.name}" for a in node.names
                     if _top(a.name) in LIBRARIES and (a.name.startswith("zarr.core") or
                                                      any(_private(p) for p in a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _top(node.module) in LIBRARIES:
            if node.module.startswith("zarr.core") or any(_private(p) for p in node.module.split(".")):
                hits.append(f"{node.lineno}: from {node.module}")
            hits += [f"{node.lineno}: {node.module}.{a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if (isinstance(base, ast.Name) and base.id in roots) or node.attr in PRIVATE_ATTRIBUTES:
                hits.append(f"{node.lineno}: .{node.attr}")
    return hits


def test_private_reaches_are_seen():
    """The walk finds each kind of private door in a sample (and none of the public ones)."""
    hits = private_reaches("import numpy as np\nimport torch._dynamo\nfrom scipy.linalg import lapack\n"
           "from zarr.core.sync import sync\nfrom numpy.linalg import _umath_linalg\nfrom dask import array\n"
           "a = np._core\nb = lapack._compute_lwork\nc = model.config._attn_implementation\n"
           "d = np.linalg.norm\ne = array.__name__\nf = self._own\n")
    assert sorted(h.split(": ", 1)[1] for h in hits) == sorted(
        ["import torch._dynamo", "from zarr.core.sync", "numpy.linalg._umath_linalg", "._core", "._compute_lwork",
         "._attn_implementation"]), hits


def test_other_libraries_only_through_public_doors():
    """Issue 38: numpy, scipy, zarr, numcodecs, dask, torch and transformers are used through their public
    names only; what truly must stay private lives in ``gradforensics/_compat.py`` (and nowhere else)."""
    bad = [f"{path.relative_to(ROOT.parent)}:{hit}" for path in MODULES.values() if path != COMPAT
           for hit in private_reaches(path.read_text())]
    assert not bad, "private internals of other libraries (use a public name, or an entry of _compat.py):\n" + \
        "\n".join(bad)


def compat_entries(source: str) -> list[tuple[str, str | None]]:
    """``(name, docstring)`` of each top-level entry of a ``_compat.py`` source: a function or class (its
    docstring), or an assigned name (the string literal right after the assignment)."""
    body = ast.parse(source).body
    entries: list[tuple[str, str | None]] = []
    for i, node in enumerate(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            entries.append((node.name, ast.get_docstring(node)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            nxt = body[i + 1] if i + 1 < len(body) else None
            doc = nxt.value.value if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                                      and isinstance(nxt.value.value, str)) else None
            entries += [(t.id, doc) for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
    return entries


def undated(entries: list[tuple[str, str | None]]) -> list[str]:
    """The entries whose docstring names no version (``2.13``, ``3.1.3``)."""
    return [name for name, doc in entries if not doc or not re.search(r"\d+\.\d+", doc)]


def test_compat_entries_are_read():
    entries = compat_entries('"""Module."""\nimport zarr\n__all__ = ["f", "X"]\n'
                             'def f():\n    """zarr 3.1.3 has no public door; remove when it has."""\n'
                             'X = 1\n"""numpy 2.3: remove after 3.0."""\nY = 2\nclass C:\n    pass\n')
    assert [n for n, _ in entries] == ["f", "X", "Y", "C"]
    assert undated(entries) == ["Y", "C"]


def test_compat_is_small_and_dated():
    """``gradforensics/_compat.py``, if present, holds at most four entries, each with a docstring that names
    the library version it was checked against."""
    if not COMPAT.exists():
        return
    entries = compat_entries(COMPAT.read_text())
    assert len(entries) <= COMPAT_MAX_ENTRIES, f"_compat.py has {len(entries)} entries: {[n for n, _ in entries]}"
    assert not undated(entries), "_compat.py entries without a docstring naming the library version: " + \
        ", ".join(undated(entries))
