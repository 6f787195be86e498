"""The `swarm` package's modules import each other without a cycle.

The graph is read from the source (ast), not by importing: every module-level `import` and `from ... import`
(relative ones resolved) that names a module of the package is an edge; `from pkg import name` is an edge to
the submodule `pkg.name` where there is one, else to `pkg`. Importing `a.b.c` runs `a/b/__init__.py` first, so
it is an edge to the package `a.b` too, unless the importer lies inside `a.b` (then `a.b` is loading already,
and Python hands out the partly loaded package without running it again). Imports inside functions are left out: they run
after every module finished loading. Imports under `if TYPE_CHECKING:` count: a module that needs another's
types to be read depends on it as much as one that imports it at run time, and hiding that edge there is the
usual way a cycle survives (a cycle of them is two modules that can only be understood together).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "swarm"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def module_imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports at module level (its own body and the `if`/`try` blocks in it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def owner(dotted: str) -> str | None:  # the innermost module of the package that `dotted` lies in
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def walk(statements: list[ast.stmt]) -> set[str]:
        found: set[str | None] = set()
        for statement in statements:
            if isinstance(statement, ast.Import):
                found |= {owner(alias.name) for alias in statement.names}
            elif isinstance(statement, ast.ImportFrom):
                base = statement.module or ""
                if statement.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - statement.level + 1] + ([base] if base else []))
                found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else owner(base)
                          for alias in statement.names}
            elif isinstance(statement, ast.If):
                found |= walk(statement.body) | walk(statement.orelse)
            elif isinstance(statement, ast.Try):
                found |= walk(statement.body) | walk(statement.orelse) | walk(statement.finalbody)
                for handler in statement.handlers:
                    found |= walk(handler.body)
        return {m for m in found if m is not None and m != name}

    inside = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    targets = walk(ast.parse(path.read_text(), str(path)).body)
    parents = {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 1)}
    return targets | {p for p in parents if p in known and p not in inside}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_reader_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_reader_resolves_imports():
    known = modules()
    assert {"swarm.net.policy", "swarm.net.schema", "swarm.errors"} <= module_imports(
        "swarm.net.peer", known["swarm.net.peer"], known)
    inner = module_imports("swarm.net.allreduce.audit", known["swarm.net.allreduce.audit"], known)
    assert "swarm.net.allreduce.groupstate" in inner and "swarm.net.allreduce" not in inner  # its own package
    assert "swarm.net.allreduce" in module_imports("swarm.net.grouping", known["swarm.net.grouping"], known)


def test_no_import_cycle_in_the_package():
    known = modules()
    graph = {name: module_imports(name, path, known) for name, path in known.items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
