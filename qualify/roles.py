"""The trained roles, in one place: the actor (the policy) and the critic (the value model). A matrix's
candidates.roles, a case's role and the roles a PPO step trains are these (GRPO trains the actor alone)."""

from __future__ import annotations

from typing import Literal, get_args

Role = Literal["actor", "critic"]
"""A trained role, as a matrix field's type (the schema reads the Literal's values)."""
ROLES: tuple[Role, ...] = get_args(Role)
"""The trained roles, actor first: a PPO step trains both."""
ACTOR_ONLY: tuple[Role, ...] = ROLES[:1]
"""The roles a GRPO step trains (no critic)."""
MODEL_ROLES = ("actor", "reference", "critic", "reward")
"""Every model of a family: the trained roles and the frozen reference policy and reward model."""
