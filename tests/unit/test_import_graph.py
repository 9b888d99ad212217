"""The megarl subpackages import each other without cycles (read from the source with ast).

A node is a subpackage (``megarl/rollout/``) or a top-level module (``megarl/cli.py``); an edge
is any ``import megarl.X`` / ``from megarl.X import`` in it, also inside functions: a lazy import
still ties the two packages together.
"""
import ast
from pathlib import Path

import megarl

ROOT = Path(megarl.__file__).parent


def _node(path: Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        src = _node(path)
        if src == "__init__":
            continue
        targets = graph.setdefault(src, set())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: use absolute megarl imports, not relative ones")
            names = [node.module] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                parts = (name or "").split(".")
                if parts[0] == "megarl" and len(parts) > 1 and parts[1] != src:
                    targets.add(parts[1])
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}   # 1 on the stack, 2 done

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, stack + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_cycle_between_megarl_subpackages():
    graph = import_graph()
    assert {"rollout", "models", "trainer", "algorithms", "rewards"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_algorithms_do_not_import_rewards():
    # reward workers must stay torch-free; the shared dotted-path loader is megarl.plugins
    graph = import_graph()
    assert "rewards" not in graph["algorithms"] and graph["plugins"] == set()
