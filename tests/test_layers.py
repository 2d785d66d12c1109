"""Imports run one way: every module of doplus_cli sits in a layer, imports only modules of its own layer or of lower
ones, and no modules import each other in a circle (docs/architecture.md, "Layers").

Every import counts: at the top of a module, inside a function, absolute or relative. The package a module sits in
is not counted as imported by it (Python runs a package's __init__ first, but doplus's __init__ files import only
what sits below them)."""

from __future__ import annotations

import ast
from pathlib import Path

import doplus_cli

PACKAGE = "doplus_cli"
ROOT = Path(doplus_cli.__file__).parent

# Top to bottom. An entry names a module, or a package and every module in it; the top package itself
# (`doplus_cli`, its __init__) names only its own module. Entries for modules that do not exist yet are fine.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("command line", ("doplus_cli.cli", "doplus_cli.__main__")),
    ("hyper-parameter search", ("doplus_cli.tune",)),  # doplus tune: its trials are bench schemes' runs
    ("benchmarks and recipes", ("doplus_cli.bench", "doplus_cli.recipes")),
    # the commands, and the engine modules that run one (the teaching stage and the relearning attack run
    # `doplus multitask`)
    ("commands", ("doplus_cli.commands", "doplus_cli.engine.teach", "doplus_cli.engine.attacks")),
    ("engine", ("doplus_cli.engine",)),
    ("evaluation", ("doplus_cli.evaluation",)),
    ("configuration", ("doplus_cli.config", "doplus_cli.options", "doplus_cli.option")),
    ("components", ("doplus_cli.data", "doplus_cli.losses", "doplus_cli.models", "doplus_cli.lora",
                    "doplus_cli.generation", "doplus_cli.decoding", "doplus_cli.files",
                    "doplus_cli.lifecycle", "doplus_cli.ownership", "doplus_cli.hub_errors")),
    ("optimizers", ("doplus_cli.optim",)),
    ("foundations", ("doplus_cli.errors", "doplus_cli.progress", "doplus_cli.registry", "doplus_cli")),
]

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path, package: str = PACKAGE) -> str:
    """`root/engine/loop.py` -> `doplus_cli.engine.loop`; a package's __init__.py is the package."""
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool, modules: set[str], package: str = PACKAGE
                     ) -> set[str]:
    """The modules of `package` that `source` (the text of `module`) imports anywhere in it. `from a.b import c`
    imports the module a.b.c when there is one, else a.b; relative imports are resolved from `module`."""
    found = set()
    tree = ast.parse(source)
    # imports under `if TYPE_CHECKING:` are for annotations only: nothing is imported when the code runs
    typing_only = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for statement in node.body for inner in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            found.update(f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                         for alias in node.names)
    return {name for name in found if name == package or name.startswith(package + ".")} - {module}


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> Graph:
    """{module: the modules of the package it imports} for every module under `root`."""
    paths = {module_name(path, root, package): path for path in sorted(root.rglob("*.py"))}
    return {module: imported_modules(path.read_text(), module, path.name == "__init__.py", set(paths), package)
            for module, path in paths.items()}


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS, package: str = PACKAGE
             ) -> int | None:
    """The index of `module`'s layer (0 is the top), by the longest entry that names it; None when none does."""
    best: tuple[int, int] | None = None
    for index, (_, entries) in enumerate(layers):
        for entry in entries:
            if module == entry or (entry != package and module.startswith(entry + ".")):
                if best is None or len(entry) > best[1]:
                    best = (index, len(entry))
    return None if best is None else best[0]


def modules_without_layer(graph: Graph, layers: list[tuple[str, tuple[str, ...]]] = LAYERS,
                          package: str = PACKAGE) -> list[str]:
    return sorted(module for module in graph if layer_of(module, layers, package) is None)


