"""Every command example in `qualify ... --help` and in README.md runs here, against real inputs.

The examples are collected, not listed: each command's epilog in the Typer app (what its --help prints after
"Example:"), and README.md's commands (every line of its code blocks, every inline code span that starts with
`qualify ` or `make `). A `qualify` example runs verbatim (split and glob-expanded as a shell would) through the
Typer app, in a sandbox directory that stands for the repository root:

    matrices/, manifests/, sbatch/, scripts/   the repository's own (each file linked)
    runs/tiny-qwen3                           a copy of the test run's frozen run (reference scored from the committed
                                              rollout, acceptance; tests/conftest.py) with the cases of CASES run once
                                              (`prepared`), so each stage finds what the stage before it left:
                                              `reference` finds its output complete and verified and resumes,
                                              `freeze` gets the reference alone (RUN_PARTS) and freezes it,
                                              `candidate` reuses the complete cases, `report`/`diagnose` read them
    matrices/tiny-qwen3.yaml for `candidate`  the embedded default with its candidates narrowed to CASES (checked by
                                              test_the_narrowed_matrix_is_the_embedded_default: every other section
                                              is the real one, and its cases are the real matrix's)
    keys/                                     an OpenSSH key and the allowed_signers file that lists it, made with
                                              ssh-keygen for an example that names keys/ (signing_keys)

A `make` example runs as `make -n` (it would set up a virtualenv or run the whole suite). An example that cannot run
here is in NOT_RUN with the reason; it is still parsed by the CLI (click validates every argument and option, nothing
runs) and the repository paths it names must exist. A new example that is neither runnable nor listed fails here, and
so does an entry of NOT_RUN or PREPARE that names no example.

README's synopses (`qualify freeze RUN [--name N]`) and mentions (`qualify candidate --expect`) are checked against
the CLI: the command exists, every option named is a visible option of that command, and the positional placeholders
fit its arguments (so README cannot say `--run` where the command takes the run directory as its first argument).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.main import get_command
from typer.testing import CliRunner

from qualify.cli.app import app

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
LINKED = ("matrices", "manifests", "sbatch", "scripts")
"""Repository directories the sandbox links (read-only use: no example writes under them)."""
RUN = "runs/tiny-qwen3"
MATRIX = "matrices/tiny-qwen3.yaml"
CASES = {"engines": ["torch-tp"], "precisions": ["fp32"], "tp": [1, 2], "roles": ["actor"]}
"""The candidates section of the narrowed matrix: the cases the candidate, report and diagnose examples name."""
RUN_PARTS = {"freeze": ("reference",)}
"""What of the prepared run a command's sandbox gets (default: all of it)."""
MANIFEST_CREATE = "qualify manifest create runs/tiny-qwen3/reference --out runs/tiny-qwen3/reference.manifest.json"
SIGN_RUN = "qualify sign runs/tiny-qwen3/acceptance/acceptance.json --key keys/id_ed25519"
SIGN_COMMITTED = ("qualify sign manifests/tiny-qwen3/acceptance/acceptance.json --key keys/id_ed25519 --out "
                  "tiny-qwen3.sig --identity ci@example.org")
PREPARE = {"qualify verify runs/tiny-qwen3/reference.manifest.json": MANIFEST_CREATE,
           "qualify verify runs/tiny-qwen3/reference.manifest.json --format json --jobs 4": MANIFEST_CREATE,
           "qualify verify runs/tiny-qwen3/acceptance/acceptance.json --allowed-signers keys/allowed_signers "
           "--signature runs/tiny-qwen3/acceptance/acceptance.json.sig": SIGN_RUN,
           "qualify verify manifests/tiny-qwen3/acceptance/acceptance.json --partial --allowed-signers "
           "keys/allowed_signers --signature tiny-qwen3.sig": SIGN_COMMITTED}
