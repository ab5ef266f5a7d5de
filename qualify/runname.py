"""A reference run's name, '<precision>-<control>' ('fp32-r0', 'bf16-tp2_split'), and a family's, '<precision>-<kind>'
('fp32-repeat'): parsed once into its two parts instead of split by hand."""

from __future__ import annotations

from typing import NamedTuple

from qualify.errors import QualifyError


class RunName(NamedTuple):
    """The two parts of a run or family name, split at the first '-' (the control's own part may hold more).
    A tuple: layout.scores(*RunName.parse(name), role) is the run's scores directory."""

    precision: str
    control: str

    @classmethod
    def parse(cls, name: str) -> RunName:
        """The name's parts; a name without a '-' between two non-empty parts is refused, naming it."""
        precision, sep, control = str(name).partition("-")
        if not sep or not precision or not control:
            raise QualifyError(f"malformed run name {name!r}: expected '<precision>-<control>', as 'fp32-r0'")
        return cls(precision, control)

    def __str__(self) -> str:
        return f"{self.precision}-{self.control}"