def upward_imports(graph: Graph, layers: list[tuple[str, tuple[str, ...]]] = LAYERS, package: str = PACKAGE
                   ) -> list[str]:
    """Every import of a module in a higher layer than the importer's, as 'importer (layer) -> imported (layer)'."""
    found = []
    for module, imported in sorted(graph.items()):
        own = layer_of(module, layers, package)
        for target in sorted(imported):
            other = layer_of(target, layers, package)
            if own is not None and other is not None and other < own:
                found.append(f"{module} ({layers[own][0]}) -> {target} ({layers[other][0]})")
    return found


def import_cycles(graph: Graph) -> list[list[str]]:
    """The groups of modules that import each other in a circle (strongly connected components of more than one
    module), each sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return sorted(cycles)


GRAPH = import_graph()


def test_the_graph_holds_the_package_and_its_imports():
    assert {"doplus_cli", "doplus_cli.cli", "doplus_cli.config", "doplus_cli.optim.kernels"} <= set(GRAPH)
    assert "doplus_cli.errors" in GRAPH["doplus_cli.config"]


def test_every_module_has_a_layer():
    assert modules_without_layer(GRAPH) == []


def test_no_module_imports_a_higher_layer():
    assert upward_imports(GRAPH) == []


def test_no_modules_import_each_other_in_a_circle():
    assert import_cycles(GRAPH) == []


def test_optim_imports_nothing_else_from_doplus():
    """optim/ is the library part, usable on its own (`from doplus_cli.optim import DualOptimPlus`)."""
    outside = {f"{module} -> {target}" for module, imported in GRAPH.items() if module.startswith("doplus_cli.optim")
               for target in imported if not target.startswith("doplus_cli.optim")}
    assert outside == set()


def test_the_registry_module_imports_nothing_from_doplus():
    """Every layer may use `Registry`: it sits in the lowest layer and depends on no other module of doplus."""
    assert GRAPH["doplus_cli.registry"] == set()


# Every table of named, pluggable things, as (module, name): each must be a `Registry` (one type that refuses a
# duplicate name and an entry of another type), so a plain dict under one of these names fails here.
REGISTRIES = [
    ("doplus_cli.config", "SCHEMES"),
    ("doplus_cli.options", "OPTIONS"),
    ("doplus_cli.losses", "FORGET_LOSSES"),
    ("doplus_cli.losses", "RETAIN_LOSSES"),
    ("doplus_cli.losses", "TASK_LOSSES"),
    ("doplus_cli.data.formatting", "PROMPT_TEMPLATES"),
    ("doplus_cli.data.fetching", "DATA_SETS"),
    ("doplus_cli.evaluation.task_metrics", "TASK_METRICS"),
    ("doplus_cli.evaluation.suite_registry", "SUITE_REGISTRY"),
    ("doplus_cli.evaluation.attacks", "ATTACKS"),
    ("doplus_cli.evaluation.attacks", "QUANTIZERS"),
    ("doplus_cli.evaluation.metrics", "INDICATORS"),
    ("doplus_cli.evaluation.metrics", "AGGREGATES"),
    ("doplus_cli.evaluation.openunlearning", "OU_METRICS"),
    ("doplus_cli.evaluation.protocol", "PROTOCOLS"),
    ("doplus_cli.evaluation.summary", "SECTION_PRINTERS"),
    ("doplus_cli.commands.base", "COMMANDS"),
    ("doplus_cli.bench.adapters.base", "ADAPTERS"),
    ("doplus_cli.engine.optimizers", "FL_OPTIMIZERS"),
]


def test_every_registry_is_a_registry():
    import importlib

    from doplus_cli.registry import Registry

    plain = [f"{module}.{name}" for module, name in REGISTRIES
             if not isinstance(getattr(importlib.import_module(module), name), Registry)]
    assert plain == []


def _module_trees() -> dict[str, ast.Module]:
    return {module_name(path, ROOT): ast.parse(path.read_text()) for path in sorted(ROOT.rglob("*.py"))}


def test_every_registry_of_the_package_is_listed():
    """Each `NAME = Registry(...)` at the top of a module is in REGISTRIES (so the test above checks it), and every
    entry of REGISTRIES is such an assignment: the list cannot fall behind the code."""
    found = set()
    for module, tree in _module_trees().items():
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Registry":
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found.update((module, target.id) for target in targets if isinstance(target, ast.Name))
    assert found == set(REGISTRIES)


def test_one_registry_type():
    """`registry.Registry` is the one class of doplus that registers named entries: no other class is called a
    registry or has a `register` method."""
    others = sorted(f"{module}.{node.name}" for module, tree in _module_trees().items() for node in ast.walk(tree)
                    if isinstance(node, ast.ClassDef) and (node.name != "Registry" or module != "doplus_cli.registry")
                    and ("registry" in node.name.lower()
                         or any(isinstance(item, ast.FunctionDef) and item.name == "register" for item in node.body)))
    assert others == []


COMMAND_MODULES = sorted(module for module in GRAPH if module.startswith("doplus_cli.commands.")
                         and module != "doplus_cli.commands.base")


def test_a_command_module_imports_no_other_command_module():
    """Each command is one module: it may use the commands' base (`Command`, the registry) but no other command, so
    a command is added, changed or removed in its own module alone (the registration in commands/__init__.py aside).
    The bench's adapters keep to the same rule."""
    assert COMMAND_MODULES == ["doplus_cli.commands.align", "doplus_cli.commands.multitask",
                               "doplus_cli.commands.unlearn"]
    crossing = sorted(f"{module} -> {target}" for module in COMMAND_MODULES for target in GRAPH[module]
                      if target.startswith("doplus_cli.commands") and target != "doplus_cli.commands.base")
    adapters = [module for module in GRAPH if module.startswith("doplus_cli.bench.adapters.")
                and module != "doplus_cli.bench.adapters.base"]
    crossing += sorted(f"{module} -> {target}" for module in adapters for target in GRAPH[module]
                       if target.startswith("doplus_cli.bench.adapters")
                       and target != "doplus_cli.bench.adapters.base"
                       or target.startswith("doplus_cli.commands.")
                       and target.rsplit(".", 1)[1] not in ("base", module.rsplit(".", 1)[1]))
    assert crossing == []


