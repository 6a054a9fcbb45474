"""No import cycle among gspo_megatron's modules, counting the imports inside functions (issue 24): a cycle is a
layering mistake that a function-level import only hides. Each module's imports are read from its source (nothing
is imported), resolved to the package's modules, and the strongly connected components of that graph must be single
modules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gspo_megatron"


def _modules() -> dict[str, Path]:
    root = PACKAGE.parent
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source (``from pkg import mod`` counts as mod)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[module] |= {r for r in map(resolve, names) if r and r != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "gspo_megatron.train.loop" in graph and graph["gspo_megatron.train.loop"]
    found = cycles(graph)
    assert not found, "import cycles (move the shared piece down a layer):\n" + "\n".join(" <-> ".join(c) for c in found)


def imports_between(graph: dict[str, set[str]], source: str, target: str) -> list[str]:
    """The edges from package ``source``'s modules (itself included) to package ``target``'s, as "a -> b"."""
    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")
    return sorted(f"{a} -> {b}" for a in graph if inside(a, source) for b in graph[a] if inside(b, target))


def test_the_direction_checker_finds_an_edge():
    graph = {"p.rollout": {"p.rollout.types"}, "p.rollout.types": set(), "p.rewards.x": {"p.rollout.types"}}
    assert imports_between(graph, "p.rewards", "p.rollout") == ["p.rewards.x -> p.rollout.types"]
    assert imports_between(graph, "p.rollout", "p.rewards") == []


def test_rewards_import_rollout_never_the_reverse():
    """The engines (``rollout``) know nothing of what they are rewarded for (``rewards``: reward functions, the
    sandbox, multi-turn environments, synthetic tasks); ``rewards`` uses the engines' types and errors (issue 36)."""
    graph = import_graph()
    assert "gspo_megatron.rewards.rewards" in graph and "gspo_megatron.rollout.sglang_engine" in graph
    reverse = imports_between(graph, "gspo_megatron.rollout", "gspo_megatron.rewards")
    assert not reverse, "rollout imports rewards (move the shared piece into rollout):\n" + "\n".join(reverse)
    assert imports_between(graph, "gspo_megatron.rewards", "gspo_megatron.rollout")  # the allowed direction is used
