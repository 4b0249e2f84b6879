"""``--html PATH`` (routetool.report.html): one self-contained page per report, its option from the
command base, its output-path rules those of --json; and each command's page rendered by headless
Chromium: the verdict's text, every figure decoded, no request leaving the page."""

from __future__ import annotations

import base64
import hashlib
import json
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from routetool.cli import main
from routetool.io.trace import LayerArrays, RouterConfig
from routetool.report.html import CONTENT_SECURITY_POLICY, SORTABLE_ROWS, html_report
from routetool.report.sinks import HtmlSink, Sinks
from routetool.report.tables import table
from tests.helpers import command_params

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get "
                                                                "install chromium; .ci/run installs it)")


class _Report:
    """A report with a header panel, a verdict line, a long table and a short one."""

    exit_code = 1

    def __init__(self, rows: int = SORTABLE_ROWS + 2) -> None:
        self.rows = rows

    def terminal(self, console, details=False):
        header = Table.grid()
        header.add_row("trace", "<script>alert(1)</script>.safetensors")
        console.print(Panel(header, title="routetool test"))
        console.print(Text("FAIL: 2 rows differ; exit code 1", style="bold red"))
        long = table("Per layer", ["layer", "tokens", "note"], left=("note",))
        for i in range(self.rows):
            long.add_row(str(i), f"{1000 * i:,}", "-" if i % 3 else "hot")
        console.print(long)
        short = table("Totals", ["what", "rows"], left=("what",))
        short.add_row("mismatch", "2")
        console.print(short)
        if details:
            console.print(Text("every table", style="dim"))

    def document(self):
        return {"schema": "routetool.test/1", "verdict": "fail", "exit_code": 1,
                "execution": {"device": "cpu", "torch_version": "t"}, "layers": [1, 2]}


def _hash_of(page: str, tag: str) -> str:
    body = re.search(f"<{tag}>(.*?)</{tag}>", page, re.S).group(1)
    return "sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()


def test_the_page_holds_the_verdict_first_then_every_table_escaped_and_sortable_where_long():
    page = html_report(_Report(), name="test", command="routetool test 'a b.safetensors'")
    verdict = page.index('id="verdict"')
    assert "<strong>FAIL · exit code 1</strong>" in page and "<title>routetool test: FAIL · exit code 1</title>" in page
    assert verdict < page.index("<table") and verdict < page.index("FAIL: 2 rows differ")
    assert '<span class="b red">FAIL: 2 rows differ; exit code 1</span>' in page  # the terminal's colours
    assert "every table" in page  # the details
    assert "&lt;script&gt;alert(1)&lt;/script&gt;.safetensors" in page and "<script>alert" not in page
    # the long table sorts, the short one and the header grid do not
    assert page.count('<table class="sortable">') == 1 and page.count('<table class="plain">') == 1
    assert re.search(r'<caption>Per layer</caption><thead><tr><th class="r">layer</th>', page)
    assert "<td class=\"r\">9,000</td>" in page
    assert "routetool test &#x27;a b.safetensors&#x27;" in page  # the command, as run
    assert "<td>execution.device</td><td>cpu</td>" in page  # the document's facts
    assert "<td>python</td>" in page and "<td>torch</td>" in page and "<td>cpu</td>" in page
    assert "routetool test draws no figures." in page


def test_the_policy_forbids_every_load_but_the_pages_own_style_script_and_data_images():
    page = html_report(_Report(), name="test")
    assert f'<meta http-equiv="Content-Security-Policy" content="{CONTENT_SECURITY_POLICY}">' in page
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY and "img-src data:" in CONTENT_SECURITY_POLICY
    assert f"style-src '{_hash_of(page, 'style')}'" in CONTENT_SECURITY_POLICY
    assert f"script-src '{_hash_of(page, 'script')}'" in CONTENT_SECURITY_POLICY
    assert not re.search(r"""(src|href)=["'](?!data:|#)""", page)  # nothing outside the page is named
    assert " style=" not in page  # no inline style attribute (the policy would refuse it)


class _Plotted(_Report):
    def plots(self, folder, force=False):
        from routetool.report.plots import _pyplot, _save

        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(2, 2))
        ax.plot([0, 1], [1, 0])
        path = Path(folder) / "load_by_layer.png"
        _save(fig, path, plt)
        return [path]


