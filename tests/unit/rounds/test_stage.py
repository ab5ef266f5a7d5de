"""The rounds settings live in the matrix (rounds:); each command-line flag overrides one of them."""

from __future__ import annotations

from qualify.matrix import ROUNDS_PROBES, load_matrix
from qualify.rounds.stage import RoundsOptions, rounds_options
from tests.unit.matrix.test_loader import edited, setter, write


def test_the_matrix_section_sets_every_option(tmp_path):
    m = load_matrix(write(tmp_path, edited(setter("rounds", {"engine": "deepspeed", "rounds": 3, "vllm_tp": 2,
                                                              "train_tp": 2, "probes": ["stale"]}))))
    assert rounds_options(m) == RoundsOptions(engine="deepspeed", rounds=3, vllm_tp=2, train_tp=2, probes=("stale",))


def test_flags_override_one_setting_each_and_keep_the_rest(tmp_path):
    m = load_matrix(write(tmp_path, edited(setter("rounds", {"engine": "deepspeed", "rounds": 3}))))
    assert rounds_options(m, vllm_tp=1, probes=()) == RoundsOptions(engine="deepspeed", rounds=3, vllm_tp=1,
                                                                    train_tp=1, probes=())
    assert rounds_options(m, engine="torch-tp").engine == "torch-tp"


def test_a_matrix_without_the_section_gets_the_defaults(tmp_path):
    m = load_matrix(write(tmp_path, edited(lambda d: d.pop("rounds", None))))
    assert rounds_options(m) == RoundsOptions(engine="torch-tp", rounds=2, vllm_tp=None, train_tp=1,
                                              probes=ROUNDS_PROBES)


def test_a_bad_override_is_a_one_line_input_error(tmp_path):
    import pytest

    from qualify.errors import QualifyError

    m = load_matrix(write(tmp_path, edited(lambda d: None)))
    with pytest.raises(QualifyError, match="rounds: rounds must be >= 2"):
        rounds_options(m, rounds=1)
    with pytest.raises(QualifyError, match=r"rounds: probes: unknown \['nosuch'\]"):
        rounds_options(m, probes=("nosuch",))


def test_the_training_precision_is_a_setting_and_a_flag(tmp_path):
    """rounds.train_precision (fp32 by default): the exact tier's claim after a weight sync is made in the rollout's
    precision, so a bf16 rollout's trainer trains in bf16; anything but fp32 or bf16 is refused in one line."""
    import pytest

    from qualify.errors import QualifyError

    m = load_matrix(write(tmp_path, edited(setter("rounds", {"train_precision": "bf16"}))))
    assert rounds_options(m).train_precision == "bf16"
    assert rounds_options(m, train_precision="fp32").train_precision == "fp32"
    with pytest.raises(QualifyError, match="train_precision: 'fp16' is not one of fp32, bf16"):
        rounds_options(m, train_precision="fp16")
