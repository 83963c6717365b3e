"""Alpha's look-ahead leaves the run alone for any optimizer, and stores Alpha only where it predicted the update.

An optimizer whose ``step()`` reaches more than its ``param_groups`` and ``optimizer.state`` (a wrapper that
steps an inner optimizer, ZeRO, buffers in a list, a tensor counter, a generator of its own) runs its look-ahead
under :class:`cockpit_like.utils.optim.StepGuard`. Each case: the run with the cockpit is bitwise the run
without it (parameters after the steps, the optimizer's state, ``torch.rand`` afterwards), and Alpha either
equals its brute-force value from the run's own parameter snapshots (``tests.test_alpha.reference_alpha``) or
is absent with a note that names the optimizer and what to declare.
"""

import collections
import tempfile
import warnings

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.quantities import Alpha, UpdateSize
from cockpit_like.utils import optim as optim_utils
from cockpit_like.utils.optim import keeps_state_in_groups, lookahead_update
from tests.helpers import make_batch, make_problem, per_sample_grads
from tests.test_alpha import reference_alpha

BATCH = 6


class Wrapper(torch.optim.Optimizer):
    """Pure delegation to an inner optimizer that holds the parameters (timm's Lookahead shares the groups)."""

    def __init__(self, base):
        self.base = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = collections.defaultdict(dict)
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()

    def step(self, closure=None):
        return self.base.step(closure)

    def zero_grad(self, set_to_none=True):
        self.base.zero_grad(set_to_none)


