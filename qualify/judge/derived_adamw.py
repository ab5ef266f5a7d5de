"""AdamW's moments and update derived from a case's own values (qualify.judge.derived composes them with the other
derivation rows): each moment from the case's own gradient, clipped by the coefficient of its own reported norm, and
its own moment of the step before; each new parameter from its own moments and start, in the form of AdamW nearest it
(qualify.ppo.adamw). Each is held to the rounding of the state's dtype, not to the reference's bound.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qualify.compare import RunTensors
from qualify.metrics import metrics_device
from qualify.verdict import Row

U = 2.0 ** -24
"""fp32 unit roundoff: one rounding of a value v is at most U x |v|."""
DERIVED = "derived"
"""The comparison of every derivation row (the derivation group: the case held to its own inputs)."""
UPDATE_RULE = ("the new parameter rounds to nearest (in the optimizer state's dtype) from a value within u x (8 |step "
               "term| + 2 |decay|) + the ulps of the reported updates so far (the start is rebuilt from them; one ulp "
               "of the parameter more where they reach half of one) of AdamW's unrounded value of the case's own "
               "moments and start, in the form nearest it (qualify.ppo.adamw: torch's, the decay subtracted, FusedAdam's, "
               "the reordered one): each form's roundings of the parameter made as it makes them, the step term's own "
               "roundings allowed (u: the state dtype's unit roundoff)")
MOMENT_RULE = ("the moment rounds to nearest (in the state's dtype) from a value within u x (2 b |previous| + 3 (1 - b) "
               "(|g| + |g - previous|)) (exp_avg) or u x (2 b |previous| + 3 (1 - b) g^2) (exp_avg_sq) of AdamW's, per "
               "element: g the case's own gradient times the clip coefficient of its reported norm (with 4 fp32 "
               "roundings of it where it clips), previous its own moment of the step before (u: the state dtype's unit "
               "roundoff): multiply-add or lerp, each scalar cast and each operation before the last rounded once")
STATE_UNIT = {"float32": U, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}

FLOAT_BITS = {"float32": (24, -126, -149), "bfloat16": (8, -126, -133), "float16": (11, -14, -24)}
"""dtype -> (significand bits, smallest normal exponent, smallest subnormal exponent)."""


def ulp(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """The spacing of a floating dtype at |x| (above it where |x| is a power of two), float64."""
    bits, _, sub_exp = FLOAT_BITS.get(dtype, FLOAT_BITS["float32"])
    f, e = torch.frexp(x.double().abs())  # |x| = f x 2^e, f in [0.5, 1); 0 gives e = 0: the subnormal spacing
    exponent = torch.where(f == 0, torch.full_like(e, sub_exp), torch.clamp(e - bits, min=sub_exp))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent)


def rounding_interval(c: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi]: the values that round to nearest to c (float64 holding values of dtype), each half-way to a
    neighbour (the neighbour towards zero half as far where |c| is a normal power of two)."""
    _, min_exp, _ = FLOAT_BITS.get(dtype, FLOAT_BITS["float32"])
    c = c.double()
    f, e = torch.frexp(c.abs())
    away = ulp(c, dtype)
    toward = torch.where((f == 0.5) & (e - 1 > min_exp), away / 2, away)
    up, down = torch.where(c >= 0, away, toward), torch.where(c >= 0, toward, away)
    return c - down / 2, c + up / 2


