"""No import circle inside lit_grpo: the graph of which module imports which (at the top or inside a function,
both are edges; imports for type checkers only are not) is read from the source, so a circle shows before it
bites at run time. Nor a circle between packages (a package with all its subpackages is one node), and the layers
of the rollout path hold: the engines import nothing of the server process, the server nothing of the trainer's side
or the data module, the shared protocol nothing of either side. No project class inherits a concrete class of
another project module (a mixin that reaches back into its host): only abstract bases (ABCs with abstract methods,
Protocols) and exceptions. And the model aliases, whose loaders are named by import path so that a recipe (the
warm-started demo model) sits above model loading, all resolve."""

import ast
import importlib
import inspect
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from lit_grpo.models import loading as models

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
    assert "lit_grpo.models.loading" in graph["lit_grpo.training.warm_start"]
    assert "lit_grpo.training.warm_start" not in graph["lit_grpo.models.loading"]
    assert "lit_grpo.cli.hooks" in graph["lit_grpo.cli.lightning_cli"]
    assert "lit_grpo.data.synthetic" in graph["lit_grpo.training.warm_start"]  # a `from pkg.module import name`


def test_imports_for_type_checkers_only_are_no_edges():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    names = {alias.name for node in runtime_nodes(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert names == {"b", "c"}


def test_lit_grpo_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def package_of(module: str) -> str:
    """The package ``module`` belongs to: ``lit_grpo.<name>`` for everything under a subpackage of lit_grpo (its
    own subpackages included), ``lit_grpo.callbacks``, or the module itself at the top of lit_grpo."""
    parts = module.split(".")
    if len(parts) > 1 and parts[0] == "lit_grpo" and (PACKAGES["lit_grpo"] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module if len(parts) < 2 or parts[1] != "callbacks" else "lit_grpo.callbacks"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph with every package folded into one node (edges inside a package dropped)."""
    folded: dict[str, set[str]] = {}
    for module, imported in graph.items():
        node = package_of(module)
        folded.setdefault(node, set()).update(package_of(m) for m in imported if package_of(m) != node)
    return folded


def test_a_circle_through_two_packages_shows_in_the_package_graph():
    # the lazy re-export of a client that lived in another package, which imported the engines back: no circle of
    # modules, a circle of packages
    graph = {"lit_grpo.engines": {"lit_grpo.serve.client"}, "lit_grpo.engines.base": set(),
             "lit_grpo.serve.client": {"lit_grpo.engines.base"}, "lit_grpo.training.module": {"lit_grpo.engines.base"}}
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == ["lit_grpo.engines", "lit_grpo.serve", "lit_grpo.engines"]
    assert package_of("lit_grpo.engines.remote.client") == "lit_grpo.engines"
    assert package_of("lit_grpo.callbacks.weight_sync") == "lit_grpo.callbacks"


def test_lit_grpo_has_no_import_circle_between_packages():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "import circle between packages: " + " -> ".join(cycle)


#: role folder -> the packages it may import (besides itself): the rule its ``__init__`` docstring states
ALLOWED = {
    "lit_grpo.math": set(),
    "lit_grpo.core": {"lit_grpo.math"},
    "lit_grpo.models": {"lit_grpo.core"},
    "lit_grpo.wire": {"lit_grpo.core"},  # shared by both sides of the rollout path
    "lit_grpo.engines": {"lit_grpo.core", "lit_grpo.math", "lit_grpo.models", "lit_grpo.wire"},
    "lit_grpo.serve": {"lit_grpo.core", "lit_grpo.engines", "lit_grpo.models", "lit_grpo.wire"},  # not the trainer's
    "lit_grpo.environments": {"lit_grpo.core"},  # plain Python objects a user writes: no engine, no tensor plumbing
    "lit_grpo.data": {"lit_grpo.core", "lit_grpo.engines", "lit_grpo.environments", "lit_grpo.math",
                      "lit_grpo.models"},
    "lit_grpo.training": {"lit_grpo.core", "lit_grpo.data", "lit_grpo.math", "lit_grpo.models"},
    "lit_grpo.evaluation": {"lit_grpo.core", "lit_grpo.data", "lit_grpo.engines", "lit_grpo.environments",
                            "lit_grpo.math", "lit_grpo.models"},
    # a reusable callback works with any module that follows its protocol: nothing of the training step
    "lit_grpo.callbacks": {"lit_grpo.core", "lit_grpo.data", "lit_grpo.engines", "lit_grpo.evaluation",
                           "lit_grpo.models"},
}
#: the modules allowed at the top of lit_grpo/ beside the role folders
TOP_MODULES = {"__init__.py", "__main__.py", "_layout.py"}


def test_every_role_imports_only_what_its_rule_allows():
    graph = import_graph()
    crossings = sorted(f"{module} -> {imported}" for module, edges in graph.items() for imported in edges
                       if package_of(module) in ALLOWED and package_of(imported) != package_of(module)
                       and package_of(imported) not in ALLOWED[package_of(module)])
    assert crossings == [], "a role imports what its rule does not allow: " + ", ".join(crossings)
    server_modules = {m for m in graph if package_of(m) == "lit_grpo.serve"}
    assert {"lit_grpo.engines.remote.client", "lit_grpo.engines.remote.weight_push"}.isdisjoint(
        set().union(*(graph[m] for m in server_modules)))


def test_no_callback_imports_the_training_step():
    # what a callback shares with GRPOModule (log_measured) lives in core, so a module of one's own can use both
    graph = import_graph()
    importers = sorted(f"{m} -> {e}" for m, edges in graph.items() if package_of(m) == "lit_grpo.callbacks"
                       for e in edges if package_of(e) == "lit_grpo.training")
    assert importers == [], "callbacks import the training step: " + ", ".join(importers)
    assert "lit_grpo.training" not in ALLOWED["lit_grpo.callbacks"]


def test_nothing_imports_the_command_line():
    graph = import_graph()
    importers = sorted(m for m, edges in graph.items() if package_of(m) not in ("lit_grpo.cli", "lit_grpo.__main__")
                       and any(package_of(e) == "lit_grpo.cli" for e in edges))
    assert importers == []


def test_the_folder_listing_is_the_architecture():
    top = PACKAGES["lit_grpo"]
    modules = {p.name for p in top.glob("*.py")}
    assert modules <= TOP_MODULES, f"modules at the top of lit_grpo/: {sorted(modules - TOP_MODULES)}"
    folders = {p.name for p in top.iterdir() if (p / "__init__.py").is_file()}
    roles = {name.split(".")[1] for name in ALLOWED} - {"callbacks"} | {"cli"}
    assert folders == roles, "each role folder needs its rule in ALLOWED (and its docstring)"
    for folder in [*(top / name for name in folders), ROOT / "callbacks"]:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 20, f"{folder.name}/__init__.py: say the role and what it may import"


def test_the_role_check_sees_a_forbidden_import():
    graph = {"lit_grpo.models.lora": {"lit_grpo.training.module"}, "lit_grpo.training.module": set()}
    crossing = [(m, e) for m, edges in graph.items() for e in edges
                if package_of(e) not in ALLOWED[package_of(m)] | {package_of(m)}]
    assert crossing == [("lit_grpo.models.lora", "lit_grpo.training.module")]


@pytest.mark.parametrize("old, new", sorted(__import__("lit_grpo._layout", fromlist=["MOVED"]).MOVED.items()))
def test_an_old_import_path_is_the_module_at_its_new_path(old, new):
    with pytest.warns(DeprecationWarning, match=new) if old not in __import__("sys").modules else nullcontext():
        moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)


#: concrete classes of another module that a project class may still extend, in code outside the rollout path
#: (each pair must still exist: a fixed one leaves the list)
KNOWN_CONCRETE_BASES = {
    ("lit_grpo.cli.lightning_cli.GRPOCLI", "lit_grpo.cli.errors.OneLineErrorsCLI"),
    ("lit_grpo.math.rec.ClipOptions", "lit_grpo.math.objective.ClipBand"),
    ("lit_grpo.math.rec.TauOptions", "lit_grpo.math.objective.LossConfig"),
    ("lit_grpo.math.rec.REDWeightOptions", "lit_grpo.math.objective.LossConfig"),
    ("lit_grpo.math.gspo.GSPOOptions", "lit_grpo.math.objective.GRPOOptions"),
    ("lit_grpo.math.cispo.CISPOOptions", "lit_grpo.math.objective.LossConfig"),
    ("lit_grpo.math.dppo.DPPOOptions", "lit_grpo.math.objective.LossConfig"),
    ("lit_grpo.math.sapo.SAPOOptions", "lit_grpo.math.objective.LossConfig"),
    ("lit_grpo.math.luspo.LUSPOOptions", "lit_grpo.math.gspo.GSPOOptions"),
    ("lit_grpo.math.vespo.VESPOOptions", "lit_grpo.math.objective.LossConfig"),
    ("lit_grpo.math.gmpo.GMPOOptions", "lit_grpo.math.objective.ClipBand"),
}


def allowed_base(base: type) -> bool:
    """An abstract base that declares what it needs (a Protocol, or an ABC with abstract methods), or an
    exception."""
    return issubclass(base, BaseException) or bool(getattr(base, "_is_protocol", False)) or inspect.isabstract(base)


def concrete_bases_from_elsewhere(classes: list[type]) -> set[tuple[str, str]]:
    """``(class, base)`` for every base of a class that is a concrete class of another project module."""
    found = set()
    for cls in classes:
        for base in cls.__bases__:
            project = base.__module__.split(".")[0] == "lit_grpo"
            if project and base.__module__ != cls.__module__ and not allowed_base(base):
                found.add((f"{cls.__module__}.{cls.__qualname__}", f"{base.__module__}.{base.__qualname__}"))
    return found


def project_classes() -> list[type]:
    """Every class defined at the top of a lit_grpo module."""
    classes = []
    for name in sorted(module_files()):
        module = importlib.import_module(name)
        classes += [obj for obj in vars(module).values() if inspect.isclass(obj) and obj.__module__ == name]
    return classes


def test_the_inheritance_check_sees_a_mixin_and_lets_abstract_bases_and_exceptions_pass():
    from abc import ABC, abstractmethod
    from typing import Protocol

    def made(name: str, bases: tuple, module: str, **members) -> type:  # noqa: ANN003
        return type(name, bases, {"__module__": module, **members})

    mixin = made("AsyncRollouts", (), "lit_grpo.data.async_rollouts")
    contract = made("Contract", (ABC,), "lit_grpo.a", run=abstractmethod(lambda self: None))
    protocol = made("Shape", (Protocol,), "lit_grpo.a")
    error = made("Failure", (RuntimeError,), "lit_grpo.a")
    classes = [made("RolloutDataModule", (mixin,), "lit_grpo.data.datamodule"),
               made("Engine", (contract, protocol), "lit_grpo.b", run=lambda self: None),
               made("Worse", (error,), "lit_grpo.b"), made("Local", (mixin,), "lit_grpo.data.async_rollouts")]
    assert concrete_bases_from_elsewhere(classes) == {
        ("lit_grpo.data.datamodule.RolloutDataModule", "lit_grpo.data.async_rollouts.AsyncRollouts")}


def test_no_project_class_extends_a_concrete_class_of_another_module():
    found = concrete_bases_from_elsewhere(project_classes())
    assert found - KNOWN_CONCRETE_BASES == set(), "mixins: own the other class's object instead"
    assert KNOWN_CONCRETE_BASES - found == set(), "no longer there: take them off KNOWN_CONCRETE_BASES"


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
    from lit_grpo.training import warm_start

    calls, tokenizer = [], models.tiny_tokenizer()
    # the real recipe trains for minutes on first use (tests/test_synthetic_task.py covers it): stand in for it
    monkeypatch.setattr(warm_start, "load_warm_started",
                        lambda config, dtype: calls.append((config, dtype)) or ("model", tokenizer))
    assert models.load_model_and_tokenizer("arith-tiny-sft", "float16") == ("model", tokenizer)
    assert calls == [(warm_start.ARITH_TINY_SFT, torch.float16)]
