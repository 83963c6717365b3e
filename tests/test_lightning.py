"""Lightning integration: a real Trainer gives the log of the same training as a plain loop.

A tiny float64 MLP, 3 steps per epoch, every quantity of the "full"
configuration (HessMaxEV needs ``create_graph``, passed by ``CockpitModule``),
validation figures through ``cockpit.log``, a checkpoint and a resume; with
``accumulate_grad_batches`` the log of the loop's one pass over each step's rows.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from backpack import extend

from cockpit_like import Cockpit, read_log
from cockpit_like.utils.configuration import configuration

LR = 0.3
BATCH = 4
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")


def _data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(12, 5, dtype=torch.float64, generator=generator), torch.randint(0, 3, (12,), generator=generator)


def _mlp():
    torch.manual_seed(0)
    return extend(torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double())


def _net_class(package: str, mixin: bool = True):
    import importlib

    from cockpit_like.integrations.lightning import CockpitModule

    L = importlib.import_module(package)
    bases = (CockpitModule, L.LightningModule) if mixin else (L.LightningModule,)

    class Net(*bases):
        def __init__(self):
            super().__init__()
            self.model = _mlp()
            self.lossfunc = extend(torch.nn.CrossEntropyLoss())

        def training_step(self, batch, batch_idx):
            torch.manual_seed(1000 + self.global_step)  # HessMaxEV's first start vector: the same draw as the loop's
            x, y = batch
            outputs = self.model(x)
            return {"loss": self.lossfunc(outputs, y), "individual_losses": F.cross_entropy(outputs, y, reduction="none")}

        def validation_step(self, batch, batch_idx):
            x, y = batch
            outputs = self.model(x)
            self.log("val_loss", F.cross_entropy(outputs, y))
            self.log("val_acc", (outputs.argmax(1) == y).double().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return Net


def _loaders():
    x, y = _data()
    dataset = torch.utils.data.TensorDataset(x, y)
    train = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False)
    valid = torch.utils.data.DataLoader(dataset, batch_size=len(x), shuffle=False)
    return train, valid


def _trainer(package, tmp_path, callback, epochs):
    import importlib

    L = importlib.import_module(package)
    return L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
        num_sanity_val_steps=0, precision="64-true", callbacks=[callback],
    )


def _fit(package, tmp_path, epochs, logpath=None, ckpt_path=None, mixin=True, tracked=None, stream_to=None, net_class=None):
    from cockpit_like.integrations.lightning import CockpitCallback

    net = (net_class or _net_class(package, mixin))()
    cockpit = Cockpit(net.parameters(), quantities=tracked or configuration("full"), model=net.model, stream_to=stream_to)
    callback = CockpitCallback(cockpit, logpath=logpath)
    trainer = _trainer(package, tmp_path, callback, epochs)
    train, valid = _loaders()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|create_graph=True|Full backward hook).*")
        trainer.fit(net, train, valid, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return cockpit, trainer


def _plain_loop(epochs: int) -> dict:
    """The same training without Lightning."""
    model = _mlp()
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    cockpit = Cockpit(model.parameters(), quantities=configuration("full"), model=model)
    x_all, y_all = _data()
    step = 0
    for epoch in range(epochs):
        for start in range(0, len(x_all), BATCH):
            x, y = x_all[start : start + BATCH], y_all[start : start + BATCH]
            torch.manual_seed(1000 + step)
            optimizer.zero_grad()
            outputs = model(x)
            loss = lossfunc(outputs, y)
            info = {"batch_size": len(y), "loss": loss, "optimizer": optimizer,
                    "individual_losses": F.cross_entropy(outputs, y, reduction="none")}
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
            step += 1
        with torch.no_grad():
            outputs = model(x_all)
            cockpit.log(step - 1, epoch_count=epoch, valid_loss=F.cross_entropy(outputs, y_all).item(),
                        valid_accuracy=(outputs.argmax(1) == y_all).double().mean().item(), learning_rate=LR)
    return cockpit.get_output()


def assert_same_log(got: dict, expected: dict, skip=("Time",), rtol=1e-9, atol=1e-12) -> None:
    """Every step and quantity but ``skip`` equal (nested lists/dicts compared leaf by leaf)."""
    assert sorted(got) == sorted(expected)
    for step in expected:
        names = set(expected[step]) - set(skip) - {"checks"}  # the self-checks: compared by validity below
        assert set(got[step]) - set(skip) - {"checks"} == names, step
        if "checks" in expected[step] or "checks" in got[step]:
            assert expected[step].get("checks", {"valid": True})["valid"] == got[step].get("checks", {"valid": True})["valid"], step
        for name in names:
            _assert_close(got[step][name], expected[step][name], f"step {step} {name}", rtol, atol)


def _assert_close(a, b, where, rtol, atol):
    if isinstance(b, dict):
        assert isinstance(a, dict) and set(a) == set(b), where
        for key in b:
            _assert_close(a[key], b[key], f"{where}.{key}", rtol, atol)
    elif b is None or isinstance(b, str):
        assert a == b, where
    elif isinstance(b, (list, tuple)) and b and not np.isscalar(b[0]):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{i}]", rtol, atol)
    else:
        np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=rtol, atol=atol, err_msg=where)


@pytest.fixture(scope="module")
def reference():
    return _plain_loop(epochs=2)


def test_trainer_log_equals_plain_loop(tmp_path, reference):
    cockpit, trainer = _fit("lightning.pytorch", tmp_path, epochs=2, logpath=tmp_path / "log")
    assert trainer.global_step == 6
    output = cockpit.get_output()
    assert "HessMaxEV" in output[0] and "UpdateSize" in output[4] and output[5]["epoch_count"] == 1
    assert_same_log(output, reference)
    assert_same_log(read_log(tmp_path / "log.json"), reference)  # written at the end of fit
    assert math.isclose(output[2]["valid_loss"], reference[2]["valid_loss"], rel_tol=1e-12)


def test_sixteen_mixed_precision_reports_the_unscaled_gradient(tmp_path, reference):
    """precision="16-mixed": Lightning scales the loss with its GradScaler before on_before_backward; the
    callback passes the scaler, so every quantity equals the plain loop's. The float64 model keeps CPU
    autocast out of the arithmetic, so the scale (2**16, a power of two) is the only difference."""
    import lightning.pytorch as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from cockpit_like.integrations.lightning import CockpitCallback

    net = _net_class("lightning.pytorch")()
    cockpit = Cockpit(net.parameters(), quantities=configuration("full"), model=net.model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
        num_sanity_val_steps=0, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        callbacks=[CockpitCallback(cockpit)],
    )  # fmt: skip
    train, valid = _loaders()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|create_graph=True|Full backward hook).*")
        trainer.fit(net, train, valid)
    assert scaler.get_scale() == 2.0**16  # no step was skipped: every step is compared
    assert_same_log(cockpit.get_output(), reference)


def test_pytorch_lightning_package_name(tmp_path, reference):
    pytest.importorskip("pytorch_lightning")
    cockpit, _ = _fit("pytorch_lightning", tmp_path, epochs=1)
    assert_same_log(cockpit.get_output(), {s: v for s, v in reference.items() if s <= 2 and s != 2} | {2: _without_update(reference[2])})


def _without_update(values):
    """Step 2 of a 3-step run: UpdateSize and Alpha of the last step wait for a next step."""
    return {k: v for k, v in values.items() if k not in ("UpdateSize", "Alpha")}


def test_checkpoint_and_resume(tmp_path, reference):
    cockpit, trainer = _fit("lightning.pytorch", tmp_path, epochs=1, stream_to=tmp_path / "stream")
    checkpoint = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(str(checkpoint))
    cockpit.close()
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["cockpit_like"]["next_step"] == 3
    resumed, trainer = _fit("lightning.pytorch", tmp_path, epochs=2, ckpt_path=checkpoint, stream_to=tmp_path / "stream")
    resumed.close()
    assert trainer.global_step == 6
    assert_same_log(resumed.get_output(), reference)  # Alpha and UpdateSize across the break included
    assert_same_log(read_log(tmp_path / "stream.jsonl"), reference)  # the stream continued: no step lost or doubled


def test_the_mixin_added_by_subclassing_an_existing_module(tmp_path, reference):
    """``class Tracked(CockpitModule, MyNet): pass`` on a module written without the cockpit: the mixin saw only a
    training_step defined in the class itself, and the run stopped with advice to put the mixin first, which it
    was (outside trial 19). Now an inherited training_step is seen too: the log of the plain loop."""
    from cockpit_like.integrations.lightning import CockpitModule

    class Tracked(CockpitModule, _net_class("lightning.pytorch", mixin=False)):
        pass

    cockpit, _ = _fit("lightning.pytorch", tmp_path, epochs=2, net_class=Tracked)
    assert_same_log(cockpit.get_output(), reference)


def test_without_the_mixin_clear_errors(tmp_path):
    from cockpit_like.quantities import HessMaxEV, Loss
    from cockpit_like.utils.schedules import linear

    with pytest.raises(ValueError, match="Alpha needs info\\['individual_losses'\\].*CockpitModule mixin first"):
        _fit("lightning.pytorch", tmp_path, epochs=1, mixin=False)
    with pytest.raises(RuntimeError, match="needs loss.backward\\(create_graph=True\\).*CockpitModule mixin"):
        _fit("lightning.pytorch", tmp_path, epochs=1, mixin=False, tracked=[Loss(linear(1)), HessMaxEV(linear(1))])
    cockpit, _ = _fit("lightning.pytorch", tmp_path, epochs=1, mixin=False, tracked=[Loss(linear(1))])
    assert sorted(cockpit.get_output()) == [0, 1, 2]  # no per-sample losses, no graph: fine without it


def _accumulating_trainer(tmp_path, callback, accumulate, epochs, **options):
    import lightning.pytorch as L

    return L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
        num_sanity_val_steps=0, precision="64-true", accumulate_grad_batches=accumulate, callbacks=[callback], **options,
    )


def _fit_accumulating(tmp_path, micro_batch, accumulate, epochs=2, quantities=None):
    """``accumulate_grad_batches=accumulate`` over loaders of ``micro_batch`` rows; the log and the trainer."""
    from cockpit_like.integrations.lightning import CockpitCallback

    net = _net_class("lightning.pytorch")()
    cockpit = Cockpit(net.parameters(), quantities=quantities or configuration("full"), model=net.model)
    trainer = _accumulating_trainer(tmp_path, CockpitCallback(cockpit), accumulate, epochs)
    x, y = _data()
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=micro_batch, shuffle=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers|create_graph=True|Full backward hook).*")
        trainer.fit(net, train, _loaders()[1])
    return cockpit.get_output(), trainer


def test_accumulation_equals_plain_loop(tmp_path, reference):
    """accumulate_grad_batches=2 over micro-batches of 2 rows: the log of the plain loop over 4 rows per step.

    Every quantity of "full" (HessMaxEV with the graph through both backward passes). float64 throughout, so
    the tolerance of the other tests here (rtol 1e-9): the two runs differ only by the order of sums.
    """
    output, trainer = _fit_accumulating(tmp_path, micro_batch=BATCH // 2, accumulate=2)
    assert trainer.global_step == 6  # numbered by optimizer steps
    assert sorted(output) == list(range(6)) and "HessMaxEV" in output[0] and "NormTest" in output[3]
    assert_same_log(output, reference)
    # the callback's info["loss"] is the loss training_step returned, from which Lightning's divided one is
    # computed: the factor 1/2 is seen (before: "loss factor not verified" noted at every step)
    assert not any("not verified" in note for values in output.values() for note in values.get("checks", {}).get("notes", []))


def _short_step_reference(epochs: int, rows_per_step: tuple[int, ...], factors: tuple[float, ...]) -> dict:
    """A plain loop whose steps take ``rows_per_step`` rows in one backward pass of their mean loss; the
    cockpit sees that pass, then the gradient is multiplied by the step's factor before the optimizer step
    (what Lightning's division by accumulate_grad_batches does to a step of fewer micro-batches)."""
    model = _mlp()
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    cockpit = Cockpit(model.parameters(), quantities=configuration("full"), model=model)
    x_all, y_all = _data()
    step = 0
    for epoch in range(epochs):
        start = 0
        for rows, factor in zip(rows_per_step, factors):
            x, y = x_all[start : start + rows], y_all[start : start + rows]
            start += rows
            torch.manual_seed(1000 + step)
            optimizer.zero_grad()
            outputs = model(x)
            loss = lossfunc(outputs, y)
            info = {"batch_size": rows, "loss": loss, "optimizer": optimizer,
                    "individual_losses": F.cross_entropy(outputs, y, reduction="none")}
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            with torch.no_grad():
                for param in model.parameters():
                    param.grad.mul_(factor)
            optimizer.step()
            step += 1
        with torch.no_grad():
            outputs = model(x_all)
            cockpit.log(step - 1, epoch_count=epoch, valid_loss=F.cross_entropy(outputs, y_all).item(),
                        valid_accuracy=(outputs.argmax(1) == y_all).double().mean().item(), learning_rate=LR)
    return cockpit.get_output()


def test_accumulation_shorter_last_step(tmp_path):
    """6 batches of 2 rows, accumulate_grad_batches=4: steps of 4 and 2 micro-batches per epoch.

    Lightning divides both by 4, so the second step's gradient is half its rows' mean gradient; the
    quantities still describe the mean loss of its 4 rows (the same tolerance as above).
    """
    output, trainer = _fit_accumulating(tmp_path, micro_batch=2, accumulate=4)
    assert trainer.global_step == 4
    expected = _short_step_reference(2, rows_per_step=(8, 4), factors=(1.0, 0.5))
    assert_same_log(output, expected)
    wrong = _short_step_reference(2, rows_per_step=(8, 4), factors=(1.0, 1.0))  # the check can fail
    assert not math.isclose(_first(output[1]["UpdateSize"]), _first(wrong[1]["UpdateSize"]), rel_tol=1e-3)


def _first(value):
    return value[0] if isinstance(value, list) else value


def test_accumulation_unequal_micro_batches_are_an_error(tmp_path):
    """12 rows in micro-batches of 5: the last step has micro-batches of 2 rows after ones of 5."""
    from cockpit_like.quantities import GradNorm, NormTest
    from cockpit_like.utils.schedules import linear

    with pytest.raises(RuntimeError, match="has 2 rows, micro-batch 0 had 5"):
        _fit_accumulating(tmp_path, micro_batch=5, accumulate=3, epochs=1,
                          quantities=[GradNorm(linear(1)), NormTest(linear(1))])


def test_bad_arguments():
    from cockpit_like.integrations.lightning import CockpitCallback

    with pytest.raises(ValueError, match="pass a cockpit_like.Cockpit"):
        CockpitCallback("not a cockpit")
    model = _mlp()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    with pytest.raises(ValueError, match="'valid_los' is not a cockpit.log figure"):
        CockpitCallback(cockpit, metrics={"valid_los": "val/loss"})


def _two_optimizer_fit(tmp_path, say_which: bool, watch_a_only: bool = False):
    """Manual optimization with two optimizers, GAN style: opt_a steps net a, then opt_b steps net b."""
    import lightning as L

    from cockpit_like.integrations.lightning import CockpitCallback, CockpitModule

    x, y = _data()

    class TwoNets(CockpitModule, L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = torch.nn.Linear(5, 3).double()
            self.b = torch.nn.Linear(5, 3).double()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            inputs, labels = batch
            opt_a, opt_b = self.optimizers()
            for net, opt in ((self.a, opt_a), (self.b, opt_b)):
                opt.zero_grad()
                losses = F.cross_entropy(net(inputs), labels, reduction="none")
                if say_which:
                    self.cockpit_info(individual_losses=losses, optimizer=opt)
                else:
                    self.cockpit_info(individual_losses=losses)
                self.manual_backward(losses.mean())
                opt.step()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.a.parameters(), lr=0.5), torch.optim.SGD(self.b.parameters(), lr=0.3)]

    net = TwoNets()
    cockpit = Cockpit((net.a if watch_a_only else net).parameters(), configuration("economy"),
                      model=net.a if watch_a_only else net)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", callbacks=[CockpitCallback(cockpit)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)  # fmt: skip
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    trainer.fit(net, loader)
    return cockpit


