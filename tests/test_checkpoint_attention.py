"""Non-reentrant activation checkpointing around ``scaled_dot_product_attention`` with the ``full`` preset.

A step that needs the graph runs its forward pass with the math attention kernel (it has a second derivative);
the checkpoint recomputes the forward inside the backward passes (the user's, and the cockpit's Hessian-vector
products), and a recomputation with another kernel saves other tensors: ``CheckpointError`` ("different
metadata"), found by an outside tester on a nanoGPT-style loop. The kernels are held there too: the numbers are
those of the same model without checkpointing. TIC's GGN diagonal from ``info["outputs"]`` runs backward passes of
its own through the step's graph, which recompute the checkpoint as well (outside trial 24: ``CheckpointError``
there, with the Hessian-vector products fine)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 16))


class Net(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.block, self.head = nn.Linear(4, 16), Attention(), nn.Linear(16, 3)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.emb(x)
        block = checkpoint(self.block, h, use_reentrant=False) if self.checkpointed else self.block(h)
        return self.head(h + block).mean(1)


def run(checkpointed: bool, outputs: bool = False) -> tuple[dict, dict]:
    model = Net(checkpointed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("full"), model=model)
    generator = torch.Generator().manual_seed(3)
    for step in range(2):
        x, y = torch.randn(8, 16, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        logits = model(x)
        losses = F.cross_entropy(logits, y, reduction="none")
        info = {"batch_size": 8, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
        if outputs:
            info["outputs"] = logits
        with cockpit(step, info=info):
            losses.mean().backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return cockpit.get_output(), cockpit.checks


@pytest.mark.parametrize("outputs", [False, True])
def test_full_preset_through_a_checkpointed_attention_block(outputs):
    checkpointed, checks = run(True, outputs)
    plain, _ = run(False, outputs)
    assert all(checks[step]["valid"] for step in range(2)), checks
    names = ("HessMaxEV", "HessTrace", "GradNorm") + (("TICDiag",) if outputs else ())
    assert all(name in checkpointed[step] for step in range(2) for name in names)
    for step in range(2):
        for name in names:
            assert checkpointed[step][name] == pytest.approx(plain[step][name], rel=1e-4, abs=1e-6), name