"""Examples that read what another example writes: that example runs first in the same sandbox."""
KEYS = "keys"
"""Where the signing examples find their OpenSSH key (keys/id_ed25519) and the allowed_signers file that lists it, made
in the sandbox of an example that names them (signing_keys)."""
NOT_RUN = {
    "qualify reference matrices/qwen3-8b.yaml --run /scratch/q8b --stage capture":
        "a real Qwen3-8B checkpoint and GPUs: the matrix names checkpoints this machine lacks",
    "qualify sbatch matrices/tiny-qwen3.yaml --cluster sbatch/clusters/local.yaml --only 'torch-tp-*' --submit --wait":
        "submits and follows the whole chain as Slurm jobs (minutes); tests/integration/test_slurm_tiny.py runs the "
        "chain through a real Slurm",
    "qualify rounds matrices/tiny-qwen3.yaml --engine torch-tp":
        "a live vLLM engine for two rounds and five probes, about 60 s on 2 cores (measured); "
        "tests/integration/test_rounds.py runs the same stage (run_rounds) at vLLM TP1 and TP2",
    "qualify rounds matrices/tiny-qwen3.yaml --run runs/tiny-qwen3 --vllm-tp 2":
        "a live vLLM engine at TP2 for two rounds and five probes (longer than TP1); "
        "tests/integration/test_rounds.py runs the same stage (run_rounds) at vLLM TP2",
    "make demo-gpu": "a CUDA GPU and the GPU stack (vLLM 0.26.0): the chain at the Qwen3-0.6B shape, about 8 minutes on "
                     "one H200 (BENCHMARKS.md)",
    "scripts/demo.sh matrices/tiny-qwen3-grpo.yaml runs/tiny-qwen3-grpo":
        "the whole GRPO chain (about 3 minutes); tests/integration/test_grpo_chain.py runs its stages",
    "qualify candidate matrices/tiny-qwen3-dp.yaml --run runs/tiny-qwen3-dp --only '[!m]*'":
        "the shipped data-parallel matrix's 80 CPU cases (about 16 minutes on 2 cores, BENCHMARKS.md); "
        "tests/integration/test_dp_matrix.py runs its representatives",
    "scripts/demo.sh matrices/tiny-qwen3-moe.yaml runs/tiny-qwen3-moe":
        "the whole MoE chain (about 5 minutes with the TP2 capture); tests/integration/test_moe.py runs its stages",
}
"""Examples that are parsed here but not run, with the reason."""
OUTPUT_OPTIONS = ("--out", "--junit", "--run")
"""Options whose value a command writes (not an input that must exist)."""


# --- collecting ------------------------------------------------------------------------------------------------------

def commands(cmd=None, path=("qualify",)):
    """(command path, click command) of every command and group of the app."""
    cmd = cmd or get_command(app)
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from commands(sub, (*path, name))


def epilog_examples(epilog: str | None) -> list[str]:
    """The commands of an epilog 'Examples:  A  |  B'."""
    if not epilog:
        return []
    _, found, rest = epilog.partition("Example")
    assert found, f"epilog without 'Example': {epilog!r}"
    rest = rest.split(":", 1)[1]
    return [e.strip() for e in re.split(r"\s+\|\s+", rest) if e.strip()]


def help_examples() -> dict[str, str]:
    """Every example of every command's --help: example -> where."""
    return {e: " ".join(path) + " --help" for path, cmd in commands() for e in epilog_examples(cmd.epilog)}


def readme_commands(text: str) -> tuple[list[str], list[str]]:
    """(commands of README's code blocks, its inline code spans that start with 'qualify ' or 'make ')."""
    blocks = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                blocks.append(line)
    spans = [s.replace("\\|", "|").strip() for s in re.findall(r"`([^`\n]+)`", text)]
    return blocks, [s for s in spans if s.startswith(("qualify ", "make "))]


PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")


def is_synopsis(command: str) -> bool:
    """A command with placeholders (`RUN`, `[--name N]`, `text|json`, `sha256:...`): a form, not an example."""
    return any(c in command for c in "[]|") or "..." in command or any(
        PLACEHOLDER.match(w) for w in command.split())


def is_mention(command: str) -> bool:
    """`qualify candidate --expect`: a command and some of its options named in prose."""
    words = command.split()
    return words[0] == "qualify" and all(w.startswith("--") or w.isidentifier() for w in words[1:]) and not any(
        w.startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--")
        for i, w in enumerate(words))