def test_two_optimizers_need_to_say_which_steps(tmp_path):
    """Before, the callback passed trainer.optimizers[0] at every backward pass: every b-step failed as 'a forgotten
    zero_grad()' (a's gradient is not b's optimizer's). Now it asks for the optimizer, and with it every step is
    valid, GradNorm the norms of the stepping net's gradients (the other net's leftovers counted as zero)."""
    pytest.importorskip("lightning")
    with pytest.raises(ValueError, match=r"self.cockpit_info\(optimizer=opt"):
        _two_optimizer_fit(tmp_path, say_which=False)
    cockpit = _two_optimizer_fit(tmp_path, say_which=True)
    assert cockpit.invalid_steps == {}
    assert len(cockpit.checks) == 6  # 3 batches, two optimizer steps each (numbered by trainer.global_step)


def test_a_cockpit_on_one_network_of_two_skips_the_other_networks_steps(tmp_path):
    """A GAN-style module whose cockpit watches one network: the other optimizer's backward passes stopped
    training (the watched parameters got no gradient there, outside trial 19). Now the passes of an optimizer
    that holds none of the cockpit's parameters are not tracked; the watched network's steps are (numbered by
    trainer.global_step: every other number, so its two-step quantities are not stored, with the note)."""
    pytest.importorskip("lightning")
    cockpit = _two_optimizer_fit(tmp_path, say_which=True, watch_a_only=True)
    assert sorted(cockpit.get_output()) == [0, 2, 4] and cockpit.invalid_steps == {}
    assert all("NormTest" in cockpit.get_output()[step] for step in (0, 2, 4))


