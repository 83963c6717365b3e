"""The cockpit under DistributedDataParallel, launched with torchrun.

Run on 2 processes (CPU, gloo; on GPUs the same script uses nccl)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 examples/ddp_torchrun.py

or as a single process (``python examples/ddp_torchrun.py``). Every rank
trains an MLP on its shard of scikit-learn's digits (``DistributedSampler``
with ``drop_last=True``: equal local batches), and every quantity describes
the global batch (``docs/distributed.md``). Only rank 0 keeps the output,
writes the log and saves the dashboard.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
from backpack import extend
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from cockpit_like import Cockpit, CockpitPlotter
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear


def main(steps: int = 30, local_batch: int = 32, logdir: str | None = None) -> None:
    distributed = "WORLD_SIZE" in os.environ  # set by torchrun
    if distributed:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # a rank that stops (an error outside the cockpit, a crash) makes the others' collectives fail
        # after this timeout instead of hanging forever
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank() if distributed else 0
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)  # the same seed on every rank: the same initial model and Monte-Carlo draws

    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target))
    sampler = DistributedSampler(data, drop_last=True, seed=0) if distributed else None
    loader = DataLoader(data, batch_size=local_batch, sampler=sampler, shuffle=sampler is None, drop_last=True)

    model = extend(nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).to(device))
    net = nn.parallel.DistributedDataParallel(model) if distributed else model
    lossfunc, individual = extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    # the cockpit gets the DDP-wrapped model and is created before the first forward pass
    cockpit = Cockpit(model.parameters(), configuration("full", track_schedule=linear(5)), model=net)

    step = 0
    while step < steps:
        if sampler is not None:
            sampler.set_epoch(step)
        for inputs, labels in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = lossfunc(outputs, labels)
            info = {
                "batch_size": len(labels),  # this rank's batch; the cockpit sums them
                "individual_losses": individual(outputs, labels),
                "loss": loss,
                "optimizer": optimizer,
            }
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
            step += 1
            if step == steps:
                break

    path = figure = None
    if cockpit.keeps_output:  # rank 0 (Cockpit(..., log_rank=0)); the others keep nothing
        logdir = logdir or tempfile.mkdtemp(prefix="cockpit_ddp_")
        path = cockpit.write(os.path.join(logdir, "ddp_digits"))
        figure = CockpitPlotter().plot(cockpit, show_plot=False, save_plot=True, savedir=logdir)
    output = cockpit.get_output()  # {} on the other ranks
    print(
        f"[rank {rank} of {cockpit.world_size}] steps kept: {len(output)}; log: {path}; "
        f"dashboard: {'saved' if figure is not None else 'not drawn on this rank'}; "
        f"last NormTest: {output[max(output)].get('NormTest') if output else None}"
    )
    if distributed:
        dist.barrier()  # rank 0 has written its log and dashboard before any rank tears the group down
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
