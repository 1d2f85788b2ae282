"""No import circle inside lit_grpo: the graph of which module imports which (at the top or inside a function,
both are edges; imports for type checkers only are not) is read from the source, so a circle shows before it
bites at run time. And the model aliases, whose loaders are named by import path so that a recipe (the
warm-started demo model) sits above model loading, all resolve."""

import ast
from pathlib import Path

import pytest
import torch

from lit_grpo import models

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lit_grpo": ROOT / "lit_grpo", "lit_grpo.callbacks": ROOT / "callbacks"}


def module_files() -> dict[str, Path]:
    files = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            files[".".join([package, *parts])] = path
    return files


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (never run)."""
    def type_checking(node: ast.AST) -> bool:
        test = getattr(node, "test", None)
        return isinstance(node, ast.If) and (
            isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")

    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        children = list(ast.iter_child_nodes(node))
        if type_checking(node):
            children = node.orelse
        todo.extend(children)
    return nodes


def import_graph() -> dict[str, set[str]]:
    """module -> the lit_grpo modules it imports (``from pkg import name`` counts as pkg.name where that is a
    module, else as pkg)."""
    files = module_files()

    def known(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                edges.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else known(base) for a in node.names)
        graph[name] = {e for e in edges if e and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_sees_a_circle_through_a_function_level_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    # the recipe builds on model loading, not the other way round
    assert "lit_grpo.models" in graph["lit_grpo.warm_start"]
    assert "lit_grpo.warm_start" not in graph["lit_grpo.models"]
    assert "lit_grpo.cli_hooks" in graph["lit_grpo.cli"]
    assert "lit_grpo.data.synthetic" in graph["lit_grpo.warm_start"]  # a `from pkg.module import name`


def test_imports_for_type_checkers_only_are_no_edges():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    names = {alias.name for node in runtime_nodes(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert names == {"b", "c"}


def test_lit_grpo_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("alias", models.ALIASES)
def test_every_alias_names_a_loader_that_imports(alias):
    loader = models.alias_loader(alias)
    assert callable(loader)
    assert loader.__name__ == models.ALIAS_LOADERS[alias].rpartition(":")[2]


def test_an_alias_loads_through_its_loader():
    model, tokenizer = models.load_model_and_tokenizer("tiny-random-llama", "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config.vocab_size == len(tokenizer) == len(models.tiny_tokenizer())
    # the same seeded weights as the building blocks give
    expected = models.tiny_llama(len(tokenizer)).to(torch.bfloat16)
    assert torch.equal(model.lm_head.weight, expected.lm_head.weight)


def test_the_demo_alias_is_the_warm_start_recipe(monkeypatch):
    from lit_grpo import warm_start

    calls, tokenizer = [], models.tiny_tokenizer()
    # the real recipe trains for minutes on first use (tests/test_synthetic_task.py covers it): stand in for it
    monkeypatch.setattr(warm_start, "load_warm_started",
                        lambda config, dtype: calls.append((config, dtype)) or ("model", tokenizer))
    assert models.load_model_and_tokenizer("arith-tiny-sft", "float16") == ("model", tokenizer)
    assert calls == [(warm_start.ARITH_TINY_SFT, torch.float16)]
