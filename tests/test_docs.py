"""The documentation in docs/ is what the README, the package and the docs point at: every
``docs/<page>.md#<anchor>`` reference, and every link between the docs' pages, resolves to a
page and to one of its headings (GitHub's anchors), and no reference to a document outside
the repository is left."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
PACKAGE_SUFFIXES = (".py", ".js", ".html", ".css")

# A reference written out in text: docs/method.md#balls (a page alone, or with an anchor).
DOCS_REFERENCE = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+))?")
# A Markdown link's target, inside the docs: (store.md#run-arrays), (#balls), (../README.md).
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without Markdown (code marks, links, bold),
    lower case, punctuation but hyphens and underscores dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings (outside code blocks); a repeated heading
    gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not heading:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def text_files() -> list[Path]:
    """The README, the docs and the package's source files: where users meet references."""
    package = [p for p in sorted((ROOT / "attngeom").rglob("*")) if p.suffix in PACKAGE_SUFFIXES]
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *package]


def test_slugs_follow_github():
    assert slug("Sink-aware bound") == "sink-aware-bound"
    assert slug("Precision, recall and F") == "precision-recall-and-f"
    assert slug("`extract`: the [store](store.md)") == "extract-the-store"
    assert slug("**Norms** and `sink_cos`") == "norms-and-sink_cos"


def test_docs_pages_exist_with_the_sections_the_references_need():
    for page in ("README.md", "method.md", "store.md", "cli.md", "api.md"):
        assert (DOCS / page).is_file(), page
    assert {"balls", "sink-aware-bound", "exact-certificate", "head-taxonomy", "ablation",
            "sparsification", "preprocessing"} <= anchors(DOCS / "method.md")
    assert {"commit-protocol", "run-arrays", "analysis-groups", "labels"} <= anchors(DOCS / "store.md")


