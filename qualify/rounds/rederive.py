"""A rounds verdict judged again from its sealed evidence: nothing the verdict says is taken from the verdict.

Every row of a rounds verdict is one check whose rule is written in the row ('== [[0, 1]]', '<= 1.2e-05',
'every request 0 cached tokens', a probe's requirement). Re-deriving a verdict means, for every row:
  - its outcome follows from its observed value and its rule (a rule this module cannot read is a problem,
    never a pass);
  - its observed value is what the sealed evidence of its round holds: round-<r>/round.json (cached tokens,
    the served version, the agreement statistics), round-<r>/agreement.safetensors (the logprob agreement
    computed again from both sides' logprobs), round-<r>/install.json (every rank's acknowledgment checked
    again against the expected shard digests), probes/<name>.json (each probe's outcome decided again);
  - its bound is the one the frozen acceptance gives (k x the reference's vLLM-vs-HF control + floor);
every piece of evidence in the run has its row: a row cannot be dropped from a verdict while its evidence
stays; and the number of rounds the verdict claims is not taken from it either: at least what a rounds run has
and what was asked for (the frozen matrix's rounds.rounds for a report, the options for a reuse), no round's
evidence past it, its last round untrained (only a round with a round after it trains), and a pass holds one
actor version per round, each the one the install before it acknowledged. A writer who forges the evidence files themselves consistently is what only the acceptance anchor and a
signature protect against (README, "What the digests protect against, and what needs an anchor").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qualify.case.meta import NAME as META_NAME
from qualify.case.meta import CaseMeta, read_case_meta
from qualify.errors import QualifyError
from qualify.rounds.checks import EXACT_REPORTED, ROLLOUT_EXACT, ROUTES_REPLAYED, rollout_exact, routes_replayed
from qualify.store import read_json, read_tensors

MAX_LISTED = 5
REL_TOL = 1e-9  # the JSON round trip of a float64; nothing else may differ
SENSITIVITY = "agreement discriminates versions"
ACKS = "every rank acknowledges the installed version"
FAILURE = "no refusal, crash or rejection"


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        return None
    try:
        return float(v)
    except ValueError:
        return None


def same_number(a: Any, b: Any) -> bool:
    x, y = _num(a), _num(b)
    if x is None or y is None:
        return False
    return (math.isnan(x) and math.isnan(y)) or x == y or math.isclose(x, y, rel_tol=REL_TOL, abs_tol=0.0)


def _ints(v: Any) -> list[int] | None:
    ok = isinstance(v, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in v)
    return v if ok else None


def _every_cached(v: Any, least: int | None) -> bool:
    cached = _ints(v)
    if cached is None:
        return False
    return all(c == 0 for c in cached) if least is None else bool(cached) and all(c >= least for c in cached)


RULES: list[tuple[re.Pattern[str], Callable[[re.Match[str], Any, Any], bool]]] = [
    (re.compile(r"== (\d+) identical responses"), lambda m, v, b: isinstance(v, int) and v == int(m[1])),
    (re.compile(r"every request 0 cached tokens"), lambda m, v, b: _every_cached(v, None)),
    (re.compile(r"every request >= (\d+) cached tokens"), lambda m, v, b: _every_cached(v, int(m[1]))),
    (re.compile(r"<= \S+"), lambda m, v, b: _num(v) is not None and _num(b) is not None and math.isfinite(_num(v))
     and _num(v) <= _num(b)),
    (re.compile(r"> (\S+)"), lambda m, v, b: _num(v) is not None and _num(v) > (_num(b) if _num(b) is not None
                                                                               else float(m[1]))),
    (re.compile(r"== (.*)", re.DOTALL), lambda m, v, b: str(v) == m[1]),
    (re.compile(re.escape(FAILURE)), lambda m, v, b: False),
    (re.compile(re.escape(EXACT_REPORTED)), lambda m, v, b: True),
]


def rule_outcome(row: dict[str, Any], frozen: float | None = None) -> bool | None:
    """Whether the row's observed value meets its written rule (None: no rule this module can read); a rule whose
    number the row does not hold as its bound ('> b', the sensitivity check) is held to the frozen bound, else to
    the number it writes."""
    rule = row.get("rule")
    if not isinstance(rule, str):
        return None
    for pattern, holds in RULES:
        m = pattern.fullmatch(rule)
        if m:
            return holds(m, row.get("value"), row["bound"] if row.get("bound") is not None else frozen)
    return None


# probes ---------------------------------------------------------------------------------------------------------
def _stale_probe(rec: dict[str, Any]) -> bool:
    state = rec.get("state_after") or {}
    return (rec.get("observed") == "stale_version" and (rec.get("reply") or {}).get("ok") is False
            and state.get("state") == "ready" and state.get("version") == 0)


def _fault_probe(rec: dict[str, Any]) -> bool:
    m = re.fullmatch(r"install_failed naming '(.*)', then generate and install refused", str(rec.get("required")))
    after = rec.get("after") or {}
    problems = rec.get("problems") if isinstance(rec.get("problems"), list) else []
    return (m is not None and rec.get("observed") == "install_failed"
            and any(isinstance(p, str) and m[1] in p for p in problems)
            and after.get("generate") == "unusable" and after.get("install") == "unusable")


def _warm_cache_probe(rec: dict[str, Any], bound: float | None) -> bool:
    guard, after = rec.get("guard") or {}, rec.get("after") or {}
    agree = rec.get("agreement_check") or {}
    cold = rule_outcome({"rule": "every request 0 cached tokens", "value": rec.get("first_cached_tokens")})
    beyond = _num(agree.get("value")) is not None and bound is not None and not _num(agree["value"]) <= bound
    return guard.get("kind") == "warm_cache" and not cold and beyond and after.get("generate") == "unusable"


def probe_outcome(name: str, rec: dict[str, Any], bound: float | None) -> bool:
    """A probe decided again from its record: its fault was rejected by the rule it targets."""
    if name.startswith("stale-"):
        return _stale_probe(rec)
    if name == "warm-cache":
        return _warm_cache_probe(rec, bound)
    return _fault_probe(rec)


# evidence per round ---------------------------------------------------------------------------------------------
def _read(path: Path) -> Any:
    try:
        return read_json(path)
    except QualifyError:
        return None


def _case_meta(train_dir: Path) -> CaseMeta | None:
    """A round's training step's meta.json (None: unreadable)."""
    try:
        return read_case_meta(train_dir)
    except QualifyError:
        return None


def agreement_max(path: Path) -> float | None:
    """max |vLLM - HF| over response tokens, computed again from the sealed logprobs (None: unreadable)."""
    from qualify.rounds.checks import logprob_agreement

    try:
        t = read_tensors(path)
        stats = logprob_agreement(t["vllm_logprobs_BT"], t["hf_logprobs_BT"], t["response_mask_BT"].bool())
    except (QualifyError, KeyError, RuntimeError, OSError):
        return None
    return stats["max_abs"] if stats["num_tokens"] > 0 else None


def round_expectations(where: Path, rnd: int) -> dict[str, Any]:
    """{check: the value round rnd's sealed evidence gives it}, for every row that evidence backs."""
    out: dict[str, Any] = {}
    doc = _read(where / f"round-{rnd}" / "round.json")
    if isinstance(doc, dict):
        first = "fresh engine: nothing cached" if rnd == 0 else "first request after install: nothing cached"
        out[first] = doc.get("first_cached_tokens")
        out["same-version replay reuses the cache"] = doc.get("replay_cached_tokens")
        out["replay logprobs agree with HF"] = (doc.get("replay_agreement") or {}).get("max_abs")
        main = "logprobs agree with HF" if rnd == 0 else "rollout logprobs agree with HF"
        out[main] = agreement_max(where / f"round-{rnd}" / "agreement.safetensors")
        exact = _exact(where, rnd)
        if exact is not None:
            out[ROLLOUT_EXACT] = exact[0]
        replayed = routes_replayed(_case_meta(where / f"round-{rnd}" / "train"))
        if replayed is not None:
            out[ROUTES_REPLAYED] = replayed[0]
        if rnd > 0:
            out["engine serves the installed version"] = (doc.get("served_version") or [None])[0]
            out[SENSITIVITY] = (doc.get("agreement_vs_previous") or {}).get("max_abs")
    return out


def _exact(where: Path, rnd: int) -> tuple[int | None, str | None] | None:
    """Round rnd's exact-tier row as its sealed train step, targets and rollout give it: (count, rule), (None, None)
    where they are unreadable; None when the round did not train (the last one)."""
    train = where / f"round-{rnd}" / "train"
    if not (train / META_NAME).is_file():
        return None
    meta = _case_meta(train)
    targets = Path((meta.spec if meta is not None else {}).get("targets_dir", ""))
    try:
        count, rule, _ = rollout_exact(train, targets)
    except (QualifyError, KeyError, OSError, RuntimeError, TypeError):
        return None, None
    return count, rule


def install_problems(where: Path, rnd: int, row: dict[str, Any] | None) -> list[str]:
    """The install after round rnd: every rank's acknowledgment checked again against the expected digests."""
    from qualify.rounds.acks import ack_problems

    doc = _read(where / f"round-{rnd}" / "install.json")
    if doc is None:
        return []
    label = f"install of v{rnd + 1}"
    if row is None:
        return [f"{label}: its evidence is sealed but the verdict has no '{ACKS}' row"]
    try:
        acks, expected = doc["rank_tensors"], doc["expected"]
        accepted = not ack_problems(acks, rnd + 1, expected)
        observed = sorted([a["rank"], a["version"]] for a in acks)
    except (KeyError, TypeError, AttributeError):
        return [f"{label}: install.json holds no readable acknowledgments"]
    if row.get("passed") is not accepted or row.get("value") != observed:
        return [(f"{label}: the verdict says passed={row.get('passed')} with {row.get('value')}; the sealed "
                 f"acknowledgments give passed={accepted} with {observed}")]
    return []


# the verdict ----------------------------------------------------------------------------------------------------
def row_problems(rows: list[dict[str, Any]], bound: float | None) -> list[str]:
    """Each row's outcome follows from its rule; each numeric bound is the frozen one."""
    out = []
    for row in rows:
        label = f"{row.get('tensor')} (round {row.get('step')})"
        if str(row.get("tensor", "")).startswith("probe "):
            continue  # decided from its record (probe_problems)
        holds = rule_outcome(row, bound)
        if holds is None:
            out.append(f"{label}: rule {row.get('rule')!r} cannot be judged again")
        elif row.get("passed") is not holds:
            out.append(f"{label}: passed={row.get('passed')} does not follow from {row.get('value')!r} "
                       f"and rule {row.get('rule')!r}")
        if bound is not None and row.get("bound") is not None and not same_number(row["bound"], bound):
            out.append(f"{label}: bound {row.get('bound')} is not the frozen {bound}")
    return out


def probe_problems(where: Path, rows: list[dict[str, Any]], bound: float | None) -> list[str]:
    out = []
    recorded = {p.stem: p for p in sorted((where / "probes").glob("*.json"))}
    by_name = {str(r.get("tensor", "")).removeprefix("probe ").removesuffix(" rejected"): r for r in rows
               if str(r.get("tensor", "")).startswith("probe ")}
    for name in sorted(recorded.keys() | by_name.keys()):
        rec, row = _read(recorded[name]) if name in recorded else None, by_name.get(name)
        if row is None:
            out.append(f"probe {name}: its record is sealed but the verdict has no row for it")
        elif not isinstance(rec, dict):
            out.append(f"probe {name}: the verdict has a row but no readable record under probes/")
        elif row.get("passed") is not probe_outcome(name, rec, bound) or rec.get("passed") is not row.get("passed"):
            out.append(f"probe {name}: the verdict says passed={row.get('passed')}; its sealed record gives "
                       f"{probe_outcome(name, rec, bound)}")
    return out


def evidence_problems(where: Path, rows: list[dict[str, Any]], rounds: int) -> list[str]:
    """Every row a round's evidence backs holds that evidence's value; none of those rows is missing."""
    out = []
    for rnd in range(rounds):
        mine = {str(r.get("tensor")): r for r in rows if r.get("step") == rnd}
        for check, value in round_expectations(where, rnd).items():
            row = mine.get(check)
            if row is None:
                out.append(f"{check} (round {rnd}): its evidence is sealed but the verdict has no row for it")
            elif value is None:
                out.append(f"{check} (round {rnd}): its sealed evidence is unreadable")
            elif not (row.get("value") == value or same_number(row.get("value"), value)):
                out.append(f"{check} (round {rnd}): the verdict says {row.get('value')!r}, its evidence {value!r}")
        exact, row = _exact(where, rnd), mine.get(ROLLOUT_EXACT)
        if exact is not None and row is not None and exact[1] is not None and row.get("rule") != exact[1]:
            out.append(f"{ROLLOUT_EXACT} (round {rnd}): the verdict's rule is {row.get('rule')!r}; the trainer's "
                       f"sealed spec gives {exact[1]!r}")
        out += install_problems(where, rnd, next((r for r in rows if r.get("tensor") == ACKS
                                                  and r.get("step") == rnd + 1), None))
    return out


def count_problems(where: Path, doc: dict[str, Any], rounds: int, asked: int | None) -> list[str]:
    """The number of rounds the verdict claims against what a run has, what was asked for, and its evidence: rounds
    past it, a last round that trained, and (for a pass) one acknowledged actor version per round."""
    from qualify.matrix import MIN_ROUNDS

    out = []
    if rounds < MIN_ROUNDS:
        out.append(f"claims {rounds} rounds; a rounds run has at least {MIN_ROUNDS}")
    if asked is not None and rounds < asked:
        out.append(f"claims {rounds} rounds; {asked} were asked for")
    beyond = sorted(p.name for p in where.glob("round-*") if p.name[6:].isdigit() and int(p.name[6:]) >= rounds)
    if beyond:
        out.append(f"{', '.join(beyond)} is in the evidence beyond the {rounds} rounds it claims")
    if rounds > 0 and (where / f"round-{rounds - 1}" / "train").exists():
        out.append(f"round {rounds - 1} trained an actor step: the run asked for more than its {rounds} rounds")
    if doc.get("passed") is True:
        out += version_problems(where, doc.get("actor_versions"), rounds)
    return out


def version_problems(where: Path, versions: Any, rounds: int) -> list[str]:
    """A pass installed v1 .. v(rounds-1): its actor versions are v0 .. v(rounds-1), each v(r+1) the version the
    install after round r acknowledged (round-r/install.json)."""
    numbers = [v.get("version") for v in versions] if isinstance(versions, list) and all(
        isinstance(v, dict) for v in versions) else None
    if numbers != list(range(rounds)):
        return [f"passed, but its actor versions are {numbers} for {rounds} rounds"]
    out = []
    for v in versions[1:]:
        acknowledged = (_read(where / f"round-{v['version'] - 1}" / "install.json") or {}).get("version_digest")
        if v.get("digest") != acknowledged:
            out.append(f"actor version {v['version']} is {v.get('digest')}; the install after round "
                       f"{v['version'] - 1} acknowledged {acknowledged}")
    return out


def rederive_problems(where: Path, doc: dict[str, Any], bound: float | None, asked: int | None = None) -> list[str]:
    """Every reason the rounds verdict at `where` is not what its sealed evidence gives (empty: it is). asked: the
    rounds the run was asked for (None: only the least a run has is held)."""
    rows = doc.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return ["no readable rows"]
    rounds = doc.get("rounds")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        return [f"rounds {rounds!r} is not a number of rounds"]
    problems = count_problems(where, doc, rounds, asked)  # first: every other check reads as many rounds as it says
    problems += row_problems(rows, bound) + probe_problems(where, rows, bound) + evidence_problems(where, rows, rounds)
    if doc.get("passed") is True:
        missing = [f"round-{r}" for r in range(rounds) if not (where / f"round-{r}" / "round.json").is_file()]
        missing += [f"install after round {r}" for r in range(rounds - 1)
                    if not (where / f"round-{r}" / "install.json").is_file()]
        if missing:
            problems.append(f"passed, but the evidence of {', '.join(missing)} is not there")
    return [f"not what its sealed evidence gives: {p}" for p in problems[:MAX_LISTED]] + (
        [f"(+{len(problems) - MAX_LISTED} more)"] if len(problems) > MAX_LISTED else [])
