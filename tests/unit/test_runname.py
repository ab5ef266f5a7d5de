"""qualify.runname: a run's name parsed into (precision, control) and written back as it was."""

from __future__ import annotations

import pytest

from qualify.errors import QualifyError
from qualify.runname import RunName


@pytest.mark.parametrize("name", ["fp32-r0", "bf16-r1", "bf16-tp2_split", "fp32-repeat", "bf16-a-b"])
def test_a_name_parses_into_its_parts_and_back(name):
    run = RunName.parse(name)
    assert str(run) == name
    assert tuple(run) == tuple(name.split("-", 1))  # what the hand-written split gave
    assert RunName.parse(str(run)) == run


def test_the_parts_are_named_and_unpack_as_a_pair():
    run = RunName.parse("bf16-tp2_split")
    assert (run.precision, run.control) == ("bf16", "tp2_split")
    precision, control = run
    assert (precision, control) == ("bf16", "tp2_split")


@pytest.mark.parametrize("name", ["fp32", "", "-r0", "fp32-"])
def test_a_malformed_name_is_refused_with_a_clear_error(name):
    with pytest.raises(QualifyError, match=r"malformed run name .*expected '<precision>-<control>'"):
        RunName.parse(name)
