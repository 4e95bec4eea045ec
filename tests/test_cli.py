"""The command line as a newcomer meets it: help texts, and one line with exit 2 for input
that cannot be used."""

from __future__ import annotations

import re

import click
from click.testing import CliRunner

from attngeom.cli import main


def test_help_lists_each_command_once_in_pipeline_order_and_every_option_has_help():
    top = CliRunner().invoke(main, ["--help"]).output
    listed = re.findall(r"^  (\w+) ", top.split("Commands:", 1)[1], flags=re.M)
    assert listed == ["extract", "analyze", "taxonomy", "ablate", "report", "explore", "validate", "migrate", "demo"]
    assert top.count("analyze") == 1, top
    for name, command in main.commands.items():
        assert all(p.help for p in command.params if isinstance(p, click.Option)), name
        text = CliRunner().invoke(main, [name, "--help"], terminal_width=200).output
        assert "%%" not in text, name
    assert "s with s % n == i" in CliRunner().invoke(main, ["extract", "--help"], terminal_width=200).output