class ListMomentum(torch.optim.Optimizer):
    """Momentum buffers in a list attribute, indexed by position (not in ``optimizer.state``)."""

    def __init__(self, params, lr=0.2, mom=0.9):
        super().__init__(params, dict(lr=lr, mom=mom))
        self.bufs = [torch.zeros_like(p) for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        i = 0
        for g in self.param_groups:
            for p in g["params"]:
                b = self.bufs[i]
                i += 1
                b.mul_(g["mom"]).add_(p.grad)
                p.add_(b, alpha=-g["lr"])


class TensorCounterAdam(torch.optim.Optimizer):
    """Adam-like, its step counter a tensor updated in place (bias correction reads it)."""

    def __init__(self, params, lr=0.02):
        super().__init__(params, dict(lr=lr))
        self.t = torch.zeros((), dtype=torch.float64)

    @torch.no_grad()
    def step(self, closure=None):
        self.t += 1
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if "m" not in st:
                    st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                st["m"].lerp_(p.grad, 0.1)
                st["v"].lerp_(p.grad**2, 0.001)
                p.addcdiv_(st["m"] / (1 - 0.9**self.t), (st["v"] / (1 - 0.999**self.t)).sqrt() + 1e-8, value=-g["lr"])


class SGLD(torch.optim.Optimizer):
    """Gradient step plus Gaussian noise, from the global generator or a generator of its own."""

    def __init__(self, params, lr=0.05, own_generator=False):
        super().__init__(params, dict(lr=lr))
        self.gen = torch.Generator().manual_seed(42) if own_generator else None

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                noise = torch.randn(p.shape, generator=self.gen, dtype=p.dtype)
                p.add_(p.grad, alpha=-g["lr"]).add_(noise, alpha=(2 * g["lr"]) ** 0.5 * 0.01)


def run(make_optimizer, with_cockpit: bool, steps: int = 4):
    """``(model, optimizer, cockpit, observed, torch.rand(3) afterwards)``; ``observed[t]``: the run's own snapshots."""
    torch.manual_seed(0)
    model, lossfunc, individual = make_problem("mlp")
    opt = make_optimizer(list(model.parameters()))
    cockpit = Cockpit(model.parameters(), [Alpha(lambda t: True), UpdateSize(lambda t: True)]) if with_cockpit else None
    observed = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        for step in range(steps):
            inputs, labels = make_batch("mlp", BATCH, seed=100 + step)
            grads = per_sample_grads(model, inputs, labels)
            opt.zero_grad()
            out = model(inputs)
            loss, losses = lossfunc(out, labels), individual(out, labels)
            observed[step] = {"params": [p.detach().clone() for p in model.parameters()],
                              "grads": grads,
                              "loss": loss.item(), "losses": losses.detach()}  # fmt: skip
            if cockpit is None:
                loss.backward()
            else:
                info = {"batch_size": BATCH, "individual_losses": losses, "loss": loss, "optimizer": opt}
                with cockpit(step, info=info):
                    loss.backward()
            opt.step()
        observed[steps] = {"params": [p.detach().clone() for p in model.parameters()]}
    return model, opt, cockpit, observed, torch.rand(3)


def assert_same_run(plain, tracked, extra_state=lambda opt: [], holder=lambda opt: opt):
    """Parameters, optimizer state (the ``state_dict`` of ``holder(optimizer)``, the optimizer that holds the
    parameters, and ``extra_state``'s tensors) and torch's RNG: bitwise."""
    (model0, opt0, _, _, rand0), (model1, opt1, _, _, rand1) = plain, tracked
    for a, b in zip(model0.parameters(), model1.parameters()):
        assert torch.equal(a, b)
        assert a._version == b._version  # a graph saved before the look-ahead stays usable
    state0, state1 = holder(opt0).state_dict()["state"], holder(opt1).state_dict()["state"]
    assert state0.keys() == state1.keys()
    for key in state0:
        for name, value in state0[key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state1[key][name])), (key, name)
    for a, b in zip(extra_state(opt0), extra_state(opt1), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(rand0, rand1)


def assert_update_size_is_brute_force(tracked, steps: int = 4):
    _, _, cockpit, observed, _ = tracked
    for t in range(steps - 1):
        expected = [(b - a).norm().item() for a, b in zip(observed[t]["params"], observed[t + 1]["params"])]
        assert cockpit.get_output()[t]["UpdateSize"] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def assert_alpha_is_brute_force(tracked, steps: int = 4):
    _, _, cockpit, observed, _ = tracked
    for t in range(steps - 1):
        expected = reference_alpha(observed[t], observed[t + 1], BATCH)
        assert cockpit.get_output()[t]["Alpha"] == pytest.approx(expected, rel=1e-8, abs=1e-10), t


@pytest.mark.parametrize(
    "make_optimizer, extra_state",
    [
        (lambda ps: ListMomentum(ps), lambda opt: opt.bufs),
        (lambda ps: TensorCounterAdam(ps), lambda opt: [opt.t]),
        (lambda ps: SGLD(ps, own_generator=True), lambda opt: [opt.gen.get_state()]),
        (lambda ps: SGLD(ps, own_generator=False), lambda opt: []),
    ],
    ids=["list-of-buffers", "tensor-counter", "sgld-own-generator", "sgld-global-generator"],
)
def test_state_outside_optimizer_state_is_left_alone_and_alpha_is_exact(make_optimizer, extra_state):
    plain, tracked = run(make_optimizer, False), run(make_optimizer, True)
    assert_same_run(plain, tracked, extra_state)
    assert_update_size_is_brute_force(tracked)
    assert_alpha_is_brute_force(tracked)
    assert not any(c.get("notes") for c in tracked[2].checks.values())


class OldLookahead(torch.optim.Optimizer):
    """timm's older Lookahead: an Optimizer subclass that never calls ``Optimizer.__init__`` (no step hook tables,
    or plain ``dict`` ones: ``tables``), stepping its inner optimizer and pulling the weights towards slow copies
    every ``k`` steps."""

    def __init__(self, base, tables=None, alpha=0.5, k=2):
        self._base_optimizer = base
        self.param_groups, self.defaults, self.state = base.param_groups, base.defaults, base.state
        self.alpha, self.k, self.n, self.slow = alpha, k, 0, {}
        if tables is not None:
            self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = tables(), tables()

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        self.n += 1
        if self.n % self.k == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    slow = self.slow.setdefault(p, p.detach().clone())
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss

    def zero_grad(self, set_to_none=True):
        self._base_optimizer.zero_grad(set_to_none)


@pytest.mark.parametrize(
    "make, inner",
    [
        (lambda ps: Wrapper(torch.optim.SGD(ps, lr=0.5, momentum=0.9)), "base"),
        # timm's older Lookahead, without Optimizer.__init__: no step hook tables, or plain dicts. Declared as
        # info['optimizer'] it made every tracked step raise torch's AttributeError (a TypeError for the dicts) from
        # the cockpit's step hooks (outside trial 36, 12 runs): its step cannot call hooks (its class was never
        # patched), so the cockpit watches it no more than any optimizer it cannot hook
        (lambda ps: OldLookahead(torch.optim.SGD(ps, lr=0.5, momentum=0.9)), "_base_optimizer"),
        (lambda ps: OldLookahead(torch.optim.SGD(ps, lr=0.5, momentum=0.9), dict), "_base_optimizer"),
    ],
    ids=["delegating-wrapper", "no-hook-tables", "dict-hook-tables"],
)
def test_a_wrapper_stepping_its_inner_optimizer_leaves_the_run_alone_and_stores_no_alpha(make, inner):
    plain, tracked = run(make, False), run(make, True)
    assert_same_run(plain, tracked, holder=lambda opt: getattr(opt, inner))
    assert_update_size_is_brute_force(tracked)
    cockpit = tracked[2]
    name = type(tracked[1]).__name__
    for t in range(3):
        assert "Alpha" not in cockpit.get_output()[t]
        (note,) = cockpit.checks[t]["notes"]
        assert f"Alpha of step {t} is not stored" in note and f"{name}.step()" in note
        assert f"info['optimizer'] = <your {name}>.{inner}, its SGD" in note


class OwnList(torch.optim.Optimizer):
    """Steps the parameters it listed at construction, not those in its param_groups."""

    def __init__(self, params, lr=0.1):
        params = list(params)
        super().__init__(params, dict(lr=lr))
        self.params = params

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.params:
            p.add_(p.grad, alpha=-self.param_groups[0]["lr"])


def test_an_optimizer_stepping_its_own_list_of_parameters_leaves_the_run_alone_and_stores_no_alpha():
    plain, tracked = run(OwnList, False), run(OwnList, True)
    assert_same_run(plain, tracked)
    assert_update_size_is_brute_force(tracked)
    for t in range(3):
        assert "Alpha" not in tracked[2].get_output()[t]
        (note,) = tracked[2].checks[t]["notes"]
        assert "OwnList.step()" in note and "keeps a list" in note and "holds the parameters in its param_groups" in note


def test_declaring_the_inner_optimizer_of_a_wrapper_gives_alpha():
    """What the note says to do works: the inner optimizer is a plain torch.optim one."""
    holder = {}

    def make(ps):
        holder["wrapper"] = Wrapper(torch.optim.SGD(ps, lr=0.5, momentum=0.9))
        return holder["wrapper"].base

    tracked = run(make, True)
    assert_alpha_is_brute_force(tracked)


def test_zero_redundancy_optimizer_is_left_alone_and_stores_no_alpha(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        make = lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, lr=0.02)  # noqa: E731
        plain, tracked = run(make, False), run(make, True)
    finally:
        dist.destroy_process_group()
    assert_same_run(plain, tracked, holder=lambda opt: opt.optim)
    assert_update_size_is_brute_force(tracked)
    cockpit = tracked[2]
    for t in range(3):
        assert "Alpha" not in cockpit.get_output()[t]
        assert any("ZeroRedundancyOptimizer.step()" in n and ".optim, its AdamW" in n for n in cockpit.checks[t]["notes"])


def test_the_guard_puts_back_what_a_failing_step_wrote():
    """A step that raises halfway: the list buffers it wrote are as they were."""

    class Failing(ListMomentum):
        def step(self, closure=None):
            super().step()
            raise RuntimeError("boom")

    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    w.grad = torch.full_like(w, 2.0)
    opt = Failing([w])
    opt.bufs[0].fill_(1.0)
    version = opt.bufs[0]._version
    with pytest.raises(RuntimeError, match="boom"):
        lookahead_update(opt, [w])
    assert torch.equal(opt.bufs[0], torch.ones(3, dtype=torch.float64)) and opt.bufs[0]._version == version
    assert torch.equal(w, torch.ones(3, dtype=torch.float64))


def test_torch_optimizers_take_the_fast_path(monkeypatch):
    """The built-in optimizers (and subclasses that add only ``__init__``) are not guarded: no cost added."""

    class OnlyInit(torch.optim.Adam):
        def __init__(self, params):
            super().__init__(params, lr=0.1)
            self.note = "mine"

    class OwnStep(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    w = torch.nn.Parameter(torch.ones(3))
    for opt in (torch.optim.SGD([w], lr=0.1, momentum=0.9), torch.optim.AdamW([w]), OnlyInit([w])):
        assert keeps_state_in_groups(opt)
    patched = torch.optim.SGD([w], lr=0.1)
    patched.step = lambda closure=None, step=patched.step: step(closure)  # a wrapper's patch on the instance
    for opt in (OwnStep([w], lr=0.1), ListMomentum([w]), Wrapper(torch.optim.SGD([w], lr=0.1)), patched):
        assert not keeps_state_in_groups(opt)

    def refuse(*_):
        raise AssertionError("guarded")

    monkeypatch.setattr(optim_utils.StepGuard, "__init__", refuse)
    w.grad = torch.ones(3)
    (update,) = lookahead_update(torch.optim.SGD([w], lr=0.1), [w])
    assert torch.allclose(update, torch.full((3,), -0.1))


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


def _job_ddp_zero(rank: int) -> dict:
    """Both ranks of DDP with ``ZeroRedundancyOptimizer(AdamW)``: each rank's inner optimizer steps its shard and
    ZeRO broadcasts the shards (``c10d::broadcast_``, an in-place op without alias annotations) in its step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    result = {}
    for with_cockpit in (False, True):
        model, lossfunc, individual = make_problem("mlp")
        ddp = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=0.02)
        cockpit = Cockpit(ddp.parameters(), [Alpha(lambda t: True), UpdateSize(lambda t: True)], model=ddp) \
            if with_cockpit else None  # fmt: skip
        snapshots = []
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook")
            for step in range(3):
                inputs, labels = make_batch("mlp", 2 * BATCH, seed=100 + step)
                inputs, labels = inputs[rank * BATCH : (rank + 1) * BATCH], labels[rank * BATCH : (rank + 1) * BATCH]
                opt.zero_grad()
                out = ddp(inputs)
                loss, losses = lossfunc(out, labels), individual(out, labels)
                snapshots.append([p.detach().clone() for p in model.parameters()])
                if cockpit is None:
                    loss.backward()
                else:
                    with cockpit(step, info={"batch_size": BATCH, "individual_losses": losses, "loss": loss,
                                             "optimizer": opt}):  # fmt: skip
                        loss.backward()
                opt.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
        result[with_cockpit] = {"snapshots": snapshots, "rand": torch.rand(3),
                                "output": None if cockpit is None else cockpit.get_output(),
                                "notes": None if cockpit is None else {t: c.get("notes", []) for t, c in cockpit.checks.items()}}  # fmt: skip
    return result


@pytest.mark.slow
def test_zero_redundancy_optimizer_under_ddp_is_left_alone_and_stores_no_alpha(tmp_path):
    from tests.test_distributed import _spawn

    for rank, result in enumerate(_spawn("tests.test_lookahead_guard:_job_ddp_zero", tmp_path, timeout=180)):
        plain, tracked = result[False], result[True]
        for a, b in zip(plain["snapshots"][-1], tracked["snapshots"][-1]):
            assert torch.equal(a, b), rank
        assert torch.equal(plain["rand"], tracked["rand"])
        if rank > 0:
            continue  # one rank keeps the values (docs/distributed.md)
        snapshots = tracked["snapshots"]
        for t in range(2):
            expected = [(b - a).norm().item() for a, b in zip(snapshots[t], snapshots[t + 1])]
            assert tracked["output"][t]["UpdateSize"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        for t in range(3):
            assert "Alpha" not in tracked["output"][t]
            (note,) = tracked["notes"][t]
            assert f"Alpha of step {t} is not stored" in note and "ZeroRedundancyOptimizer.step()" in note


def test_the_users_step_hooks_run_once_per_step():
    """``register_step_pre_hook`` / ``register_step_post_hook`` (an EMA of the weights in a post-hook) and a global
    pre-hook: Alpha's look-ahead ran them a second time per tracked step, and the EMA differed from the run without
    the cockpit (seventh round of outside trials). They now run once per step, and the run is bitwise the same."""
    from torch import nn
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from cockpit_like.utils.schedules import linear

    def run(tracked: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ema = [p.detach().clone() for p in model.parameters()]
        calls = {"pre": 0, "post": 0, "global": 0}

        def pre(opt, args, kwargs):
            calls["pre"] += 1

        def post(opt, args, kwargs):
            calls["post"] += 1
            with torch.no_grad():
                for average, p in zip(ema, model.parameters()):
                    average.mul_(0.9).add_(0.1 * p)

        def counted(opt, args, kwargs):
            if opt is optimizer:
                calls["global"] += 1

        handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post),
                   register_optimizer_step_pre_hook(counted)]
        cockpit = Cockpit(model.parameters(), quantities=[Alpha(linear(1)), UpdateSize(linear(1))], model=model) if tracked else None
        generator = torch.Generator().manual_seed(1)
        try:
            for step in range(3):
                x, y = torch.randn(6, 5, dtype=torch.float64, generator=generator), torch.randint(0, 3, (6,), generator=generator)
                optimizer.zero_grad()
                losses = nn.functional.cross_entropy(model(x), y, reduction="none")
                if tracked:
                    with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean(),
                                             "optimizer": optimizer}):
                        losses.mean().backward()
                else:
                    losses.mean().backward()
                optimizer.step()
        finally:
            for handle in handles:
                handle.remove()
        return calls, ema, [p.detach().clone() for p in model.parameters()], cockpit

    plain, tracked = run(False), run(True)
    assert plain[0] == tracked[0] == {"pre": 3, "post": 3, "global": 3}
    assert all(torch.equal(a, b) for a, b in zip(plain[1] + plain[2], tracked[1] + tracked[2]))
    assert isinstance(tracked[3].get_output()[1]["Alpha"], float)  # the look-ahead still predicts the update
