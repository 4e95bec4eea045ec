"""The layers docs/architecture.md promises, read from every import of the package (those
inside functions included): the data flows extract -> store -> analyze -> report, and an
arrow against it, a model import in a stage that needs no model, zarr in analyze, a reader
reaching a writer, an import cycle, two packages importing each other, a module importing
its own package's ``__init__``, or a store layer importing one above it fails here, naming
the module and the import."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attngeom"
STAGES = ("extract", "analyze", "ablate", "detect", "report", "explore")
# What each part may not import: no stage imports a later one, the store none at all.
LATER = {
    "store": STAGES,
    "extract": ("analyze", "ablate", "detect", "report", "explore"),
    "analyze": ("extract", "ablate", "detect", "report", "explore"),
    "ablate": ("detect", "report", "explore"),
    "detect": ("ablate", "report", "explore"),
    "report": ("explore",),
    "explore": ("report",),
}
MODEL_STACK = ("torch", "transformers", "accelerate", "datasets")
# The parts that never load a model (they answer from the store alone), and what of the
# model stack each may still use: explore decodes the stored tokens with the run's tokenizer.
MODEL_FREE = {"store": (), "analyze": (), "report": (), "explore": ("transformers",)}
# The store's layers, lowest first (drawn in docs/architecture.md): each imports only those
# before it.
STORE_LAYERS = ("objects", "holds", "extracted", "derived_groups", "integrity", "session")


def imports() -> list[tuple[str, str]]:
    """(module path relative to the package, imported module) for every import statement."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).with_suffix("").as_posix()
        package = module.rsplit("/", 1)[0].replace("/", ".") if "/" in module else ""
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(module, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(["attngeom", *package.split(".")[: len(package.split(".")) - node.level + 1]])
                    found.append((module, f"{base}.{node.module}" if node.module else base))
                else:
                    found.append((module, node.module or ""))
    return found


def part(module: str) -> str:
    return module.split("/", 1)[0] if "/" in module else module


@pytest.mark.parametrize("layer", sorted(LATER))
def test_no_part_imports_a_later_stage(layer):
    wrong = [f"{module} imports {name}" for module, name in imports() if part(module) == layer
             and any(name == f"attngeom.{s}" or name.startswith(f"attngeom.{s}.") for s in LATER[layer])]
    assert not wrong, wrong


@pytest.mark.parametrize("layer", sorted(MODEL_FREE))
def test_the_store_and_the_model_free_stages_never_import_the_model_stack(layer):
    wrong = [f"{module} imports {name}" for module, name in imports() if part(module) == layer
             and name.split(".")[0] in MODEL_STACK and name.split(".")[0] not in MODEL_FREE[layer]]
    assert not wrong, wrong


def test_analyze_reaches_the_store_only_through_its_package():
    wrong = [f"{module} imports {name}" for module, name in imports()
             if part(module) == "analyze" and name.split(".")[0] in ("zarr", "numcodecs")]
    assert not wrong, wrong


def test_readers_never_reach_the_writers():
    """report and explore never write: they import none of the store's writers."""
    writers = ("SequenceWriter", "DerivedWrite", "create_run", "write_sequence", "consolidate")
    wrong = []
    for path in sorted([*(PACKAGE / "report").rglob("*.py"), *(PACKAGE / "explore").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                wrong += [f"{path.name} imports {a.name}" for a in node.names if a.name in writers]
    assert not wrong, wrong


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def edges() -> Iterator[tuple[str, str, int]]:
    """(module, module of the package it imports, line) for every import statement, those
    inside functions and ``TYPE_CHECKING`` blocks included: ``from a import b`` imports the
    module ``a.b`` where there is one, else ``a`` itself (its ``__init__``)."""
    known = modules()
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    yield module, target, node.lineno


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycle():
    graph: dict[str, set[str]] = {module: set() for module in modules()}
    lines: dict[tuple[str, str], int] = {}
    for module, target, line in edges():
        graph[module].add(target)
        lines.setdefault((module, target), line)
    wrong = [f"{a} imports {b} (line {lines[a, b]})" for component in cycles(graph)
             for a in component for b in sorted(graph[a]) if b in component]
    assert not wrong, wrong


def test_no_two_packages_import_each_other():
    """Of two sibling parts of a package (its sub-packages and modules), at most one imports
    the other: the store's layers, and the stages and the store, form no loop."""
    arrows: dict[tuple[str, str], str] = {}
    for module, target, line in edges():
        a, b = module.split("."), target.split(".")
        common = 0
        while common < min(len(a), len(b)) and a[common] == b[common]:
            common += 1
        if common < min(len(a), len(b)):
            pair = (".".join(a[: common + 1]), ".".join(b[: common + 1]))
            arrows.setdefault(pair, f"{module} imports {target} (line {line})")
    wrong = [f"{arrows[a, b]}, and {arrows[b, a]}" for a, b in sorted(arrows) if a < b and (b, a) in arrows]
    assert not wrong, wrong


def test_no_module_imports_its_own_package():
    """Modules import the modules they use, never their own package's ``__init__`` (the
    public face, made for the package's users) nor an ancestor's."""
    wrong = [f"{module} imports {target} (line {line})" for module, target, line in edges()
             if module.startswith(f"{target}.")]
    assert not wrong, wrong


def test_each_store_layer_imports_only_those_below_it():
    layers = {f"attngeom.store.{name}": rank for rank, name in enumerate(STORE_LAYERS)}

    def layer(module: str) -> int | None:
        return next((rank for name, rank in layers.items() if module == name or module.startswith(f"{name}.")), None)

    assert {p.stem if p.suffix else p.name for p in (PACKAGE / "store").iterdir()
            if not p.name.startswith("__")} == set(STORE_LAYERS), "every module of the store is in a layer"
    wrong = [f"{module} imports {target} (line {line})" for module, target, line in edges()
             if (own := layer(module)) is not None and (other := layer(target)) is not None and other > own]
    assert not wrong, wrong


def test_architecture_md_draws_the_store_layers_in_their_order():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    drawing = text.split("## Layers", 1)[1].split("```")[3]
    drawn = [line.split()[0].removeprefix("store/").removesuffix("/").removesuffix(".py")
             for line in drawing.splitlines() if line.startswith("store/")]
    assert drawn == list(reversed(STORE_LAYERS))