def test_each_command_has_one_object_registered_and_one_bench_adapter():
    """One registry of commands (by name, each a `Command` of its own module), and the bench's adapters keyed by
    the same names in the same order, each standing beside the command of its name."""
    from doplus_cli.bench.adapters import ADAPTERS
    from doplus_cli.commands import COMMANDS, Command

    assert list(COMMANDS) == list(ADAPTERS)
    for name, command in COMMANDS.items():
        assert isinstance(command, Command) and command.command == name
        assert type(command).__module__ == f"doplus_cli.commands.{name}"
        adapter = ADAPTERS[name]
        assert adapter.training is command and type(adapter).__module__ == f"doplus_cli.bench.adapters.{name}"


COMMANDS_LAYER = next(index for index, (name, _) in enumerate(LAYERS) if name == "commands")
# Modules below the commands that name one, each with what it names: none. A command's config class, its options
# and its checks are in its own module.
STILL_NAMING: dict[str, set[str]] = {}


def command_names_in(source: str, commands: dict[str, str]) -> set[str]:
    """The names of commands (`commands`: name -> its config class's name) that `source` holds as a string or uses
    as a name: what a module that switches on the command it serves holds."""
    names = set(commands) | set(commands.values())
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and node.value in names:
            found.add(node.value)
        elif isinstance(node, ast.Name) and node.id in names or isinstance(node, ast.alias) and node.name in names:
            found.add(node.id if isinstance(node, ast.Name) else node.name)
    return found