def readme_examples() -> dict[str, str]:
    blocks, spans = readme_commands(README.read_text())
    found = {c: "README.md code block" for c in blocks}
    for span in spans:
        if span.startswith("make ") or not (is_synopsis(span) or is_mention(span)):
            found.setdefault(span, "README.md")
    return found


def all_examples() -> dict[str, str]:
    return help_examples() | readme_examples()


EXAMPLES = all_examples()
RUNS = sorted(e for e in EXAMPLES if e.startswith("qualify ") and e not in NOT_RUN)


# --- the sandbox -----------------------------------------------------------------------------------------------------

def narrowed_matrix() -> dict:
    data = yaml.safe_load((REPO / MATRIX).read_text())
    data["candidates"].update(CASES)
    return data


def sandbox(root: Path, *, narrowed: bool) -> Path:
    """root made to stand for the repository: its directories linked file by file (so matrices/tiny-qwen3.yaml can be
    the narrowed matrix where `narrowed`)."""
    for name in LINKED:
        for src in sorted((REPO / name).iterdir()):
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / name / src.name).symlink_to(src, target_is_directory=src.is_dir())
    if narrowed:
        (root / MATRIX).unlink()
        (root / MATRIX).write_text(yaml.safe_dump(narrowed_matrix(), sort_keys=False))
    return root


def words_of(example: str, cwd: Path) -> list[str]:
    """The example split as a shell would: a quoted word as it is, an unquoted one with its globs expanded (cwd)."""
    raw = shlex.shlex(example, posix=False)
    raw.whitespace_split = True
    out = []
    for token in raw:
        word = shlex.split(token)[0]
        quoted = token[0] in "'\""
        matches = [] if quoted or not any(c in word for c in "*?[") else sorted(glob.glob(word, root_dir=cwd))
        out += matches or [word]
    return out


def inputs_missing(words: list[str], cwd: Path) -> list[str]:
    """Repository paths the example reads that do not exist (values of OUTPUT_OPTIONS are written, not read)."""
    missing = []
    for i, word in enumerate(words):
        if word.startswith("-") or (i and words[i - 1] in OUTPUT_OPTIONS):
            continue
        if word.split("/", 1)[0] in LINKED and not (cwd / word).exists():
            missing.append(word)
    return missing


def parse(words: list[str]):
    """Parse a qualify command line with the CLI (every argument and option validated), running nothing."""
    cmd, name, args, parent = get_command(app), "qualify", words[1:], None
    while True:
        ctx = cmd.make_context(name, args, parent=parent)
        if not hasattr(cmd, "resolve_command"):
            return ctx
        name, cmd, args = cmd.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
        parent = ctx


@pytest.fixture(scope="module")
def prepared(frozen_run, tmp_path_factory):
    """A sandbox's runs/tiny-qwen3: the frozen run with the narrowed matrix's cases run and judged (its verdict)."""
    from qualify.candidate.stage import run_candidates
    from qualify.matrix import load_matrix

    root = sandbox(tmp_path_factory.mktemp("examples"), narrowed=True)
    for part in ("reference", "acceptance"):
        shutil.copytree(frozen_run / part, root / RUN / part)
    here = os.getcwd()
    os.chdir(root)  # the cases' specs name the run as the examples do (relative), so the examples reuse them
    try:
        assert run_candidates(load_matrix(Path(MATRIX)), Path(RUN)).passed
    finally:
        os.chdir(here)
    return root / RUN


def signing_keys(root: Path) -> None:
    """keys/id_ed25519 (ssh-keygen, no passphrase) and keys/allowed_signers naming its public half as ci@example.org,
    allowed to sign acceptances (qualify.signing)."""
    from qualify.signing import allowed_signer_line

    keys = root / KEYS
    if keys.is_dir():
        return
    keys.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ci@example.org", "-f",
                    str(keys / "id_ed25519")], check=True)
    (keys / "allowed_signers").write_text(allowed_signer_line("ci@example.org", keys / "id_ed25519") + "\n")


