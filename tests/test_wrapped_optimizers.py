"""``info["optimizer"]`` as a framework's wrapper: accelerate's ``AcceleratedOptimizer`` (an ``Optimizer`` subclass
without the base class's initialisation: ``register_step_pre_hook`` raised ``AttributeError:
'_optimizer_step_pre_hooks'``, found by an outside tester) is read through to the optimizer it wraps; the numbers
are those of the unwrapped optimizer passed directly."""

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")


def train(wrap: bool, steps: int = 3) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    passed = optimizer
    if wrap:
        model, passed = accelerate.Accelerator(cpu=True).prepare(model, optimizer)
        assert type(passed).__name__ == "AcceleratedOptimizer"
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(6, 5, generator=generator), torch.randint(0, 3, (6,), generator=generator)
        passed.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        info = {"batch_size": 6, "individual_losses": losses, "loss": losses.mean(), "optimizer": passed}
        with cockpit(step, info=info):
            losses.mean().backward()
        passed.step()
        assert info["optimizer"] is passed  # the caller's dict is left as it is
    return cockpit.get_output(), cockpit.checks


def test_accelerated_optimizer_is_read_through():
    wrapped, checks = train(wrap=True)
    plain, _ = train(wrap=False)
    assert all(checks[s]["valid"] and not checks[s]["notes"] for s in range(3)), checks
    for step in range(2):
        assert wrapped[step]["Alpha"] == pytest.approx(plain[step]["Alpha"], rel=1e-6)
        assert wrapped[step]["UpdateSize"] == pytest.approx(plain[step]["UpdateSize"], rel=1e-6)
