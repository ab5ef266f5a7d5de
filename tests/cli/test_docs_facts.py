"""What README.md and BENCHMARKS.md state about the code, checked against the code; and no script uses a hidden
(legacy) flag spelling.

README: the bound rule is the one definition's formula (qualify.bounds.rule.FORMULA, quantum included); the engine
method list is TrainEngine's; the run-directory map names every path RunLayout makes. BENCHMARKS.md is the page of
current figures (one table per area, each row with its machine and date); its links into the dated log,
benchmarks/LOG.md, name sections that exist there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.main import get_command

from qualify.cli.app import app

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BENCHMARKS = (REPO / "BENCHMARKS.md").read_text()
LOG = REPO / "benchmarks" / "LOG.md"


def section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_states_the_rule_with_its_quantum():
    from qualify.bounds.rule import FORMULA

    assert "quantum" in FORMULA and f"`{FORMULA}`" in README


def test_readme_lists_the_engine_protocol_methods():
    from qualify.engines.base import TrainEngine

    listed = re.search(r"`qualify\.engines\.base\.TrainEngine` \(([^)]*)\)", README.replace("\n", " ")).group(1)
    methods = [n for n, v in vars(TrainEngine).items() if callable(v) and not n.startswith("_")]
    assert [m.strip() for m in listed.split(",")] == methods


def test_readme_run_directory_names_every_path_of_the_layout():
    from qualify.layout import RunLayout

    layout, text = RunLayout(Path("R")), section(README, "Run directory")
    paths = {name: getattr(layout, name) for name, v in vars(RunLayout).items() if isinstance(v, property)}
    missing = {name: p.relative_to("R").as_posix() for name, p in paths.items() if p.name not in text}
    assert not missing, f"README's run-directory map lacks {missing}"


def test_benchmarks_is_current_figures_with_machine_and_date_and_links_into_the_log():
    tables = [t for t in re.split(r"\n\s*\n", BENCHMARKS) if t.lstrip().startswith("|")]
    assert len(tables) >= 5
    for table in tables:
        header = [c.strip() for c in table.strip().splitlines()[0].strip("|").split("|")]
        assert {"machine", "date"} <= set(header), header
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", LOG.read_text(), flags=re.MULTILINE)}
    links = re.findall(r"\]\(benchmarks/LOG\.md#([^)]+)\)", BENCHMARKS)
    assert links and set(links) <= anchors, set(links) - anchors
    assert "[benchmarks/LOG.md](benchmarks/LOG.md)" in BENCHMARKS


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# --- legacy flags ----------------------------------------------------------------------------------------------------

SCRIPTS = sorted({REPO / "Makefile", REPO / ".ci" / "run", *REPO.glob("benchmarks/*.sh"), *REPO.glob("benchmarks/*.py"),
                  *REPO.glob("sbatch/templates/*"), *REPO.glob("scripts/*.sh")})


def hidden_options() -> dict[str, list[str]]:
    """Command name -> its hidden (old) option spellings."""
    root = get_command(app)
    return {name: [o for p in cmd.params if getattr(p, "hidden", False) for o in p.opts]
            for name, cmd in root.commands.items() if any(getattr(p, "hidden", False) for p in cmd.params)}


def legacy_uses(text: str, hidden: dict[str, list[str]]) -> list[str]:
    """Lines of a script (comments too: they tell how to run it) that call a command with a hidden spelling: shell
    lines (`qualify`, `$q`, `{{ qualify }}`, continuation lines joined) and Python argument lists."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        for m in re.finditer(r"(?:qualify|\$\{?q\}?|\{\{ qualify \}\})[\"']?\s+([a-z]+)\b([^;&|]*)", line):
            command, rest = m.groups()
            if any(re.search(rf"(?<![\w-]){o}(?![\w-])", rest) for o in hidden.get(command, ())):
                found.append(line.strip())
    for m in re.finditer(r"\[([^\]]*)\]", text):
        items = re.findall(r"[\"']([^\"']+)[\"']", m.group(1))
        if any(c in items and set(opts) & set(items) for c, opts in hidden.items()):
            found.append(m.group(0))
    return found


def test_the_hidden_spellings_are_the_old_ones():
    assert hidden_options() == {"reference": ["--out"], "sbatch": ["--cases"]}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_script_uses_a_hidden_flag(path):
    assert not legacy_uses(path.read_text(), hidden_options())


