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
