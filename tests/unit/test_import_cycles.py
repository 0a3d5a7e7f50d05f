"""No import circles among vllm_sinks modules: settings, the registry and the patch list depend one
way (``env`` <- ``patches.registry`` <- ``patches`` <- ``patches.lifecycle``), and so does the rest.

What counts as an import: every ``import`` / ``from ... import`` statement in a module, *including
those inside functions*. Lazy imports keep the plugin cheap at startup, but a function that imports
a module still needs it, and a circle hidden in a function is how one came in (``env.documented``
imported the patch list, whose registry imports ``env``). ``from pkg import name`` counts as an
import of the submodule ``pkg.name`` where that is a module of ours, else of ``pkg``.

What does not count: the parent package Python runs before a submodule (``import a.b`` runs
``a/__init__.py`` first). A package's ``__init__`` importing its own children is the normal form,
and counting that edge would call every such package a circle. Dynamic imports by name
(``importlib.import_module(patch.hooks)``) are not seen: the registry imports hook modules that
way on purpose, one way (hooks import the registry, never the reverse).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def modules_under(package_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py under the package folder."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _target(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The module of ours a dotted name lands in (the longest known prefix), if any."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ours that ``module`` imports anywhere in its source (see the module docstring)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module is in (or is)
                base = module.split(".")
                if not is_package:
                    base.pop()
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        found.update(t for t in (_target(n, known) for n in names) if t is not None)
    found.discard(module)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_graph(package_dir: pathlib.Path) -> dict[str, set[str]]:
    known = modules_under(package_dir)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_vllm_sinks_has_no_import_cycles():
    graph = import_graph(ROOT / "vllm_sinks")
    assert "vllm_sinks.patches.registry" in graph and graph["vllm_sinks.env"] == set()
    found = cycles(graph)
    assert not found, "import circles (each: modules that import each other, directly or not; " \
        "inside functions too): " + "; ".join(" <-> ".join(c) for c in found)


def test_settings_registry_and_list_depend_one_way():
    graph = import_graph(ROOT / "vllm_sinks")
    assert graph["vllm_sinks.patches.registry"] == {"vllm_sinks.env"}
    assert "vllm_sinks.patches.registry" in graph["vllm_sinks.patches"]
    assert "vllm_sinks.patches.lifecycle" not in graph["vllm_sinks.patches"] | graph["vllm_sinks.patches.registry"]


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    # The shape of the circle this test was written for: settings -> (inside a function) the list
    # -> the registry -> settings. A parent package importing its child is not one.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "env.py").write_text("def documented():\n    from pkg.sub import LIST\n    return LIST\n")
    (pkg / "sub" / "__init__.py").write_text(
        "from pkg.sub.registry import Patch\nfrom . import other\nLIST = ()\n")
    (pkg / "sub" / "registry.py").write_text("from pkg import env\nfrom pkg.sub import other\nPatch = object\n")
    (pkg / "sub" / "other.py").write_text("import os\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.registry"] == {"pkg.env", "pkg.sub.other"}
    assert graph["pkg.sub"] == {"pkg.sub.registry", "pkg.sub.other"}
    assert cycles(graph) == [["pkg.env", "pkg.sub", "pkg.sub.registry"]]
    (pkg / "env.py").write_text("import os\n")
    assert cycles(import_graph(pkg)) == []