def test_figures_are_embedded_as_png_data():
    pytest.importorskip("matplotlib")
    page = html_report(_Plotted(), name="test")
    data = re.findall(r'<img class="figure" alt="load by layer" src="data:image/png;base64,([^"]+)">', page)
    assert len(data) == 1 and base64.b64decode(data[0])[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_page_is_written_and_says_the_figures_need_the_plot_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib now fails)
    page = html_report(_Plotted(), name="test")
    assert "<img" not in page
    assert "The figures need matplotlib, which is not installed: pip install &#x27;routetool[plot]&#x27;" in page


def test_the_run_names_the_commit_of_this_checkout_and_no_host_name():
    from routetool.report.provenance import machine, source_commit

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not run from a git checkout")
    assert source_commit().split()[0] == head.stdout.strip()
    node = platform.node()
    assert not node or all(node not in value for value in machine().values())


def test_the_five_report_commands_take_html_from_the_command_base():
    found = {path for path, _ in command_params(main, lambda p: p.name == "html_path")}
    assert found == {f"routetool {c}" for c in ("replay", "validate", "bench", "balance", "diff")}
    for name in ("replay", "balance", "diff"):  # listed after --json in the help
        names = [p.name for p in main.commands[name].params]
        assert names.index("html_path") == names.index("json_path") + 1


def _replay(*args):
    return CliRunner().invoke(main, ["replay", str(TRACE), "--no-latency", "--no-progress", *map(str, args)])


def test_html_follows_the_output_rules_of_json(tmp_path):
    page = tmp_path / "r.html"
    before = TRACE.read_bytes()
    res = _replay("--html", TRACE)
    assert res.exit_code == 2 and res.output.strip().splitlines() == [
        f"routetool: error: {TRACE}: is this run's input; writing the output there would destroy it (choose another "
        "output path)"], res.output
    assert TRACE.read_bytes() == before
    page.write_text("mine")
    res = _replay("--html", page)
    assert res.exit_code == 2 and "already exists" in res.output and page.read_text() == "mine", res.output
    res = _replay("--html", tmp_path / "both", "--json", tmp_path / "both")
    assert res.exit_code == 2 and "is named for two outputs of one run" in res.output
    res = _replay("--html", "-", "--json", "-")
    assert res.exit_code == 2 and "--json - and --html - both want stdout" in res.output
    res = _replay("--html", page, "--force")
    assert res.exit_code == 0, res.output
    text = page.read_text(encoding="utf-8")
    assert "<strong>PASS · exit code 0</strong>" in text
    argv = ["replay", str(TRACE), "--no-latency", "--no-progress", "--html", str(page), "--force"]
    assert f"<code>{shlex.join(['routetool', *argv])}</code>" in text  # the exact command
    assert res.stderr.strip().splitlines()[-1] == f"wrote {page}"


def test_html_may_not_be_a_figure_of_balances_plot(tmp_path):
    res = CliRunner().invoke(main, ["balance", str(TRACE), "--no-progress", "--plot", str(tmp_path), "--html",
                                    str(tmp_path / "rank_load.png")])
    assert res.exit_code == 2 and res.output.strip() == (f"routetool: error: {tmp_path / 'rank_load.png'}: is named "
                                                         "by --html and is a --plot figure (give each output its own "
                                                         "file)"), res.output
    assert list(tmp_path.iterdir()) == []


def test_html_to_stdout_sends_the_tables_to_stderr():
    res = _replay("--html", "-")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("<!DOCTYPE html>") and res.stdout.rstrip().endswith("</html>")
    assert "PASS: no real mismatch" in res.stderr


# ---------------------------------------------------------------------------------------
# in a browser
def _page_requests(netlog: Path, page: Path) -> list[str]:
    """The URLs the page asked the network stack for (beside the page itself and data: URLs); the
    browser's own background requests (updates, accounts) are not the page's: theirs do not carry
    the page's site, file://, in their network isolation key."""
    log = json.loads(netlog.read_text(encoding="utf-8"))
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    urls = []
    for event in log["events"]:
        params = event.get("params") or {}
        if event["type"] == start and "url" in params and "file://" in str(params.get("network_isolation_key")):
            urls.append(params["url"])
    return [u for u in urls if not u.startswith("data:") and u != page.as_uri()]


def _render(page: Path, tmp_path: Path) -> tuple[str, list[str]]:
    """The page's DOM once loaded (its scripts run) in headless Chromium, and its requests."""
    profile, netlog = tmp_path / "chromium-profile", tmp_path / "netlog.json"
    profile.mkdir()
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}", f"--log-net-log={netlog}",
         "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=180)  # (a hang guard, not a speed test)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, _page_requests(netlog, page)


def _verdict(dom: str) -> str:
    return re.search(r'id="verdict"><strong>(.*?)</strong>', dom).group(1)


