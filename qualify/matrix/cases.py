"""Cases: one candidate case (Case), its name written and read back (Case.name, parse_case_name), every case of a
candidates section in a stable order (enumerate_cases), and what a case's ranks are told of the matrix
(CaseSettings)."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from qualify.matrix.candidates import Candidates
from qualify.matrix.objective import Objective
from qualify.matrix.reference import Reference
from qualify.matrix.rollout import Rollout
from qualify.matrix.values import PRECISIONS, Packing, Precision
from qualify.roles import ROLES, Role

CASE_NAME = re.compile(rf"^(?P<engine>.+)-(?P<precision>{'|'.join(PRECISIONS)})-tp(?P<tp>[1-9][0-9]*)"
                       r"(?:-dp(?P<dp>[2-9]|[1-9][0-9]+))?"
                       rf"(?:-(?P<packing>packed))?-(?P<role>{'|'.join(ROLES)})$")
"""What Case.name writes: engine-precision-tp<N>[-dp<M>][-packed]-role (parse_case_name reads it back)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Case:
    """One candidate case."""

    engine: str
    precision: Precision
    tp: int
    role: Role
    dp: int = 1
    packing: Packing = "padded"

    @property
    def name(self) -> str:
        """engine-precision-tp<N>[-dp<M>][-packed]-role: the DP degree appears only above 1 and the packing only when
        packed, so DP1 padded names stay as they were (CASE_NAME; parse_name reads it back)."""
        safe = self.engine.replace(":", "-").replace(".", "-")
        dp = f"-dp{self.dp}" if self.dp > 1 else ""
        packed = "-packed" if self.packing == "packed" else ""
        return f"{safe}-{self.precision}-tp{self.tp}{dp}{packed}-{self.role}"

    @classmethod
    def parse_name(cls, name: str) -> Case | None:
        """The case a case name names (parse_case_name)."""
        return parse_case_name(name)

    @property
    def world_size(self) -> int:
        """Ranks of the case's launch: tp x dp."""
        return self.tp * self.dp


def parse_case_name(name: str) -> Case | None:
    """Case.name read back: the case whose name this is (None: not a case name). A plugin's engine comes back as the
    name writes it ('my.pkg:make' as 'my-pkg-make'), a case of the same name; a built-in engine's case comes back
    whole."""
    m = CASE_NAME.match(name)
    if m is None:
        return None
    return Case(engine=m["engine"], precision=m["precision"], tp=int(m["tp"]), role=m["role"], dp=int(m["dp"] or 1),
                packing=m["packing"] or "padded")


def enumerate_cases(c: Candidates) -> list[Case]:
    """Every case of the candidate matrix, in a stable order (DP degrees after TP's, DP1 first; each layout of
    candidates.packing after the DP degree, in its order)."""
    return [Case(engine=e, precision=p, tp=t, role=r, dp=d, packing=k)
            for e, p, t, d, k, r in itertools.product(c.engines, c.precisions, c.tp, c.dp, c.packing, c.roles)
            if c.max_ranks is None or t * d <= c.max_ranks]


@dataclass(kw_only=True, slots=True, frozen=True)
class CaseSettings:
    """What a case's ranks are told of the matrix (qualify.case.spec.make_spec): the objective, the rollout's
    sampling settings, the reference's logprob chunking and device, and the candidates section (logprob formula,
    determinism, vocabulary tiles, layout invariance). Matrix.case_settings makes it."""

    objective: Objective
    rollout: Rollout
    reference: Reference
    candidates: Candidates
