"""Alpha: float64 brute force for several optimizers, the 1-D quadratic, memory, look-ahead."""

import gc
import warnings

import numpy as np
import pytest
import torch
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.context import MissingInfoError
from cockpit_like.functional.alpha import alpha_from_observations
from cockpit_like.quantities import Alpha, UpdateSize
from cockpit_like.quantities.alpha import lookahead_update
from cockpit_like.utils.schedules import linear
from tests.helpers import make_batch, make_problem, per_sample_grads


class DecayingSignSGD(torch.optim.Optimizer):
    """A custom optimizer with non-tensor state: p -= lr / n * sign(grad)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                p.add_(torch.sign(p.grad), alpha=-group["lr"] / state["n"])


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.3),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.02),
    "custom": lambda ps: DecayingSignSGD(ps, lr=0.01),
}


def reference_alpha(start, end, batch_size):
    """Alpha from its definition; GLS solved by weighted lstsq (not the normal equations)."""
    d = torch.cat([(b - a).reshape(-1) for a, b in zip(start["params"], end["params"])])
    tau = d.norm().item()
    ys, variances = [], []
    for obs in (start, end):
        ys.append(obs["loss"])
        variances.append(obs["losses"].var().item())
    for obs in (start, end):
        g = torch.cat([x.reshape(batch_size, -1) for x in obs["grads"]], 1)
        u = g @ d / tau
        ys.append(u.mean().item())
        variances.append(u.var().item())
    phi = np.array([[1, 0, 0], [1, tau, tau**2], [0, 1, 0], [0, 1, 2 * tau]], dtype=float)
    w = 1 / np.sqrt(np.array(variances))
    mu = np.linalg.lstsq(phi * w[:, None], np.array(ys) * w, rcond=None)[0]
    return -1 if mu[2] < 0 else 2 * tau / (-mu[1] / mu[2]) - 1


def run(problem, optimizer, schedule, steps, batch_size=6, bias=True, clip=None, quantities=(), after_step=None):
    model, lossfunc, individual = make_problem(problem, bias=bias)
    opt = OPTIMIZERS[optimizer](model.parameters())
    alpha = Alpha(schedule)
    cockpit = Cockpit(model.parameters(), [alpha, *quantities])
    observed = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        for step in range(steps):
            inputs, labels = make_batch(problem, batch_size, seed=100 + step)
            grads = per_sample_grads(model, inputs, labels)
            opt.zero_grad()
            out = model(inputs)
            loss = lossfunc(out, labels)
            losses = individual(out, labels)
            observed[step] = {
                "params": [p.detach().clone() for p in model.parameters()],
                "grads": grads,
                "loss": loss.item(),
                "losses": losses.detach(),
            }
            info = {"batch_size": batch_size, "individual_losses": losses, "loss": loss, "optimizer": opt}
            with cockpit(step, info=info):
                loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if after_step is not None:
                after_step(step, model, alpha)
    return alpha, observed


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_matches_brute_force(problem, optimizer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alpha, observed = run(problem, optimizer, linear(1), 4)
    assert not [w for w in caught if "Alpha" in str(w.message)]
    out = alpha.get_output()
    assert sorted(out) == [0, 1, 2]
    for step, value in out.items():
        expected = reference_alpha(observed[step], observed[step + 1], 6)
        assert float(value) == pytest.approx(expected, rel=1e-8, abs=1e-10)


@pytest.mark.parametrize("bias,batch_size", [(False, 3), (True, 9)])
def test_sparse_schedule_and_batch_sizes(bias, batch_size):
    alpha, observed = run("mlp", "adam", linear(2, offset=1), 5, batch_size=batch_size, bias=bias)
    out = alpha.get_output()
    assert sorted(out) == [1, 3]
    for step, value in out.items():
        assert float(value) == pytest.approx(reference_alpha(observed[step], observed[step + 1], batch_size), rel=1e-8)


def test_clipping_with_sgd_is_exact_and_with_adam_warns():
    # SGD: clipping rescales the update, the direction (all Alpha's slopes need) is unchanged
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alpha, observed = run("mlp", "sgd", linear(1), 3, clip=1e-3)
    assert not [w for w in caught if "Alpha" in str(w.message)]
    for step, value in alpha.get_output().items():
        assert float(value) == pytest.approx(reference_alpha(observed[step], observed[step + 1], 6), rel=1e-8)
    # Adam: clipping changes the direction; the result is approximate and says so
    with pytest.warns(UserWarning, match="differs in direction from the optimizer's look-ahead"):
        alpha, _ = run("mlp", "adam", linear(1), 3, clip=1e-3)
    assert sorted(alpha.get_output()) == [0, 1]


def test_the_predicted_update_is_freed_at_the_optimizer_step():
    """Right after ``optimizer.step()`` Alpha keeps only the start parameters (one copy, shared with
    UpdateSize), its observations and the settled check: no predicted update or gradient sum through the
    next forward and backward pass. The update is made one parameter at a time; the values stay those
    of the brute-force twin."""
    from cockpit_like.quantities import alpha as alpha_module

    update_size = UpdateSize(linear(1))
    seen = []

    def after_step(step, model, alpha):
        keys = sorted(key for start, key in alpha.cached_keys() if start == step)
        kept = alpha.load_from_cache(step, "params")
        shared = update_size.load_from_cache(step, "params")
        seen.append((keys, all(a is b for a, b in zip(kept, shared))))

    alpha, observed = run("mlp", "adam", linear(1), 4, quantities=(update_size,), after_step=after_step)
    assert seen == [(["observations", "params", "settled"], True)] * 4
    steps = alpha_module._Steps([torch.ones(3), torch.zeros(2)], [torch.zeros(3), torch.ones(2)])
    assert steps._made is None  # one parameter at a time
    assert [s.tolist() for s in steps] == [[1.0, 1.0, 1.0], [-1.0, -1.0]] and len(steps) == 2
    for step, value in alpha.get_output().items():
        assert float(value) == pytest.approx(reference_alpha(observed[step], observed[step + 1], 6), rel=1e-8, abs=1e-10)


@pytest.mark.parametrize("optimizer,clip", [("adam", 1e-3), ("momentum", None)])
def test_settling_at_the_step_equals_checking_at_the_next_step(optimizer, clip, monkeypatch):
    """The check made right after ``optimizer.step()`` gives the numbers of the check made when the next
    step begins (an optimizer without a step post-hook: the predicted update and the gradient sum kept
    until then), warning alike."""

    def outputs():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            alpha, _ = run("mlp", optimizer, linear(1), 4, clip=clip)
        return alpha.get_output(), sorted({str(w.message)[:40] for w in caught if "Alpha" in str(w.message)})

    settled = outputs()
    monkeypatch.setattr(Alpha, "_watch_step", lambda self, start, optimizer: None)
    assert settled == outputs()
    assert bool(settled[1]) == (clip is not None)


@pytest.mark.parametrize("settled", [False, True])
def test_parameters_changed_after_the_step_warn(settled, monkeypatch):
    """A change of the parameters after ``optimizer.step()`` (a projection) is not the predicted update
    (against the update settled at the optimizer's step, or checked at the next step where the optimizer
    has no step post-hook): Alpha says its value is approximate."""
    if not settled:
        monkeypatch.setattr(Alpha, "_watch_step", lambda self, start, optimizer: None)

    def project(step, model, alpha):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)

    with pytest.warns(UserWarning, match="differs in direction from the optimizer's look-ahead"):
        alpha, _ = run("mlp", "adam", linear(1), 3, after_step=project)
    assert sorted(alpha.get_output()) == [0, 1]


def _quadratic_alpha(lr, targets, steps=2):
    """Per-sample losses (w - y_i)^2 on a 1-D parameter; minimum of the mean at mean(y)."""
    model = extend(nn.Linear(1, 1, bias=False).double())
    with torch.no_grad():
        model.weight.fill_(3.0)
    lossfunc, individual = extend(nn.MSELoss()), nn.MSELoss(reduction="none")
    inputs, y = torch.ones(len(targets), 1, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64)[:, None]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    alpha = Alpha(linear(1))
    cockpit = Cockpit(model.parameters(), [alpha])
    for step in range(steps):
        opt.zero_grad()
        out = model(inputs)
        loss = lossfunc(out, y)
        info = {"batch_size": len(targets), "individual_losses": individual(out, y).flatten(), "loss": loss, "optimizer": opt}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook")
            with cockpit(step, info=info):
                loss.backward()
        opt.step()
    return float(alpha.get_output()[0])


@pytest.mark.parametrize("lr,expected", [(0.5, 0.0), (1.0, 1.0), (0.25, -0.5)])
def test_quadratic_noisy_samples(lr, expected):
    # Hessian of the mean loss is 2: lr 0.5 jumps to the minimum, lr 1 to the mirrored point
    assert _quadratic_alpha(lr, [0.5, 1.0, 2.0, -0.5]) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("lr,expected", [(0.5, 0.0), (1.0, 1.0)])
def test_quadratic_noise_free(lr, expected):
    # identical samples: every variance is exactly zero and replaced by 1e-10 (with a warning)
    with pytest.warns(RuntimeWarning, match="variance of the fit is exactly zero"):
        value = _quadratic_alpha(lr, [1.0, 1.0, 1.0])
    assert value == pytest.approx(expected, abs=1e-9)


def test_fit_corner_cases():
    assert alpha_from_observations(0.0, (1.0, 1.0), (0.0, 0.0), (1.0, 1.0), (1.0, 1.0)) == -1
    # concave: slope decreases along the step
    assert alpha_from_observations(1.0, (1.0, 0.0), (-0.5, -1.5), (1.0, 1.0), (1.0, 1.0)) == -1


def _per_sample_sized(batch_size, shapes):
    """Live tensors shaped like a per-sample gradient [B, *p.shape] of a weight matrix."""
    targets = {(batch_size, *s) for s in shapes}
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and tuple(obj.shape) in targets:
                    found.append(tuple(obj.shape))
            except Exception:  # noqa: BLE001 - exotic objects in gc
                continue
    return found


def test_memory_adam_keeps_no_per_sample_tensor_across_steps():
    batch_size = 7
    model, lossfunc, individual = make_problem("mlp")
    params = list(model.parameters())
    weight_shapes = [tuple(p.shape) for p in params if p.dim() == 2]
    num_params = sum(p.numel() for p in params)
    opt = torch.optim.Adam(params, lr=0.01)
    alpha = Alpha(linear(1))
    cockpit = Cockpit(params, [alpha])
    probe = torch.zeros(batch_size, *weight_shapes[0])  # the detector finds what it must find
    assert _per_sample_sized(batch_size, weight_shapes) == [probe.shape]
    del probe
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        for step in range(4):
            inputs, labels = make_batch("mlp", batch_size, seed=step)
            opt.zero_grad()
            out = model(inputs)
            loss = lossfunc(out, labels)
            info = {"batch_size": batch_size, "individual_losses": individual(out, labels), "loss": loss, "optimizer": opt}
            with cockpit(step, info=info):
                loss.backward()
            opt.step()
            del out, loss, info
            gc.collect()
            # between steps: no per-sample gradient anywhere, only O(D) in Alpha's cache
            assert _per_sample_sized(batch_size, weight_shapes) == []
            assert not any(hasattr(p, "grad_batch") for p in params)
            cached = [alpha.load_from_cache(s, k) for s, k in alpha.cached_keys()]
            tensors = [t for value in cached if isinstance(value, list) for t in value]
            assert all(isinstance(t, torch.Tensor) and t.shape in [p.shape for p in params] for t in tensors)
            assert sum(t.numel() for t in tensors) <= 3 * num_params
            assert all(isinstance(x, float) for value in cached if isinstance(value, tuple) for x in value)
    assert sorted(alpha.get_output()) == [0, 1, 2]


@pytest.mark.parametrize("part_bytes", [None, 1])
@pytest.mark.parametrize("optimizer", ["momentum", "adam", "custom"])
def test_lookahead_restores_everything(optimizer, part_bytes, monkeypatch):
    """The look-ahead equals the real step bitwise and writes nothing; ``part_bytes=1``: an element-wise
    optimizer's look-ahead steps one parameter at a time (bounded copies), with the same result."""
    from cockpit_like.utils import optim

    model, lossfunc, _ = make_problem("mlp")
    params = list(model.parameters())
    opt = OPTIMIZERS[optimizer](params)
    steps = []
    if part_bytes is not None:
        monkeypatch.setattr(optim, "LOOKAHEAD_PART_BYTES", part_bytes)
        shadow_step = optim._shadow_step
        monkeypatch.setattr(optim, "_shadow_step", lambda *a, **k: steps.append(k.get("only")) or shadow_step(*a, **k))
    for step in range(3):
        inputs, labels = make_batch("mlp", 5, seed=step)
        opt.zero_grad()
        lossfunc(model(inputs), labels).backward()
        before_params = [p.detach().clone() for p in params]
        before_grads = [p.grad.clone() for p in params]
        before_state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in params if p in opt.state}
        versions = [p._version for p in params]
        predicted = lookahead_update(opt, params)
        assert [p._version for p in params] == versions  # real params never written
        assert all(torch.equal(a, p) for a, p in zip(before_params, params))
        assert all(torch.equal(a, p.grad) for a, p in zip(before_grads, params))
        assert {id(p) for p in params if p in opt.state} == set(before_state)
        for p in params:
            for k, v in before_state.get(id(p), {}).items():
                assert torch.equal(v, opt.state[p][k]) if torch.is_tensor(v) else v == opt.state[p][k]
        opt.step()
        actual = [p.detach() - b for p, b in zip(params, before_params)]
        assert all(torch.equal(a, b) for a, b in zip(actual, predicted))
    if part_bytes is not None:  # one part per parameter for the element-wise ones, one step for the custom one
        expected = [None] * 3 if optimizer == "custom" else [{id(p)} for p in params] * 3
        assert steps == expected


