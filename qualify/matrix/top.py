"""The top level of a matrix file (Matrix): its sections together, and the rules that read several of them at once
(the algorithm's, packing's, DP's and TP's). Each section is a module of its own; qualify.matrix.loader reads a file
into a Matrix."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from qualify.errors import MatrixError
from qualify.matrix.candidates import Candidates
from qualify.matrix.cases import Case, CaseSettings, enumerate_cases
from qualify.matrix.disk import missing_here, read_checkpoint_family, resolve
from qualify.matrix.engine_names import MEGATRON_ENGINES
from qualify.matrix.models import Models
from qualify.matrix.objective import GRPO, PPO, Objective, Optimizer
from qualify.matrix.reference import Freeze, Reference
from qualify.matrix.rollout import Capture, Rollout
from qualify.matrix.rounds import Rounds
from qualify.matrix.values import MAX_SEED, PRECISIONS, Algorithm
from qualify.roles import Role

# A matrix name becomes a directory (runs/<name>) and a Slurm job name: plain ASCII, no path separators.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Matrix:
    """A whole qualification matrix."""

    name: str
    """Name; runs go to runs/<name> by default."""
    description: str = ""
    """One line for people."""
    models: Models
    """The model family."""
    rollout: Rollout
    """Rollout capture."""
    algorithm: Algorithm = "ppo"
    """ppo (actor and critic, GAE advantages) or grpo (group-relative advantages, no critic; needs the grpo section)."""
    ppo: PPO = field(default_factory=PPO)
    """PPO settings (under grpo only the policy clip, entropy_coef, epochs and minibatches are used)."""
    grpo: GRPO | None = None
    """GRPO settings: required with algorithm grpo, refused otherwise."""
    optimizer: Optimizer = field(default_factory=Optimizer)
    """AdamW settings."""
    reference: Reference = field(default_factory=Reference)
    """Reference and controls."""
    freeze: Freeze
    """Bound rule."""
    candidates: Candidates
    """Candidate matrix."""
    rounds: Rounds = field(default_factory=Rounds)
    """The rounds run."""
    source: str = ""
    """Path of the YAML file (set by the loader)."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"name {self.name!r} must be 1-100 ASCII letters, digits, '.', '_' or '-', starting "
                             "with a letter or digit (it names the run directory and the Slurm jobs)")
        if not self.description.isprintable():
            raise ValueError("description must be one line of printable text")
        if set(self.reference.precisions) != set(PRECISIONS):
            raise ValueError("reference.precisions must be [fp32, bf16]: the bound families need both")
        self._check_algorithm()
        self._check_required_branches()
        self._check_packing()
        if self.ppo.entropy_coef > 0 and self.candidates.vocab_tile is not None:
            raise ValueError(f"ppo.entropy_coef {self.ppo.entropy_coef} with candidates.vocab_tile "
                             f"{self.candidates.vocab_tile}: the vocab-parallel logprob path computes no entropy; "
                             "unset vocab_tile or entropy_coef")
        if self.algorithm == "ppo" and self.rollout.num_prompts % self.ppo.minibatches:
            raise ValueError(f"ppo.minibatches {self.ppo.minibatches} does not divide rollout.num_prompts "
                             f"{self.rollout.num_prompts} (every minibatch has the same rows; none is dropped)")
        step_rows = self.num_rows // self.ppo.minibatches
        for dp in self.candidates.dp:
            if step_rows % dp:
                raise ValueError(f"candidates.dp {dp} does not divide the {step_rows} rows of an optimizer step "
                                 f"({self.num_rows} rows / ppo.minibatches {self.ppo.minibatches}): each DP rank "
                                 "holds an equal, contiguous slice and no row is dropped")
        if self.models.tiny is not None:
            t = self.models.tiny
            if (t.moe is None) != (self.rollout.routing is None):
                raise ValueError("rollout.routing (replay or recompute) is required for a MoE family (models.tiny.moe) "
                                 "and refused for a dense one")
            megatron = [e for e in self.candidates.engines if e in MEGATRON_ENGINES]
            if t.moe is not None and megatron and max(self.candidates.tp) > 1:
                raise ValueError(f"candidates.engines lists {megatron[0]} beside the MoE family of models.tiny.moe "
                                 f"with candidates.tp {list(self.candidates.tp)}: megatron runs a Qwen3-MoE model at "
                                 "TP 1 only (megatron-core trains MoE under TP with sequence parallelism alone, which "
                                 "the norms of its local spec refuse); give megatron a matrix of its own with tp [1]")
            self.check_family(t.num_heads, t.num_kv_heads, t.intermediate_size, t.vocab_size, "models.tiny")
            if self.rollout.max_model_len > t.max_position_embeddings:
                raise ValueError(f"rollout.max_model_len {self.rollout.max_model_len} exceeds "
                                 f"models.tiny.max_position_embeddings {t.max_position_embeddings}")

    def _check_required_branches(self) -> None:
        """freeze.require: refuse a branch that no reference of this matrix can take (freeze would refuse it after the
        whole reference ran), naming the setting that wakes it."""
        from qualify.ppo.coverage import BRANCHES

        steps = self.ppo.epochs * self.ppo.minibatches
        never = {"adam_past_first_step": steps < 2, "grad_clip": self.optimizer.max_grad_norm <= 0,
                 "padded_rows": self.rollout.max_new_tokens < 2, "policy_clip_dual": self.ppo.dual_clip_c is None}
        for branch in self.freeze.require:
            if never.get(branch):
                raise ValueError(f"freeze.require lists {branch}, which no reference of this matrix can exercise: "
                                 f"{BRANCHES[branch]}")

    def _check_packing(self) -> None:
        """Packed cases need the reference's packed control (what packing changes enters the bounds through it, never
        a wider tolerance); its budget is candidates.pack_tokens, which every sample must fit (samples are never
        split); a MoE family's routes are not replayed in the packed layout."""
        c, r = self.candidates, self.rollout
        packed_cases, packed_control = "packed" in c.packing, "packed" in self.reference.perturbations
        if packed_cases and not packed_control:
            raise ValueError("candidates.packing lists packed: reference.perturbations must list packed, the control "
                             "that samples what packing legitimately changes (attention shapes, micro-batching)")
        if packed_control and c.pack_tokens is None:
            raise ValueError("reference.perturbations lists packed: candidates.pack_tokens (the token budget of a "
                             "packed micro-batch) is required")
        longest = r.prompt_len + r.max_new_tokens
        if c.pack_tokens is not None and r.prompts_file is None and c.pack_tokens < longest:
            raise ValueError(f"candidates.pack_tokens {c.pack_tokens} is less than the longest sample, rollout.prompt_len "
                             f"{r.prompt_len} + max_new_tokens {r.max_new_tokens} = {longest} tokens (a sample is "
                             "never split)")
        if (packed_cases or packed_control) and r.routing is not None:
            raise ValueError("packed batches are not built for a MoE family (rollout.routing): its routes are "
                             "replayed in the padded layout only")

    def _check_algorithm(self) -> None:
        """GRPO: its section, no critic, whole groups in every minibatch, one seed per response."""
        if (self.algorithm == "grpo") != (self.grpo is not None):
            raise ValueError("the grpo section is required with algorithm: grpo and refused otherwise "
                             f"(algorithm is {self.algorithm!r})")
        if self.algorithm != "grpo":
            return
        if "critic" in self.candidates.roles:
            raise ValueError("candidates.roles lists critic, but GRPO has no critic: write roles: [actor]")
        if "value_clip" in self.freeze.require:
            raise ValueError("freeze.require lists value_clip, but GRPO has no critic (no value loss to clip)")
        rows, g = self.num_rows, self.grpo.group_size
        if rows % self.ppo.minibatches or (rows // self.ppo.minibatches) % g:
            raise ValueError(f"ppo.minibatches {self.ppo.minibatches} must split the {rows} rows (rollout.num_prompts "
                             f"{self.rollout.num_prompts} x grpo.group_size {g}) into equal minibatches of whole "
                             "groups")
        if self.rollout.seed + rows - 1 > MAX_SEED:
            raise ValueError("rollout.seed + rows - 1 must be <= 2^63 - 1 (response i samples with seed + i)")

    @property
    def num_rows(self) -> int:
        """Sequences in the batch: one per prompt under ppo, grpo.group_size per prompt under grpo."""
        return self.rollout.num_prompts * (self.grpo.group_size if self.grpo is not None else 1)

    @property
    def objective(self) -> Objective:
        """The objective's sections (algorithm, ppo, grpo, optimizer): what a step computes."""
        return Objective(algorithm=self.algorithm, ppo=self.ppo, grpo=self.grpo, optimizer=self.optimizer)

    @property
    def case_settings(self) -> CaseSettings:
        """The sections a case's spec is made from."""
        return CaseSettings(objective=self.objective, rollout=self.rollout, reference=self.reference,
                            candidates=self.candidates)

    @property
    def capture(self) -> Capture:
        """The rollout's sampling: its section, GRPO's group size and the resolved prompts file."""
        r = self.rollout
        return Capture(rollout=r, group_size=self.grpo.group_size if self.grpo is not None else 1,
                       prompts_file=None if r.prompts_file is None else self.resolve(r.prompts_file))

    @property
    def roles(self) -> tuple[Role, ...]:
        """The trained roles the reference scores: actor and critic under ppo, the actor alone under grpo."""
        return self.objective.roles

    def cases(self) -> list[Case]:
        """Every case of the candidate matrix, in a stable order (qualify.matrix.cases.enumerate_cases)."""
        return enumerate_cases(self.candidates)

    def resolve(self, path: str) -> Path:
        """A path from the matrix, relative to the matrix file's directory."""
        return resolve(self.source, path)

    def check_family(self, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
                     where: str) -> None:
        """Every TP degree (candidates.tp, rollout.vllm_tp) shards the heads and the MLP evenly; EOS is in the vocab."""
        degrees = [("candidates.tp", tp) for tp in self.candidates.tp] + [("rollout.vllm_tp", tp)
                                                                             for tp in self.rollout.vllm_tp]
        degrees += [("rounds.train_tp", self.rounds.train_tp)] + (
            [("rounds.vllm_tp", self.rounds.vllm_tp)] if self.rounds.vllm_tp is not None else [])
        for key, tp in degrees:
            for name, size in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                               ("intermediate_size", intermediate_size)):
                if size % tp:
                    raise ValueError(f"{key} {tp} does not divide {where}.{name} {size} "
                                     f"(every TP degree must divide num_heads, num_kv_heads and intermediate_size)")
        tile = self.candidates.vocab_tile
        for tp in self.candidates.tp if tile is not None else ():
            if vocab_size % (tp * tile):
                raise ValueError(f"candidates.vocab_tile {tile} x candidates.tp {tp} does not divide {where} "
                                 f"vocab_size {vocab_size} (every TP rank holds whole tiles of the vocabulary)")
        eos = self.rollout.eos_token_id
        if eos is not None and eos >= vocab_size:
            raise ValueError(f"rollout.eos_token_id {eos} is not in the vocabulary (must be < {where} vocab_size "
                             f"{vocab_size})")

    def check_checkpoint_family(self) -> None:
        """For checkpoint models, check the TP degrees and EOS against the actor's config.json when it is there
        (qualify.matrix.disk.read_checkpoint_family)."""
        values = read_checkpoint_family(self.source, self.models.checkpoints)
        if values is None:
            return
        try:
            self.check_family(*values, "models.checkpoints.actor config.json")
        except ValueError as exc:
            raise MatrixError(f"{self.source}: {exc}") from exc

    def missing_here(self) -> list[str]:
        """What the matrix names that is not on this machine (qualify.matrix.disk.missing_here)."""
        return missing_here(self.source, self.models, self.rollout)