def update_row(case: str, role: str, k: int, step: RunTensors, start: dict[str, torch.Tensor], optimizer: Any,
               state_dtypes: dict[str, str], rebuilt: dict[str, torch.Tensor] | None = None) -> Row | None:
    """Every parameter's update against AdamW's step k + 1 of the case's own moments and start in the forms real
    optimizers take (qualify.ppo.adamw): the new parameter must round to nearest from a value within the step term's
    rounding of some form's unrounded value. Each tensor is held to the form nearest it; one row per step names the
    element nearest (or furthest past) its allowance and that form.

    The start is rebuilt from the initial parameters and the case's earlier updates as reported, each p' - p rounded to
    its dtype (inexact where p is small beside the step): rebuilt[name] is the sum of their ulps, updated here with
    this step's (pass the same dict step after step; None: a first step, or a start known exactly)."""
    from qualify.ppo.adamw import step_term

    worst: tuple[float, str, float, float, int, str] | None = None  # (ratio, name, needed, allowance, element, form)
    tiny = torch.finfo(torch.float64).tiny
    device = metrics_device()  # float64 elementwise arithmetic: the same values on the GPU, many times faster
    for name, update in sorted(step.updates.items()):
        m, v, p = step.moments.get(f"exp_avg/{name}"), step.moments.get(f"exp_avg_sq/{name}"), start.get(name)
        if m is None or v is None or p is None or update.shape != p.shape or not update.numel():
            continue
        if device is not None:
            update, m, v, p = (t.to(device) for t in (update, m, v, p))
        dtype = state_dtypes.get(name, "float32")
        state = getattr(torch, dtype, torch.float32)
        # the start as the engine holds it: the initial parameters plus the case's earlier updates as reported
        held = p.to(state)
        new = (held.double() + update.double()).to(state)
        lo, hi = rounding_interval(new, dtype)
        step_exact = step_term(m, v, k + 1, optimizer.lr, optimizer.betas, optimizer.eps)
        decay = optimizer.lr * optimizer.weight_decay * held.double()
        # the step term's and the decay's own roundings, and the rebuilding: the ulps of the reported updates, this
        # one's and the earlier ones' (which moved the start), and where those could move the new parameter across a
        # rounding midpoint, one ulp of it
        own = ulp(update, str(update.dtype).removeprefix("torch.")).float()
        carried = own if rebuilt is None or name not in rebuilt else rebuilt[name] + own
        if rebuilt is not None:
            rebuilt[name] = carried
        spacing = ulp(new, dtype)
        rebuilding = carried.double() + torch.where(2 * carried.double() >= spacing, spacing, 0.0)
        allowance = (STATE_UNIT.get(dtype, U) * (8 * step_exact.abs() + 2 * decay.abs()) + rebuilding).clamp(min=tiny)
        r, needed, form = nearest_form(held, m.to(state), v.to(state), k, optimizer, new, lo, hi, allowance)
        i = int((needed / allowance).reshape(-1).argmax())
        if worst is None or r > worst[0]:
            worst = (r, name, float(needed.reshape(-1)[i]), float(allowance.reshape(-1)[i]), i, form)
    if worst is None:
        return None
    ratio, name, needed, allowance, i, form = worst
    passed = ratio <= 1
    note = (f"{name} element {i}: the update is not AdamW of the case's own moments and start in any form (nearest: "
            f"{form}, {needed:.3g} from a value that rounds to it, allowed {allowance:.3g})")
    return Row(case, role, DERIVED, f"step{k}/updates", "derived_abs", needed, allowance, passed,
               "" if passed else note, step=k, rule=UPDATE_RULE)


