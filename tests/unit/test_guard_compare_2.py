"""qualify.compare's StepFiles and StepStarts: what mutation testing (run J, at 1219bce) found unpinned.

The index bounds of both sequences (negative indices down to -len for StepFiles, len refused by StepStarts), the
index an IndexError names, and slices of StepStarts. Expected values are the eagerly loaded steps and their starts
(load_steps, and the starts computed eagerly in tests/unit/_runs.eager_starts), which share none of the indexing code.
"""

from __future__ import annotations

import pytest
import torch

from qualify.compare import StepFiles, StepStarts, load_steps, params_before_steps
from tests.unit._runs import eager_starts, params, role_steps, write_steps


def _same_run(a, b) -> bool:
    return all(torch.equal(getattr(a, g)[n], t) for g in ("outputs", "grads", "updates", "moments")
               for n, t in getattr(b, g).items())


def test_step_files_take_every_negative_index_down_to_minus_len(tmp_path):
    write_steps(tmp_path, role_steps("actor", 0.0, 3))
    eager, lazy = load_steps(tmp_path), StepFiles(tmp_path)
    assert _same_run(lazy[-3], eager[0]) and _same_run(lazy[-1], eager[2])
    with pytest.raises(IndexError) as below:
        lazy[-4]
    assert below.value.args == (-4,)
    with pytest.raises(IndexError) as above:
        lazy[3]
    assert above.value.args == (3,)


def test_step_starts_refuse_len_and_slice_like_a_list(tmp_path):
    write_steps(tmp_path, role_steps("actor", 0.0, 3))
    lazy = params_before_steps(StepFiles(tmp_path), params())
    assert isinstance(lazy, StepStarts) and len(lazy) == 3
    eager = eager_starts(load_steps(tmp_path), params())
    with pytest.raises(IndexError) as at_len:
        lazy[3]
    assert at_len.value.args == (3,)
    with pytest.raises(IndexError) as negative:
        lazy[-1]
    assert negative.value.args == (-1,)
    for got, want in ((lazy[1:], eager[1:]), (lazy[:2], eager[:2]), (lazy[::2], eager[::2])):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.keys() == w.keys() and all(torch.equal(g[n], w[n]) for n in w)
    # the steps differ, so a slice that took the wrong starts would differ from the eager ones
    assert not torch.equal(eager[1]["w"], eager[2]["w"])


def test_step_starts_asked_out_of_order_are_the_eager_starts(tmp_path):
    write_steps(tmp_path, role_steps("actor", 0.0, 4))
    eager = eager_starts(load_steps(tmp_path), params())
    assert not any(torch.equal(eager[i]["w"], eager[j]["w"]) for i in range(4) for j in range(i))
    # a fresh sequence asked for its last start first (several steps advanced at once), then backwards, then the same
    # index twice
    lazy = params_before_steps(StepFiles(tmp_path), params())
    for k in (3, 1, 2, 2, 0, 3):
        got = lazy[k]
        assert got.keys() == eager[k].keys() and all(torch.equal(got[n], eager[k][n]) for n in eager[k]), k
