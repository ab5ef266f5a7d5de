"""A case's logprobs are judged against the reference's formula of the name it declared (candidates.logprob_formula).

The reference records outputs/logprobs_BT (the full formula) and, when the rollout's sampling truncates,
outputs/logprobs_processed_BT (the processed formula), each bounded by freeze. A case's evidence holds one
outputs/logprobs_BT, in its declared formula: the reference runs and bounds are seen here through that formula,
so that the judge compares name for name. Without truncation the two formulas are bitwise the same and the
reference holds only the full one, which then stands for both; an acceptance frozen before the processed
tensor existed judges a 'full' case exactly as before.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from qualify.case.meta import CaseMeta
from qualify.compare import RunTensors
from qualify.errors import EvidenceError
from qualify.metrics import max_abs
from qualify.ppo.formula import FORMULAS, PROCESSED_KEY, Sampling

LOGPROBS_KEY = "logprobs_BT"


def declared_formula(meta: CaseMeta | dict[str, Any]) -> tuple[str, bool]:
    """(formula, whether the sampling truncates) of a case, from the spec sealed in its meta.json; evidence sealed
    before candidates.logprob_formula existed is the full formula."""
    spec = CaseMeta.of(meta).spec
    formula = spec.get("logprob_formula", "full")
    if formula not in FORMULAS:
        raise EvidenceError(f"case {spec.get('name')!r} declares logprob formula {formula!r} (known: "
                            f"{', '.join(FORMULAS)})")
    sampling = Sampling(temperature=spec.get("temperature", 1.0), top_k=spec.get("top_k", -1),
                        top_p=spec.get("top_p", 1.0), min_p=spec.get("min_p", 0.0))
    return formula, sampling.truncates(int(spec.get("vocab_size", 0)))


def _missing(formula: str, truncates: bool, has_processed: bool) -> None:
    if formula == "processed" and truncates and not has_processed:
        raise EvidenceError("the case declares candidates.logprob_formula 'processed' on truncating sampling, but the "
                            "reference has no processed-formula logprobs (outputs/logprobs_processed_BT: it predates "
                            "them); run 'qualify reference' and 'qualify freeze' again, or declare 'full'")


def formula_run(run: RunTensors, formula: str, truncates: bool) -> RunTensors:
    """One reference step whose outputs/logprobs_BT is the named formula's (and no processed tensor beside it)."""
    outputs = dict(run.outputs)
    processed = outputs.pop(PROCESSED_KEY, None)
    if formula == "processed" and LOGPROBS_KEY in outputs:
        _missing(formula, truncates, processed is not None)
        if processed is not None:
            outputs[LOGPROBS_KEY] = processed
    return replace(run, outputs=outputs)


def formula_steps(steps: list[RunTensors], formula: str, truncates: bool) -> list[RunTensors]:
    """Every step of a reference run seen through the named formula."""
    return [formula_run(run, formula, truncates) for run in steps]


def formula_bounds(bounds: dict[str, Any], formula: str, truncates: bool) -> dict[str, Any]:
    """A family's bounds ('step<k>/outputs/...') with outputs/logprobs_BT's bound the named formula's."""
    suffix = f"/outputs/{PROCESSED_KEY}"
    processed = {key.removesuffix(suffix): b for key, b in bounds.items() if key.endswith(suffix)}
    out = {key: b for key, b in bounds.items() if not key.endswith(suffix)}
    if formula == "processed" and any(key.endswith(f"/outputs/{LOGPROBS_KEY}") for key in out):
        _missing(formula, truncates, bool(processed))
        out.update({f"{step}/outputs/{LOGPROBS_KEY}": b for step, b in processed.items()})
    return out


def explain_formula(rows: list[Any], candidate: list[RunTensors], reference: list[RunTensors],
                    bounds: dict[str, Any], formula: str) -> list[Any]:
    """Failing rows of outputs/logprobs_BT (every metric) say which formula they were judged against and, where the
    reference holds both formulas, how far the candidate is from the other one: within the other formula's bound,
    the engine computes the formula it did not declare."""
    other = "full" if formula == "processed" else "processed"
    other_bounds = formula_bounds(bounds, other, truncates=False)
    out = []
    for row in rows:
        k, rest = _step_of(row)
        if (row.passed or rest != f"outputs/{LOGPROBS_KEY}"
                or not 0 <= k < min(len(candidate), len(reference)) or PROCESSED_KEY not in reference[k].outputs):
            out.append(row)
            continue
        cand_BT = candidate[k].outputs.get(LOGPROBS_KEY)
        other_BT = formula_run(reference[k], other, truncates=False).outputs[LOGPROBS_KEY]
        bound = other_bounds.get(f"step{k}/outputs/{LOGPROBS_KEY}", {}).get("max_abs", {}).get("bound")
        note = f"judged against the reference's {formula}-formula logprobs (candidates.logprob_formula: {formula})"
        if cand_BT is not None and cand_BT.shape == other_BT.shape and bound is not None:
            value = max_abs(cand_BT, other_BT)
            note += (f"; these are the {other} formula's: max_abs {value:.3g} against the reference's {other} "
                     f"logprobs, within its bound {bound:.3g} (formula mismatch)" if value <= bound else
                     f"; against the {other} formula: max_abs {value:.3g} (bound {bound:.3g})")
        out.append(replace(row, note="; ".join(filter(None, (row.note, note)))))
    return out


def _step_of(row: Any) -> tuple[int, str]:
    """(step, tensor key without its step) of a row: 'step2/outputs/x' -> (2, 'outputs/x'); -1 without a step."""
    head, _, rest = row.tensor.partition("/")
    if head.startswith("step") and head[4:].isdigit():
        return int(head[4:]), rest
    step = getattr(row, "step", None)
    return (step, row.tensor) if isinstance(step, int) else (-1, row.tensor)
