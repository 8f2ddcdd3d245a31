"""Layering rules the code must keep (DESIGN.md, issue 13): no package imports another
package's private names, and the packages' import graph has no cycles — counting imports
inside functions too, since a lazy import only hides a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

SRC = Path(__file__).resolve().parents[1] / "src" / "meshplace"


def _package(module: str) -> str:
    """``meshplace.placers.base`` -> ``placers``; top-level modules are their own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import statement, anywhere."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def test_no_package_imports_another_package_s_private_names() -> None:
    offences = []
    for name, tree in _modules().items():
        for module, names in _imports(tree):
            if not module.startswith("meshplace.") or _package(module) == _package(name):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private += [p for p in module.split(".") if p.startswith("_") and p != "__init__"]
            if private:
                offences.append(f"{name} imports {private} from {module}")
    assert not offences, offences


def test_the_package_import_graph_is_acyclic() -> None:
    graph = nx.DiGraph()
    for name, tree in _modules().items():
        here = _package(name)
        if name in ("meshplace", "meshplace.cli") or name.endswith(".cli"):
            continue  # the command line sits on top of everything and is imported by nothing
        for module, names in _imports(tree):
            if module == "meshplace":  # `from meshplace import models`: subpackages
                targets = [n for n in names if (SRC / n).is_dir() or (SRC / f"{n}.py").is_file()]
            elif module.startswith("meshplace."):
                targets = [_package(module)]
            else:
                continue
            graph.add_edges_from((here, t) for t in targets if t != here)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles between packages: {cycles}"


def test_placers_import_neither_gymnasium_nor_the_learned_policies() -> None:
    import subprocess
    import sys

    code = (
        "import sys, meshplace.placers\n"
        "from meshplace.placers import registry\n"
        "names = list(registry())\n"
        "heavy = [m for m in sys.modules if m == 'gymnasium' or m.startswith('meshplace.learn')]\n"
        "print(len(names), heavy)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    count, heavy = done.stdout.strip().split(" ", 1)
    assert int(count) == 18  # the learned placers are listed, just not imported
    assert heavy == "[]"
