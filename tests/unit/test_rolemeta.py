"""qualify.rolemeta: a reference role directory's meta.json read back typed and given back key for key; what the
stages after the reference read of it (num_steps, coverage, evidence) refused when it is not what they read."""

from __future__ import annotations

import json

import pytest

from qualify.compare import is_lean, num_steps, read_role_meta
from qualify.errors import EvidenceError
from qualify.rolemeta import RoleMeta

WRITTEN = {"attn_impl": "sdpa", "compute_grad_dtypes": {"w": "torch.float32"}, "control": "r0",
           "coverage": [{"policy_clip_high": 3}, {"policy_clip_low": 1}], "grad_dtypes": {"w": "torch.float32"},
           "master_dtype": "torch.float32", "microbatches": 1, "num_steps": 2, "precision": "fp32",
           "reverse_rows": False, "role": "actor", "rollout_digest": "sha256:" + "0" * 64, "seconds": 1.5,
           "settings": "default", "state_dtypes": {"w": "torch.float32"}, "targets_digest": "sha256:" + "1" * 64,
           "tp_split": 1}
"""The keys the reference writes for a run kept in full (a real r0's, values shortened)."""


@pytest.mark.parametrize("kept", [{}, {"evidence": "lean"}, {"evidence": "summary"}])
def test_a_written_meta_reads_back_and_is_given_back_key_for_key(tmp_path, kept):
    doc = WRITTEN | kept
    (tmp_path / "meta.json").write_text(json.dumps(doc))
    meta = read_role_meta(tmp_path)
    assert meta.to_json() == doc and list(meta.to_json()) == list(doc)
    assert RoleMeta.from_json(meta.to_json()) == meta
    assert (meta.num_steps, meta.coverage, meta.evidence) == (2, doc["coverage"], kept.get("evidence"))
    assert meta.lean is (kept == {"evidence": "lean"}) and is_lean(meta) is meta.lean
    assert num_steps(tmp_path) == 2


def test_what_is_not_written_reads_as_a_run_kept_in_full_of_one_step():
    meta = RoleMeta.from_json({"role": "critic"})
    assert (meta.num_steps, meta.coverage, meta.evidence, meta.lean) == (1, [], None, False)


@pytest.mark.parametrize(("change", "named"), [
    ({"num_steps": "2"}, "num_steps"), ({"num_steps": True}, "num_steps"), ({"num_steps": -1}, "num_steps"),
    ({"coverage": {"policy_clip_high": 3}}, "coverage"), ({"evidence": "full"}, "evidence")])
def test_a_field_of_another_type_is_refused_naming_it(change, named):
    with pytest.raises(EvidenceError, match=named):
        RoleMeta.from_json(WRITTEN | change, "scores/fp32-r0/actor/meta.json")


def test_a_document_that_is_not_an_object_is_refused():
    with pytest.raises(EvidenceError, match="not a JSON object"):
        RoleMeta.from_json([WRITTEN])
