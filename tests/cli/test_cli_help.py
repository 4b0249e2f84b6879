"""The command line's help: a group run without its command, --help's width, and the docs' links."""

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from routetool.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _commands(command=main, path=()):
    """The argument lists naming every command and group of the command line."""
    found = [list(path)]
    for name, sub in getattr(command, "commands", {}).items():
        found += _commands(sub, (*path, name))
    return found


@pytest.mark.parametrize("args", [[], ["capture"]])
def test_a_group_without_its_command_prints_its_help_as_click_does(args):
    # it was one line, "routetool: error: Usage: ...\n\n  Profile ...", with the newlines escaped
    res = CliRunner().invoke(main, args, prog_name="routetool", catch_exceptions=False)
    assert res.exit_code == 2
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines[0] == f"Usage: {' '.join(['routetool', *args])} [OPTIONS] COMMAND [ARGS]..."
    assert "Commands:" in lines and "\\n" not in res.stderr and "routetool: error" not in res.stderr


@pytest.mark.parametrize("args", _commands(), ids=lambda a: " ".join(a) or "routetool")
def test_help_fits_80_columns(args):
    res = CliRunner().invoke(main, [*args, "--help"], prog_name="routetool", terminal_width=80,
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    wide = [line for line in res.stdout.splitlines() if len(line) > 80]
    assert wide == []


def _relative_links(doc: Path):
    text = re.sub(r"```.*?```|`[^`\n]*`", "", doc.read_text(encoding="utf-8"), flags=re.S)  # (code holds no links)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # a URL, or an anchor of the page
            continue
        yield target.split("#", 1)[0]


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_in_the_docs_resolves(doc):
    broken = [t for t in _relative_links(doc) if not (doc.parent / t).exists()]
    assert broken == []