def test_the_validation_learning_rate_is_the_last_trained_steps(tmp_path):
    """A per-step scheduler (StepLR, interval "step"): the learning rate logged with the validation figures under
    the last trained step is the rate that step used (LearningRate's), not the one the scheduler set for the next
    step (seventh round of outside trials: 0.0125 logged beside LearningRate's 0.025)."""
    from cockpit_like.integrations.lightning import CockpitCallback
    from cockpit_like.quantities import LearningRate

    base = _net_class("lightning")

    class Scheduled(base):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=LR)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    net = Scheduled()
    cockpit = Cockpit(net.parameters(), quantities=[LearningRate(lambda step: True)], model=net.model)
    trainer = _trainer("lightning", tmp_path, CockpitCallback(cockpit), epochs=2)
    train, valid = _loaders()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(does not have many workers).*")
        trainer.fit(net, train, valid)
    logged = {step: values for step, values in cockpit.get_output().items() if "learning_rate" in values}
    assert len(logged) == 2
    for step, values in logged.items():
        assert values["learning_rate"] == values["LearningRate"] == LR * 0.5**step


def test_unequal_micro_batches_say_what_to_do_under_lightning(tmp_path):
    """14 rows, batches of 4, accumulate_grad_batches=2: the second step has micro-batches of 4 and 2 rows, which
    Lightning trains on as a mean of their means. The PartitionError's fixes were for hand-written loops only
    (seventh round of outside trials); it now says what to do with Lightning."""
    from cockpit_like.backends.partitions import PartitionError
    from cockpit_like.integrations.lightning import CockpitCallback

    net = _net_class("lightning.pytorch")()
    cockpit = Cockpit(net.parameters(), quantities=configuration("economy"), model=net.model)
    trainer = _accumulating_trainer(tmp_path, CockpitCallback(cockpit), 2, 1)
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(14, 5, dtype=torch.float64, generator=generator), torch.randint(0, 3, (14,), generator=generator)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)
    with warnings.catch_warnings(), pytest.raises(PartitionError, match="With Lightning .*drop_last=True"):
        warnings.filterwarnings("ignore", message=".*(does not have many workers).*")
        trainer.fit(net, train)


