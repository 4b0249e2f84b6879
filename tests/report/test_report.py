"""Report tables never cut a number: rich narrowed the widest columns of a table wider than the
terminal below their longest word and ended it with "…" (`1,044,…`, `max/me…` at 80 columns)."""

import io
import re

import pytest
from rich.console import Console

from routetool.report.tables import table

HEADERS = ["layer", "steps", "tokens", "assign", "max/mean", "CV", "entropy", "Gini", "idle", "hottest e:assign"]
ROWS = [
    ["0", "5", "1,044,480", "8,355,840", "2.098", "0.34", "0.988", "0.169", "0", "11:273,925, 0:269,322, 41:265,572"],
    ["all", "", "", "25,067,520", "2.393", "0.314", "0.989", "0.16", "0", "17:937,267, 58:732,360, 0:631,703"],
]


def _render(width: int) -> str:
    t = table("Expert load per layer (assignments = token-expert pairs)", HEADERS, left=("hottest e:assign",))
    for row in ROWS:
        t.add_row(*row)
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(t)
    return out.getvalue()


@pytest.mark.parametrize("width", [30, 60, 80, 100, 200])
def test_a_table_wider_than_the_terminal_keeps_every_number_whole(width):
    text = _render(width)
    assert "…" not in text, text
    assert max(map(len, text.splitlines())) <= width, text
    words = set(re.split(r"\s+", text))
    for row in ROWS:
        for cell in row:
            assert set(cell.split()) <= words, (cell, text)  # each number whole, on one line
    assert "max/mean" in words, text


def test_a_table_that_fits_is_one_table():
    text = _render(200)
    assert len(re.findall(r"^ *layer ", text, re.M)) == 1 and text.count("Expert load per layer") == 1, text


def test_a_table_too_wide_for_its_longest_words_is_split_repeating_the_first_column():
    text = _render(60)
    parts = len(re.findall(r"^ *layer ", text, re.M))
    assert parts >= 2, text
    # each continuation repeats the row labels and says what it continues
    assert text.count("(continued)") == parts - 1, text
    assert len(re.findall(r"^ *all ", text, re.M)) >= 2, text
