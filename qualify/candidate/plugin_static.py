"""The engine plugin contract as far as a plugin's source shows it, checked by `qualify candidate` before any rank
starts: for the class the factory makes, where its source settles it (qualify.engines.plugin_source), an objective()
that cannot take what the matrix's cases pass it, a packed case of a class that does not declare packed = True, an
entropy bonus for a class with neither entropy() nor an objective() of its own. What the source leaves open is left
to the ranks (qualify.candidate.plugin_contract)."""

from __future__ import annotations

import ast

from qualify.candidate.plugin_contract import objective_signature_problem
from qualify.engines.plugin_source import EngineClass, PluginSource, signature_of
from qualify.engines.registry import ENGINES, plugin_source
from qualify.errors import EngineError
from qualify.matrix import Case, Objective


def objective_problem(made: EngineClass, case: Case, objective: Objective) -> str | None:
    """Why the class's own objective() (an undecorated def of its source) cannot take what the case passes it."""
    own = made.member("objective")
    if not isinstance(own.node, ast.FunctionDef):
        return None
    signature = signature_of(own.node.args, method=True)
    if signature is None:
        return None
    problem = objective_signature_problem(signature, objective.grpo is not None, case.dp, case.packing == "packed")
    return None if problem is None else f"class {own.owner}'s {problem} (case {case.name})"


def packed_problem(made: EngineClass, case: Case) -> str | None:
    """Why the class certainly does not declare packed batches, for a packed case: no packed attribute anywhere in
    its order, or a class statement packed = <a constant other than True>."""
    if case.packing != "packed":
        return None
    packed = made.member("packed")
    node = packed.node
    if packed.state == "absent":
        shows = "no packed attribute"
    elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is not True:
        shows = f"packed = {node.value.value!r} (class {packed.owner})"
    else:
        return None
    return (f"class {made.name} does not declare packed batches (packed = True: docs/plugins.md, 'Packed batches'; "
            f"its source shows {shows}), so its packed case {case.name} cannot run")


def entropy_problem(made: EngineClass, case: Case, objective: Objective) -> str | None:
    """Why an actor case with an entropy bonus certainly cannot have the policy's entropy: the class has neither an
    entropy() hook nor an objective() of its own."""
    coef = objective.ppo.entropy_coef
    if case.role != "actor" or coef == 0:
        return None
    if made.member("entropy").state != "absent" or made.member("objective").state != "absent":
        return None
    return (f"ppo.entropy_coef {coef} needs the entropy of the policy from the forward score() ran, and class "
            f"{made.name} has no entropy() hook nor an objective() of its own (neither it nor its bases define them; "
            f"see qualify.engines.base.TrainEngine), so its case {case.name} cannot run")


def require_static_contract(name: str, cases: list[Case], objective: Objective, where: str = "") -> None:
    """Refuse a plugin whose source settles the class its factory makes and shows it breaking the contract for one of
    its cases (objective_problem, packed_problem, entropy_problem): one line naming the plugin, the source file, what
    was expected and what the source shows."""
    if name in ENGINES:
        return
    source = plugin_source(name)
    made = source.made_class() if isinstance(source, PluginSource) else None
    if made is None:
        return
    for case in (c for c in cases if c.engine == name):
        problem = (objective_problem(made, case, objective) or packed_problem(made, case)
                   or entropy_problem(made, case, objective))
        if problem:
            raise EngineError(f"engine plugin '{name}': {source.origin}: {problem}{where}")
