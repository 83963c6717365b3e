"""Hugging Face integration: a real transformers.Trainer gives the log of the same training as a plain loop.

With gradient accumulation the Trainer's micro-batches give the log of the loop's one pass over their rows.

Tiny float64 models built from configs: GPT-2 (causal LM, ``tests/zoo.py``)
and a BERT sequence classifier. GPT-2's loss is computed in float32 by
transformers (it upcasts the logits with ``.float()``), so logs are compared
with a float32 tolerance; the classifier's loss stays in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from cockpit_like import Cockpit, quantities, read_log
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear

from .test_lightning import assert_same_log
from .zoo import gpt2

pytest.importorskip("accelerate")
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
LR = 0.1
BATCH = 4


class Rows(torch.utils.data.Dataset):
    def __init__(self, **columns):
        self.columns = columns

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index):
        return {key: value[index] for key, value in self.columns.items()}


def _gpt_data():
    tokens = torch.randint(0, 40, (8, 6), generator=torch.Generator().manual_seed(3))
    return {"input_ids": tokens, "labels": tokens.clone()}


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).double().train()


def _bert_data():
    generator = torch.Generator().manual_seed(4)
    return {"input_ids": torch.randint(1, 30, (8, 5), generator=generator), "labels": torch.randint(0, 3, (8,), generator=generator)}


def _tracked():
    return configuration("economy") + [quantities.HessMaxEV(linear(1))]


def _plain_loop(model, data, steps, eval_data=None, rows_per_step=None, smoothing=0.0, tracked=None) -> dict:
    """The same training without the Trainer (the model's own loss, per-sample losses from the logits): one
    backward pass per step over ``rows_per_step[i]`` rows (default ``BATCH`` each), in order, every epoch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    cockpit = Cockpit(model.parameters(), quantities=(tracked or _tracked)(), model=model)
    rows = len(data["labels"])
    schedule = rows_per_step or (BATCH,) * (rows // BATCH)
    assert sum(schedule) == rows
    for step in range(steps):
        start, size = sum(schedule[: step % len(schedule)]), schedule[step % len(schedule)]
        batch = {key: value[start : start + size] for key, value in data.items()}
        torch.manual_seed(1000 + step)
        optimizer.zero_grad()
        labels = batch["labels"]
        if labels.dim() == 2:
            # The Trainer's loss for GPT2LMHeadModel: transformers 5.23 counts all B x T labels as the
            # loss's divisor (num_items_in_batch; the model's loss_type is None, so the Trainer does not
            # know that the loss shifts the labels): (T-1)/T of the token mean. The loop trains the same loss.
            count = (labels != -100).sum()
            outputs = model(**batch, num_items_in_batch=count)
            per_token = F.cross_entropy(outputs.logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
            losses = per_token.sum(1) * (size / count)
        else:
            outputs = model(**batch)
            losses = F.cross_entropy(outputs.logits, labels, reduction="none", label_smoothing=smoothing)
        loss = losses.mean() if smoothing else outputs.loss  # (the Trainer's LabelSmoother, where it smooths)
        info = {"batch_size": size, "loss": loss, "individual_losses": losses, "optimizer": optimizer,
                "outputs": outputs.logits}
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
        if eval_data is not None and (step + 1) % len(schedule) == 0:
            with torch.no_grad():
                model.eval()
                loss = model(**eval_data).loss.item()
                model.train()
            cockpit.log(step, epoch_count=(step + 1) // len(schedule), valid_loss=loss, learning_rate=LR)
    return cockpit.get_output()


class _Seed:
    """The same HessMaxEV start vector as the loop: reseed before each step's forward pass."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Seed(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                torch.manual_seed(1000 + state.global_step)

        return Seed()


def _train(tmp_path, model, data, steps, logpath=None, save_steps=None, resume=None, eval_data=None, trainer_class=None,
           stream_to=None, batch=BATCH, accumulate=1, tracked=None, **arguments):
    from transformers import TrainingArguments

    from cockpit_like.integrations.transformers import CockpitCallback, CockpitTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulate,
        per_device_eval_batch_size=len(data["labels"]), learning_rate=LR, lr_scheduler_type="constant",
        max_grad_norm=0.0, report_to="none", logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0,
        train_sampling_strategy="sequential", save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        eval_strategy="epoch" if eval_data is not None else "no", **arguments,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    cockpit = Cockpit(model.parameters(), quantities=(tracked or _tracked)(), model=model, stream_to=stream_to)
    trainer = (trainer_class or CockpitTrainer)(
        model=model, args=args, train_dataset=Rows(**data), optimizers=(optimizer, None),
        eval_dataset=None if eval_data is None else Rows(**eval_data),
        callbacks=[CockpitCallback(cockpit, logpath=logpath), _Seed()],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(create_graph=True|Full backward hook).*")
        trainer.train(resume_from_checkpoint=resume)
    return cockpit


@pytest.fixture(scope="module")
def gpt_reference():
    return _plain_loop(gpt2().model, _gpt_data(), 4)


def test_causal_lm_trainer_equals_plain_loop(tmp_path, gpt_reference):
    cockpit = _train(tmp_path, gpt2().model, _gpt_data(), 4, logpath=tmp_path / "log")
    output = cockpit.get_output()
    assert sorted(output) == [0, 1, 2, 3] and "HessMaxEV" in output[3] and "UpdateSize" in output[2]
    assert_same_log(output, gpt_reference, rtol=1e-5, atol=1e-8)
    assert_same_log(read_log(tmp_path / "log.json"), gpt_reference, rtol=1e-5, atol=1e-8)


def test_classifier_trainer_equals_plain_loop(tmp_path):
    eval_data = _bert_data()
    reference = _plain_loop(_bert(), _bert_data(), 4, eval_data=eval_data)
    output = _train(tmp_path, _bert(), _bert_data(), 4, eval_data=eval_data).get_output()
    assert output[1]["epoch_count"] == 1.0 and output[3]["epoch_count"] == 2.0
    assert_same_log(output, reference, rtol=1e-9, atol=1e-12)  # float64 throughout


def test_the_trainer_gives_tic_the_logits(tmp_path):
    """TICDiag's GGN diagonal reads info["outputs"], which the Trainer integration did not pass: under the Trainer
    it was never stored, with a note asking for an info key the user cannot give (outside trial 19). Now the
    model's logits are passed, and TICDiag equals the plain loop's, which passes them itself (float64)."""
    def tracked():
        return configuration("economy") + [quantities.TICDiag(linear(1))]

    reference = _plain_loop(_bert(), _bert_data(), 3, tracked=tracked)
    output = _train(tmp_path, _bert(), _bert_data(), 3, tracked=tracked).get_output()
    assert all("TICDiag" in output[step] for step in range(3)), output[0]["checks"]
    assert_same_log(output, reference, rtol=1e-9, atol=1e-12)


def test_a_compute_loss_that_bypasses_the_mixin_is_an_error(tmp_path):
    """A Trainer subclass with the mixin first that defines compute_loss itself bypassed the mixin's: three steps
    trained, nothing recorded, no error (outside trial 19). Now train() says so and how to arrange the classes;
    the arrangement it gives (compute_loss in a base below the mixin) is tracked."""
    from transformers import Trainer

    from cockpit_like.integrations.transformers import CockpitTrainerMixin

    class Bypassing(CockpitTrainerMixin, Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(TypeError, match="Bypassing defines compute_loss, which comes before the mixin's"):
        _train(tmp_path, _bert(), _bert_data(), 1, trainer_class=Bypassing)

    class Mine(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class Tracked(CockpitTrainerMixin, Mine):
        pass

    assert sorted(_train(tmp_path, _bert(), _bert_data(), 2, trainer_class=Tracked).get_output()) == [0, 1]


def test_the_trainers_label_smoothing_gets_its_per_sample_losses(tmp_path):
    """``label_smoothing_factor`` (the Trainer's LabelSmoother): the built-in per-row rule refused it (outside
    trial 14: "the per-sample losses average to 3.60169, but the Trainer's loss is 3.60083"); now each row's
    loss is the smoothed one, and the log is the plain loop's with ``F.cross_entropy(label_smoothing=0.1)``.
    In float32: the LabelSmoother sums its smoothing term in float32 even for a float64 model, whose loss then
    differs from any float64 rows by float32 rounding, which the cockpit's float64 check refuses (with that cause)."""
    reference = _plain_loop(_bert().float(), _bert_data(), 4, smoothing=0.1)
    output = _train(tmp_path, _bert().float(), _bert_data(), 4, label_smoothing_factor=0.1).get_output()
    assert_same_log(output, reference, rtol=1e-4, atol=1e-6)


def test_individual_losses_of_a_seq2seq_decoder_are_not_shifted():
    """Logits ``[B, T, V]`` aligned with their labels (T5, BART): ``shift=False``; the Trainer's rules try both."""
    from cockpit_like.integrations.transformers import individual_losses

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 5), generator=generator)
    labels[0, 3:] = -100
    rows = individual_losses({"logits": logits}, {"labels": labels}, shift=False, smoothing=0.2)
    loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, label_smoothing=0.2)
    assert rows.mean().item() == pytest.approx(loss.item(), rel=1e-12)


def test_checkpoint_and_resume(tmp_path, gpt_reference):
    from cockpit_like.integrations.transformers import STATE_FILE

    _train(tmp_path, gpt2().model, _gpt_data(), 4, save_steps=2, stream_to=tmp_path / "stream")
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / STATE_FILE).is_file() and (tmp_path / "out" / "checkpoint-4" / STATE_FILE).is_file()
    assert torch.load(checkpoint / STATE_FILE, weights_only=True)["next_step"] == 2
    model = gpt2(seed=5).model  # other weights: the checkpoint's replace them
    resumed = _train(tmp_path / "again", model, _gpt_data(), 4, resume=str(checkpoint), stream_to=tmp_path / "stream")
    resumed.close()
    assert_same_log(resumed.get_output(), gpt_reference, rtol=1e-5, atol=1e-8)
    assert_same_log(read_log(tmp_path / "stream.jsonl"), gpt_reference, rtol=1e-5, atol=1e-8)  # continued at step 2


