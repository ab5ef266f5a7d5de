"""matrices/README.md documents every field the matrix loader accepts, and no field it does not: each section's table
(`## ppo`, `### models.tiny`, ...) lists exactly the fields of that section's dataclass."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from qualify.matrix import Matrix

README = Path(__file__).resolve().parents[2] / "matrices" / "README.md"
SECTION = re.compile(r"^#{2,3} (?:Top level \(`Matrix`\)|(?P<path>[a-z_.]+))\s*$")
ROW = re.compile(r"^\| `(?P<field>[a-z_]+)` \|")


def documented() -> dict[str, set[str]]:
    """{section path ('' for the top level): the fields its table lists}."""
    out: dict[str, set[str]] = {}
    current = None
    for line in README.read_text(encoding="utf-8").splitlines():
        heading = SECTION.match(line)
        if heading:
            current = heading["path"] or ""
            out.setdefault(current, set())
            continue
        if line.startswith("#"):
            current = None
            continue
        row = ROW.match(line)
        if row and current is not None:
            out[current].add(row["field"])
    return {k: v for k, v in out.items() if v}


def section_classes(cls: type = Matrix, path: str = "") -> dict[str, type]:
    """{section path: dataclass} of the matrix and every section below it."""
    out = {path: cls}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        for arg in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(arg):
                out |= section_classes(arg, f"{path}.{f.name}" if path else f.name)
    return out


def test_every_section_documents_exactly_its_fields():
    docs, classes = documented(), section_classes()
    assert set(docs) == set(classes), (sorted(set(classes) - set(docs)), sorted(set(docs) - set(classes)))
    problems = {}
    for path, cls in sorted(classes.items()):
        fields = {f.name for f in dataclasses.fields(cls)}
        if docs[path] != fields:
            problems[path or "top level"] = {"undocumented": sorted(fields - docs[path]),
                                             "documented but not a field": sorted(docs[path] - fields)}
    assert problems == {}


def test_the_check_sees_a_missing_row():
    docs = documented()
    assert "clip_eps" in docs["ppo"] and "seed" in docs["models.tiny"] and "name" in docs[""]
