"""Options declared once on their request (attngeom.options): each refusal names the option's
flag on the command line and its keyword in Python; the API's keyword arguments are the request's fields, an unknown one refused as by any
function (by the request); the command passes no value for an option left out, so the request's default holds."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import attngeom as ag
from attngeom.ablate.request import AblateRequest
from attngeom.ablate.request import check_request as check_ablate
from attngeom.detect.request import DetectRequest
from attngeom.detect.request import check_request as check_detect
from attngeom.extract.request import ExtractRequest, check_arguments
from attngeom.options import flag


@pytest.mark.parametrize("request_, check, message", [
    (ExtractRequest(model="m", store="s", dataset="d", context_length=1, num_sequences=1), check_arguments,
     "--context-length must be at least 2 (BOS and one token) (got 1)"),
    (ExtractRequest(model="m", store="s", dataset="d", context_length=8, num_sequences=1, batch_size=0),
     check_arguments, "--batch-size must be at least 1 (got 0)"),
    (ExtractRequest(model="m", store="s", dataset="d", context_length=8, num_sequences=1, store_rows="some"),
     check_arguments, "--store-rows 'some': use last or all"),
    (ExtractRequest(model="m", store="s", dataset="d", context_length=8, num_sequences=1, window_rule="last"),
     check_arguments, "--window 'last': use first or random"),
    (AblateRequest(store="s", run_id="r", random_masks=-1), check_ablate, "--random-masks must be at least 0 (got -1)"),
    (AblateRequest(store="s", run_id="r", max_sequences=1), check_ablate,
     "--max-sequences must be at least 2 (an importance and an evaluation split) (got 1)"),
    (AblateRequest(store="s", run_id="r", dtype="float32-tf32"), check_ablate,
     "--dtype 'float32-tf32': use auto, float32, bfloat16 or float16 (float32-tf32 is extract's alone)"),
    (DetectRequest(store="s", run_id="r", needle_length=1), check_detect,
     "--needle-length must be at least 2 (a token and the one after it) (got 1)"),
    (DetectRequest(store="s", run_id="r", device="gpu"), check_detect, "--device 'gpu': use auto, cpu, cuda or cuda:N"),
])
def test_a_refused_option_is_named_by_its_flag_and_by_its_keyword_in_python(request_, check, message):
    with pytest.raises(ag.InputError) as raised:
        check(request_)
    assert (raised.value.command_line or str(raised.value)) == message
    option = next(f for f in dataclasses.fields(request_) if f"{flag(f)} " in message)
    keyword = message.replace(f"{flag(option)} must", f"{option.name} must").replace(f"{flag(option)} '",
                                                                                     f"{option.name}='")
    assert str(raised.value) == (message if option.name == "device" else keyword)


@pytest.mark.parametrize("name, request_, left", [
    ("extract", ExtractRequest, {"command_line"}), ("ablate", AblateRequest, set()), ("detect", DetectRequest, set()),
])
def test_the_api_takes_the_requests_fields_as_keywords(name, request_, left):
    function = getattr(ag.api, name)
    parameters = inspect.signature(function).parameters
    fields = {f.name: f for f in dataclasses.fields(request_) if f.name not in left}
    assert list(parameters) == list(fields)
    for field in fields.values():
        if field.default is not dataclasses.MISSING:
            assert parameters[field.name].default == field.default
    args, keywords = (("m",), {"store": "s"}) if name == "extract" else (("s", "r"), {})
    with pytest.raises(TypeError, match=rf"^{request_.__name__}.__init__\(\) got an unexpected keyword argument 'nope'$"):
        function(*args, **keywords, nope=1)


def test_an_option_left_out_on_the_command_line_takes_the_requests_default(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from attngeom.cli import main

    seen = {}

    def ablate(store, run_id, **options):
        seen.update(AblateRequest(store=store, run_id=run_id, **options).__dict__)
        raise ag.InputError("stop")

    monkeypatch.setattr(ag.api, "ablate", ablate)
    result = CliRunner().invoke(main, ["ablate", "--store", str(tmp_path), "--run", "r"])
    assert result.exit_code == 2
    defaults = AblateRequest(store=str(tmp_path), run_id="r")
    assert seen == {**defaults.__dict__, "protect": (), "progress": True}