def nearest_form(held: torch.Tensor, m: torch.Tensor, v: torch.Tensor, k: int, optimizer: Any, new: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, allowance: torch.Tensor) -> tuple[float, torch.Tensor, str]:
    """(worst needed / allowance, needed per element, form) of the AdamW form (qualify.ppo.adamw.FORMS) whose
    unrounded step k + 1 from held, m and v lies nearest the interval [lo, hi] that rounds to the new parameter."""
    from qualify.ppo.adamw import FORMS, unrounded

    best: tuple[float, torch.Tensor, str] | None = None
    for form in FORMS:
        x = unrounded(form, held, m, v, k + 1, optimizer.lr, optimizer.betas, optimizer.eps, optimizer.weight_decay)
        needed = torch.clamp(torch.maximum(lo - x, x - hi), min=0.0)
        needed = torch.where(torch.isfinite(new.double()), needed, torch.full_like(needed, math.inf))
        r = float((needed / allowance).max())
        if best is None or r < best[0]:
            best = (r, needed, form)
    return best


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """The clip coefficient the optimizer's gradients were scaled by: min(1, max_norm / (norm + 1e-6)) (torch's
    clip_grad_norm_, DeepSpeed's, Megatron's), 1 without clipping."""
    if not max_norm or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def moment_row(case: str, role: str, k: int, step: RunTensors, before: RunTensors | None, optimizer: Any,
               state_dtypes: dict[str, str]) -> Row | None:
    """Every parameter's AdamW moments at step k against the moments of the case's own gradients, clipped by the
    coefficient of its own reported norm, and its own moments of step k - 1 (zero before the first step): each moment
    must round to nearest (in the state's dtype) from a value within the roundings before the last of the exact
    one, as the update's derivation holds the new parameter."""
    if "grad_norm" not in step.outputs or not step.grads:
        return None
    b1, b2 = optimizer.betas
    c = clip_coefficient(float(step.outputs["grad_norm"].reshape(-1)[0]), optimizer.max_grad_norm)
    worst: tuple[float, str, float, float, int] | None = None  # (ratio, key, needed, allowance, element)
    device = metrics_device()  # float64 elementwise arithmetic: the same values on the GPU, many times faster
    for name, g in sorted(step.grads.items()):
        g = g if device is None else g.to(device)
        for key, beta in (("exp_avg", b1), ("exp_avg_sq", b2)):
            got = step.moments.get(f"{key}/{name}")
            if got is None or got.shape != g.shape or not got.numel():
                continue
            got = got if device is None else got.to(device)
            prev = before.moments.get(f"{key}/{name}") if before is not None else None
            prev = prev if prev is None or device is None else prev.to(device)
            prev = torch.zeros_like(got, dtype=torch.float64) if prev is None else prev.double()
            dtype = state_dtypes.get(name, "float32")
            unit = STATE_UNIT.get(dtype, U)
            clipped = c * g.double()
            # the clipped gradient as the optimizer holds it: the coefficient's fp32 computation and the product
            shaken = (4 * U if c < 1 else 0.0) * clipped.abs()
            # the roundings before the last (the sum, checked by the interval): each scalar's cast and each product
            # (multiply-add), or the difference, the weight's cast and the product (lerp: prev + w (g - prev))
            if key == "exp_avg":
                want = beta * prev + (1 - beta) * clipped
                tol = unit * (2 * beta * prev.abs() + 3 * (1 - beta) * (clipped.abs() + (clipped - prev).abs())) \
                    + (1 - beta) * shaken
            else:
                want = beta * prev + (1 - beta) * clipped.square()
                tol = unit * (2 * beta * prev.abs() + 3 * (1 - beta) * clipped.square()) \
                    + (1 - beta) * 2 * clipped.abs() * shaken
            lo, hi = rounding_interval(got, dtype)
            diff = torch.clamp(torch.maximum(lo - want, want - hi), min=0.0)
            tol = tol.clamp(min=torch.finfo(torch.float64).tiny)
            ratio = torch.where(torch.isfinite(got.double()), diff / tol, torch.full_like(diff, math.inf)).reshape(-1)
            i = int(ratio.argmax())
            if worst is None or float(ratio[i]) > worst[0]:
                worst = (float(ratio[i]), f"{key}/{name}", float(diff.reshape(-1)[i]), float(tol.reshape(-1)[i]), i)
    if worst is None:
        return None
    ratio, key, diff, tol, i = worst
    passed = ratio <= 1
    note = (f"{key} element {i}: not AdamW's moment of the case's own gradient (clipped by {c:.9g}, from its reported "
            f"norm) and its previous moment ({diff:.3g} from a value that rounds to it, allowed {tol:.3g})")
    return Row(case, role, DERIVED, f"step{k}/moments", "derived_abs", diff if math.isfinite(diff) else math.inf, tol,
               passed, "" if passed else note, step=k, rule=MOMENT_RULE)
