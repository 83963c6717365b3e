"""Shared test toolkit: small models, data, a training loop, brute-force references.

References are computed independently of BackPACK and of cockpit_like, with
``torch.func`` in float64:

- :func:`per_sample_grads` ``g_i = grad of l_i`` (NOT divided by B), one
  ``[B, *p.shape]`` tensor per parameter;
- :func:`dense_hessian` the ``D x D`` Hessian of the mean loss over all params.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy

import torch
from backpack import extend
from torch import nn
from torch.func import functional_call, grad, hessian, vmap

DTYPE = torch.float64


def make_mlp(bias: bool = True, seed: int = 0) -> nn.Module:
    """MLP on 12 features (given as 3x4 images): Flatten, 12-10 Tanh 10-8 Sigmoid 8-4."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(12, 10, bias=bias),
        nn.Tanh(),
        nn.Linear(10, 8, bias=bias),
        nn.Sigmoid(),
        nn.Linear(8, 4, bias=bias),
    ).to(DTYPE)


def make_cnn(bias: bool = True, seed: int = 0) -> nn.Module:
    """Small CNN on 2x6x6 inputs: Conv 2-4 3x3, Tanh, MaxPool 2, Flatten, Linear 16-5."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, bias=bias),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 5, bias=bias),
    ).to(DTYPE)


#: name -> (model factory, input shape without batch, number of classes)
PROBLEMS: dict[str, tuple[Callable[..., nn.Module], tuple[int, ...], int]] = {
    "mlp": (make_mlp, (3, 4), 4),
    "cnn": (make_cnn, (2, 6, 6), 5),
}


def make_batch(problem: str, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, shape, classes = PROBLEMS[problem]
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, *shape, generator=generator, dtype=DTYPE)
    labels = torch.randint(0, classes, (batch_size,), generator=generator)
    return inputs, labels


def make_problem(problem: str, bias: bool = True, seed: int = 0):
    """``(extended model, extended CrossEntropyLoss, per-sample loss function)``."""
    factory = PROBLEMS[problem][0]
    model = extend(factory(bias=bias, seed=seed))
    return model, extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss(reduction="none")


def train(
    model: nn.Module,
    lossfunc: nn.Module,
    individual_lossfunc: nn.Module,
    cockpit,
    problem: str,
    steps: int,
    batch_size: int = 8,
    optimizer: torch.optim.Optimizer | None = None,
    record: Callable | None = None,
    start: int = 0,
) -> None:
    """A plain training loop with the cockpit around every backward pass (steps ``start, start + 1, ...``).

    ``record(step, model, inputs, labels)`` is called before each backward
    pass (with the parameters of that step) so tests can compute references.
    """
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start, start + steps):
        inputs, labels = make_batch(problem, batch_size, seed=1000 + step)
        if record is not None:
            record(step, model, inputs, labels)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        losses = individual_lossfunc(outputs, labels)
        info = {"batch_size": batch_size, "individual_losses": losses, "loss": loss, "optimizer": optimizer}
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()


def backward_in(cockpit, step: int, losses: torch.Tensor, optimizer=None, outputs=None, batch_size=None) -> None:
    """The rows' mean ``losses.mean()`` backpropagated: inside ``cockpit``'s block at ``step`` (``info`` with the
    rows' losses, the optimizer and the outputs where given; the graph kept where the step needs it), or plainly
    where ``cockpit`` is ``None`` (the same loop without a cockpit)."""
    loss = losses.mean()
    if cockpit is None:
        loss.backward()
        return
    info = {"batch_size": len(losses) if batch_size is None else batch_size, "individual_losses": losses, "loss": loss}
    info.update({key: value for key, value in (("optimizer", optimizer), ("outputs", outputs)) if value is not None})
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))


def _params_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def plain_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` without BackPACK's hooks (``torch.func`` cannot run through them)."""
    copy = deepcopy(model)
    for module in copy.modules():
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            getattr(module, hooks).clear()
        module._is_full_backward_hook = None
    return copy


def per_sample_grads(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """``g_i`` of the per-sample cross-entropy losses, ``[B, *p.shape]`` per parameter."""
    model = plain_copy(model)
    params = _params_dict(model)

    def sample_loss(p, x, y):
        out = functional_call(model, p, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(out, y.unsqueeze(0))

    grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, inputs, labels)
    return [grads[name] for name in params]


def mean_loss_fn(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
    """``(flat_params, unflatten, f)`` with ``f(flat) =`` the mean cross-entropy."""
    model = plain_copy(model)
    params = _params_dict(model)
    names = list(params)
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]
    flat = torch.cat([params[n].reshape(-1) for n in names])

    def unflatten(vector: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: piece.reshape(s) for n, piece, s in zip(names, vector.split(sizes), shapes)}

    def loss(vector: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, unflatten(vector), (inputs,))
        return nn.functional.cross_entropy(out, labels)

    return flat, unflatten, loss


def dense_hessian(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The ``D x D`` Hessian of the mean loss w.r.t. all parameters (flattened in order)."""
    flat, _, loss = mean_loss_fn(model, inputs, labels)
    return hessian(loss)(flat)


def block_sizes(model: nn.Module) -> list[int]:
    return [p.numel() for p in model.parameters()]


def hutchinson_errors(signs: torch.Tensor, products: torch.Tensor, sizes: list[int]) -> tuple[list[float], float]:
    """Dense twin of the stored standard errors of Hutchinson's block traces (float64): ``signs`` ``[K, D]``
    (``+-1``), ``products`` ``[K, D]`` the operator's products with them. Per block and for the total, the larger
    of the samples' standard deviation over ``sqrt(K)`` and ``sqrt(2 mean_k ||(A v_k)_p||^2 / K)``."""
    count = signs.shape[0]
    blocks = torch.stack([e.sum(1) for e in (signs * products).split(sizes, dim=1)], dim=1)
    energies = torch.stack([(x**2).sum(1) for x in products.split(sizes, dim=1)], dim=1)
    bound = (2 * energies.mean(0) / count).sqrt()
    total_bound = (2 * energies.sum(1).mean() / count).sqrt()
    if count < 2:
        return bound.tolist(), float(total_bound)
    return (torch.maximum(blocks.std(0) / count**0.5, bound).tolist(),
            float(torch.maximum(blocks.sum(1).std() / count**0.5, total_bound)))


def assert_nested_close(actual, expected, where: str = "", rtol: float = 1e-8, atol: float = 1e-11) -> None:
    """``actual`` equals ``expected`` leaf by leaf (dicts by key, lists and tuples by position; numbers,
    arrays and tensors to ``rtol`` / ``atol``, NaN equal to NaN; anything else by ``==``)."""
    import numpy as np

    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{where}: keys {set(actual)} != {set(expected)}"
        for key in expected:
            if key == "checks" and isinstance(expected[key], dict) and "valid" in expected[key]:
                # a step's self-checks describe how it was computed (backward passes, loss factor, rounding):
                # runs of the same step in other forms agree on whether it is valid, not on those details
                assert actual[key]["valid"] == expected[key]["valid"], f"{where}.checks: {actual[key]} vs {expected[key]}"
                continue
            assert_nested_close(actual[key], expected[key], f"{where}.{key}", rtol, atol)
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: {actual!r} != {expected!r}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_nested_close(a, e, f"{where}[{index}]", rtol, atol)
    elif isinstance(expected, (float, int, np.ndarray, np.number, torch.Tensor)) and not isinstance(expected, bool):
        def plain(value):
            return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value

        np.testing.assert_allclose(np.asarray(plain(actual), dtype=float), np.asarray(plain(expected), dtype=float),
                                   rtol=rtol, atol=atol, err_msg=where)  # fmt: skip
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def zoo_or_helper_problem(name: str):
    """``(model, mean loss fn(outputs, targets), per-row losses fn, batch(size, seed))`` of a helper
    problem (``mlp``, ``cnn``) or a :mod:`tests.zoo` problem."""
    if name in ("mlp", "cnn"):
        model, lossfunc, individual = make_problem(name)
        return model, lossfunc, individual, lambda size, seed: make_batch(name, size, seed)
    from tests.zoo import ZOO

    problem = ZOO[name](0)

    def mean_loss(outputs, targets):
        return problem.sample_losses(outputs, targets).mean()

    return problem.model, mean_loss, problem.sample_losses, problem.batch


def accumulated_steps(cockpit, problem, optimizer, steps: int, rows: int, micro_batches: int, before_last=None):
    """``steps`` optimizer steps of ``rows`` rows each (batches ``batch(rows, 100 + step)``), each in
    ``micro_batches`` equal micro-batches whose losses are divided by their count, the cockpit
    entered around every backward pass with ``info["micro_batches"]``; ``before_last(step)`` runs
    before the last micro-batch's backward pass. Returns the cockpit's output."""
    model, lossfunc, individual, batch = problem
    size = rows // micro_batches
    for step in range(steps):
        inputs, targets = batch(rows, 100 + step)
        optimizer.zero_grad()
        for micro in range(micro_batches):
            part = slice(micro * size, (micro + 1) * size)
            outputs = model(inputs[part])
            loss = lossfunc(outputs, targets[part])
            info = {
                "batch_size": size,
                "individual_losses": individual(outputs, targets[part]),
                "loss": loss,
                "optimizer": optimizer,
                "micro_batches": micro_batches,
            }
            if before_last is not None and micro == micro_batches - 1:
                before_last(step)
            with cockpit(step, info=info):
                (loss / micro_batches).backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return cockpit.get_output()


def row_stats_probe(track_schedule):
    """A quantity that stores this step's per-sample sums of squares (per parameter) and squared norms (per row):
    what a brute-force loop over rows is compared with."""
    from cockpit_like.backends.per_sample_stats import SquaredNorms, SumOfSquares
    from cockpit_like.context import get_record
    from cockpit_like.quantities.quantity import SingleStepQuantity

    class RowStatsProbe(SingleStepQuantity):
        def per_sample_stats(self, step):
            return [SumOfSquares(), SquaredNorms()]

        def _compute(self, step, params, loss):
            record = get_record(step)
            return [s.clone() for s in record.stat(SumOfSquares())], record.stat(SquaredNorms()).clone()

    return RowStatsProbe(track_schedule)


def gram_probe(track_schedule):
    """A quantity that stores this step's Gram summary of the rows: ``{"diag": ||g_i||^2 / B^2, "row_sums":
    g_i^T gbar / B}`` per row, for comparison with per-sample gradients of a brute-force loop."""
    from cockpit_like.backends.per_sample_stats import GramSummary
    from cockpit_like.context import get_record
    from cockpit_like.quantities.quantity import SingleStepQuantity

    class GramProbe(SingleStepQuantity):
        def per_sample_stats(self, step):
            return [GramSummary()]

        def _compute(self, step, params, loss):
            diag, row_sums = get_record(step).stat(GramSummary())
            return {"diag": diag.clone(), "row_sums": row_sums.clone()}

    return GramProbe(track_schedule)


def assert_rows_match(cockpit, probe, step: int, G: torch.Tensor) -> None:
    """Step ``step`` valid, and its :func:`gram_probe` values and ``NormTest`` those of the per-sample gradients
    ``G`` (``[B, D]``, a brute-force loop), in float64."""
    import pytest

    rows = G.shape[0]
    assert cockpit.checks[step].get("valid", True), cockpit.checks[step]
    got = probe.output[step]
    torch.testing.assert_close(torch.as_tensor(got["diag"]), (G**2).sum(1) / rows**2, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(torch.as_tensor(got["row_sums"]), G @ G.mean(0) / rows, rtol=1e-9, atol=1e-15)
    gbar = G.mean(0)
    expected = (((G - gbar) ** 2).sum() / (rows * (rows - 1) * (gbar @ gbar))).sqrt()
    assert cockpit.get_output()[step]["NormTest"] == pytest.approx(float(expected), rel=1e-9)


def brute_force_step(model: nn.Module, row_loss, rows: int) -> dict:
    """Loss, GradNorm, NormTest, InnerTest and OrthoTest of one batch of ``rows`` rows (QUANTITIES.md §3, §5), from
    per-sample gradients of a loop of ``torch.autograd.grad``; ``row_loss(model, i)``: the loss of row ``i``."""
    import math

    params = [p for p in model.parameters() if p.requires_grad]
    losses, grads = [], []
    for i in range(rows):
        loss = row_loss(model, i)
        losses.append(float(loss.detach()))
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    flat = torch.stack(grads).to(torch.float64)  # [N, D]
    mean = flat.mean(0)
    g2 = float(mean @ mean)
    pi = flat @ mean  # <g_i, g>
    n = rows
    ortho = flat - (pi / g2)[:, None] * mean
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    return {
        "Loss": sum(losses) / n,
        "GradNorm": [float(mean[offsets[k] : offsets[k + 1]].norm()) for k in range(len(params))],
        "NormTest": math.sqrt(float(((flat - mean) ** 2).sum()) / ((n - 1) * n * g2)),
        "InnerTest": math.sqrt(float(((pi - g2) ** 2).sum()) / ((n - 1) * n * g2**2)),
        "OrthoTest": math.sqrt(float((ortho**2).sum()) / ((n - 1) * n * g2)),
    }
