"""Find flipped labels in scikit-learn's digits with SelfInfluence.

Some training labels are flipped to a wrong class; an MLP is trained on the
noisy data with a cockpit that tracks ``SelfInfluence``
(``g_iᵀ (F + λI)^{-1} g_i`` per sample, ``F`` KFAC of the empirical Fisher,
from the same backward pass) with the dataset index of each row as its
sample id. After training, one pass over the training set (no updates) ranks
every sample; the flipped ones should be at the top::

    python examples/flipped_labels.py                 # 5% flipped, 400 steps
    python examples/flipped_labels.py --flip 0.1 --steps 200
    cockpit-like influence runs/flipped_labels --top 10

Runs in a few seconds on one CPU thread, without downloads.
"""

from __future__ import annotations

import argparse

import torch

from cockpit_like import Cockpit
from cockpit_like.demo import load_digits_tensors, minibatches
from cockpit_like.quantities import SelfInfluence
from cockpit_like.utils.schedules import linear


def flip_labels(labels: torch.Tensor, fraction: float, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(noisy labels, indices of the flipped ones)``: a ``fraction`` of the labels moved to another class."""
    generator = torch.Generator().manual_seed(seed)
    flipped = torch.randperm(len(labels), generator=generator)[: int(round(fraction * len(labels)))]
    noisy = labels.clone()
    shift = torch.randint(1, classes, (len(flipped),), generator=generator)
    noisy[flipped] = (labels[flipped] + shift) % classes
    return noisy, flipped


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="find flipped labels in digits with SelfInfluence")
    parser.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--flip", type=float, default=0.05, help="fraction of flipped training labels (default 0.05)")
    parser.add_argument("--damping", type=float, default=1e-3)
    parser.add_argument("--out", default="runs/flipped_labels", help="log path without suffix")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train_x, train_y, _, _ = load_digits_tensors(args.seed)
    noisy_y, flipped = flip_labels(train_y, args.flip, 10, args.seed)
    indices = torch.arange(len(noisy_y))
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    lossfunc = torch.nn.CrossEntropyLoss()

    # training: SelfInfluence every 50 steps (its KFAC statistics are those of the tracked steps)
    batch = args.batch_size
    audit_start = args.steps
    audit_steps = (len(noisy_y) + batch - 1) // batch
    influence = SelfInfluence(
        lambda step: step % 50 == 0 or step >= audit_start, damping=args.damping, k=batch, window="step"
    )
    cockpit = Cockpit(model.parameters(), quantities=[influence], model=model)
    data = torch.cat([train_x, indices.unsqueeze(1).float()], 1)  # the dataset index rides along
    for step, _, _, rows, labels in minibatches(data, noisy_y, batch, args.steps):
        inputs, ids = rows[:, :-1], rows[:, -1].long()
        optimizer.zero_grad()
        loss = lossfunc(model(inputs), labels)
        with cockpit(step, info={"batch_size": len(labels), "loss": loss, "sample_ids": ids.tolist()}):
            loss.backward()
        optimizer.step()

    # audit: every training sample once, no updates; window="step": each batch's own KFAC
    scores = torch.empty(len(noisy_y))
    for k in range(audit_steps):
        ids = indices[k * batch : (k + 1) * batch]
        model.zero_grad()
        loss = lossfunc(model(train_x[ids]), noisy_y[ids])
        with cockpit(audit_start + k, info={"batch_size": len(ids), "loss": loss, "sample_ids": ids.tolist()}):
            loss.backward()
        scores[ids] = influence.last_values.float()
    log = cockpit.write(args.out)

    flagged = torch.argsort(scores, descending=True)[: len(flipped)]
    hits = len(set(flagged.tolist()) & set(flipped.tolist()))
    precision = hits / max(1, len(flipped))
    print(
        f"{len(flipped)} of {len(noisy_y)} training labels flipped; of the {len(flipped)} samples with the largest "
        f"self-influence, {hits} are flipped ({precision:.0%}; {len(flipped) / len(noisy_y):.0%} by chance)"
    )
    print(f"log: {log}  (list them: cockpit-like influence {log} --top 10)")
    return {"log": log, "precision": precision, "flipped": flipped, "scores": scores}


if __name__ == "__main__":
    main()
