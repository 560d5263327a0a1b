"""meshsim's import graph: every import circle and every upward import, between packages and modules.

    python tools/import_graph.py            # this checkout
    python tools/import_graph.py --edges    # also every module-to-module edge

An import counts wherever it is written (module level or inside a function); those under
``if TYPE_CHECKING:`` are left out, since they never run. Packages are the folders right
below ``meshsim/`` (``_sim``, ``_observe``, ...); the top-level modules (``__init__``,
``testing``, ``pytest_plugin``) form the package ``meshsim``; ``__main__`` belongs to ``_cli``.

The layers, top down, are ``LAYERS`` below: an import from a lower layer into a higher one is
*upward*. The engine runs a world and hands it instruments; ``_observe`` (the instruments:
findings, traces, snapshots, the cost model) sits above the backend it observes, ``_record``
(what the backend records into: the ledger, call sites) below it; ``_process`` (what a process
owns and threads share) and ``_base`` sit below everything that runs a world.

Exit status 1 when any circle or upward import exists.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("meshsim", "shardtensor")

# Top down. A package may import those after it in this list, never those before.
LAYERS = [
    "_cli",  # the command line (and python -m meshsim): it uses the public face
    "meshsim",
    "_pytest",
    "_unittest",
    "_modes",
    "_engine",
    "_observe",
    "_baton",
    "_sim",
    "_record",
    "_cuda",
    "_process",
    "_base",
]


# The faces above the engine reach what lies below it through the engine's face
# (``meshsim._engine``), not directly (``_base``, which every layer shares, aside).
FACED = ("_cli", "_pytest", "_unittest")
BEHIND_THE_ENGINE = ("_baton", "_sim", "_record", "_cuda", "_process")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _typing_only(tree: ast.AST) -> set[int]:
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
        if inner is not node
    }


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that the file imports at run time."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _typing_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # ``from package import module`` imports the module (the package's
            # ``__init__`` runs first, as for any submodule: not an edge of its own);
            # ``from module import name`` imports the module
            target = _resolve(module, path.name == "__init__.py", node)
            names = [
                f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target
                for alias in node.names
            ]
        for name in names:
            # the longest known module the dotted name starts with (``from a.b import c``
            # names module a.b.c when c is a module, else the object c of a.b)
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def package_of(module: str) -> str:
    if module == "meshsim.__main__":
        return "_cli"  # python -m meshsim: the command line's entry
    parts = module.split(".")
    if parts[0] != "meshsim":
        return parts[0]
    return (
        parts[1]
        if len(parts) > 2
        or (len(parts) == 2 and parts[1].startswith("_") and (ROOT / "meshsim" / parts[1]).is_dir())
        else "meshsim"
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    sys.setrecursionlimit(10000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def build() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    known = {_module_name(p) for p in files}
    return {_module_name(p): imports_of(p, known) for p in files}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every module-to-module edge")
    args = parser.parse_args()
    graph = build()
    packages: dict[str, set[str]] = {}
    evidence: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = package_of(module), package_of(target)
            if a != b:
                packages.setdefault(a, set()).add(b)
                evidence.setdefault((a, b), []).append(f"{module} -> {target}")
    problems = 0
    print("== import circles between modules")
    for members in _cycles(graph):
        problems += 1
        print("  " + " <-> ".join(members))
    print("== import circles between packages")
    for members in _cycles(packages):
        problems += 1
        print("  " + " <-> ".join(members))
    print("== upward imports (a lower layer importing a higher one)")
    for (a, b), edges in sorted(evidence.items()):
        if a == "shardtensor" and b.startswith(("meshsim", "_")):
            problems += 1
            print(f"  shardtensor -> {b}: " + "; ".join(sorted(edges)))
            continue
        if a in LAYERS and b in LAYERS and LAYERS.index(b) < LAYERS.index(a):
            problems += 1
            print(f"  {a} -> {b}: " + "; ".join(sorted(edges)))
    print("== past the engine's face (the plugin and the unittest bases importing below the engine)")
    for (a, b), edges in sorted(evidence.items()):
        if a in FACED and b in BEHIND_THE_ENGINE:
            problems += 1
            print(f"  {a} -> {b}: " + "; ".join(sorted(edges)))
    unknown = sorted({p for p in packages} - set(LAYERS) - {"shardtensor"})
    if unknown:
        print("== packages with no layer in LAYERS: " + ", ".join(unknown))
    if args.edges:
        print("== edges")
        for module in sorted(graph):
            for target in sorted(graph[module]):
                print(f"  {module} -> {target}")
    print(f"{problems} circle(s), upward import(s) or import(s) past the engine's face")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