def test_every_docs_reference_resolves():
    references = []
    for path in text_files():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for page, anchor in DOCS_REFERENCE.findall(line):
                references.append((f"{path.relative_to(ROOT)}:{lineno}", DOCS / page, anchor))
    assert len(references) >= 10  # the README, --help texts and docstrings point at the docs
    broken = [f"{where}: docs/{target.name}#{anchor}" for where, target, anchor in references
              if not target.is_file() or (anchor and anchor not in anchors(target))]
    assert not broken, broken


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_link_of_a_docs_page_resolves(page):
    source = DOCS / page
    broken = []
    for target in LINK.findall(source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an external address
        file, _, anchor = target.partition("#")
        path = (source.parent / file).resolve() if file else source
        if not path.exists() or (anchor and anchor not in anchors(path)):
            broken.append(target)
    assert not broken, broken


def test_no_reference_to_a_document_outside_the_repository():
    stale = [f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}"
             for path in text_files()
             for lineno, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bSPEC\b|§", line)]
    assert not stale, stale


def section(page: Path, anchor: str) -> str:
    """The text of the section of ``page`` whose heading has ``anchor``, to the next heading
    of the same or a higher level."""
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        heading = re.match(r"(#{1,6})\s+(.*)", line)
        if heading and slug(heading.group(2)) == anchor:
            level = len(heading.group(1))
            end = next((j for j in range(i + 1, len(lines))
                        if re.match(rf"#{{1,{level}}}\s", lines[j])), len(lines))
            return "\n".join(lines[i:end])
    raise AssertionError(f"{page.name} has no section #{anchor}")


def test_cli_md_documents_every_command_and_option():
    from attngeom.cli import main

    missing = []
    for name, command in main.commands.items():
        text = section(DOCS / "cli.md", name)
        for param in command.params:
            missing += [f"{name} {opt}" for opt in param.opts if opt.startswith("--") and f"`{opt}`" not in text]
    assert not missing, missing


def test_api_md_documents_every_public_name():
    import attngeom

    text = (DOCS / "api.md").read_text()
    missing = [name for name in attngeom.__all__ if name != "__version__" and name not in text]
    assert not missing, missing


def test_tables_have_as_many_cells_in_every_row():
    """An unescaped bar inside a code span (``||x||``) splits a table cell on GitHub."""
    uneven = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        table: list[tuple[int, int]] = []
        for lineno, line in enumerate([*page.read_text().splitlines(), ""], 1):
            if line.startswith("|"):
                table.append((lineno, len(re.findall(r"(?<!\\)\|", line))))
                continue
            if len({cells for _, cells in table}) > 1:
                uneven.append(f"{page.name}:{table[0][0]}")
            table = []
    assert not uneven, uneven


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown text, in order."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def readme_offline_example() -> str:
    """The README's offline script: the one python block that extracts a named model."""
    blocks = [b for b in python_blocks((ROOT / "README.md").read_text()) if 'ag.extract("smollm2-135m"' in b]
    assert len(blocks) == 1, len(blocks)
    return blocks[0]


def run_offline_example(block: str, folder: Path, monkeypatch, capsys) -> dict:
    monkeypatch.chdir(folder)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert sorted(p.name for p in (folder / "notes").iterdir()) == ["for.txt", "try.txt", "while.txt"]
    assert scope["analyzed"].sequences == 3 and scope["analyzed"].run_id == scope["result"].run_id
    f8 = scope["f8"]
    assert f8.dims == ("layer", "head") and np.isfinite(f8.values).all()
    assert ((0 <= f8.values) & (f8.values <= 1)).all()
    printed = capsys.readouterr().out
    assert printed.startswith("3 {'layer': ")
    return scope


def test_readme_offline_example_runs_with_a_tiny_model(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The README's offline script, its named model swapped for a tiny random Llama's folder
    (which, named by path, also loads its own tokenizer): it runs as written, input included."""
    block = readme_offline_example().replace('"smollm2-135m"', repr(str(tiny_model_dir("llama"))))
    scope = run_offline_example(block, tmp_path, monkeypatch, capsys)
    assert dict(scope["f8"].sizes) == {"layer": 3, "head": 4}
    assert scope["run"].text(0).startswith("<bos>")


@pytest.mark.needs_model
def test_readme_offline_example_runs_as_written_with_the_real_model(tmp_path, monkeypatch, capsys):
    """A real-model test: the README's offline script exactly as written, smollm2-135m
    (converted once into the cache on its first use) on three short windows."""
    scope = run_offline_example(readme_offline_example(), tmp_path, monkeypatch, capsys)
    assert dict(scope["f8"].sizes) == {"layer": 30, "head": 9}
    assert scope["run"].provenance["model"]["id"] == "smollm2-135m"
    assert scope["result"].committed == 3


def test_store_md_reading_examples_run_as_written(tmp_path, monkeypatch):
    """docs/store.md's "Reading a store" blocks (attngeom, xarray, zarr-python, tensorstore)
    on an analyzed synthetic store of the run they name; every reader gets the same values."""
    import zarr

    import attngeom as ag
    from attngeom.extract.synthetic import write_synthetic_run

    blocks = python_blocks(section(DOCS / "store.md", "reading-a-store"))
    assert len(blocks) == 5 and "commit.get(\"generation\")" in blocks[2] and "import tensorstore" in blocks[4]
    pytest.importorskip("tensorstore")  # the interop extra
    monkeypatch.chdir(tmp_path)
    run_id = "gemma3-270m__wiki-summaries__L128"
    write_synthetic_run("runs.zarr", run_id, n_seq=2, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, length=16)
    ag.analyze("runs.zarr", scheduler="threads", progress=False)
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "store.md", "exec"), scope)
        scope.setdefault("attngeom_topn", scope.get("topn"))
    assert scope["ds"].sizes["seq"] == 2 and scope["topn"].sizes["seq"] == 2
    np.testing.assert_array_equal(scope["topn"]["precision"], scope["attngeom_topn"]["precision"])
    # The plain reader of a derived group on an object store, whose writer put it in a generation.
    url = f"memory://docs-{uuid.uuid4().hex}/runs.zarr"
    fsspec.filesystem("memory").put("runs.zarr", url.removeprefix("memory://"), recursive=True)
    ag.analyze(url, scheduler="threads", n_grid=[1, 2], progress=False)
    plain: dict = {}
    exec(compile(blocks[2].replace('"runs.zarr"', repr(url)), "store.md", "exec"), plain)
    assert plain["commit"]["generation"].startswith("gen-")
    np.testing.assert_array_equal(plain["topn"]["precision"],
                                  ag.open_store(url).run(run_id).analysis("topn")["precision"])
    assert set(scope["labels"]) == {"Retriever", "Mixer", "Reset"}
    stored = zarr.open_group("runs.zarr", path=f"runs/{run_id}", mode="r")
    np.testing.assert_array_equal(scope["first"], stored["attn_last"][0])
    np.testing.assert_array_equal(scope["values"], stored["values"][0, 0])
    assert scope["provenance"]["model"]["id"]


def test_store_md_bfloat16_decoding_runs_as_written(tmp_path, monkeypatch):
    """docs/store.md's decoding of bfloat16 values with zarr-python alone, on a synthetic run
    of bfloat16 values: it gives the float32 values attngeom reads."""
    import attngeom as ag
    from attngeom.extract.synthetic import write_synthetic_run

    (block,) = python_blocks(section(DOCS / "store.md", "values-in-the-models-precision"))
    monkeypatch.chdir(tmp_path)
    write_synthetic_run("runs.zarr", "r", n_seq=1, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, length=16,
                        values_dtype="bfloat16")
    scope: dict = {}
    exec(compile(block.replace("<run>", "r"), "store.md", "exec"), scope)
    want = ag.open_store("runs.zarr").run("r").dataset()["values"][0, 0].values
    assert scope["v"].dtype == np.float32 and np.array_equal(scope["v"], want)


def _table_defaults(text: str) -> dict[str, str]:
    """Option -> its default cell, from the option tables of a docs/cli.md section."""
    cells = {}
    for options, default in re.findall(r"^\| (`-[^|]*?) \| ([^|]*?) \|", text, flags=re.M):
        for option in re.findall(r"`(--[\w-]+)`", options):
            cells[option] = default.strip()
    return cells


def test_each_option_default_is_the_same_in_help_docs_api_and_request():
    """A command's option defaults as --help shows them (click's, or the ``[default: ...]``
    of an option whose default click cannot hold, a tuple), as docs/cli.md's table states
    them, as its function in attngeom.api takes them and as its request dataclass holds
    them: one value each. What an option accepts (its choices, its least value) is the
    request's too."""
    import dataclasses
    import inspect

    import click
    from click.testing import CliRunner

    from attngeom import api
    from attngeom.ablate.request import AblateRequest
    from attngeom.cli import main
    from attngeom.detect.request import DetectRequest
    from attngeom.extract.request import ExtractRequest
    from attngeom.options import accepts

    requests = {"extract": ExtractRequest, "ablate": AblateRequest, "detect": DetectRequest}
    wrong = []
    for name, command in main.commands.items():
        table = _table_defaults(section(DOCS / "cli.md", name))
        shown = " ".join(CliRunner().invoke(main, [name, "--help"], terminal_width=1000).output.split())
        function = getattr(api, name, None)
        signature = inspect.signature(function).parameters if callable(function) else {}
        fields = {f.name: f for f in dataclasses.fields(requests[name])} if name in requests else {}
        # The values the command passes on when only its required options are given.
        given = []
        for p in command.params:
            if p.required:
                value = "2" if isinstance(p.type, click.types._NumberParamTypeBase) else "x"
                given += [p.opts[0], value] if isinstance(p, click.Option) else [value]
        passed = command.make_context(name, given).params
        for param in command.params:
            if not isinstance(param, click.Option) or param.is_flag or param.required:
                continue
            option = next(o for o in param.opts if o.startswith("--"))
            field = fields.get(param.name)
            code = passed.get(param.name)
            if code is None and field is not None and isinstance(field.default, tuple):
                code = ",".join(map(str, field.default))  # left to the request, shown in --help
            if field is not None:
                said = accepts(field)
                if said.choices and tuple(getattr(param.type, "choices", ())) != said.choices:
                    wrong.append(f"{name} {option}: the command takes {param.type}, the request {said.choices}")
                if said.least is not None and getattr(param.type, "min", None) != said.least:
                    wrong.append(f"{name} {option}: the command takes {param.type}, the request at least {said.least}")
            if code in (None, ""):
                continue
            value = str(code)
            if (param.show_default or field is not None) and not re.search(rf"\[default: {re.escape(value)}[;\]]", shown):
                wrong.append(f"{name} {option}: --help does not show {value}")
            if table.get(option, "").strip("`") != value:
                wrong.append(f"{name} {option}: docs/cli.md says {table.get(option)!r}, the code {value!r}")
            for where, defaults in (("attngeom.api", {k: p.default for k, p in signature.items()}),
                                    ("the request", {k: f.default for k, f in fields.items()})):
                if param.name in defaults:
                    default = defaults[param.name]
                    default = ",".join(map(str, default)) if isinstance(default, tuple) else default
                    if str(default) != value:
                        wrong.append(f"{name} {option}: {where} takes {default!r}, the command {value!r}")
    assert not wrong, wrong


def test_api_md_signatures_are_the_functions():
    """docs/api.md's signature of each command's function names its keyword arguments with
    the defaults the function takes (those of its request), in its order."""
    import inspect

    from attngeom import api

    text = (DOCS / "api.md").read_text()
    wrong = []
    for name in ("extract", "ablate", "detect"):
        block = re.search(rf"^ag\.{name}\((.*?)\) -> ", text, flags=re.M | re.S)
        assert block, f"docs/api.md has no signature of ag.{name}"
        words, star = [], False
        for p in inspect.signature(getattr(api, name)).parameters.values():
            if p.kind is p.KEYWORD_ONLY and not star:
                words.append("*")
                star = True
            words.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}".replace("'", '"'))
        if " ".join(block.group(1).split()) != ", ".join(words):
            wrong.append(f"ag.{name}({', '.join(words)})")
    assert not wrong, "docs/api.md should say: " + "; ".join(wrong)