def test_no_layer_below_the_commands_names_a_command():
    """What differs between commands (the model card's title, words and command line; the memory plan's states and
    reference model; the report) comes from the command's own module through its `Plan` hooks, so a new command
    gets them right without an edit below commands/ (tests/test_toy_command.py)."""
    from doplus_cli.commands import COMMANDS

    commands = {name: type(command).config_class.__name__ for name, command in COMMANDS.items()}
    paths = {module_name(path, ROOT): path for path in sorted(ROOT.rglob("*.py"))}
    naming = {module: found for module, path in sorted(paths.items())
              if (layer_of(module) or 0) > COMMANDS_LAYER and (found := command_names_in(path.read_text(), commands))}
    assert {module: found - STILL_NAMING.get(module, set()) for module, found in naming.items()
            if found - STILL_NAMING.get(module, set())} == {}
    # the list is exact: an entry whose module no longer names a command goes
    assert {module: naming.get(module, set()) for module in STILL_NAMING} == STILL_NAMING


def test_a_module_switching_on_a_command_is_reported():
    source = ('CARD = {"unlearn": "forgotten"}\n'
              'def steps(config):\n    return 2 if isinstance(config, UnlearnConfig) else 1\n')
    assert command_names_in(source, {"unlearn": "UnlearnConfig"}) == {"unlearn", "UnlearnConfig"}
    assert command_names_in("unlearning = 'unlearned'\n", {"unlearn": "UnlearnConfig"}) == set()


# ---- the checks themselves, on made-up packages that break each rule ----

TOY_LAYERS = [("top", ("toy.app",)), ("middle", ("toy.engine",)), ("bottom", ("toy.util", "toy"))]


def test_a_module_outside_every_layer_is_reported():
    graph = {"toy": set(), "toy.app": set(), "toy.engine.loop": set(), "toy.util": set(), "toy.extra": set()}
    assert modules_without_layer(graph, TOY_LAYERS, "toy") == ["toy.extra"]
    assert layer_of("toy.engine.loop", TOY_LAYERS, "toy") == 1 and layer_of("toy", TOY_LAYERS, "toy") == 2


def test_an_import_of_a_higher_layer_is_reported():
    graph = {"toy.app": {"toy.engine.loop"}, "toy.engine.loop": {"toy.util", "toy.app"}, "toy.util": set()}
    assert upward_imports(graph, TOY_LAYERS, "toy") == ["toy.engine.loop (middle) -> toy.app (top)"]
    del graph["toy.engine.loop"]
    assert upward_imports(graph, TOY_LAYERS, "toy") == []


def test_a_circle_of_imports_is_reported():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}, "f": {"g"}, "g": {"f"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["f", "g"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_inside_functions_and_relative_imports_are_read(tmp_path):
    package = tmp_path / "toy"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "app.py").write_text("from toy.engine import loop\n")
    (package / "util.py").write_text("def f():\n    from .engine.loop import run\n    import toy.app\n")
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "loop.py").write_text("from .. import util\n\n\ndef run():\n    from ..app import x\n")
    graph = import_graph(package, "toy")
    assert graph == {"toy": set(), "toy.app": {"toy.engine.loop"}, "toy.util": {"toy.engine.loop", "toy.app"},
                     "toy.engine": set(), "toy.engine.loop": {"toy.util", "toy.app"}}
    assert upward_imports(graph, TOY_LAYERS, "toy") == ["toy.engine.loop (middle) -> toy.app (top)",
                                                        "toy.util (bottom) -> toy.app (top)",
                                                        "toy.util (bottom) -> toy.engine.loop (middle)"]
    assert import_cycles(graph) == [["toy.app", "toy.engine.loop", "toy.util"]]


def test_imports_for_annotations_only_are_not_counted():
    source = ("from typing import TYPE_CHECKING\nimport typing\nfrom toy import a\n"
              "if TYPE_CHECKING:\n    from toy import b\nif typing.TYPE_CHECKING:\n    import toy.c\n"
              "if a.ready:\n    from toy import d\n")
    modules = {"toy.a", "toy.b", "toy.c", "toy.d", "toy.e"}
    assert imported_modules(source, "toy.e", False, modules, "toy") == {"toy.a", "toy.d"}
