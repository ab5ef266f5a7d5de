"""Qualification matrices: YAML files loaded into frozen, validated dataclasses.

A matrix says which models to qualify, how the rollout is captured, which PPO and optimizer settings the reference
uses, how bounds are frozen and which candidate cases run. matrices/README.md documents every field.

One module per job: loader (load_matrix, the one loader), top (Matrix and its cross-section rules), one module per
section (models, rollout, objective, reference, candidates, rounds), values (field types and single-value checks),
engine_names (which engine names a matrix may give), disk (checks against a checkpoint's config.json and this
machine's files) and cases (Case, its name written and read back, the enumeration of a matrix's cases). Every public
name is importable from qualify.matrix itself.
"""

from __future__ import annotations

from qualify.matrix.candidates import Candidates
from qualify.matrix.cases import CASE_NAME, Case, CaseSettings, enumerate_cases, parse_case_name
from qualify.matrix.engine_names import (
    BUILTIN_ENGINES,
    DEEPSPEED_ENGINES,
    MEGATRON_ENGINES,
    UNPACKED_ENGINES,
    engine_name_problem,
)
from qualify.matrix.loader import load_matrix, matrix_files
from qualify.matrix.models import Checkpoints, Models, TinyModel, TinyMoE
from qualify.matrix.objective import GRPO, PPO, PPO_ADDED, Objective, Optimizer, ppo_as_before
from qualify.matrix.reference import Freeze, Reference
from qualify.matrix.rollout import Capture, Rollout
from qualify.matrix.rounds import MIN_ROUNDS, ROUNDS_PROBES, Rounds
from qualify.matrix.top import Matrix
from qualify.matrix.values import (
    MAX_SEED,
    MAX_TINY_SIZE,
    METRIC_KINDS,
    PRECISIONS,
    Aggregation,
    Algorithm,
    ClipFrac,
    KLEstimator,
    LogprobFormula,
    Packing,
    Perturbation,
    Precision,
    StdEstimator,
    TokenNormalizer,
    Topology,
)
from qualify.roles import ROLES, Role

__all__ = [
    "BUILTIN_ENGINES", "CASE_NAME", "DEEPSPEED_ENGINES", "GRPO", "MAX_SEED", "MAX_TINY_SIZE", "MEGATRON_ENGINES",
    "METRIC_KINDS", "MIN_ROUNDS", "PPO", "PPO_ADDED", "PRECISIONS", "ROLES", "ROUNDS_PROBES", "UNPACKED_ENGINES",
    "Aggregation", "Algorithm", "Candidates", "Capture", "Case", "CaseSettings", "Checkpoints", "ClipFrac", "Freeze",
    "KLEstimator", "LogprobFormula", "Matrix", "Models", "Objective", "Optimizer", "Packing", "Perturbation",
    "Precision", "Reference", "Role", "Rollout", "Rounds", "StdEstimator", "TinyMoE", "TinyModel", "TokenNormalizer",
    "Topology", "engine_name_problem", "enumerate_cases", "load_matrix", "matrix_files", "parse_case_name",
    "ppo_as_before",
]
