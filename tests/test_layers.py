"""The layers docs/architecture.md promises, read from every import of the package (those
inside functions included): the data flows extract -> store -> analyze -> report, and an
arrow against it, a model import in a stage that needs no model, zarr in analyze, or a
reader reaching a writer fails here, naming the module and the import."""

from __future__ import annotations

import ast
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
