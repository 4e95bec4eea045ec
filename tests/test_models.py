"""The one-time preparation of a GGUF model: the assembly of a chunked file and the conversion
into a plain transformers folder say what they do, and an interrupted one leaves nothing a
later run would take for the model."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
torch = pytest.importorskip("torch", reason="needs a model: torch is not installed")

from attngeom.errors import InputError
from attngeom.extract import gguf_files, models
from conftest import tiny_config, tiny_tokenizer


def _parts(folder: Path, sizes=(3000, 5000, 1)) -> tuple[list[Path], bytes]:
    folder.mkdir()
    rng = torch.Generator().manual_seed(0)
    whole = b""
    parts = []
    for i, size in enumerate(sizes):
        data = bytes(torch.randint(0, 256, (size,), generator=rng, dtype=torch.uint8).tolist())
        (folder / f"part{i}").write_bytes(data)
        parts.append(folder / f"part{i}")
        whole += data
    return parts, whole


def test_assembly_says_what_it_does_once(tmp_path, capsys):
    parts, whole = _parts(tmp_path / "parts")
    target = tmp_path / "cache" / "gguf" / "m.gguf"
    assert gguf_files.assemble_parts(parts, target, hashlib.sha256(whole).hexdigest()) == target
    assert target.read_bytes() == whole
    assert "assembling m.gguf once from 3 parts into " in capsys.readouterr().err
    assert [p.name for p in target.parent.iterdir()] == ["m.gguf"]
    gguf_files.assemble_parts(parts, target, hashlib.sha256(whole).hexdigest())
    assert capsys.readouterr().err == ""
    # A truncated file in its place (an assembler that wrote in place, stopped midway).
    target.write_bytes(whole[:100])
    gguf_files.assemble_parts(parts, target, hashlib.sha256(whole).hexdigest())
    assert target.read_bytes() == whole
    assert "is not the published file (sha256 differs): assembling it again" in capsys.readouterr().err


def test_assembly_that_fails_or_is_interrupted_leaves_no_file(tmp_path):
    parts, whole = _parts(tmp_path / "parts")
    target = tmp_path / "gguf" / "m.gguf"
    with pytest.raises(InputError, match="do not add up to the published file"):
        gguf_files.assemble_parts(parts, target, "0" * 64)
    assert list(target.parent.iterdir()) == []

    # A part that cannot be read after others were written: an assembly stopped midway.
    (tmp_path / "parts" / "gone").mkdir()
    with pytest.raises(IsADirectoryError):
        gguf_files.assemble_parts([*parts, tmp_path / "parts" / "gone"], target, hashlib.sha256(whole).hexdigest())
    assert list(target.parent.iterdir()) == []


class _Quantized:
    """What transformers gives for a GGUF, without one: a tiny Llama carrying the
    quantization_config that the conversion drops."""

    @staticmethod
    def from_pretrained(path, gguf_file, dtype):
        from transformers import modeling_gguf_pytorch_utils as loader

        for _ in loader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass  # as transformers' loader goes over the file's tensors
        torch.manual_seed(0)
        config = tiny_config("llama")
        config.quantization_config = {"quant_method": "gguf"}
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config, dtype=dtype)


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A GGUF source whose reading, tokenizer and weights are faked (tiny Llama, 100 tokens)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("ATTNGEOM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(2000))
    n_elements = sum(p.numel() for p in _Quantized.from_pretrained(None, None, torch.float32).parameters())
    reader = SimpleNamespace(tensors=[SimpleNamespace(n_elements=n_elements)])
    opened = []
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, mode="r": opened.append(path) or reader)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", _Quantized.from_pretrained)
    source = models.ModelSource("tiny", str(tmp_path), gguf_file="m.gguf", file_sha256="cd" * 32)
    return source, opened


def test_conversion_says_each_step_once_and_reads_the_file_once(fake_gguf, capsys):
    source, opened = fake_gguf
    folder = gguf_files.converted_folder(source)
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("converting tiny once into ")
    steps = [line.strip()[:3] for line in err.splitlines() if line.startswith("  ")]
    assert steps == ["1/4", "2/4", "3/4", "4/4"]
    assert "de-quantizing 1 tensors into float32" in err
    assert len(opened) == 1  # transformers' own openings get the shared reader
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
    assert not hasattr(models.load_config(source), "quantization_config")
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    assert gguf_files.converted_folder(source) == folder
    assert capsys.readouterr().err == ""


def test_without_progress_the_conversion_says_only_what_it_makes_and_where(fake_gguf, capsys):
    """extract's, ablate's and detect's progress=False (their --no-progress): no step lines,
    no bar, transformers' own over the tensors included; the first line stays."""

    source, _ = fake_gguf
    with models.library_bars(False):
        folder = gguf_files.converted_folder(source)
    assert (folder / "config.json").exists()
    err = capsys.readouterr().err
    assert err.startswith("converting tiny once into ") and err.count("\n") == 1, err
    assert "Converting and de-quantizing" not in err
    from transformers import modeling_gguf_pytorch_utils as loader
    from tqdm.auto import tqdm

    assert loader.tqdm is tqdm  # as it was after the block


