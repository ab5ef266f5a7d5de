"""qualify.tensor_codec.residual: an int32 difference kept in its smallest form and read back exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qualify.tensor_codec.residual import residual_from, residual_parts


@pytest.mark.parametrize("scale,expected", [(0, "zero"), (1, "sparse"), (100, "int8"), (20000, "int16"),
                                            (2 ** 30, "int32")])
def test_each_residual_form_reads_back_exactly(scale, expected):
    rng = np.random.default_rng(3)
    n = 4096
    r = np.zeros(n, np.int32)
    if expected == "sparse":
        r[rng.choice(n, 20, replace=False)] = rng.integers(-2 ** 31, 2 ** 31 - 1, 20, dtype=np.int32)
    elif scale:
        r = rng.integers(-scale, scale, n, dtype=np.int32)
        r[[5, 77]] = [2 ** 31 - 1, -2 ** 31]  # outliers: kept apart
    parts, form = residual_parts(r, "t")
    assert form == expected
    assert np.array_equal(residual_from(parts.get, "t", form, n).numpy(), r)
    # the parts are the ones an independent numpy coding of the same rule keeps, byte for byte (and from a tensor)
    theirs, their_form = numpy_residual_parts(r, "t")
    assert their_form == form and sorted(theirs) == sorted(parts)
    for k, v in theirs.items():
        assert parts[k].numpy().dtype == v.dtype and parts[k].numpy().tobytes() == v.tobytes(), k
    again, _ = residual_parts(torch.from_numpy(r), "t")
    assert all(torch.equal(again[k], parts[k]) for k in parts)


def numpy_residual_parts(r, name):
    """The residual forms' rule written in numpy (the first version of residual_parts)."""
    idx = np.flatnonzero(r)
    if not idx.size:
        return {}, "zero"
    itype, isize = np.int32, 4
    sizes = {"sparse": idx.size * (isize + 4), "int32": 4 * r.size}
    outside = {}
    if sizes["sparse"] > r.size:
        for form, dt in (("int8", np.int8), ("int16", np.int16)):
            info = np.iinfo(dt)
            outside[form] = idx[(r[idx] < info.min) | (r[idx] > info.max)]
            sizes[form] = r.size * info.bits // 8 + outside[form].size * (isize + 4)
    form = min(sizes, key=lambda f: (sizes[f], f != "int32"))
    if form == "int32":
        return {f"{name}#r": r.copy()}, form
    if form == "sparse":
        return {f"{name}#i": idx.astype(itype), f"{name}#v": r[idx].copy()}, form
    dense = r.copy()
    dense[outside[form]] = 0
    parts = {f"{name}#r": dense.astype(np.int8 if form == "int8" else np.int16)}
    if outside[form].size:
        parts |= {f"{name}#i": outside[form].astype(itype), f"{name}#v": r[outside[form]].copy()}
    return parts, form
