"""Rendering of the sbatch chain: committed scripts are fresh, output is reproducible, GPUs follow each job's use."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from qualify.errors import MatrixError, SlurmError
from qualify.matrix import load_matrix
from qualify.slurm.profile import load_profile
from qualify.slurm.render import case_gpus, render_chain, stale_scripts, write_chain

ROOT = Path(__file__).resolve().parents[3]
GPU_PROFILES = ("b200x4", "h100x4")


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    # Scripts name the matrix and profile as given; the committed ones were rendered from the repo root.
    monkeypatch.chdir(ROOT)


def render(profile: str = "h100x4", matrix: str = "matrices/qwen3-8b.yaml", **kw):
    kw.setdefault("run", Path("runs") / load_matrix(matrix).name)
    kw.setdefault("out", Path("unused"))
    path = profile if profile.endswith(".yaml") else f"sbatch/clusters/{profile}.yaml"
    return render_chain(Path(matrix), Path(path), **kw)


def directives(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=?(\S*)$", text, re.MULTILINE))


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_committed_rendered_scripts_are_fresh(profile):
    directory = Path("sbatch/rendered/qwen3-8b") / profile
    stale = stale_scripts(render(profile, out=directory), directory)
    assert not stale, (f"stale: {stale}; regenerate with  qualify sbatch matrices/qwen3-8b.yaml "
                       f"--cluster sbatch/clusters/{profile}.yaml --out {directory}")


def test_stale_check_finds_edited_missing_and_extra_scripts(tmp_path):
    copy = tmp_path / "h100x4"
    shutil.copytree(ROOT / "sbatch/rendered/qwen3-8b/h100x4", copy)
    chain = render(out=copy)
    assert stale_scripts(chain, copy) == []
    (copy / "2-freeze.sbatch").write_text((copy / "2-freeze.sbatch").read_text() + "# edit\n")
    (copy / "1-reference.sbatch").unlink()
    (copy / "9-old.sbatch").write_text("#!/bin/bash\n")
    assert stale_scripts(chain, copy) == ["1-reference.sbatch", "2-freeze.sbatch", "9-old.sbatch"]


def test_rendering_is_reproducible_and_free_of_machine_details(tmp_path):
    first = render("b200x4", out=tmp_path / "a")
    second = render("b200x4", out=tmp_path / "b")
    assert [(j.file, j.text) for j in first.jobs] == [(j.file, j.text) for j in second.jobs]
    for job in first.jobs:
        assert str(ROOT) not in job.text and str(tmp_path) not in job.text
        assert job.text.isascii() and job.text.endswith("\n")


def test_write_chain_replaces_an_older_rendering(tmp_path):
    (tmp_path / "9-candidate-9gpu.sbatch").write_text("old")
    (tmp_path / "notes.txt").write_text("kept")
    paths = write_chain(render(out=tmp_path))
    assert sorted(p.name for p in tmp_path.glob("*.sbatch")) == sorted(p.name for p in paths)
    assert (tmp_path / "notes.txt").read_text() == "kept"


def test_every_rendered_script_is_valid_bash(tmp_path):
    for profile in (*GPU_PROFILES, "local"):
        for job in render(profile, matrix="matrices/tiny-qwen3.yaml" if profile == "local" else
                          "matrices/qwen3-8b.yaml").jobs:
            path = tmp_path / f"{profile}-{job.file}"
            path.write_text(job.text)
            proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
            assert proc.returncode == 0, f"{profile} {job.file}: {proc.stderr}"


def test_chain_order_dependencies_and_requeue():
    chain = render()
    assert [(j.file, j.after) for j in chain.jobs] == [
        ("1-reference.sbatch", ()), ("2-freeze.sbatch", ("reference",)),
        ("3-candidate-1gpu.sbatch", ("freeze",)), ("4-candidate-2gpu.sbatch", ("freeze",)),
        ("5-verdict.sbatch", ("candidate-1gpu", "candidate-2gpu")),
        ("6-rounds-dedicated.sbatch", ("freeze",)), ("7-rounds-shared.sbatch", ("rounds-dedicated",))]
    for job in chain.jobs:
        d = directives(job.text)
        assert "requeue" in d and d["open-mode"] == "append"
        assert d["output"] == "runs/qwen3-8b/slurm/logs/%x-" + ("%A_%a" if job.cases else "%j") + ".out"
        assert "srun --nodes=1 --ntasks=1" in job.text
        assert "export CUBLAS_WORKSPACE_CONFIG=:4096:8" in job.text
        # exports come before the environment activation and before the first process
        assert job.text.index("export CUBLAS_WORKSPACE_CONFIG") < job.text.index("module load")
        assert job.text.index("module load") < job.text.index("srun ")


def gres_count(job) -> int:
    d = directives(job.text)
    count = int(d["gres"].split(":")[-1])
    assert d["gres"] == f"gpu:h100:{count}" and job.need.gpus == count
    assert d["cpus-per-task"] == str(64 * count // 4) and d["mem"] == f"{1000 * 1024 * count // 4}M"
    return count


@pytest.mark.parametrize("topology", ["dedicated", "shared"])
def test_candidate_jobs_ask_for_tp_x_dp_gpus_whatever_the_topology(topology):
    # No vLLM runs in a candidate job: a TP1 case asks one GPU, a TP2 case two, under either topology.
    chain = render(topology=topology)
    seen = {name: gres_count(job) for job in chain.jobs if job.stage == "candidate" for name in job.cases}
    assert seen == {c.name: c.tp for c in chain.matrix.cases()}
    assert [j.key for j in chain.jobs if j.stage == "candidate"] == ["candidate-1gpu", "candidate-2gpu"]


def test_case_gpus_are_tp_times_dp():
    assert case_gpus(SimpleNamespace(tp=2)) == 2  # a matrix without data parallelism: dp = 1
    assert case_gpus(SimpleNamespace(tp=2, dp=2)) == 4


def test_a_rounds_job_per_topology_asks_for_vllm_and_trainer_gpus():
    # qwen3-8b: vLLM TP2, trainer TP2 (the largest candidates.tp). dedicated: 2 + 2 GPUs; shared: colocated on 2.
    chain = render()
    rounds = [j for j in chain.jobs if j.stage == "rounds"]
    assert [(j.key, gres_count(j)) for j in rounds] == [("rounds-dedicated", 4), ("rounds-shared", 2)]
    for job in rounds:
        assert "qualify rounds matrices/qwen3-8b.yaml --run runs/qwen3-8b --vllm-tp 2 --train-tp 2" in job.text
        assert directives(job.text)["time"] == chain.profile.time.reference
        assert job.key not in chain.job("verdict").after
    only = render(topology="shared")
    assert [(j.key, j.after, gres_count(j)) for j in only.jobs if j.stage == "rounds"] == [
        ("rounds-shared", ("freeze",), 2)]


def test_job_kinds_ask_for_the_gpus_they_use():
    chain = render()
    gpus = {j.key: j.need.gpus for j in chain.jobs}
    assert gpus == {"reference": 2, "freeze": 0, "candidate-1gpu": 1, "candidate-2gpu": 2, "verdict": 0,
                    "rounds-dedicated": 4, "rounds-shared": 2}


def test_reference_gets_the_vllm_tp_gpus_and_freeze_none():
    chain = render("b200x4")
    assert directives(chain.job("reference").text)["gres"] == "gpu:b200:2"
    assert "gres" not in directives(chain.job("freeze").text)
    assert "gres" not in directives(chain.job("verdict").text)


def test_local_profile_gives_one_cpu_per_process_and_no_gpus():
    chain = render("local", matrix="matrices/tiny-qwen3.yaml")
    for job in chain.jobs:
        assert "gres" not in directives(job.text)
    cpus = {j.key: int(directives(j.text)["cpus-per-task"]) for j in chain.jobs}
    assert cpus == {"reference": 2, "freeze": 1, "candidate-1cpu": 1, "candidate-2cpu": 2, "verdict": 1}  # no rounds
    tp = {c.name: c.tp for c in chain.matrix.cases()}
    for job in (j for j in chain.jobs if j.stage == "candidate"):
        assert {tp[name] for name in job.cases} == {job.need.cpus}


def test_array_index_selects_its_case_in_bash(tmp_path):
    job = render().job("candidate-2gpu")
    assert directives(job.text)["array"] == f"0-{len(job.cases) - 1}%8"
    block = re.search(r"^cases=\(\n.*?^\)$", job.text, re.MULTILINE | re.DOTALL).group(0)
    for index, name in enumerate(job.cases):
        script = f"{block}\nSLURM_ARRAY_TASK_ID={index}\ncase=${{cases[$SLURM_ARRAY_TASK_ID]}}\necho $case\n"
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
        assert out.strip() == name and "-tp2-" in name


def test_cases_glob_selects_cases_and_the_verdict_covers_them():
    chain = render("local", matrix="matrices/tiny-qwen3.yaml", cases="torch-tp-fp32-*")
    arrays = [j for j in chain.jobs if j.stage == "candidate"]
    assert [c for j in arrays for c in j.cases] == [
        "torch-tp-fp32-tp1-actor", "torch-tp-fp32-tp1-critic", "torch-tp-fp32-tp2-actor", "torch-tp-fp32-tp2-critic"]
    assert "--only 'torch-tp-fp32-*'" in chain.job("verdict").text
    with pytest.raises(SlurmError, match="matches no case"):
        render("local", matrix="matrices/tiny-qwen3.yaml", cases="megatron-*")


def test_matrix_digest_guards_the_rendered_cases(tmp_path):
    text = render().job("freeze").text
    digest = re.search(r"!= ([0-9a-f]{64}) \]; then", text).group(1)
    assert digest == hashlib.sha256((ROOT / "matrices/qwen3-8b.yaml").read_bytes()).hexdigest()


def test_a_job_larger_than_a_node_is_refused(tmp_path):
    data = yaml.safe_load((ROOT / "matrices/qwen3-8b.yaml").read_text())
    data["candidates"]["tp"] = [1, 8]
    matrix = tmp_path / "big.yaml"
    matrix.write_text(yaml.safe_dump(data))
    with pytest.raises(SlurmError, match=r"case megatron-fp32-tp8-actor needs 8 GPUs; a node of .* has 4"):
        render(matrix=str(matrix), run=Path("runs/x"))
    data["candidates"]["tp"] = [1, 4]
    matrix.write_text(yaml.safe_dump(data))
    with pytest.raises(SlurmError, match=r"rounds \(dedicated: vLLM TP2, trainer TP4\) needs 6 GPUs; a node of .* has 4"):
        render(matrix=str(matrix), run=Path("runs/x"))
    render(matrix=str(matrix), run=Path("runs/x"), topology="shared")  # TP4 trainer and TP2 vLLM colocated on 4


def test_unknown_topology_and_unquotable_paths_are_refused():
    with pytest.raises(SlurmError, match="topology 'ring' is not in"):
        render(topology="ring")
    with pytest.raises(SlurmError, match="needs shell quoting"):
        render(run=Path("runs/my run"))


def test_a_template_slot_without_a_value_is_named(tmp_path):
    templates = tmp_path / "templates"
    shutil.copytree(ROOT / "sbatch/templates", templates)
    (templates / "freeze.sh").write_text("{{ header }}\n{{ nodes }}\n")
    profile = yaml.safe_load((ROOT / "sbatch/clusters/local.yaml").read_text())
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump({**profile, "templates": "templates"}))
    with pytest.raises(SlurmError, match=r"freeze.sh: unknown slots \['nodes'\]"):
        render(str(path), matrix="matrices/tiny-qwen3.yaml")


def write_profile(tmp_path: Path, **changes) -> Path:
    data = {**yaml.safe_load((ROOT / "sbatch/clusters/h100x4.yaml").read_text()), **changes}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_profiles_load_with_their_file_stem_as_name():
    for name in (*GPU_PROFILES, "local"):
        profile = load_profile(ROOT / f"sbatch/clusters/{name}.yaml")
        assert profile.name == name
    assert load_profile(ROOT / "sbatch/clusters/local.yaml").gpus_per_node == 0


@pytest.mark.parametrize(("changes", "message"), [
    ({"gpus": 4}, r"p.yaml: unknown key 'gpus'"),
    ({"time": {"refrence": "01:00:00"}}, r"p.yaml: unknown key 'time.refrence'"),
    ({"time": {"reference": "1h"}}, r"time.reference '1h' is not"),
    ({"mem": "lots"}, r"mem 'lots' is not a size"),
    ({"exports": {"NCCL-ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}}, r"not environment variable names"),
    ({"exports": {"NCCL_ALGO": "Ring"}}, r"must export CUBLAS_WORKSPACE_CONFIG"),
    ({"exports": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_IB_DISABLE": 1}}, r"exports.NCCL_IB_DISABLE: expected str"),
    ({"name": "x"}, r"key 'name' is set by the loader"),
    ({"cpus_per_node": 0}, r"cpus_per_node >= 1"),
])
def test_bad_profiles_are_refused_naming_the_key_and_file(tmp_path, changes, message):
    with pytest.raises(MatrixError, match=message):
        load_profile(write_profile(tmp_path, **changes))


def test_a_missing_profile_is_an_input_error(tmp_path):
    with pytest.raises(MatrixError, match="cluster profile not found"):
        load_profile(tmp_path / "none.yaml")


def test_a_profile_path_with_a_newline_cannot_add_a_directive(tmp_path):
    """The profile's path lands in each script's header comment: a directory name holding a newline and
    '#SBATCH --wrap=...' must stay inside the comment, escaped, and the directives be the profile's alone."""
    evil = tmp_path / "clusters\n#SBATCH --wrap=rm -rf ~\n"
    evil.mkdir()
    shutil.copy(ROOT / "sbatch/clusters/h100x4.yaml", evil / "h100x4.yaml")
    chain = render(str(evil / "h100x4.yaml"))
    for job in chain.jobs:
        assert "--wrap" not in directives(job.text) and "\n#SBATCH --wrap" not in job.text
        [comment] = [line for line in job.text.splitlines() if line.startswith("# Rendered by")]
        assert "\\n#SBATCH --wrap=rm -rf ~\\n" in comment
    plain = render("h100x4")
    assert "from matrices/qwen3-8b.yaml and sbatch/clusters/h100x4.yaml:" in plain.jobs[0].text  # plain paths as they are


def test_a_profile_in_a_non_ascii_directory_renders_and_is_written(tmp_path):
    """A profile under a directory named in any script (no traceback): the header comment holds its path escaped
    to ASCII, and the scripts are written and readable as ASCII."""
    from qualify.slurm.render import write_chain

    where = tmp_path / "grappes-\u00e9t\u00e9 \u2603"
    where.mkdir()
    shutil.copy(ROOT / "sbatch/clusters/h100x4.yaml", where / "h100x4.yaml")
    chain = render(str(where / "h100x4.yaml"), out=tmp_path / "out")
    [comment] = [line for line in chain.jobs[0].text.splitlines() if line.startswith("# Rendered by")]
    assert "grappes-\\xe9t\\xe9 \\u2603" in comment
    for path in write_chain(chain):
        path.read_text(encoding="ascii")


def test_out_naming_a_file_is_refused(tmp_path):
    from qualify.slurm.render import write_chain

    file = tmp_path / "scripts"
    file.write_text("x")
    with pytest.raises(SlurmError, match="is a file: the scripts are written into a directory"):
        write_chain(render("h100x4", out=file))
