"""The source of megarl, read with ast: imports without cycles, and prose that states the design.

Import graphs: a node is a subpackage (``megarl/rollout/``) or a top-level module
(``megarl/cli.py``), or, in the module graph, one module (``megarl.rollout.engine``; a package's
``__init__.py`` is the package, ``megarl.rollout``). An edge is any ``import megarl.X`` /
``from megarl.X import`` in it, also inside functions: a lazy import still ties the two together.

Prose: no tracker issue numbers or benchmark result paths (a docstring says what the code does
and why, not which ticket or run led to it), no class over :data:`MAX_CLASS_LINES` lines and no
module docstring over :data:`MAX_MODULE_DOCSTRING_LINES` lines.
"""
import ast
import re
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
    assert {"rollout", "models", "driver", "actors", "policy", "data", "algorithms", "rewards"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_algorithms_do_not_import_rewards():
    # reward workers must stay torch-free; the shared dotted-path loader is megarl.plugins
    graph = import_graph()
    assert "rewards" not in graph["algorithms"] and graph["plugins"] == set()


# ---------------------------------------------------------------------------- module import graph
def _module_name(path: Path) -> str:
    parts = ("megarl",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _under_type_checking(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks (not imported at run time)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def module_import_graph() -> dict[str, set[str]]:
    """Module -> the megarl modules it imports. ``from megarl.x import y`` is an edge to
    ``megarl.x.y`` when that is a module, else to ``megarl.x``; ``import megarl.x.y`` to the
    longest existing module of the dotted name."""
    paths = {_module_name(path): path for path in ROOT.rglob("*.py")}

    def existing(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for src, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _under_type_checking(tree)
        targets = graph.setdefault(src, set())
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                found = [existing(a.name) for a in node.names if a.name.split(".")[0] == "megarl"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megarl":
                found = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else existing(node.module)
                         for a in node.names]
            else:
                continue
            targets.update(t for t in found if t is not None and t != src)
    return graph


def test_module_import_graph_reads_submodule_imports():
    graph = module_import_graph()
    assert "megarl.rollout" in graph and "megarl.rollout.engine" in graph   # __init__ is the package
    assert "megarl.plugins" in graph["megarl.algorithms.registry"]          # a function-level import
    assert all(t in graph for targets in graph.values() for t in targets)


def test_no_cycle_between_megarl_modules():
    cycle = find_cycle(module_import_graph())
    assert cycle is None, " -> ".join(cycle)


# ---------------------------------------------------------------------------- prose
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w/])#\d+\b")
# an upstream reference names its repository: owner/repo#N, "owner/repo issue #N", "owner/repo PR #N"
UPSTREAM_REFERENCE = re.compile(r"[\w.-]+/[\w.-]+(?:#| (?:issues?|PR|pull) #?)\d+")
MAX_CLASS_LINES = 300
MAX_MODULE_DOCSTRING_LINES = 20


def _sources() -> list[tuple[str, str]]:
    return [(str(path.relative_to(ROOT.parent)), path.read_text()) for path in sorted(ROOT.rglob("*.py"))]


def tracker_references(text: str) -> list[tuple[int, str]]:
    """(line, text) of the tracker issue numbers ``text`` mentions, less the upstream references
    to other repositories."""
    upstream = [m.span() for m in UPSTREAM_REFERENCE.finditer(text)]
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in ISSUE_NUMBER.finditer(text)
            if not any(start <= m.start() < end for start, end in upstream)]


def test_tracker_references_keeps_upstream_ones():
    assert tracker_references("fixed for issue 36 (#12);\nsee Issues #7") == \
        [(1, "issue 36"), (1, "#12"), (2, "Issues #7")]
    assert tracker_references("works around ray-project/ray#58080 and NVIDIA/nccl-tests issue #290") == []
    assert tracker_references("# 3 items, #define, a#1, issues with 2 ranks") == []


def test_no_tracker_issue_numbers_or_result_paths():
    offenders = [f"{path}:{line}: {ref}" for path, text in _sources() for line, ref in tracker_references(text)]
    offenders += [f"{path}: perf/results" for path, text in _sources() if "perf/results" in text]
    assert not offenders, "\n".join(offenders)


def test_classes_and_module_docstrings_stay_short():
    offenders = []
    for path, text in _sources():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                offenders.append(f"{path}:{node.lineno}: class {node.name} spans {n} lines")
        doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) and \
            isinstance(tree.body[0].value, ast.Constant) and isinstance(tree.body[0].value.value, str) else None
        if doc is not None and (n := doc.end_lineno - doc.lineno + 1) > MAX_MODULE_DOCSTRING_LINES:
            offenders.append(f"{path}: module docstring of {n} lines")
    assert not offenders, "\n".join(offenders)


def test_the_driver_loop_stays_short():
    """train() orders the run (set-up, steps, checkpoints, interrupt) in at most 60 lines; the
    set-up and resume live in their own functions."""
    tree = ast.parse((ROOT / "driver" / "loop.py").read_text())
    spans = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert spans["train"] <= 60, spans


PASS_METHODS = {"plan", "logprobs", "values", "advantages", "train", "train_critic", "forward_passes",
                "old_logprobs", "reference_logprobs"}
"""The names of a step's forward passes and updates (WorkerGroup's and RankStep's methods; the
policy update is ``train``: ``update`` is also a dict's, and StepRunner has no method of that name)."""


def test_the_step_is_one_call_to_the_training_ranks():
    """StepRunner.run reads generate -> score -> train_step -> sync -> metrics in at most 15 lines
    and calls no forward pass or update itself: those are WorkerGroup.train_step's."""
    tree = ast.parse((ROOT / "driver" / "loop.py").read_text())
    runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StepRunner")
    run = next(n for n in runner.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    assert run.end_lineno - run.lineno + 1 <= 15, run.end_lineno - run.lineno + 1
    called = {c.func.attr for c in ast.walk(run) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)}
    assert "train_step" in called and not called & PASS_METHODS, called
    methods = {n.name for n in runner.body if isinstance(n, ast.FunctionDef)}
    assert not methods & (PASS_METHODS | {"update"}), methods & (PASS_METHODS | {"update"})