def _manual_fit(tmp_path, cockpit_on: bool, max_steps: int = 5, declare: str = "optimizer", accumulate: int = 1):
    """Manual optimization with one optimizer, ``opt = self.optimizers()`` (Lightning's wrapper) declared to the
    cockpit as lightning.md says; returns (parameters, global_step, the cockpit, the next torch.rand).
    ``declare``: "optimizer" (optimizer and per-sample losses), "none" (no cockpit_info), "loss" (also the mean
    loss and the micro-batches); ``accumulate``: micro-batches per optimizer step, each ``manual_backward(loss / K)``."""
    import lightning as L

    from cockpit_like.integrations.lightning import CockpitCallback, CockpitModule

    x, y = _data()
    bases = (CockpitModule, L.LightningModule) if cockpit_on else (L.LightningModule,)

    class Manual(*bases):
        def __init__(self):
            super().__init__()
            self.net = _mlp()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            losses = F.cross_entropy(self.net(batch[0]), batch[1], reduction="none")
            if cockpit_on and declare == "optimizer":
                self.cockpit_info(optimizer=opt, individual_losses=losses)
            elif cockpit_on and declare == "loss":
                self.cockpit_info(optimizer=opt, individual_losses=losses, loss=losses.mean(), micro_batches=accumulate)
            micro = self.__dict__.setdefault("micro", 0)  # counted across epochs (3 batches per epoch)
            if micro % accumulate == 0:
                opt.zero_grad()
            self.manual_backward(losses.mean() / accumulate)
            if micro % accumulate == accumulate - 1:
                opt.step()
            self.micro = micro + 1

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    module = Manual()
    cockpit = Cockpit(module.parameters(), configuration("economy"), model=module.net) if cockpit_on else None
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", callbacks=[CockpitCallback(cockpit)] if cockpit_on else [],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)  # fmt: skip
    torch.manual_seed(3)
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH))
    return [p.detach().clone() for p in module.parameters()], trainer.global_step, cockpit, torch.rand(1)


