"""Argument checks shared by the optimizers (DualOptimPlus, DualOptim, AdamW, the FL schemes): one ValueError
each, as torch's optimizers raise, and the TypeError of a step without its objective."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

STATE_BITS = (8, 32)


def check_objectives(objectives: Sequence[str]) -> tuple[str, ...]:
    if isinstance(objectives, str):
        objectives = (objectives,)
    objectives = tuple(objectives)
    if not objectives:
        raise ValueError("objectives must name at least one objective, e.g. ('forget', 'retain')")
    for name in objectives:
        if not isinstance(name, str) or not name:
            raise ValueError(f"objective names must be non-empty strings, got {name!r}")
    if len(set(objectives)) != len(objectives):
        raise ValueError(f"objective names must be unique, got {list(objectives)}")
    return objectives


def check_lr_multipliers(multipliers: Mapping[str, float] | None, objectives: tuple[str, ...]) -> dict:
    multipliers = dict(multipliers or {})
    for name, value in multipliers.items():
        if name not in objectives:
            raise ValueError(f"lr_multipliers names unknown objective {name!r}; objectives are {list(objectives)}")
        if not value >= 0.0:
            raise ValueError(f"lr multiplier for {name!r} must be >= 0, got {value}")
    return multipliers


def check_common(lr: float, betas: Sequence[float], eps: float, weight_decay: float, state_bits: int) -> None:
    if not lr >= 0.0:
        raise ValueError(f"invalid learning rate: {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {tuple(betas)}")
    if not eps >= 0.0:
        raise ValueError(f"invalid eps: {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"invalid weight_decay: {weight_decay}")
    if state_bits not in STATE_BITS:
        raise ValueError(f"state_bits must be 8 or 32, got {state_bits!r}")


def check_param_groups(param_groups: Sequence[Mapping[str, Any]], betas_keys: Sequence[str] = ("betas",)) -> None:
    """The hyper-parameters a param group sets for itself, checked as the constructor's own (torch checks only
    the defaults, so a group's negative lr or beta of 1 would step silently)."""
    for index, group in enumerate(param_groups):
        try:
            check_common(group["lr"], group["betas"], group["eps"], group["weight_decay"], 32)
            for key in betas_keys[1:]:
                value = group.get(key)
                if value is not None and (len(value) != 2 or not all(0.0 <= b < 1.0 for b in value)):
                    raise ValueError(f"{key} must be two numbers in [0, 1) or None, got {value!r}")
        except ValueError as error:
            raise ValueError(f"param group {index}: {error}") from None


def with_built_settings(state_dict: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]]) -> dict:
    """`state_dict` whose saved param groups take the settings they lack from this optimizer's groups of the same
    index, as it was built (doplus 0.1.0 and 0.2.0 kept some settings on the optimizer, so their state dicts'
    groups lack them); a saved value wins. With another number of groups it is returned as it is, for torch's
    load to name the mismatch."""
    saved = state_dict.get("param_groups")
    if not isinstance(saved, Sequence) or len(saved) != len(param_groups):
        return dict(state_dict)
    groups = [{**{key: value for key, value in built.items() if key != "params"}, **group}
              for built, group in zip(param_groups, saved)]
    return {**state_dict, "param_groups": groups}


def unknown_objective(objective: Any, objectives: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"unknown objective {objective!r}: this optimizer was built with objectives={list(objectives)}"
    )


def step_arguments(optimizer: Any, closure: Callable[[], Any] | str | None, objective: str | None
                   ) -> tuple[Callable[[], Any] | None, str]:
    """(closure, objective) of `optimizer.step(closure=None, *, objective)`, checked.

    The objective says which state the gradient in `.grad` belongs to, so nothing stands in for a missing one
    (TypeError). A name given where the closure goes, `step("forget")`, is the deprecated positional form: it
    steps that objective and warns. An objective the optimizer was not built with is a ValueError."""
    name = type(optimizer).__name__
    if isinstance(closure, str):
        if objective is not None:
            raise TypeError(f"{name}.step() got the objective twice: {closure!r} where the closure goes and "
                            f"objective={objective!r}")
        warnings.warn(f"{name}.step({closure!r}) names the objective where the closure goes; write "
                      f"step(objective={closure!r}) (the positional form will be removed)", DeprecationWarning,
                      stacklevel=_caller_level())
        closure, objective = None, closure
    if objective is None:
        raise TypeError(f"{name}.step() needs objective=...: one of {list(optimizer.objectives)}, the objective "
                        "whose gradient is in .grad")
    if objective not in optimizer.objectives:
        raise unknown_objective(objective, optimizer.objectives)
    return closure, objective


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside torch and this package's optimizers (torch wraps `step` in
    its no-grad and hook decorators), so that a warning names the line that called `step`."""
    import torch

    inside = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