def test_the_legacy_check_finds_each_form():
    hidden = hidden_options()
    assert legacy_uses("qualify reference m.yaml --stage capture \\\n  --out runs/x\n", hidden)
    assert legacy_uses('{{ srun }} {{ qualify }} sbatch {{ matrix }} --cases "${case}"\n', hidden)
    assert legacy_uses('step "$q" reference "$matrix" --out "$run"\n', hidden)
    assert legacy_uses('subprocess.run([QUALIFY, "reference", str(m), "--out", str(run)])\n', hidden)
    assert not legacy_uses('qualify report "$run" --out r.html; qualify sbatch m.yaml --only "x"\n', hidden)


# --- what the docs name exists -------------------------------------------------------------------------------------

DOCS = sorted({REPO / "README.md", REPO / "TESTING.md", REPO / "BENCHMARKS.md", *REPO.glob("docs/*.md"),
               *REPO.glob("*/README.md")} - {REPO / ".venv" / "README.md"})
"""The pages that describe the product as it is now (benchmarks/LOG.md is a dated log: it names what existed then)."""
PATH = re.compile(r"(?<![\w/.-])((?:tests|qualify|benchmarks|scripts|matrices|manifests|sbatch|requirements|docs)"
                  r"/[\w./-]*\w)(?:::(\w+))?")
MODULE = re.compile(r"(?<![\w/.-])(qualify(?:\.\w+)+)")


def missing_paths(text: str) -> list[str]:
    """Repository paths a page names that do not exist (`tests/x.py::test_name`: the test function too); a path with a
    placeholder (`<case>`, `*`, `{a,b}`) is a pattern, not a name."""
    out = []
    for m in PATH.finditer(text):
        path, test = m.groups()
        if any(c in path for c in "*<>{}"):
            continue
        if not (REPO / path).exists():
            out.append(path)
        elif test and not re.search(rf"^def {test}\(", (REPO / path).read_text(), flags=re.MULTILINE):
            out.append(f"{path}::{test}")
    return out