def test_manual_optimization_with_lightnings_optimizer_wrapper_leaves_the_run_alone(tmp_path):
    """``self.optimizers()`` is Lightning's ``LightningOptimizer``, an instance of the wrapped optimizer's class
    too: it was not unwrapped, and Alpha's look-ahead through its ``step`` counted as an optimizer step (outside
    trial 19: 3 of 5 steps trained with max_steps=5, the parameters 0.029 apart). Now the run is bitwise the
    same as without the cockpit, every step tracked, Alpha and UpdateSize stored."""
    pytest.importorskip("lightning")
    plain, plain_steps, _, plain_next = _manual_fit(tmp_path, cockpit_on=False)
    tracked, tracked_steps, cockpit, tracked_next = _manual_fit(tmp_path, cockpit_on=True)
    assert tracked_steps == plain_steps == 5
    assert all(torch.equal(a, b) for a, b in zip(plain, tracked)) and torch.equal(plain_next, tracked_next)
    output = cockpit.get_output()
    assert sorted(output) == [0, 1, 2, 3, 4] and cockpit.invalid_steps == {}
    assert all("Alpha" in output[step] and "UpdateSize" in output[step] for step in range(4))


def test_manual_optimization_errors_say_what_to_do_under_lightning(tmp_path):
    """Manual optimization runs the backward pass inside training_step: the error for missing per-sample losses
    said to return them from training_step, which comes too late; a manual accumulation (manual_backward(loss / 2))
    was told causes it does not have and not the factor (the factor's hint asked for at least 2, and a float32
    loss / 2 is 1.99999992 of the rows' mean). Both now say what works under Lightning, and that works: the run
    bitwise the same as without the cockpit (outside trial 19)."""
    pytest.importorskip("lightning")
    with pytest.raises(ValueError, match=r"before it returns: call self.cockpit_info\(individual_losses=...\) in "
                                         r"training_step before self.manual_backward"):
        _manual_fit(tmp_path, cockpit_on=True, declare="none")
    with pytest.raises(ValueError, match=r"1/2 x that mean.*self.cockpit_info\(loss=loss, micro_batches=K"):
        _manual_fit(tmp_path, cockpit_on=True, accumulate=2)
    plain, plain_steps, _, _ = _manual_fit(tmp_path, cockpit_on=False, max_steps=2, accumulate=2)
    tracked, steps, cockpit, _ = _manual_fit(tmp_path, cockpit_on=True, max_steps=2, declare="loss", accumulate=2)
    assert steps == plain_steps == 2 and all(torch.equal(a, b) for a, b in zip(plain, tracked))
    assert sorted(cockpit.get_output()) == [0, 1] and cockpit.invalid_steps == {}
    assert all(check["backward_passes"] == 2 for check in cockpit.checks.values())