def test_plain_trainer_and_bad_losses_are_errors(tmp_path):
    from transformers import Trainer

    with pytest.raises(RuntimeError, match="use cockpit_like.integrations.transformers.CockpitTrainer"):
        _train(tmp_path, gpt2().model, _gpt_data(), 1, trainer_class=Trainer)

    from cockpit_like.integrations.transformers import CockpitCallback

    model = gpt2().model
    with pytest.raises(ValueError, match="average to .* but the Trainer's loss is"):
        cockpit = Cockpit(model.parameters(), quantities=_tracked(), model=model)
        _train_with_callback(tmp_path, model, CockpitCallback(cockpit, individual_losses=lambda out, inp: torch.ones(BATCH)))



def test_causal_lm_accumulation_equals_plain_loop(tmp_path, gpt_reference):
    """gradient_accumulation_steps=2 over micro-batches of 2 rows: the log of the loop's 4 rows per step.

    GPT-2 accepts loss kwargs, so the Trainer passes the step's label count (num_items_in_batch) to the
    model and does not divide its loss by the micro-batches. float32 tolerance as above (the loss is float32).
    """
    output = _train(tmp_path, gpt2().model, _gpt_data(), 4, batch=BATCH // 2, accumulate=2).get_output()
    assert sorted(output) == [0, 1, 2, 3] and "HessMaxEV" in output[3]  # numbered by optimizer steps
    assert_same_log(output, gpt_reference, rtol=1e-5, atol=1e-8)


def test_bf16_accumulation_sees_the_loss_factor(tmp_path):
    """bf16=True: accelerate returns the model's outputs cast to float32, while the model's own loss reads the
    bfloat16 logits, so the backward pass never reached the cast where the cockpit watched the output, and every
    step with accumulation noted "loss factor not verified" (outside trial 19). The node before the cast is
    watched: the factor is seen, every step valid."""
    model = gpt2().model.float()  # (autocast leaves float64 alone)
    cockpit = _train(tmp_path, model, _gpt_data(), 3, batch=BATCH // 2, accumulate=2, bf16=True)
    notes = [note for check in cockpit.checks.values() for note in check.get("notes", [])]
    assert sorted(cockpit.checks) == [0, 1, 2] and cockpit.invalid_steps == {}
    assert not [note for note in notes if "loss factor not verified" in note], notes


def test_causal_lm_accumulation_shorter_last_step(tmp_path):
    """4 micro-batches of 2 rows per epoch, gradient_accumulation_steps=3: steps of 6 and 2 rows."""
    reference = _plain_loop(gpt2().model, _gpt_data(), 4, rows_per_step=(6, 2))
    output = _train(tmp_path, gpt2().model, _gpt_data(), 4, batch=2, accumulate=3).get_output()
    assert_same_log(output, reference, rtol=1e-5, atol=1e-8)


def test_classifier_accumulation(tmp_path):
    """BERT's classifier accepts loss kwargs but its loss ignores num_items_in_batch: the Trainer (5.23) then
    divides nothing and the accumulated gradient is twice the mean gradient, which the cockpit refuses. With
    loss_is_scaled_for_ga = False the Trainer divides by the micro-batches: the log of the plain loop over
    4 rows per step (float64 throughout: the tolerance of the classifier test above)."""
    from cockpit_like.integrations.transformers import CockpitTrainer

    eval_data = _bert_data()
    with pytest.raises(ValueError, match="the accumulated gradient is 2 times the step's mean gradient"):
        _train(tmp_path, _bert(), _bert_data(), 4, batch=BATCH // 2, accumulate=2)

    class DividingTrainer(CockpitTrainer):
        loss_is_scaled_for_ga = False

    reference = _plain_loop(_bert(), _bert_data(), 4, eval_data=eval_data)
    output = _train(tmp_path, _bert(), _bert_data(), 4, eval_data=eval_data, batch=BATCH // 2, accumulate=2,
                    trainer_class=DividingTrainer).get_output()
    assert output[1]["epoch_count"] == 1.0 and output[3]["epoch_count"] == 2.0
    assert_same_log(output, reference, rtol=1e-9, atol=1e-12)


def _train_with_callback(tmp_path, model, callback, resume_from_checkpoint=None, **options):
    from transformers import TrainingArguments

    from cockpit_like.integrations.transformers import CockpitTrainer

    args = TrainingArguments(output_dir=str(tmp_path / "bad"), max_steps=1, per_device_train_batch_size=BATCH,
                             report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
                             use_cpu=True, **options)
    trainer = CockpitTrainer(model=model, args=args, train_dataset=Rows(**_gpt_data()), callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)


def test_individual_losses_rules():
    from cockpit_like.integrations.transformers import individual_losses

    logits = torch.randn(3, 4, 5, dtype=torch.float64)
    labels = torch.tensor([[1, 2, 3, -100], [4, 0, -100, -100], [2, 2, 2, 2]])
    losses = individual_losses({"logits": logits}, {"labels": labels})
    tokens = [(b, t) for b in range(3) for t in range(3) if labels[b, t + 1] != -100]  # 3 + 1 + 3 counted tokens
    total = {b: 0.0 for b in range(3)}
    for b, t in tokens:
        total[b] += -torch.log_softmax(logits[b, t], 0)[labels[b, t + 1]].item()
    expected = torch.tensor([total[b] * 3 / len(tokens) for b in range(3)], dtype=torch.float64)
    torch.testing.assert_close(losses, expected)
    classifier = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(individual_losses({"logits": classifier}, {"labels": torch.tensor([0, 3, 1])}),
                               torch.stack([-torch.log_softmax(classifier[i], 0)[c] for i, c in enumerate([0, 3, 1])]))
    # an ignored label counts 0; the divisor: the Trainer's num_items_in_batch (here a step of 8 labels), else
    # the counted labels of the batch (2): the mean is then transformers' fixed_cross_entropy
    nll = [-torch.log_softmax(classifier[i], 0)[c].item() for i, c in ((0, 0), (2, 1))]
    labels = torch.tensor([0, -100, 1])
    torch.testing.assert_close(individual_losses({"logits": classifier}, {"labels": labels}, num_items_in_batch=8),
                               torch.tensor([nll[0] * 3 / 8, 0.0, nll[1] * 3 / 8], dtype=torch.float64))
    own = individual_losses({"logits": classifier}, {"labels": labels})
    torch.testing.assert_close(own, torch.tensor([nll[0] * 3 / 2, 0.0, nll[1] * 3 / 2], dtype=torch.float64))
    torch.testing.assert_close(own.mean(), F.cross_entropy(classifier, labels))
    with pytest.raises(ValueError, match="without outputs.logits and inputs\\['labels'\\]"):
        individual_losses({"logits": classifier}, {})


def _gpt_data_7(padded: bool):
    tokens = torch.randint(0, 40, (7, 6), generator=torch.Generator().manual_seed(3))
    labels = tokens.clone()
    if padded:  # rows with different numbers of counted tokens
        labels[1, 4:], labels[4, 2:], labels[6, 5:] = -100, -100, -100
    return {"input_ids": tokens, "labels": labels}


@pytest.mark.parametrize("padded", [False, True], ids=["equal_tokens", "padded_rows"])
def test_causal_lm_accumulation_unequal_micro_batches(tmp_path, padded):
    """7 rows, micro-batches of 2, gradient_accumulation_steps=2: steps of 2 + 2 and 2 + 1 rows. The loss is
    normalised over the step's counted labels (num_items_in_batch), so each micro-batch backpropagates the
    step's mean loss weighted by its share of the rows; the callback declared k times the micro-batch's loss,
    which the cockpit refused (PartitionError) at the 2 + 1 step. Now B_step / B_k: the log of a plain loop
    over 4 and 3 rows, also with rows that count different numbers of tokens (float32 loss: rtol 5e-5, Alpha
    of the 3-row step differs by 2e-5)."""
    data = _gpt_data_7(padded)
    reference = _plain_loop(gpt2().model, data, 4, rows_per_step=(4, 3))
    output = _train(tmp_path, gpt2().model, data, 4, batch=2, accumulate=2).get_output()
    assert sorted(output) == [0, 1, 2, 3]
    assert_same_log(output, reference, rtol=5e-5, atol=1e-8)


def test_the_evaluation_learning_rate_is_the_last_trained_steps(tmp_path):
    """The Trainer's linear schedule, evaluation every 2 steps: the learning rate logged with the evaluation figures
    under the last trained step is the rate that step used (LearningRate's), not the next step's (seventh round
    of outside trials: 0.0005 logged beside LearningRate's 0.0006)."""
    from transformers import TrainingArguments

    from cockpit_like.integrations.transformers import CockpitCallback, CockpitTrainer

    model = gpt2().model
    data = _gpt_data()
    cockpit = Cockpit(model.parameters(), quantities=[quantities.LearningRate(linear(1))], model=model)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=BATCH, learning_rate=LR,
        lr_scheduler_type="linear", report_to="none", logging_strategy="no", disable_tqdm=True, use_cpu=True,
        save_strategy="no", eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8,
    )
    trainer = CockpitTrainer(model=model, args=args, train_dataset=Rows(**data), eval_dataset=Rows(**data),
                             callbacks=[CockpitCallback(cockpit)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    logged = {step: values for step, values in cockpit.get_output().items() if "learning_rate" in values}
    assert sorted(logged) == [1, 3]
    for values in logged.values():
        assert values["learning_rate"] == pytest.approx(values["LearningRate"], rel=1e-12)
    assert logged[1]["learning_rate"] == pytest.approx(LR * 3 / 4)  # step 1 of 4 under the linear decay


def test_unequal_micro_batches_the_trainer_divides_say_what_to_do(tmp_path):
    """BERT's classifier with loss_is_scaled_for_ga = False (the Trainer divides each micro-batch's loss by 2) over
    6 rows in batches of 4: micro-batches of 4 and 2 rows, a mean of their means. The PartitionError now names
    the Trainer's fixes (dataloader_drop_last=True, a loss normalised over the step)."""
    from cockpit_like.backends.partitions import PartitionError
    from cockpit_like.integrations.transformers import CockpitTrainer

    class DividingTrainer(CockpitTrainer):
        loss_is_scaled_for_ga = False

    data = {key: value[:6] for key, value in _bert_data().items()}
    with pytest.raises(PartitionError, match="With the Trainer: .*dataloader_drop_last=True"):
        _train(tmp_path, _bert(), data, 1, batch=4, accumulate=2, trainer_class=DividingTrainer)
