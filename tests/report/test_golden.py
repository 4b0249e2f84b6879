"""replay, validate and balance give the recorded outputs (tests/golden.py) for the same inputs:
counts, classes, statistics, first failing rows and exit codes, case by case."""

from __future__ import annotations

import json

import pytest

import golden


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("golden"))
    golden.make_inputs(tmp)
    return tmp


@pytest.mark.parametrize("name", sorted(golden.CASES))
def test_output_as_recorded(inputs, name):
    expected = json.loads((golden.GOLDEN / f"{name}.json").read_text())
    got = json.loads(json.dumps(golden.run_case(name, inputs)))  # tuples -> lists, as stored
    assert got["exit_code"] == expected["exit_code"]
    assert got["json"] == expected["json"]
