"""The sinks (routetool.report.sinks): the stdout rule computed once, the files each writes."""

import json

import pytest

from routetool.errors import RouteToolError
from routetool.report.sinks import CsvSink, JsonSink, JUnitSink, PlotSink, Sinks


class _Report:
    exit_code = 0

    def document(self):
        return {"schema": "test/1", "value": float("nan")}

    def junit(self):
        return "<testsuites/>\n"

    def csv(self):
        return "a,b\n1,2\n"

    def plots(self, folder, force=False):
        return [f"{folder}/one.png"]


def test_two_sinks_on_stdout_are_refused_naming_both_in_order():
    with pytest.raises(RouteToolError, match="--csv - and --json - both want stdout"):
        Sinks(CsvSink("-"), JsonSink("-")).check()
    with pytest.raises(RouteToolError, match="--json - and --eplb-out - both want stdout"):
        Sinks(JsonSink("-"), JsonSink("-", flag="--eplb-out"), JUnitSink(None)).check()
    Sinks(JsonSink("-"), JUnitSink("out.xml"), PlotSink("-")).check()  # a plot folder named - is a folder


def test_the_stdout_rule_and_the_paths_come_from_the_sinks():
    sinks = Sinks(JsonSink(None), JUnitSink("v.xml"), CsvSink("-"), PlotSink("figs"))
    assert sinks.to_stdout and sinks.paths == ["v.xml"]  # stdout and the plot folder are not files to check
    sinks = Sinks(JsonSink("r.json"), PlotSink("-"))
    assert not sinks.to_stdout and sinks.paths == ["r.json"]
    assert not Sinks().to_stdout and Sinks().paths == []


def test_each_sink_writes_its_face_of_the_report(tmp_path, capsys):
    paths = {name: str(tmp_path / name) for name in ("r.json", "v.xml", "b.csv")}
    Sinks(JsonSink(paths["r.json"], announce=True), JUnitSink(paths["v.xml"]), CsvSink(paths["b.csv"]),
          JsonSink(str(tmp_path / "none.json"), flag="--eplb-out", document=lambda report: None)).write(_Report())
    assert json.loads((tmp_path / "r.json").read_text()) == {"schema": "test/1", "value": None}
    assert (tmp_path / "v.xml").read_text() == "<testsuites/>\n"
    assert (tmp_path / "b.csv").read_text() == "a,b\n1,2\n"
    assert not (tmp_path / "none.json").exists()  # a document of None writes nothing
    out, err = capsys.readouterr()
    assert out == "" and err.split() == ["wrote", paths["r.json"]]  # only the announcing sink says it


def test_a_sink_on_stdout_writes_the_document_there_and_announces_nothing(capsys):
    Sinks(JsonSink("-", announce=True), PlotSink("figs")).write(_Report())
    out, err = capsys.readouterr()
    assert json.loads(out) == {"schema": "test/1", "value": None}
    assert err.split() == ["wrote", "figs/one.png"]