def test_with_progress_transformers_bar_over_the_tensors_shows(fake_gguf, capsys):
    gguf_files.converted_folder(fake_gguf[0])
    assert "Converting and de-quantizing GGUF tensors..." in capsys.readouterr().err


def test_without_progress_the_assembly_says_only_its_first_line(tmp_path, capsys):
    parts, whole = _parts(tmp_path / "parts")
    target = tmp_path / "cache" / "gguf" / "m.gguf"
    with gguf_files.one_time_progress(False):
        gguf_files.assemble_parts(parts, target, hashlib.sha256(whole).hexdigest())
    err = capsys.readouterr().err
    assert err.startswith("assembling m.gguf once from 3 parts into ") and err.count("\n") == 1, err
    assert target.read_bytes() == whole


def test_an_interrupted_conversion_leaves_no_folder(fake_gguf, monkeypatch):
    source, _ = fake_gguf
    from transformers import PreTrainedModel

    def killed(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        gguf_files.converted_folder(source)
    assert list(gguf_files.converted_path(source.gguf_file, source.file_sha256).parent.iterdir()) == []


def test_a_step_on_a_terminal_keeps_its_line_and_ends_it(monkeypatch):
    """On a terminal a step without a bar of its own shows its seconds beside its text; the
    line is ended when the step ends, failed or not."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with gguf_files._step("  2/4 building the tokenizer"):
        pass
    with pytest.raises(KeyboardInterrupt), gguf_files._step("  3/4 stopped"):
        raise KeyboardInterrupt
    lines = terminal.getvalue().replace("\r", "\n").split("\n")
    assert any(line.startswith("  2/4 building the tokenizer (") for line in lines)
    assert any(line.startswith("  3/4 stopped (") for line in lines)
    assert terminal.getvalue().endswith("\n")


def test_transformers_takes_the_gguf_reader_from_the_gguf_module_at_each_load():
    """A conversion shares one parsed reader by standing in for ``gguf.GGUFReader`` during
    its block (``gguf_files._shared_reader``): that reaches transformers' loader only while it
    imports the class from the module at each call and opens a file by (path, mode)."""
    import inspect

    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader

    assert "from gguf import GGUFReader" in inspect.getsource(loader.load_gguf_checkpoint)
    assert "GGUFReader" not in vars(loader)
    assert list(inspect.signature(gguf.GGUFReader).parameters)[:2] == ["path", "mode"]


def test_the_shared_reader_reaches_only_its_own_thread_and_file(tmp_path, monkeypatch):
    """Within the block this thread's openings of the file get the shared reader; another
    file, another thread and any opening after the block open as gguf does."""
    import threading

    import gguf

    monkeypatch.setattr(gguf, "GGUFReader", lambda path, mode="r": ("opened", Path(path).name))
    shared = object()
    file, other = tmp_path / "m.gguf", tmp_path / "n.gguf"
    seen = []
    with gguf_files._shared_reader(shared, file):
        here = (gguf.GGUFReader(file), gguf.GGUFReader(other))
        thread = threading.Thread(target=lambda: seen.append(gguf.GGUFReader(file)))
        thread.start()
        thread.join()
    assert here == (shared, ("opened", "n.gguf"))
    assert seen == [("opened", "m.gguf")]
    assert gguf.GGUFReader(file) == ("opened", "m.gguf")