def test_missing_info_fails_before_backward():
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), [Alpha(linear(1))])
    inputs, labels = make_batch("mlp", 4, 0)
    loss = lossfunc(model(inputs), labels)
    with pytest.raises(MissingInfoError, match=r"Alpha needs info\['individual_losses'\]"):
        with cockpit(0, info={"batch_size": 4, "loss": loss}):
            raise AssertionError("the body must not run")


def test_without_optimizer_warns_and_is_exact_for_sgd():
    model, lossfunc, individual = make_problem("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    alpha = Alpha(linear(1))
    cockpit = Cockpit(model.parameters(), [alpha])
    observed = {}
    with pytest.warns(UserWarning, match=r"no info\['optimizer'\]"):
        for step in range(2):
            inputs, labels = make_batch("mlp", 6, seed=step)
            observed[step] = {"params": [p.detach().clone() for p in model.parameters()], "grads": per_sample_grads(model, inputs, labels)}
            opt.zero_grad()
            out = model(inputs)
            loss = lossfunc(out, labels)
            losses = individual(out, labels)
            observed[step].update(loss=loss.item(), losses=losses.detach())
            with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": loss}):
                loss.backward()
            opt.step()
    assert float(alpha.get_output()[0]) == pytest.approx(reference_alpha(observed[0], observed[1], 6), rel=1e-8)