def _figures(dom: str) -> list[str]:
    """Each figure's mark from the page's script: yes (decoded) or no."""
    return [re.search(r'data-decoded="(\w+)"', img).group(1) if "data-decoded" in img else "unchecked"
            for img in re.findall(r'<img class="figure"[^>]*>', dom)]


@pytest.fixture
def diff_traces(make_trace):
    """``(a, b)``: two 12-row traces of the same logits whose layer 1 routes three rows elsewhere."""
    router = RouterConfig(num_experts=8, topk=2, route_scale=1.0)
    g = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    ids = g.topk(2, dim=-1).indices.to(torch.int32)
    other = ids.clone()
    other[:3] = torch.tensor([6, 7], dtype=torch.int32)  # three rows routed elsewhere in layer 1

    def layer(i):
        return LayerArrays(gating_output=g, topk_ids=i, topk_weights=torch.full((12, 2), 0.5),
                           step_offsets=torch.tensor([0, 6, 12]))

    a = make_trace("a.safetensors", {0: layer(ids), 1: layer(ids)}, router=router)
    b = make_trace("b.safetensors", {0: layer(ids), 1: layer(other)}, router=router)
    return a, b


def _bench_report():
    from tests.analysis.test_bench import _result_with_host_costs
    from routetool.report.bench import BenchReport

    return BenchReport(_result_with_host_costs())


# each command's report once: (arguments, the banner's words, figures, a line of its tables)
COMMANDS = {
    "replay": (["replay", "TRACE", "--no-latency"], "PASS · exit code 0", 0, "Per layer: kernel vs reference"),
    "validate": (["validate", "--family", "layouts", "--device", "cpu"], "PASS · exit code 0", 0, "Every case"),
    "balance": (["balance", "TRACE"], "exit code 0", 3, "Expert load per layer"),
    "diff": (["diff", "A", "B"], "DIFFERENT · exit code 1", 1, "Agreement by layer"),
    # bench needs a GPU to run: its report, from a sweep's result, through the same sink
    "bench": (None, "exit code 0", 0, "GPU latency"),
}


@needs_chromium
@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_commands_page_renders_offline_in_chromium(command, tmp_path, diff_traces):
    args, verdict, figures, words = COMMANDS[command]
    page = tmp_path / f"{command}.html"
    if args is None:
        Sinks(HtmlSink(str(page), name=command, command="routetool bench")).write(_bench_report())
    else:
        if figures:
            pytest.importorskip("matplotlib")
        swap = dict(zip(("A", "B"), diff_traces)) if command == "diff" else {"TRACE": TRACE}
        res = CliRunner().invoke(main, [str(swap.get(a, a)) for a in args] + ["--no-progress", "--html", str(page)])
        assert res.exit_code in (0, 1) and page.exists(), res.output
    dom, requests = _render(page, tmp_path)
    assert _verdict(dom) == verdict
    assert words in dom
    assert _figures(dom) == ["yes"] * figures
    assert requests == []


@needs_chromium
def test_the_browser_checks_see_a_request_a_cut_figure_and_the_sort_order(tmp_path):
    # the checks above can fail: the page without its policy, given an outside image, a cut PNG and
    # a script that sorts the long table by its second column (click: ascending, click: descending)
    text = html_report(_Report(rows=SORTABLE_ROWS + 4), name="test")
    text = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", text)
    cut = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 30).decode()
    text = text.replace("routetool test draws no figures.", f'<img class="figure" src="data:image/png;base64,{cut}">'
                        '<img class="figure" src="http://routetool.invalid/figure.png">')
    probe = ('<script>var th = document.querySelectorAll("table.sortable th")[1]; th.click();'
             'var up = Array.from(document.querySelectorAll("table.sortable tbody tr")).map(r => r.cells[0].textContent);'
             'th.click(); var down = Array.from(document.querySelectorAll("table.sortable tbody tr")).map('
             'r => r.cells[0].textContent); document.body.dataset.sorted = up.join(",") + "|" + down.join(",");</script>')
    page = tmp_path / "probe.html"
    page.write_text(text.replace("</body>", probe + "</body>"), encoding="utf-8")
    dom, requests = _render(page, tmp_path)
    assert requests == ["http://routetool.invalid/figure.png"]
    assert _figures(dom) == ["no", "no"]
    assert dom.count('<p class="note">This figure could not be decoded') == 2
    rows = [str(i) for i in range(SORTABLE_ROWS + 4)]  # tokens 0, 1,000, ..., 11,000: by number, not as text
    assert re.search(r'data-sorted="([^"]*)"', dom).group(1) == ",".join(rows) + "|" + ",".join(reversed(rows))
