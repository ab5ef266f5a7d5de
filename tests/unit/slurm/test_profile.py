"""Cluster profile rules: every string is one line of printable ASCII (nothing can inject a line into a rendered
script), Slurm names are Slurm names, numbers are finite; the shipped profiles still load and render."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from qualify.cli.app import app
from qualify.errors import MatrixError
from qualify.slurm.profile import load_profile

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = sorted((ROOT / "sbatch/clusters").glob("*.yaml"))
H100 = yaml.safe_load((ROOT / "sbatch/clusters/h100x4.yaml").read_text())
INJECT = "x\n#SBATCH --wrap=rm -rf ~"


def write_profile(tmp_path: Path, data: dict, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def profile_error(tmp_path: Path, data: dict, name: str = "p.yaml") -> str:
    path = write_profile(tmp_path, data, name)
    with pytest.raises(MatrixError) as info:
        load_profile(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_profiles_load(path):
    assert load_profile(path).name == path.stem


# (changes to the H100 profile, the key the message must name)
INJECTIONS = [
    ({"partition": INJECT}, "partition"),
    ({"account": INJECT}, "account"),
    ({"qos": INJECT}, "qos"),
    ({"gpu_type": INJECT}, "gpu_type"),
    ({"description": "two\nlines"}, "description"),
    ({"mem": "1000G\n"}, "mem"),
    ({"qualify": "qualify\nrm -rf /"}, "qualify"),
    ({"templates": "t\nx"}, "templates"),
    ({"srun_args": ["--exclusive", INJECT]}, "srun_args[1]"),
    ({"sbatch_args": [INJECT]}, "sbatch_args[0]"),
    ({"exports": {**H100["exports"], "NCCL_DEBUG": "WARN\n#SBATCH --wrap=x"}}, "exports.NCCL_DEBUG"),
    ({"exports": {**H100["exports"], "X\n#SBATCH --wrap=y": "1"}}, "exports key: 'X\\n#SBATCH"),
    ({"environment": {"modules": ["cuda\nmodule load evil"]}}, "environment: modules[0]"),
    ({"environment": {"venv": ".venv\nsource /tmp/x"}}, "environment: venv"),
    ({"environment": {"setup": ["ok", "a\rb"]}}, "environment: setup[1]"),
    ({"time": {"reference": "01:00:00\n#SBATCH --wrap=x"}}, "time.reference"),
    ({"time": {"reference": "01:00:00\n"}}, "time.reference"),
    ({"partition": "h100\x00"}, "partition"),
]


@pytest.mark.parametrize("changes, key", INJECTIONS, ids=[k.split(":")[0] for _, k in INJECTIONS])
def test_a_line_break_cannot_reach_a_script(tmp_path, changes, key):
    message = profile_error(tmp_path, {**H100, **changes})
    assert key in message, message
    assert "one line of printable ASCII" in message or "is not" in message, message


@pytest.mark.parametrize("key", ["partition", "account", "qos", "gpu_type", "description"])
def test_non_ascii_is_refused(tmp_path, key):
    assert key in profile_error(tmp_path, {**H100, key: "gp\u00fc"})


def test_a_non_ascii_file_name_is_refused(tmp_path):
    assert "name: 'cl\\xfcster' must be one line of printable ASCII" in profile_error(tmp_path, H100, "cl\u00fcster.yaml")


@pytest.mark.parametrize("key, value", [("partition", "h100 gpu"), ("account", "a;b"), ("qos", "-x"),
                                        ("gpu_type", "h100:4")])
def test_slurm_names(tmp_path, key, value):
    assert f"{key} {value!r} is not a Slurm name" in profile_error(tmp_path, {**H100, key: value})


def test_slurm_names_that_are_fine(tmp_path):
    p = load_profile(write_profile(tmp_path, {**H100, "partition": "gpu,gpu-long", "account": "rl.team_1",
                                              "gpu_type": "nvidia_h100_80gb"}))
    assert p.partition == "gpu,gpu-long"


def test_sbatch_args_must_be_options(tmp_path):
    message = profile_error(tmp_path, {**H100, "sbatch_args": ["--exclusive", "exclusive"]})
    assert "sbatch_args ['exclusive'] must be sbatch options" in message


@pytest.mark.parametrize("value", [math.inf, math.nan, 0.0, -1.0])
def test_poll_seconds_is_finite_and_positive(tmp_path, value):
    assert "poll_seconds must be a finite number > 0" in profile_error(tmp_path, {**H100, "poll_seconds": value})


@pytest.mark.parametrize("key, value", [("gpus_per_node", -1), ("cpus_per_node", 0)])
def test_node_shape(tmp_path, key, value):
    assert "gpus_per_node must be >= 0 and cpus_per_node >= 1" in profile_error(tmp_path, {**H100, key: value})


def test_sbatch_refuses_an_injecting_profile_before_writing_a_script(tmp_path):
    path = write_profile(tmp_path, {**H100, "partition": INJECT})
    out = tmp_path / "scripts"
    result = CliRunner().invoke(app, ["sbatch", str(ROOT / "matrices/qwen3-8b.yaml"), "--cluster", str(path),
                                      "--out", str(out), "--run", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "partition" in result.stderr
    assert not out.exists()