def test_every_derived_group_a_command_writes_is_in_its_help_and_store_md():
    from click.testing import CliRunner

    from attngeom.cli import main
    from attngeom.store import ABLATION_GROUPS, ANALYSIS_GROUPS, DETECT_GROUPS, QUERY_GROUPS, SCORE_GROUPS

    store_md = (DOCS / "store.md").read_text()
    written = {"analyze": ("analysis", (*ANALYSIS_GROUPS, *QUERY_GROUPS, *SCORE_GROUPS)),
               "ablate": ("ablation", ABLATION_GROUPS), "detect": ("detect", DETECT_GROUPS)}
    missing = []
    for command, (kind, groups) in written.items():
        shown = " ".join(CliRunner().invoke(main, [command, "--help"], terminal_width=1000).output.split())
        for group in groups:
            if not re.search(rf"\b{group}\b", shown):
                missing.append(f"{command} --help lacks {kind}/{group}")
            if not re.search(rf"`{group}[` ]", store_md) and f"{kind}/{group}" not in store_md:
                missing.append(f"docs/store.md lacks {kind}/{group}")
    assert not missing, missing


@pytest.mark.needs_model  # extract's phases are torch profiler ranges
def test_architecture_md_names_every_phase_of_extracts_profile():
    """The profile ranges docs/architecture.md lists are the ones extract records."""
    from attngeom.extract.phases import PHASES

    text = (DOCS / "architecture.md").read_text()
    section = text.split("## extract's phases in a profile", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `(attngeom\.\w+)` \|", section, flags=re.M) == list(PHASES)
