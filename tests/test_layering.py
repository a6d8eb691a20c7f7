"""The package's import graph runs one way: no part of ``nemo_granular`` imports a part above it.

Every ``import`` of a ``nemo_granular`` module in the package's source (module level or inside a
function: a lazy import is a dependency all the same) is an edge between the two *parts* the
modules belong to (a part = a sub-package or a top-level module), and the dispatcher
``nemo_granular.cli`` also depends on the modules its ``COMMANDS`` table names. The graph of parts
must have no cycle, and the parts the comparison is built from keep the order of ``STACK``
(each may import only the parts before it). The test reads the source (``ast``); nothing is
imported, so it fails on an edge before any code could run.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_granular"

# bottom to top: the trainer; the benchmark suites that evaluate its checkpoints; the report that
# reads runs and evals.json; the comparison that runs all three; the command-line dispatcher
STACK = ["embedded", "evals", "report", "compare", "cli"]
# the small leaf modules everything may use: no import of any other part of the package
LEAVES = ["atomic", "batch_schema", "cli_common", "lookup", "rundir"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported nemo_granular module or attribute path, line) for every import in ``path``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from . import x`` imports the module x when there is one
            found += [(f"{module}.{a.name}", node.lineno) for a in node.names]
    return [(m, line) for m, line in found if m == "nemo_granular" or m.startswith("nemo_granular.")]


def _commands() -> list[tuple[str, int]]:
    """The modules the dispatcher imports by name (``COMMANDS``)."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMANDS" for t in node.targets):
            return [(v.elts[0].value, node.lineno) for v in node.value.values]
    raise AssertionError("nemo_granular/cli.py has no COMMANDS table")


def _part(module: str) -> str:
    """``nemo_granular.report.build`` → ``report``; ``nemo_granular`` and its attributes → ``__init__``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    top = parts[1]
    is_part = (PACKAGE / top).is_dir() or (PACKAGE / f"{top}.py").is_file()
    return top if is_part else "__init__"  # e.g. ``from nemo_granular import __version__``


def import_graph() -> dict[str, dict[str, list[str]]]:
    """part → imported part → ["file:line", ...] (edges inside one part left out)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _part(_module_name(path))
        edges = _imports(path) + (_commands() if path == PACKAGE / "cli.py" else [])
        for module, line in edges:
            dst = _part(module)
            if dst != src:
                where = f"{path.relative_to(PACKAGE.parent)}:{line}"
                seen = graph.setdefault(src, {}).setdefault(dst, [])
                if where not in seen:
                    seen.append(where)
    return graph


def _cycle(graph) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_parts_import_each_other_without_a_cycle():
    graph = import_graph()
    cycle = _cycle(graph)
    assert cycle is None, (
        "import cycle "
        + " → ".join(cycle)
        + ": "
        + "; ".join(f"{a} → {b} at {', '.join(graph[a][b][:3])}" for a, b in zip(cycle, cycle[1:]))
    )


def test_the_comparison_stack_imports_only_downwards():
    graph = import_graph()
    upward = [
        f"{src} imports {dst} (above it) at {', '.join(graph[src][dst])}"
        for i, src in enumerate(STACK)
        for dst in STACK[i + 1 :]
        if dst in graph.get(src, {})
    ]
    assert not upward, "; ".join(upward)


def test_only_the_entry_point_imports_the_dispatcher_and_the_leaves_import_nothing():
    graph = import_graph()
    users = sorted(src for src, dsts in graph.items() if "cli" in dsts and src != "__main__")
    assert not users, f"{users} import nemo_granular.cli (the dispatcher): import nemo_granular.cli_common instead"
    for leaf in LEAVES:
        assert (PACKAGE / f"{leaf}.py").is_file(), leaf
        assert not graph.get(leaf), f"{leaf} imports {graph[leaf]}"


def test_the_graph_sees_lazy_imports_and_the_commands_table():
    """The checker itself: a function-level import and a COMMANDS entry are edges."""
    graph = import_graph()
    assert "embedded" in graph["evals"]  # evals/embedded.py imports the trainer's parts inside functions
    assert {"embedded", "compare", "export", "evals"} <= set(graph["cli"])  # only through COMMANDS
