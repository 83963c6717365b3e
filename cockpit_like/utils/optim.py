"""What an optimizer is about to do: its next update, computed without taking it.

- :func:`lookahead_update`: the update ``optimizer.step()`` would make now, for
  any ``torch.optim.Optimizer``, run on shadow copies (Alpha predicts its
  direction with it).
- :class:`ComputeStep`: Cockpit's helper for quantities that need the update
  (``compute_update_step``) or are defined only for plain SGD
  (``is_sgd_default_kwargs``, used by CABS-style quantities). Its updates come
  from :func:`lookahead_update`.

May import torch only.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import numpy as np
import torch

__all__ = ["lookahead_update", "lookahead_parameters", "is_elementwise", "looking_ahead", "ComputeStep"]

_IMMUTABLE = (bool, int, float, str, type(None), tuple)


def lookahead_update(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    gradients: Mapping[torch.Tensor, torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """The update ``optimizer.step()`` would make now, without making it.

    The step runs on *shadow* parameters: detached copies of every parameter
    of the optimizer with copies of their gradients and of their optimizer
    state, in new param groups with the same hyperparameters, swapped in for
    the duration of the call. The
    real parameters, gradients and state are never written (not even their
    autograd version counters change, so a graph kept for later
    Hessian-vector products stays valid). Afterwards the param groups (with
    their hyperparameters), the optimizer's plain attributes and torch's CPU
    RNG are restored.

    Works for any optimizer whose ``step()`` reads the parameters from
    ``param_groups`` and their state from ``optimizer.state`` (all of
    ``torch.optim`` and the usual custom subclasses). For an element-wise
    optimizer (:func:`is_elementwise`) only ``params`` are stepped, in parts
    of at most :data:`LOOKAHEAD_PART_BYTES` of parameters each (one step per
    part), so the copies that exist at once stay bounded on a large model.

    Args:
        optimizer: the optimizer.
        params: the parameters whose update is returned.
        gradients: optional ``{param: gradient}`` used instead of ``param.grad``
            for the parameters it contains (e.g. ``grad_batch.sum(0)`` while
            ``param.grad`` is not written yet); a ``None`` gradient: the
            parameter has none, and the optimizer skips it (as torch's
            optimizers skip a ``p.grad`` that is None: no weight decay, no
            momentum), its update is zero.

    Returns:
        ``[theta_p(after) - theta_p(before) for p in params]`` (zeros for
        tensors the optimizer does not update).

    Example:
        >>> opt = torch.optim.SGD([w], lr=0.1)      # w.grad = g
        >>> lookahead_update(opt, [w])              # [-0.1 * g]
    """
    gradients = {} if gradients is None else gradients
    if is_elementwise(optimizer):
        updates = {}
        for part in _parts(optimizer, params):
            updates.update(_shadow_step(optimizer, gradients, only=part))
    else:
        updates = _shadow_step(optimizer, gradients)
    return [updates[id(p)] if id(p) in updates else torch.zeros_like(p) for p in params]


#: an element-wise optimizer's look-ahead steps the parameters in parts of at most this many bytes of
#: parameters (a larger parameter is a part of its own): its copies of a part's parameters, gradients
#: and state exist at once, not those of the whole model
LOOKAHEAD_PART_BYTES = 64 * 2**20


def _parts(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[set[int]]:
    """The ids of those ``params`` the optimizer holds, in parts of at most :data:`LOOKAHEAD_PART_BYTES`."""
    wanted = {id(p) for p in params}
    parts: list[set[int]] = [set()]
    size = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in wanted:
                continue
            nbytes = param.numel() * param.element_size()
            if parts[-1] and size + nbytes > LOOKAHEAD_PART_BYTES:
                parts.append(set())
                size = 0
            parts[-1].add(id(param))
            size += nbytes
    return [part for part in parts if part]


def _shadow_step(
    optimizer: torch.optim.Optimizer,
    gradients: Mapping[torch.Tensor, torch.Tensor | None],
    only: set[int] | None = None,
    lend: bool = False,
) -> dict[int, torch.Tensor]:
    """``{id(param): update}`` of one ``optimizer.step()`` on shadow copies (all parameters, or those in ``only``).

    Each shadow gets ``gradients[param]`` (else ``param.grad``; none where that is None) and a copy of the
    parameter's state; the step runs on new group dicts (same hyperparameters)
    holding the shadows. The real parameters, gradients, state and groups are
    never written; the optimizer's plain attributes and torch's CPU RNG are restored.
    ``lend``: the tensors in ``gradients`` are the caller's own and are given to
    the shadows as they are, not copied (the optimizer may write into them:
    torch's foreach SGD with Nesterov momentum does; their ``_version`` tells).
    """
    global _LOOKING_AHEAD
    saved_groups = optimizer.param_groups
    attributes = {k: v for k, v in vars(optimizer).items() if isinstance(v, _IMMUTABLE)}
    rng = torch.get_rng_state()
    shadows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        try:
            groups = []
            for group in saved_groups:
                shadowed = []
                for param in group["params"]:
                    if only is not None and id(param) not in only:
                        continue
                    shadow = param.detach().clone().requires_grad_(param.requires_grad)
                    grad = gradients[param] if param in gradients else param.grad
                    if grad is not None:
                        grad = grad.detach().to(param.dtype).reshape(param.shape)
                        shadow.grad = grad if lend and param in gradients else grad.clone()
                    if param in optimizer.state:
                        optimizer.state[shadow] = {
                            k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                            for k, v in optimizer.state[param].items()
                        }
                    shadows[id(param)] = (param, shadow)
                    shadowed.append(shadow)
                if shadowed:
                    groups.append(dict(group, params=shadowed))
            if groups:
                optimizer.param_groups = groups
                _LOOKING_AHEAD += 1  # the optimizer's step hooks see a look-ahead, not the training's step
                try:
                    optimizer.step()
                finally:
                    _LOOKING_AHEAD -= 1
            # the shadows are ours: each becomes its update in place (no third copy of the parameters)
            return {key: shadow.detach().sub_(param.detach()) for key, (param, shadow) in shadows.items()}
        finally:  # the optimizer's own groups first: what an interrupt inside this block must leave right
            optimizer.param_groups = saved_groups
            for _, shadow in shadows.values():
                optimizer.state.pop(shadow, None)
            for key, value in attributes.items():
                setattr(optimizer, key, value)
            torch.set_rng_state(rng)


#: look-aheads running now: an optimizer's step hooks called meanwhile are the look-ahead's (:func:`looking_ahead`)
_LOOKING_AHEAD = 0


def looking_ahead() -> bool:
    """Whether ``optimizer.step()`` is being called by a look-ahead on shadow copies (its step hooks then run too)."""
    return _LOOKING_AHEAD > 0


#: optimizers whose update of a parameter reads only that parameter, its gradient and its state
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop")
    if hasattr(torch.optim, name)
)


def is_elementwise(optimizer) -> bool:
    """Whether ``optimizer`` is one of :data:`ELEMENTWISE` (exact type: a subclass may couple parameters)."""
    return type(optimizer) in ELEMENTWISE


def lookahead_parameters(
    optimizer: torch.optim.Optimizer, gradients: Mapping[torch.Tensor, torch.Tensor], lend: bool = False
) -> dict[torch.Tensor, torch.Tensor]:
    """``{param: update}``: what ``optimizer.step()`` would do to each ``param`` if its gradient were ``gradients[param]``.

    Only these parameters are shadowed and stepped (their groups'
    hyperparameters, copies of their state), so this costs
    ``O(sum of their sizes)``: for an element-wise optimizer
    (:func:`is_elementwise`) it equals their part of :func:`lookahead_update`,
    and it can run during the backward pass, a few layers at a time. A
    parameter the optimizer does not hold gets a zero update. ``lend``: the
    gradient tensors are the caller's to lend, not copied (see
    :func:`_shadow_step`; a caller that reads them afterwards checks their
    ``_version``).
    """
    updates = _shadow_step(optimizer, gradients, only={id(p) for p in gradients}, lend=lend)
    return {p: updates[id(p)] if id(p) in updates else torch.zeros_like(p) for p in gradients}


class ComputeStep:
    """An optimizer's update step, for quantities that need it (Cockpit's ``cockpit.utils.optim.ComputeStep``).

    The update comes from :func:`lookahead_update`, so it is exact for every
    ``torch.optim`` optimizer (Cockpit computes it for plain SGD only and
    raises ``NotImplementedError`` otherwise). The gradient that the step
    reads is ``param.grad_batch.sum(0)`` where the parameter carries
    BackPACK's ``grad_batch`` (as in Cockpit: inside a backward hook
    ``param.grad`` is not written yet), else ``param.grad``. For a mean loss
    both are the mini-batch gradient.

    Example:
        >>> if not ComputeStep.is_sgd_default_kwargs(optimizer):
        ...     raise ValueError("only for plain SGD")
        >>> updates = ComputeStep.compute_update_step(optimizer, [id(p) for p in params])
        >>> updates[id(params[0])]                 # -lr * grad for plain SGD
    """

    @staticmethod
    def compute_update_step(
        optimizer: torch.optim.Optimizer, parameter_ids: Iterable[int]
    ) -> dict[int, torch.Tensor]:
        """``{id(p): update of p}`` for the optimizer's parameters whose ids are in ``parameter_ids``.

        Raises:
            ValueError: an id is not one of the optimizer's parameters.
        """
        wanted = set(parameter_ids)
        params = [p for group in optimizer.param_groups for p in group["params"] if id(p) in wanted]
        params = list({id(p): p for p in params}.values())
        if len(params) != len(wanted):
            found = {id(p) for p in params}
            raise ValueError(
                f"ComputeStep: {len(wanted - found)} of the requested parameter ids are not parameters of "
                f"this {type(optimizer).__name__}; pass ids of tensors in optimizer.param_groups"
            )
        gradients = {
            p: p.grad_batch.detach().sum(0) for group in optimizer.param_groups for p in group["params"]
            if isinstance(getattr(p, "grad_batch", None), torch.Tensor)
        }
        updates = lookahead_update(optimizer, params, gradients)
        return {id(p): update.detach() for p, update in zip(params, updates)}

    @staticmethod
    def is_sgd_default_kwargs(optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is ``torch.optim.SGD`` without momentum, dampening, weight decay or Nesterov.

        As in Cockpit: every param group has ``weight_decay``, ``momentum`` and
        ``dampening`` close to 0 (``numpy.isclose``) and ``nesterov`` False.
        """
        if not isinstance(optimizer, torch.optim.SGD):
            return False
        for group in optimizer.param_groups:
            for key in ("weight_decay", "momentum", "dampening"):
                if not np.isclose(group.get(key, 0.0), 0.0):
                    return False
            if group.get("nesterov", False) is not False:
                return False
        return True

    @staticmethod
    def update_sgd_default_kwargs(
        optimizer: torch.optim.Optimizer, parameter_ids: Iterable[int]
    ) -> dict[int, torch.Tensor]:
        """:meth:`compute_update_step` for plain SGD (``-lr * gradient``).

        Raises:
            ValueError: ``optimizer`` is not plain SGD (:meth:`is_sgd_default_kwargs`).
        """
        if not ComputeStep.is_sgd_default_kwargs(optimizer):
            raise ValueError(
                f"update_sgd_default_kwargs needs torch.optim.SGD without momentum, dampening, weight decay "
                f"or Nesterov, got {type(optimizer).__name__}; use compute_update_step for any optimizer"
            )
        return ComputeStep.compute_update_step(optimizer, parameter_ids)