def run_example(example: str, prepared: Path, root: Path):
    words = shlex.split(example)
    command = words[1]
    sandbox(root, narrowed=command == "candidate")
    if f"{KEYS}/" in example:
        signing_keys(root)
    if "runs/" in example or command in ("reference", "candidate"):  # it reads the run (by default, for the two)
        for part in RUN_PARTS.get(command, ("reference", "acceptance", "candidates")):
            shutil.copytree(prepared / part, root / RUN / part, symlinks=True)
    return CliRunner().invoke(app, words_of(example, root)[1:])


# --- the tests -------------------------------------------------------------------------------------------------------

def test_examples_are_collected_from_every_command_and_the_readme():
    helps = help_examples()
    assert {e.split()[1] for e in helps} >= {"reference", "freeze", "candidate", "verify", "rounds", "sbatch",
                                              "report", "diagnose", "manifest", "matrices"}
    readme = readme_examples()
    assert {"make demo", "make test", "qualify verify manifests/tiny-qwen3/acceptance/acceptance.json --partial",
            SIGN_RUN} <= set(readme)


@pytest.mark.parametrize("path", [p for p, c in commands() if c.epilog], ids=" ".join)
def test_help_prints_the_examples_collected_from_it(path):
    """The examples come from the epilog: --help prints each of them (so what runs here is what a reader sees)."""
    cmd = dict(commands())[path]
    text = " ".join(CliRunner().invoke(app, [*path[1:], "--help"], terminal_width=400).stdout
                    .replace("│", " ").split())
    for example in epilog_examples(cmd.epilog):
        assert example in text, (example, text)


def test_every_not_run_and_prepare_entry_names_an_example():
    assert set(NOT_RUN) <= set(EXAMPLES), set(NOT_RUN) - set(EXAMPLES)
    assert set(PREPARE) | set(PREPARE.values()) <= set(EXAMPLES)


def test_the_narrowed_matrix_is_the_embedded_default(tmp_path):
    from qualify.matrix import load_matrix
    from qualify.schema import to_dict

    real = load_matrix(REPO / MATRIX)
    path = tmp_path / "tiny-qwen3.yaml"
    path.write_text(yaml.safe_dump(narrowed_matrix()))
    narrowed = load_matrix(path)
    assert {k: v for k, v in to_dict(narrowed).items() if k not in ("candidates", "source")} == \
           {k: v for k, v in to_dict(real).items() if k not in ("candidates", "source")}
    assert {c.name for c in narrowed.cases()} <= {c.name for c in real.cases()}


