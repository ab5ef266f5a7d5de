"""Where every artifact of a run lives. One place, so every stage agrees.

runs/<matrix name>/
  reference/                     the evidence root that acceptance.json covers
    models/<role>/               tiny family made from the seed (HF safetensors + config)
    rollout/tp<N>/rollout.safetensors, rollout.json
    targets/targets.safetensors, targets.json
    scores/<precision>-<control>/<role>/{outputs,grads,updates,moments}.safetensors, meta.json
    matrix/matrix.json           the matrix snapshot taken when the reference started (sealed)
    reference.json               summary: rollout digest, controls, versions, platform
    replays/<precision>-r0-<key>/<role>/  r0 replayed on a control's clip decisions (before freeze)
  acceptance/acceptance.json, acceptance/bounds/<role>-<family>.json
  acceptance/layers/<role>.json  per-layer bounds for qualify diagnose
  candidates/<case>/...          per-case evidence; <case>.work/ its spec, launch log and scratch
  candidates/replays/...         r0 replayed on a case's clip decisions (sealed before judging)
  candidates/verdict.json        the verdict (verdict-<selection>.json for --only)
  rounds/vllm-tp<N>/verdict.json  one sealed rounds run per vLLM TP degree
  diagnose/<case>/, <case>.json  a case's layer outputs and its diagnosis
  replay/replays/...             this platform's reference on a committed run's decisions (qualify.replay)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RunLayout:
    """Paths of one run directory."""

    root: Path

    @property
    def models(self) -> Path:
        return self.reference / "models"

    def model(self, role: str) -> Path:
        return self.models / role

    @property
    def reference(self) -> Path:
        return self.root / "reference"

    def rollout(self, tp: int) -> Path:
        return self.reference / "rollout" / f"tp{tp}"

    @property
    def freeze_work(self) -> Path:
        """acceptance.work/: the bound files an interrupted freeze had finished, kept for the next freeze to resume
        from (qualify.freeze); removed once the acceptance is written."""
        return work_dir(self.acceptance_dir)

    @property
    def scratch_replays(self) -> Path:
        """Where a control kept as a summary has r0 replayed on its decisions, used and removed while it is scored
        (qualify.reference.summary): beside the reference, never inside the evidence an acceptance covers."""
        return work_dir(self.reference) / REPLAYS

    @property
    def targets(self) -> Path:
        return self.reference / "targets"

    def scores(self, precision: str, control: str, role: str) -> Path:
        return self.reference / "scores" / f"{precision}-{control}" / role

    @property
    def reference_summary(self) -> Path:
        return self.reference / "reference.json"

    @property
    def matrix_snapshot(self) -> Path:
        """reference/matrix/: the matrix as the reference stage first saw it (sealed; freeze takes the rule from it)."""
        return self.reference / "matrix"

    @property
    def acceptance_dir(self) -> Path:
        return self.root / "acceptance"

    @property
    def acceptance(self) -> Path:
        return self.acceptance_dir / "acceptance.json"

    @property
    def bounds(self) -> Path:
        return self.acceptance_dir / "bounds"

    @property
    def candidates(self) -> Path:
        return self.root / "candidates"

    def case(self, name: str) -> Path:
        return self.candidates / name

    def is_case_dir(self, path: Path) -> bool:
        """A case's evidence directory under candidates/ (not its .work/, nor the replays)."""
        return path.is_dir() and not path.name.endswith(WORK_SUFFIX) and path.name != REPLAYS

    @property
    def verdict(self) -> Path:
        return self.candidates / "verdict.json"

    def selection_verdict(self, label: str) -> Path:
        """The verdict of a --only selection (label: qualify.candidate.stage.selection_name of its glob)."""
        return self.candidates / f"verdict-{label}.json"

    @property
    def layer_bounds(self) -> Path:
        return self.acceptance_dir / "layers"

    @property
    def diagnose(self) -> Path:
        """diagnose/: <case>/ (a candidate's sealed activations) and <case>.json (its diagnosis)."""
        return self.root / "diagnose"

    @property
    def platform_replay(self) -> Path:
        """replay/: this platform's reference replayed on a committed run's decisions (qualify.replay)."""
        return self.root / "replay"

    @property
    def rounds(self) -> Path:
        return self.root / "rounds"

    def rounds_dir(self, tp: int) -> Path:
        """One sealed rounds run per vLLM TP degree, with its verdict.json."""
        return self.rounds / f"vllm-tp{tp}"


WORK_SUFFIX = ".work"
REPLAYS = "replays"
LAUNCH_LOG = "launch.log"
SPEC_FILE = "spec.json"


def work_dir(evidence_dir: Path | str) -> Path:
    """<dir>.work/ beside a sealed evidence directory, outside it: a case's spec, launch log and engine scratch (the
    same for diagnose's and rounds' engine runs)."""
    return Path(str(evidence_dir) + WORK_SUFFIX)


def launch_log(evidence_dir: Path | str) -> Path:
    """The launch log of the engine run that writes evidence_dir."""
    return work_dir(evidence_dir) / LAUNCH_LOG


def spec_file(evidence_dir: Path | str) -> Path:
    """The spec of the engine run that writes evidence_dir."""
    return work_dir(evidence_dir) / SPEC_FILE


def replays_dir(root: Path | str) -> Path:
    """<root>/replays/: r0 runs replayed on other clip decisions (qualify.reference.forced), under the reference
    (the controls', before freeze), the candidates (the cases') or a platform replay's directory."""
    return Path(root) / REPLAYS


def step_dir(step: int) -> str:
    """'step<k>': one optimizer step's evidence inside a role's directory."""
    return f"step{step}"


def rounds_case(tp: int) -> str:
    """The case name of a rounds run in its verdict rows: its directory's name under rounds/."""
    return f"rounds-vllm-tp{tp}"


def default_run_dir(matrix_name: str) -> Path:
    """runs/<matrix name> under the current directory."""
    return Path("runs") / matrix_name
