"""The report of a real run: HTML in headless Chromium, JUnit from `qualify candidate --junit`, and false passes.

Data: the session's real reference + acceptance (frozen_run: real vLLM) and two real torch-tp cases
(fp32 and bf16, TP1, actor) run by `qualify candidate --junit`. The page is loaded in Debian's
chromium (scripts/ensure-chromium.sh installs it) over the DevTools protocol: no console error, no
request other than the page itself, the banner and every case present, a screenshot that is not
blank. Every tampering of the evidence after the verdict turns the report into NOT VERIFIED, exit 1.
Set QUALIFY_SCREENSHOT=PATH to keep the browser's screenshot (docs/report.png is made this way).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qualify.cli.app import app
from qualify.layout import RunLayout
from tests.integration._support import matrix_with

pytestmark = [pytest.mark.vllm, pytest.mark.engines]
CASES = ("torch-tp-fp32-tp1-actor", "torch-tp-bf16-tp1-actor")


@pytest.fixture(scope="module")
def candidate_run(frozen_run, tmp_path_factory):
    """A copy of the frozen run with two real candidate cases and their verdict; the JUnit file beside it."""
    base = tmp_path_factory.mktemp("report")
    run = base / "run"
    shutil.copytree(frozen_run / "reference", run / "reference")
    shutil.copytree(frozen_run / "acceptance", run / "acceptance")
    matrix = matrix_with(base, engines=["torch-tp"], precisions=["fp32", "bf16"], tp=[1], roles=["actor"])
    result = CliRunner().invoke(app, ["candidate", str(matrix.source), "--run", str(run),
                                      "--junit", str(base / "candidate-junit.xml")])
    assert result.exit_code == 0, result.output
    return run


@pytest.fixture(scope="module")
def failing_run(frozen_run, tmp_path_factory):
    """A copy of the frozen run with one real failing case: an engine that divides by a bf16 temperature."""
    base = tmp_path_factory.mktemp("failing")
    run = base / "run"
    shutil.copytree(frozen_run / "reference", run / "reference")
    shutil.copytree(frozen_run / "acceptance", run / "acceptance")
    matrix = matrix_with(base, engines=["tests.integration.plugins:bf16_temperature"], precisions=["fp32"], tp=[1],
                         roles=["actor"])
    repo = str(Path(__file__).resolve().parents[2])
    with pytest.MonkeyPatch.context() as mp:  # torchrun's workers import the plugin from the repo root
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
        result = CliRunner().invoke(app, ["candidate", str(matrix.source), "--run", str(run),
                                          "--junit", str(base / "candidate-junit.xml")])
    assert result.exit_code == 1, result.output
    return run


def report(run: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["report", str(run), *args])
    return result.exit_code, result.output


def tampered(candidate_run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(candidate_run, dst)
    return dst


# ---- the browser ------------------------------------------------------------------------------------

class Page:
    """One Chromium tab over the DevTools protocol (websockets' sync client), recording errors and requests."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.next_id = 0
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.events: list[str] = []

    def _record(self, msg: dict) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        self.events.append(method)
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append(json.dumps(params["args"]))
        elif method == "Runtime.exceptionThrown":
            self.errors.append(json.dumps(params["exceptionDetails"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append(params["entry"]["text"])
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=120))
            if msg.get("id") == self.next_id:
                assert "error" not in msg, msg
                return msg["result"]
            self._record(msg)

    def wait_for(self, event: str) -> None:
        while event not in self.events:
            self._record(json.loads(self.ws.recv(timeout=120)))

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"]["value"]


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """Headless Chromium with a DevTools port; yields the port."""
    repo = Path(__file__).resolve().parents[2]
    subprocess.run(["bash", str(repo / "scripts" / "ensure-chromium.sh")], check=True, capture_output=True)
    profile = tmp_path_factory.mktemp("chromium-profile")
    proc = subprocess.Popen(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={profile}",
                             "--window-size=1280,1500", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port_file = profile / "DevToolsActivePort"
    for _ in range(600):  # written once the browser listens; a browser that dies stops the wait
        if port_file.is_file() and port_file.read_text().count("\n") >= 1 or proc.poll() is not None:
            break
        time.sleep(0.1)
    assert proc.poll() is None and port_file.is_file(), "chromium did not start"
    yield int(port_file.read_text().splitlines()[0])
    proc.terminate()
    proc.wait()


@contextlib.contextmanager
def open_page(port: int, url: str) -> Iterator[Page]:
    """The browser's tab with url loaded (events of every domain the tests read are on before it loads)."""
    from websockets.sync.client import connect

    targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list").read())
    with connect(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"], max_size=None) as ws:
        page = Page(ws)
        for domain in ("Runtime", "Log", "Network", "Page"):
            page.call(f"{domain}.enable")
        page.call("Page.navigate", url=url)
        page.wait_for("Page.loadEventFired")
        yield page


def pixel_spread(png: bytes) -> tuple[float, int]:
    """Standard deviation of grey levels and number of distinct colours of a PNG."""
    from PIL import Image, ImageStat

    image = Image.open(io.BytesIO(png)).convert("RGB")
    return ImageStat.Stat(image.convert("L")).stddev[0], len(image.getcolors(maxcolors=1 << 20) or [])


def test_html_report_in_headless_chromium(candidate_run, chromium, tmp_path):
    out = tmp_path / "report.html"
    code, output = report(candidate_run, "--format", "html", "--out", str(out))
    assert code == 0 and "PASSED" in output, output
    assert out.stat().st_size < 2_000_000  # a bounded number of rows (tests/unit/report_html/test_page.py: at 500k rows)
    with open_page(chromium, out.as_uri()) as page:
        assert page.errors == []
        fetched = {u for u in page.requests if not u.startswith("data:")}  # inline images are data: URIs
        assert fetched == {out.as_uri()}, fetched  # nothing fetched but the page itself
        assert page.evaluate("document.getElementById('banner').dataset.status") == "PASSED"
        assert page.evaluate("document.getElementById('banner').textContent").startswith("PASS: 2/2 cases pass")
        shown = page.evaluate("[...document.querySelectorAll('section.case')].map(s => s.dataset.case)")
        assert sorted(shown) == sorted(CASES)
        # a bounded number of rows per case and family; the page counts the rest and links the verdict that has them
        note = page.evaluate("Object.assign({}, document.getElementById('rows-note').dataset)")
        num_rows = len(json.loads(RunLayout(candidate_run).verdict.read_text())["rows"])
        tabled = page.evaluate("document.querySelectorAll('section.case tbody tr').length")
        assert (int(note["rows"]), int(note["shown"]), int(note["leftOut"])) == (num_rows, tabled, num_rows - tabled)
        assert page.evaluate("document.querySelector('#rows-note a').getAttribute('href')").endswith(
            "candidates/verdict.json")
        for figure in ("heatmap", "families", "rollout"):  # (and 'steps' when cases take several steps)
            assert page.evaluate(f"document.querySelectorAll('#{figure} figure svg').length") == 1, figure
        assert page.evaluate("document.querySelectorAll('#coverage tbody tr').length") > 0
        provenance = page.evaluate("document.getElementById('provenance').textContent")
        assert "versions.torch" in provenance and "digests.acceptance" in provenance and "git.commit" in provenance
        if "platform" in json.loads((RunLayout(candidate_run).reference_summary).read_text()):
            assert "platform." in provenance
        shot = base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"])
    stddev, colours = pixel_spread(shot)
    assert stddev > 10 and colours > 50, (stddev, colours)  # a blank or single-colour page has ~0 and 1
    if os.environ.get("QUALIFY_SCREENSHOT"):
        Path(os.environ["QUALIFY_SCREENSHOT"]).write_bytes(shot)


def test_unverified_page_in_chromium_shows_no_pass(candidate_run, chromium, tmp_path):
    run = tampered(candidate_run, tmp_path)
    targets = RunLayout(run).targets / "targets.json"
    targets.write_text(targets.read_text() + " ")
    out = tmp_path / "report.html"
    assert report(run, "--format", "html", "--out", str(out))[0] == 1
    with open_page(chromium, out.as_uri()) as page:
        assert page.errors == []
        assert page.evaluate("document.getElementById('banner').dataset.status") == "NOT VERIFIED"
        assert "targets/targets.json" in page.evaluate("document.getElementById('verification').textContent")


def test_failed_qualification_is_a_verified_fail_banner(failing_run, chromium, tmp_path):
    code, output = report(failing_run, "--format", "json")
    summary = json.loads(output)
    assert code == 1 and summary["status"] == "FAILED" and summary["verification"]["ok"], summary["verification"]
    out = tmp_path / "report.html"
    assert report(failing_run, "--format", "html", "--out", str(out))[0] == 1
    with open_page(chromium, out.as_uri()) as page:
        assert page.errors == []
        assert page.evaluate("document.getElementById('banner').textContent").startswith("FAIL: 0/1 cases pass")
        assert page.evaluate("document.querySelector('section.case details').open") is True  # failing: open
        failed = page.evaluate("[...document.querySelectorAll('section.case tr.failed')].map(r => r.textContent)")
        assert any("outputs/logprobs_BT" in row for row in failed), failed


def test_blank_screenshot_is_detected():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(buf, format="PNG")
    stddev, colours = pixel_spread(buf.getvalue())
    assert stddev == 0 and colours == 1


# ---- JUnit ------------------------------------------------------------------------------------------

def test_candidate_junit_parses_with_one_testcase_per_case_and_family(candidate_run):
    from junitparser import JUnitXml

    xml = JUnitXml.fromfile(str(candidate_run.parent / "candidate-junit.xml"))
    names = {(tc.classname, tc.name) for suite in xml for tc in suite}
    # no "moments" family: the moments are judged by derivation (the "derived" family), not against the reference;
    # "rollout": an actor's step-0 logprobs against the rollout's (the exact tier, reported for undeclared engines)
    groups = ("decisions", "derived", "evidence", "grads", "layout", "outputs", "rollout", "updates")
    assert names == {(c, g) for c in CASES for g in groups}
    assert all(tc.is_passed for suite in xml for tc in suite)


def test_candidate_junit_failure_names_tensor_metric_value_bound_and_rule(failing_run):
    from junitparser import JUnitXml

    xml = JUnitXml.fromfile(str(failing_run.parent / "candidate-junit.xml"))
    outputs = next(tc for suite in xml for tc in suite if tc.name == "outputs")
    (failure,) = outputs.result
    line = next(x for x in failure.text.splitlines() if family_tensor(x).startswith("outputs/logprobs_BT max_abs"))
    assert " value " in line and " > bound " in line and "rule: value <= bound" in line and "fp32-repeat" in line


def test_report_junit_includes_the_verification(candidate_run, tmp_path):
    from junitparser import JUnitXml

    out = tmp_path / "junit.xml"
    assert report(candidate_run, "--format", "junit", "--out", str(out))[0] == 0
    suites = {s.name: s for s in JUnitXml.fromfile(str(out))}
    (verification,) = list(suites["qualify tiny-qwen3: verification"])
    assert verification.is_passed
    assert suites["qualify tiny-qwen3: candidates"].tests == 16  # 2 actor cases x 8 groups (derived, layout, rollout)


# ---- false passes: evidence changed after the verdict -------------------------------------------------

STEP_PREFIX = re.compile(r"^step[0-9]+/")


def family_tensor(text: str) -> str:
    """A tensor name (or a JUnit failure line) without the 'step<k>/' prefix of multi-step cases."""
    return STEP_PREFIX.sub("", text)


def edit_verdict(run: Path, edit) -> None:
    path = RunLayout(run).verdict
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def lower_a_value(doc: dict) -> None:
    row = next(r for r in doc["rows"] if r["case"] == CASES[1] and family_tensor(r["tensor"]).startswith("grads/")
               and r["value"])
    row["value"] /= 2  # still a pass, and consistent, but not what the evidence gives
    row["ratio"] = row["value"] / row["bound"]


def drop_a_check(doc: dict) -> None:
    i = next(i for i, r in enumerate(doc["rows"])
             if r["case"] == CASES[0] and family_tensor(r["tensor"]).startswith("updates/"))
    doc["rows"].pop(i)
    doc["cases"][CASES[0]]["num_checks"] -= 1


def widen_a_bound(doc: dict) -> None:
    row = next(r for r in doc["rows"] if r["case"] == CASES[1] and r["comparison"].startswith("vs ref"))
    row["bound"] *= 100
    row["ratio"] = row["value"] / row["bound"]


def touch_reference(run: Path) -> None:
    path = RunLayout(run).targets / "targets.json"
    path.write_text(path.read_text() + " ")


def touch_case(run: Path) -> None:
    path = RunLayout(run).case(CASES[0]) / "meta.json"
    path.write_text(path.read_text() + " ")


def widen_bound_file(run: Path) -> None:
    path = RunLayout(run).bounds / "actor-bf16-repeat.json"
    path.write_text(path.read_text().replace('"k": 4.0', '"k": 40.0'))


def remove_case(run: Path) -> None:
    shutil.rmtree(RunLayout(run).case(CASES[1]))


def drop_a_case(doc: dict) -> None:
    """The verdict without one case (its rows and summary): what dropping the failing cases of a FAILED verdict is."""
    doc["rows"] = [r for r in doc["rows"] if r["case"] != CASES[1]]
    del doc["cases"][CASES[1]]


def every_case_a_passed_run_row(run: Path) -> None:
    """Every case turned into one passing 'run' row, its evidence deleted: nothing left to judge again."""
    def edit(doc: dict) -> None:
        doc["rows"] = [{"case": c, "role": "actor", "comparison": "run", "tensor": "case", "metric": "exit",
                        "value": 0.0, "bound": 0.0, "ratio": 0.0, "passed": True, "note": ""} for c in CASES]
        doc["cases"] = {c: {"passed": True, "num_checks": 1, "num_failed": 0, "worst": None} for c in CASES}
    edit_verdict(run, edit)
    for c in CASES:
        shutil.rmtree(RunLayout(run).case(c))


def case_copied_over_another(run: Path) -> None:
    """One case's sealed evidence copied over the other's, the seal's case name edited to match."""
    layout = RunLayout(run)
    shutil.rmtree(layout.case(CASES[1]))
    shutil.copytree(layout.case(CASES[0]), layout.case(CASES[1]))
    marker = layout.case(CASES[1]) / "_complete.json"
    marker.write_text(marker.read_text().replace(f'"case": "{CASES[0]}"', f'"case": "{CASES[1]}"'))


def case_left_unsealed_and_out(run: Path) -> None:
    """What a later candidate stage that died midway leaves: a case it redid and never sealed, which the verdict (an
    earlier stage's) does not list."""
    edit_verdict(run, drop_a_case)
    (RunLayout(run).case(CASES[1]) / "_complete.json").unlink()


def case_linked_to_another_runs(run: Path) -> None:
    """One case directory replaced by a symlink to the same case of another run (the untouched original)."""
    layout = RunLayout(run)
    shutil.rmtree(layout.case(CASES[1]))
    layout.case(CASES[1]).symlink_to(run.parent / "original" / "candidates" / CASES[1],
                                     target_is_directory=True)


def remove_acceptance(run: Path) -> None:
    shutil.rmtree(RunLayout(run).acceptance_dir)


@pytest.mark.parametrize("tamper, expect", [
    (touch_reference, "reference evidence modified against the acceptance: targets/targets.json"),
    (widen_bound_file, "does not match the acceptance's digest"),
    (remove_acceptance, "no acceptance"),
    (touch_case, f"case {CASES[0]}: evidence"),
    (remove_case, f"case {CASES[1]}: evidence"),
    (lambda run: edit_verdict(run, lower_a_value), "differs from what its evidence gives"),
    (lambda run: edit_verdict(run, drop_a_check), "the verdict lacks checks its evidence gives"),
    (lambda run: edit_verdict(run, widen_a_bound), "differs from what its evidence gives"),
    (lambda run: edit_verdict(run, drop_a_case), "verdict: leaves out 1 case(s) whose sealed evidence is in"),
    (every_case_a_passed_run_row, "a case that did not run cannot pass"),
    (case_copied_over_another, f"case {CASES[1]}: its evidence was made from the spec of '{CASES[0]}'"),
    (case_left_unsealed_and_out, f"candidate stage did not finish: cases missing from the verdict: {CASES[1]}"),
    (case_linked_to_another_runs, "refusing symlinked directory in evidence: "),
], ids=["reference", "bound-file", "no-acceptance", "case-evidence", "case-removed", "verdict-value",
        "verdict-dropped-check", "verdict-bound", "verdict-dropped-case", "verdict-run-rows", "case-copied",
        "case-unsealed-and-dropped", "case-linked"])
def test_tampered_evidence_is_not_verified(candidate_run, tmp_path, tamper, expect):
    (tmp_path / "original").symlink_to(candidate_run, target_is_directory=True)  # another run, for a link to it
    run = tampered(candidate_run, tmp_path)
    tamper(run)
    code, output = report(run, "--format", "json")
    summary = json.loads(output)
    assert code == 1 and summary["status"] == "NOT VERIFIED"
    assert any(expect in p for p in summary["verification"]["problems"]), summary["verification"]["problems"]
    code, output = report(run, "--format", "markdown")
    assert code == 1 and "PASSED" not in output


def test_untouched_copy_verifies(candidate_run, tmp_path):
    code, output = report(tampered(candidate_run, tmp_path), "--format", "json")
    assert code == 0 and json.loads(output)["status"] == "PASSED", output


# ---- no verdict is no pass --------------------------------------------------------------------------

FORMATS = ("text", "markdown", "json", "html", "junit")


def assert_no_verdict_fails(run: Path, out_dir: Path, reason: str) -> None:
    """Every format exits 1 with NO VERDICT, and the JUnit file has a failing testcase naming the candidate stage."""
    from junitparser import JUnitXml

    for fmt in FORMATS:
        out = out_dir / f"report.{fmt}"
        code, output = report(run, "--format", fmt, "--out", str(out))
        assert code == 1 and "(NO VERDICT)" in output, (fmt, output)
    summary = json.loads((out_dir / "report.json").read_text())
    assert summary["verification"]["ok"] and summary["unfinished"] == [{"stage": "candidate", "reason": reason}]
    failing = [tc for suite in JUnitXml.fromfile(str(out_dir / "report.junit")) for tc in suite if not tc.is_passed]
    assert [tc.name for tc in failing] == ["candidate stage finished"]
    assert f"candidate stage did not finish: {reason}" in failing[0].result[0].message
    assert "candidate stage did not finish" in (out_dir / "report.html").read_text()


def test_reference_and_acceptance_alone_are_no_verdict(run_copy, tmp_path):
    """Frozen, no candidate stage yet: the report of a qualification that has not happened fails."""
    assert_no_verdict_fails(run_copy, tmp_path, "no verdict")


def test_a_candidate_stage_that_died_before_its_verdict_fails(candidate_run, tmp_path):
    """The cases sealed, the stage killed before it wrote the verdict (as when the judge ran out of GPU memory)."""
    run = tampered(candidate_run, tmp_path)
    RunLayout(run).verdict.unlink()
    assert_no_verdict_fails(run, tmp_path, f"no verdict (cases started: {', '.join(sorted(CASES))})")


def test_candidate_on_a_run_with_a_symlinked_case_is_one_line(candidate_run, tmp_path):
    """`qualify candidate` on a run whose case directory links to another run's: one line, exit 2, nothing removed
    through the link (it was a traceback from rmtree on a link)."""
    (tmp_path / "original").symlink_to(candidate_run, target_is_directory=True)
    run = tampered(candidate_run, tmp_path)
    case_linked_to_another_runs(run)
    matrix = matrix_with(tmp_path, engines=["torch-tp"], precisions=["fp32", "bf16"], tp=[1], roles=["actor"])
    result = CliRunner().invoke(app, ["candidate", str(matrix.source), "--run", str(run)])
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("qualify: error:")]  # after the log
    assert len(errors) == 1 and f"refusing symlinked directory in evidence: {RunLayout(run).case(CASES[1])}" in \
        errors[0], result.stderr
    assert (candidate_run / "candidates" / CASES[1] / "_complete.json").is_file()
