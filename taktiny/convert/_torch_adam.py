"""PyTorch's Adam and AdamW state, named as an optax ``adamw`` state names it.

``torch.optim.AdamW.state_dict()`` keys each parameter's state by its index in the order
the optimizer was given the parameters: ``{"state": {i: {"step", "exp_avg",
"exp_avg_sq"}}, "param_groups": [{"params": [i, ...], "lr", "betas", "eps",
"weight_decay", ...}]}``. Given the parameters' names in that order, the state becomes a
flat source in the PyTorch model's names (``0.mu.fc.weight``), which the model's own
rules then convert (:func:`convert` with an optax state as target, or :func:`resume`):
a Linear weight's moments are transposed as the weight is.

The two updates are the same function. PyTorch's AdamW, at step t:
``p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)``, where ``m_hat = m / (1 -
b1^t)`` and ``v_hat = v / (1 - b2^t)``. optax's ``adamw(lr, b1, b2, eps,
weight_decay=wd)``: ``p <- p - lr (m_hat / (sqrt(v_hat) + eps) + wd p)``, with the
same ``m_hat`` and ``v_hat`` from its ``count`` (``eps_root`` is 0). ``exp_avg`` is
``mu``, ``exp_avg_sq`` is ``nu``, and ``step`` is ``count``. PyTorch's Adam with a
weight decay adds it to the gradient (L2) instead, which is another optimizer; with
none it is AdamW with none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_KEYS = ("lr", "betas", "eps", "weight_decay")


def torch_adam(
    state_dict: Mapping[str, Any], names: Sequence[str], *, prefix: str = "0"
) -> tuple[dict[str, Any], dict[str, float]]:
    """A ``torch.optim.AdamW`` (or ``Adam``) state dict as a flat optax ``adamw`` state
    in the PyTorch parameters' names, and the ``optax.adamw`` arguments that continue
    the same run.

    The step after conversion matches PyTorch's next step: the moments are the same
    arrays, the step count is optax's ``count``, and optax's AdamW computes the same
    bias corrections, epsilon and decoupled weight decay (``lr * weight_decay * p``).

    Args:
        state_dict: ``optimizer.state_dict()``, in memory (tensors or arrays).
        names: the parameters' names in the order of the groups' ``params`` indices,
            which is the order the optimizer was given them: ``[n for n, _ in
            torch_model.named_parameters()]`` for an optimizer made from
            ``torch_model.parameters()``.
        prefix: where the optax state keeps Adam's ``count``, ``mu`` and ``nu``: ``"0"``
            for ``optax.adamw`` and ``optax.adam``, ``"inner_state.0"`` under
            ``optax.inject_hyperparams``, ``"1.0"`` for ``optax.chain(clip, adamw)``.

    Returns:
        ``(source, hyperparameters)``: the flat source
        ``{f"{prefix}.count": int32 step, f"{prefix}.mu.{name}": exp_avg,
        f"{prefix}.nu.{name}": exp_avg_sq}``, and ``{"learning_rate", "b1", "b2",
        "eps", "weight_decay"}`` for ``optax.adamw(**hyperparameters)``.

    Raises:
        ValueError: a state dict that is not one of these, with what is wrong and what to
            do: another number of parameters than `names`, a parameter without its state
            or with a state that lacks ``exp_avg``, ``exp_avg_sq`` or ``step``, steps that
            differ, parameter groups with different hyperparameters, or options optax's
            AdamW lacks (``amsgrad``, ``maximize``, Adam's coupled weight decay).
    """
    groups = _groups(state_dict)
    where = "convert.torch_adam"
    indices = [i for group in groups for i in group["params"]]
    if len(indices) != len(names) or len(set(indices)) != len(indices):
        raise ValueError(
            f"{where}: the optimizer's groups hold {len(indices)} parameters (indices "
            f"{indices[:8]}{'...' if len(indices) > 8 else ''}), but {len(names)} names were "
            f"given; pass the names of the parameters in the order the optimizer was given "
            f"them ([n for n, _ in model.named_parameters()] for one made from "
            f"model.parameters())."
        )
    hyper = _hyperparameters(groups, where)
    state = state_dict["state"]
    source: dict[str, Any] = {}
    steps = {}
    for i, name in zip(indices, names, strict=True):
        entry = state.get(i)
        if not isinstance(entry, Mapping):
            raise ValueError(
                f"{where}: parameter {i} ({name!r}) has no state: PyTorch makes it at the "
                f"first step in which the parameter has a gradient; take the state dict "
                f"after such a step, or freeze the parameter in both frameworks."
            )
        lacking = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in entry]
        if lacking:
            raise ValueError(
                f"{where}: the state of parameter {i} ({name!r}) lacks {lacking}; it holds "
                f"{sorted(entry)}. This reads Adam's and AdamW's state only."
            )
        steps[name] = int(float(entry["step"]))
        source[f"{prefix}.mu.{name}"] = entry["exp_avg"]
        source[f"{prefix}.nu.{name}"] = entry["exp_avg_sq"]
    if len(set(steps.values())) > 1:
        raise ValueError(
            f"{where}: the parameters were stepped different numbers of times ({steps}), "
            f"but optax keeps one step count for all; convert a state in which every "
            f"parameter has taken every step."
        )
    count = next(iter(steps.values()), 0)
    return {f"{prefix}.count": np.asarray(count, np.int32), **source}, hyper


def _groups(state_dict: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    if (
        not isinstance(state_dict, Mapping)
        or not isinstance(state_dict.get("state"), Mapping)
        or not isinstance(state_dict.get("param_groups"), Sequence)
        or not all(isinstance(g, Mapping) and "params" in g for g in state_dict["param_groups"])
    ):
        raise ValueError(
            f"convert.torch_adam takes optimizer.state_dict(): {{'state': {{index: {{...}}}}, "
            f"'param_groups': [{{'params': [...], ...}}]}}, got {type(state_dict).__name__} "
            f"with keys {sorted(state_dict) if isinstance(state_dict, Mapping) else None}."
        )
    return list(state_dict["param_groups"])


def _hyperparameters(groups: Sequence[Mapping[str, Any]], where: str) -> dict[str, float]:
    first = groups[0]
    lacking = [k for k in _KEYS if k not in first]
    if lacking:
        raise ValueError(
            f"{where}: the parameter group lacks {lacking}; it holds {sorted(first)}. This "
            f"reads the state of torch.optim.Adam and AdamW only."
        )
    for i, group in enumerate(groups[1:], 1):
        differ = [k for k in _KEYS if _value(group.get(k)) != _value(first[k])]
        if differ:
            raise ValueError(
                f"{where}: parameter groups 0 and {i} differ in {differ}, and optax.adamw "
                f"takes one set of hyperparameters; give the groups the same ones before "
                f"saving, or write an optax.multi_transform with one adamw per group and "
                f"convert each group's state by itself ({{'state': ..., 'param_groups': "
                f"[group]}}, with that transform's prefix)."
            )
    refused = {
        "amsgrad": "AMSGrad keeps a further moment optax.adamw lacks",
        "maximize": "optax minimises; negate the loss instead",
    }
    for key, why in refused.items():
        if first.get(key):
            raise ValueError(f"{where}: {key}=True is not supported: {why}.")
    b1, b2 = (float(b) for b in first["betas"])
    decay = float(_value(first["weight_decay"]))
    if decay and not first.get("decoupled_weight_decay", False):
        raise ValueError(
            f"{where}: this is torch.optim.Adam with weight_decay={decay}, which adds the "
            f"decay to the gradient (L2), not AdamW's decoupled decay that optax.adamw "
            f"applies; the two runs would differ. Train with torch.optim.AdamW, or with "
            f"weight_decay=0."
        )
    return {
        "learning_rate": float(_value(first["lr"])),
        "b1": b1,
        "b2": b2,
        "eps": float(_value(first["eps"])),
        "weight_decay": decay,
    }


def _value(x: Any) -> Any:
    """A number, from a Python number or a one-element tensor (a learning rate may be one)."""
    if x is None:
        return None
    return tuple(map(_value, x)) if isinstance(x, (tuple, list)) else float(x)