def top_level_names(source: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return names


def module_resolves(name: str) -> bool:
    """`qualify.a.b` is a module of the package, or `qualify.a.b.NAME` a name its source binds at its top level (read,
    not imported: an adapter's module would import its library)."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        base = REPO.joinpath(*parts[:i])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            rest = parts[i:]
            return not rest or rest[0] in top_level_names(source) or (base / f"{rest[0]}.py").is_file()
    return False


def unknown_modules(text: str) -> list[str]:
    """qualify.* names a page gives that are no module or top-level name (mutation testing's mutant names, which
    `mutmut` gives as `module.x_function__mutmut_N` or `module.x_function`, are records of a run, not names of the
    code)."""
    mutant = re.compile(r"\.x(_|ǁ)|mutmut")
    return [m for m in MODULE.findall(text) if not mutant.search(m) and not module_resolves(m)]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_and_module_a_page_names_exists(page):
    text = page.read_text()
    assert not missing_paths(text), missing_paths(text)
    assert not unknown_modules(text), unknown_modules(text)


def test_the_name_checks_catch_a_stale_page():
    assert missing_paths("checked by `tests/integration/test_acceptance_reproduces.py`") == \
        ["tests/integration/test_acceptance_reproduces.py"]
    assert missing_paths("`tests/integration/test_replay.py::test_gone_long_ago`") == \
        ["tests/integration/test_replay.py::test_gone_long_ago"]
    assert not missing_paths("`tests/integration/test_replay.py::test_fresh_reference_against_committed_acceptance`, "
                             "`runs/<m>/candidates/<case>/`, `sbatch/clusters/*.yaml`")
    assert unknown_modules("`qualify.reference.resident` and `qualify.engines.base.NoSuchEngine`") == \
        ["qualify.reference.resident", "qualify.engines.base.NoSuchEngine"]
    assert not unknown_modules("`qualify.engines.base.TrainEngine`, `qualify.bounds.rule.FORMULA`, `qualify.candidate`")


# --- the rule, wherever the code states it ---------------------------------------------------------------------------

RULE_TEXT = re.compile(r"bound\s*=\s*k\s*[x*]\s*control[ _]error\s*\+\s*floor(?!\s*\+\s*quantum)")
"""The rule stated without its last term (qualify.bounds.rule.FORMULA has it)."""


def rule_without_quantum(text: str) -> list[str]:
    return [" ".join(m.group(0).split()) for m in RULE_TEXT.finditer(text)]


@pytest.mark.parametrize("path", sorted(REPO.glob("qualify/**/*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_the_code_states_the_rule_with_its_quantum(path):
    assert not rule_without_quantum(path.read_text())


def test_the_rule_check_sees_a_missing_quantum():
    from qualify.bounds.rule import FORMULA

    assert rule_without_quantum('"""Rule: bound = k x control error + floor, per (role, tensor, metric)."""')
    assert rule_without_quantum("The acceptance rule: bound = k * control_error +\n    floor.")
    assert not rule_without_quantum(FORMULA) and not rule_without_quantum("bound = k x control error + floor + quantum")


# --- the code's notes and the records speak of the product ----------------------------------------------------------

WORK_LOG = re.compile(r"\bsessions? \d+|\bthis session\b|\bthe session's (?:device|time|deadline)|device tool|device time",
                      re.IGNORECASE)
"""An internal work-log numbering or a remote machine's limits: records are dated by date and commit."""
UNIT = r"\d(?:\.\d+)? ?(?:s|ms|min|GB|GiB|MB|MiB)\b"
MACHINE = r"\b(?:H100|H200|EPYC|Xeon|\d-core)"
MEASURED = re.compile(rf"measured:.{{0,60}}(?<![\w.])\d|{UNIT}.{{0,80}}{MACHINE}|{MACHINE}.{{0,80}}{UNIT}")
"""A measured figure: a number after 'measured:', or a time or size beside the machine it was taken on."""
RECORDS = sorted({*DOCS, LOG, *REPO.glob("benchmarks/*.sh"), *REPO.glob("benchmarks/*.py"), *REPO.glob("benchmarks/*.yaml"),
                  *REPO.glob("scripts/*"), REPO / "Makefile"})


def notes(path: Path) -> list[str]:
    """The comments and docstrings of a Python file, line by line."""
    import io
    import tokenize

    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            out.append(tok.string)
        elif tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''")):
            out += tok.string.splitlines()
    return out


def figures_in_notes(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines if MEASURED.search(line) or WORK_LOG.search(line)]


@pytest.mark.parametrize("path", sorted(REPO.glob("qualify/**/*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_no_measured_figure_or_work_log_in_the_codes_notes(path):
    """Figures live in BENCHMARKS.md and benchmarks/LOG.md, dated; a docstring keeps the reasoning and points there."""
    assert not figures_in_notes(notes(path))


ISSUE_LOG = re.compile(r"\bissues? \d+|\bone (?:part|wheel) (?:a|per) call\b|\bper call limit\b", re.IGNORECASE)
"""A work item's number ("issue 29", "(issues 29, 31)") or a remote runner's transfer limits: the records date a figure by
its date, commit and machine, and a how-to is what a user runs on their own host."""
RESULTS = sorted(REPO.glob("benchmarks/results/**/*.md"))


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_records_speak_of_the_product(path):
    assert not [line for line in path.read_text().splitlines() if WORK_LOG.search(line)]


@pytest.mark.parametrize("path", [*RECORDS, *RESULTS], ids=lambda p: str(p.relative_to(REPO)))
def test_the_records_name_no_work_item(path):
    assert not [line for line in path.read_text().splitlines() if ISSUE_LOG.search(line)]


def test_the_work_item_check_catches_a_number():
    assert ISSUE_LOG.search("## One GPU (issue 29, 2026-12-02, cfd11ed)")
    assert ISSUE_LOG.search("(issues 29, 31, 2026-12-03)") and ISSUE_LOG.search("wheel parts, one part per call")
    assert ISSUE_LOG.search("Issue 31 asks for at most 0.4") and ISSUE_LOG.search("# Issue 21: qualify at 0.6B")
    assert not ISSUE_LOG.search("## One GPU (2026-12-02, cfd11ed): a known issue of vLLM 0.26")


def test_the_notes_checks_catch_a_figure_and_a_work_log(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Ranks (about 11 s a rank on a 2-core AMD EPYC).\n\nOn one H200, 0.6B: the stage 166.6 s."""\n'
                   "# measured: 0.49 of their bounds\n# hashed again (benchmarks/LOG.md, session 17)\n"
                   'X = "12 GB on one H200"  # a string that is code, not a note\n')
    assert len(figures_in_notes(notes(bad))) == 4
    good = tmp_path / "good.py"
    good.write_text('"""Kill any rank that outlives 30 s.\n\nA case that is measured here (benchmarks/LOG.md)."""\n')
    assert figures_in_notes(notes(good)) == []
    assert WORK_LOG.search("Not run this session (device time: a failed start cost 122 s)")
    assert not WORK_LOG.search("a session-scoped fixture, the test session's frozen run")


# --- links and section names between the pages -----------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def headings(path: Path) -> list[str]:
    return re.findall(r"^#+ (.+)$", path.read_text(), flags=re.MULTILINE)


def broken_links(page: Path, text: str) -> list[str]:
    """Relative links of a page (to a file, to a file's section, to a section of the page) that lead nowhere."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        missing_section = path.exists() and path.suffix == ".md" and anchor and anchor not in map(slug, headings(path))
        if not path.exists() or missing_section:
            out.append(target)
    return out


@pytest.mark.parametrize("page", [*DOCS, LOG], ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_between_the_pages_resolves(page):
    assert not broken_links(page, page.read_text())


def test_the_link_check_catches_a_missing_section_and_file():
    page = REPO / "docs" / "plugins.md"
    assert broken_links(page, "[setup](../README.md#setup) [ok](../README.md#two-commands)") == ["../README.md#setup"]
    assert broken_links(page, "[gone](../GONE.md) [guide](plugins.md) [here](#2-the-contract)") == ["../GONE.md"]


SECTION_NAME = re.compile(r'"([A-Z][^"\n]{3,70})"')
"""A section named in prose: ("Reading a verdict"), (docs/plugins.md, "Reading a FAIL")."""


def unknown_sections(text: str, pages: list[Path]) -> list[str]:
    """Quoted section names that begin no heading of the pages (a heading's 'N. ' numbering ignored)."""
    known = [re.sub(r"^\d+\. ", "", h) for p in pages for h in headings(p)]
    return [name for name in SECTION_NAME.findall(text) if not any(h.startswith(name) for h in known)]


def test_the_sections_readme_names_exist():
    pages = [REPO / "README.md", *REPO.glob("docs/*.md")]
    for page in pages:
        assert not unknown_sections(page.read_text(), pages), page


LOG_SECTION = re.compile(r'LOG\.md,? \(?"([^"]+)"')


def unknown_log_sections(text: str) -> list[str]:
    """Sections of benchmarks/LOG.md a note names ('benchmarks/LOG.md, "CPU ranks forked"') that are no part of a
    heading or of a paragraph's bold lead there."""
    log = LOG.read_text()
    leads = headings(LOG) + re.findall(r"\*\*([^*]+)\*\*", log)
    return [name for name in LOG_SECTION.findall(" ".join(text.split())) if not any(name in h for h in leads)]


@pytest.mark.parametrize("path", sorted(REPO.glob("qualify/**/*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_the_log_sections_the_code_names_exist(path):
    assert not unknown_log_sections("\n".join(notes(path)))


def test_the_section_checks_catch_a_wrong_name():
    pages = [REPO / "README.md", *REPO.glob("docs/*.md")]
    assert unknown_sections('(see "Reading a verdict"; "Setup")', pages) == ["Setup"]
    assert unknown_sections('(docs/plugins.md, "Reading a FAIL")', pages) == []
    assert unknown_log_sections('(benchmarks/LOG.md, "CPU ranks forked"; benchmarks/LOG.md, "No such run")') == \
        ["No such run"]


# --- the GPU quickstart: what `make demo-gpu` runs is what README's "On your own CUDA host" says ------------------------

def make_dry_run(*args: str) -> str:
    import shutil
    import subprocess

    if not shutil.which("make"):
        pytest.skip("no make on PATH")
    return subprocess.run(["make", "-n", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout


def test_make_demo_gpu_installs_from_the_lock_then_runs_the_one_gpu_chain():
    plan = make_dry_run("demo-gpu")
    install, chain = plan.index("scripts/install-gpu.sh"), plan.index("scripts/demo.sh")
    assert install < chain and "--wheelhouse" not in plan
    assert "benchmarks/gpu-qwen3-0.6b-1gpu.yaml" in plan[chain:] and (REPO / "benchmarks/gpu-qwen3-0.6b-1gpu.yaml").is_file()
    script = (REPO / "scripts" / "install-gpu.sh").read_text()
    assert "--no-deps" in script and "-r requirements/gpu.lock" in script  # the host's CUDA torch stays
    assert "scripts/install-gpu.sh --wheelhouse /tmp/wh" in make_dry_run("demo-gpu", "WHEELHOUSE=/tmp/wh")
    section = README.split("\n## On your own CUDA host\n", 1)[1].split("\n## ", 1)[0]
    assert "make demo-gpu" in section and "benchmarks/gpu-qwen3-0.6b-1gpu.yaml" in section