@pytest.mark.parametrize("example", sorted(EXAMPLES), ids=str)
def test_every_example_parses_and_names_files_that_exist(example, tmp_path, monkeypatch):
    """Each example (run or not): its repository paths exist; a qualify command line is accepted by the CLI's parser;
    a make target exists (make -n); a script is valid bash."""
    root = sandbox(tmp_path, narrowed=False)
    monkeypatch.chdir(root)
    words = words_of(example, root)
    assert not inputs_missing(words, root), f"{example} ({EXAMPLES[example]}) names missing files"
    if words[0] == "qualify":
        parse(words)
    elif words[0] == "make":
        done = subprocess.run(["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
    else:
        assert words[0].endswith(".sh"), f"{example} ({EXAMPLES[example]}): not a qualify, make or script command"
        assert subprocess.run(["bash", "-n", words[0]], check=False).returncode == 0
        assert example in NOT_RUN, f"{example}: a script example must run here or say why not in NOT_RUN"


def test_the_parse_check_catches_a_wrong_example(tmp_path, monkeypatch):
    """The parse-only check fails on what a stale example would say: an unknown option, a missing argument, a file
    that does not exist (what `qualify candidate --help` once named)."""
    try:  # typer >= 0.25 carries its own copy of click
        from typer._click.exceptions import UsageError
    except ImportError:  # pragma: no cover
        from click.exceptions import UsageError

    root = sandbox(tmp_path, narrowed=False)
    monkeypatch.chdir(root)
    for bad in (["qualify", "sbatch", MATRIX, "--cluster", "sbatch/clusters/local.yaml", "--cases-glob", "x"],
                ["qualify", "diagnose", RUN], ["qualify", "rounds", MATRIX, "--rounds", "1"]):
        with pytest.raises(UsageError):
            parse(bad)
    assert inputs_missing(shlex.split("qualify candidate matrices/tiny-qwen3.yaml --acceptance "
                                      "manifests/tiny-qwen3/acceptance.json"), root) == \
           ["manifests/tiny-qwen3/acceptance.json"]


@pytest.mark.vllm
@pytest.mark.engines
@pytest.mark.slow
@pytest.mark.parametrize("example", RUNS, ids=str)
def test_every_example_runs(example, prepared, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = PREPARE.get(example)
    if before:
        first = run_example(before, prepared, tmp_path)
        assert first.exit_code == 0, first.output
        result = CliRunner().invoke(app, words_of(example, tmp_path)[1:])
    else:
        result = run_example(example, prepared, tmp_path)
    assert result.exit_code == 0, f"{example} ({EXAMPLES[example]}) exit {result.exit_code}:\n{result.output[-3000:]}"


# --- README's synopses ---------------------------------------------------------------------------------------------

def synopsis_problems(form: str) -> list[str]:
    """What a synopsis or mention says that the CLI does not: an unknown command, an option the command lacks (or
    hides), more or fewer positional arguments than it takes."""
    words = shlex.split(form.replace("[", " ").replace("]", " "))
    cmds, i = [get_command(app)], 1
    while i < len(words) and all(hasattr(c, "commands") for c in cmds):
        names = words[i].split("|")
        unknown = [n for c in cmds for n in names if n not in c.commands]
        if unknown:
            return [f"no command {' '.join(words[:i])} {unknown[0]}"]
        cmds, i = [c.commands[n] for c in cmds for n in names], i + 1
    problems = []
    for cmd in cmds:
        problems += option_problems(cmd, words[i:], form)
    return problems


def option_problems(cmd, rest: list[str], form: str) -> list[str]:
    options = {o: p for p in cmd.params if p.param_type_name == "option" for o in p.opts}
    arguments = [p for p in cmd.params if p.param_type_name == "argument"]
    problems, positional, j = [], [], 0
    while j < len(rest):
        word = rest[j]
        if word.startswith("--"):
            option = options.get(word)
            if option is None or option.hidden:
                problems.append(f"{form}: {cmd.name} has no option {word}")
            elif not option.is_flag and j + 1 < len(rest) and not rest[j + 1].startswith("--"):
                j += 1  # its value
        else:
            positional.append(word)
        j += 1
    if positional:  # a mention names options only; a synopsis gives the arguments too
        most = float("inf") if any(a.nargs == -1 for a in arguments) else len(arguments)
        least = sum(a.required for a in arguments)
        if not least <= len(positional) <= most:
            problems.append(f"{form}: {len(positional)} positional arguments, {cmd.name} takes {least} to {most} "
                            f"({', '.join(a.name for a in arguments)})")
    return problems


def readme_forms() -> list[str]:
    _, spans = readme_commands(README.read_text())
    return sorted({s for s in spans if s.startswith("qualify ") and (is_synopsis(s) or is_mention(s))})


@pytest.mark.parametrize("form", readme_forms(), ids=str)
def test_readme_synopses_say_what_the_cli_takes(form):
    assert not synopsis_problems(form)


def test_the_synopsis_check_catches_a_wrong_form():
    assert synopsis_problems("qualify freeze --run RUN")  # freeze takes the run as its first argument
    assert synopsis_problems("qualify report RUN [--run RUN]")
    assert synopsis_problems("qualify reference MATRIX [--out RUN]")  # the hidden legacy spelling
    assert synopsis_problems("qualify matrices list|check")
    assert synopsis_problems("qualify diagnose RUN EXTRA --case NAME")
    assert not synopsis_problems("qualify diagnose RUN --case NAME [--out FILE] [--format text|json]")


def test_readme_covers_every_command():
    forms = " ".join(readme_forms())
    for path, cmd in commands():
        if len(path) == 2:
            assert f"{' '.join(path)} " in forms, f"README has no synopsis of {' '.join(path)}"


# --- README's verbs table: a row per command, every visible option in its synopsis ---------------------------------

def verbs_rows(text: str) -> dict[tuple[str, ...], str]:
    """{command path: synopsis} of the verbs table (the code span that opens a row's first cell)."""
    table = text.split("\n## The verbs\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for form in re.findall(r"^\| `(qualify [^`]+)` \|", table, flags=re.MULTILINE):
        form = form.replace("\\|", "|")
        words, cmd, path = form.split(), get_command(app), ["qualify"]
        for word in words[1:]:
            if not hasattr(cmd, "commands") or word not in cmd.commands:
                break
            cmd, path = cmd.commands[word], [*path, word]
        rows[tuple(path)] = form
    return rows


def table_gaps(text: str) -> list[str]:
    """Every command without a row of its own in the verbs table, and every visible option its row's synopsis does not
    name (a group such as `qualify matrices` is covered by a row for each of its commands)."""
    rows, gaps = verbs_rows(text), []
    for path, cmd in commands():
        if hasattr(cmd, "commands"):
            continue
        form = rows.get(path)
        if form is None:
            gaps.append(f"no row for {' '.join(path)}")
            continue
        named = set(re.findall(r"--[\w-]+", form))
        gaps += [f"{' '.join(path)}: the synopsis lacks {p.opts[0]}" for p in cmd.params
                 if p.param_type_name == "option" and not p.hidden and not set(p.opts) & named]
    return gaps


def test_every_command_has_a_row_whose_synopsis_names_every_visible_option():
    assert table_gaps(README.read_text()) == []
    top = {path[1] for path in verbs_rows(README.read_text())}
    assert top == set(get_command(app).commands), top ^ set(get_command(app).commands)


def long_cells(text: str, most: int = 2, words: int = 40) -> list[str]:
    """Rows of the verbs table whose description (the second cell) says more than `most` sentences or `words` words:
    the table is a summary; the detail lives in the sections it names and in matrices/README.md."""
    table = text.split("\n## The verbs\n", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in table.splitlines():
        m = re.match(r"^\| `(qualify [^`]+)` \| (.*) \|$", line)
        if m:
            prose = re.sub(r"`[^`]*`", "X", m.group(2))
            sentences = [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", prose.strip()) if s]
            if len(sentences) > most or len(m.group(2).split()) > words:
                out.append(f"{m.group(1).split(' [')[0]}: {len(sentences)} sentences, {len(m.group(2).split())} words")
    return out


def test_every_verbs_cell_is_one_or_two_sentences():
    assert long_cells(README.read_text()) == []


def test_the_cell_check_counts_sentences():
    row = "| `qualify freeze RUN` | Freezes the bounds. It never changes an acceptance. It resumes (`freeze.require`). |"
    text = f"\n## The verbs\n\n| command | what it does |\n| --- | --- |\n{row}\n\n## Next\n"
    assert long_cells(text) == ["qualify freeze RUN: 3 sentences, 11 words"]
    assert long_cells(text.replace(" It resumes (`freeze.require`).", "")) == []
    assert long_cells(text.replace("Freezes the bounds.", "Freezes " + "the bounds " * 20 + "."), most=3) == \
        ["qualify freeze RUN: 3 sentences, 50 words"]


def test_the_table_check_catches_a_missing_option_and_a_missing_row():
    text = README.read_text()
    freeze = next(f for p, f in verbs_rows(text).items() if p == ("qualify", "freeze"))
    no_format = text.replace(freeze.replace("|", "\\|"), "qualify freeze RUN [--name N]")
    assert table_gaps(no_format) == ["qualify freeze: the synopsis lacks --format"]
    no_row = "\n".join(line for line in text.splitlines() if not line.startswith("| `qualify diagnose "))
    assert table_gaps(no_row) == ["no row for qualify diagnose"]
    no_list = "\n".join(line for line in text.splitlines() if not line.startswith("| `qualify matrices list"))
    assert table_gaps(no_list) == ["no row for qualify matrices list"]