def test_alpha_under_lightnings_clipping_says_it_cannot_wait(tmp_path):
    """gradient_clip_val with momentum: the update is not the look-ahead's from the unclipped gradient, and
    Lightning runs the backward pass inside optimizer.step(closure), where Alpha cannot wait for the update. Its
    note promised that Alpha would predict the update at the optimizer's step from the next start step on, which
    never came (outside trial 19); now it says why it cannot, and what would let it."""
    import lightning as L

    from cockpit_like.integrations.lightning import CockpitCallback, CockpitModule

    x, y = _data()

    class Clipped(CockpitModule, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):
            outputs = self.net(batch[0])
            return {"loss": F.cross_entropy(outputs, batch[1]),
                    "individual_losses": F.cross_entropy(outputs, batch[1], reduction="none")}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    module = Clipped()
    cockpit = Cockpit(module.parameters(), configuration("economy"), model=module.net)
    trainer = L.Trainer(max_steps=5, accelerator="cpu", callbacks=[CockpitCallback(cockpit)], logger=False,
                        gradient_clip_val=1e-3, precision="64-true", enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH))
    notes = [note for check in cockpit.checks.values() for note in check.get("notes", []) if note.startswith("Alpha")]
    assert notes and all("cannot wait for the optimizer's update" in note for note in notes), notes
    assert not any("From the next start step on" in note for note in notes)


def test_a_second_fit_with_a_new_trainer_says_what_to_do_under_lightning(tmp_path):
    """A second fit with a new Trainer on the same module and cockpit counts global_step from 0 again: refused
    (as it should be), with the fixes of a hand-written loop only (outside trial 19); now Lightning's too."""
    from cockpit_like.integrations.lightning import CockpitCallback
    from cockpit_like.run_output import StepAlreadyTrackedError

    net = _net_class("lightning.pytorch")()
    cockpit = Cockpit(net.parameters(), quantities=configuration("economy"), model=net.model)
    callback = CockpitCallback(cockpit)
    train, valid = _loaders()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer("lightning.pytorch", tmp_path, callback, 1).fit(net, train, valid)
        with pytest.raises(StepAlreadyTrackedError, match=r"With Lightning: a second trainer.fit\(\).*ckpt_path"):
            _trainer("lightning.pytorch", tmp_path, callback, 1).fit(net, train, valid)
