"""Bad models and bad settings on the any-model path: each gets a clear error that says what to do."""

import re
import warnings

import pytest
import torch
from backpack import extend
from torch import nn
from torch.nn import functional as F

from cockpit_like import Cockpit
from cockpit_like.cockpit import BatchNormInTrainingError, NotExtendedError, UnsupportedLayerError
from cockpit_like.backends.rerun import UncoveredParameterError
from cockpit_like.quantities import GradNorm, HessMaxEV, HessTrace, NormTest
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests.zoo import resnet_batchnorm_eval

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")


def _step(cockpit, model, inputs, labels, step=0, lossfunc=None):
    lossfunc = lossfunc or nn.CrossEntropyLoss()
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    losses = nn.functional.cross_entropy(outputs, labels, reduction="none")
    info = {"batch_size": len(labels), "loss": loss, "individual_losses": losses.detach()}
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))


def _data(shape=(2, 5, 5), classes=3, batch=4):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch, *shape, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, classes, (batch,), generator=generator)


@pytest.mark.parametrize("extended", [False, True])
def test_batch_norm_in_training_mode_leaves_the_per_sample_quantities_out_with_a_note(extended):
    """Issue 34: the run never stops because of a BatchNorm (it raised BatchNormInTrainingError); the
    per-sample quantities are left out of such steps, with a note that says why and how to get them."""
    model = resnet_batchnorm_eval().model.train()
    if extended:
        model = extend(model)
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1)), GradNorm(linear(1))], model=model)
    _step(cockpit, model, *_data())
    values = cockpit.get_output()[0]
    assert "NormTest" not in values and "GradNorm" in values
    note = values["checks"]["notes"][0]
    for words in ("BatchNorm2d in training mode", "model.eval()", "GroupNorm"):
        assert words in note
    # eval mode: the same model gives the per-sample quantities
    model.eval()
    model.zero_grad()
    _step(cockpit, model, *_data(), step=1)
    assert "NormTest" in cockpit.get_output()[1]


def test_a_quantity_that_works_without_per_sample_stats_computes_under_batch_norm_in_training_mode():
    """``Quantity.works_without_per_sample_stats``: where a BatchNorm in training mode leaves the per-sample
    statistics out, such a quantity still runs (its statistic reads as the default) while the others are left out,
    and the note names both; in eval mode it gets its statistic."""
    from cockpit_like import context
    from cockpit_like.backends.per_sample_stats import GramSummary
    from cockpit_like.quantities.quantity import Quantity

    class RowsIfAny(Quantity):
        works_without_per_sample_stats = True

        def per_sample_stats(self, global_step):
            return [GramSummary()] if self.should_compute(global_step) else []

        def _compute(self, global_step, params, batch_loss):
            stats = context.get_record(global_step).stat(GramSummary(), None)
            return 0 if stats is None else int(stats[0].shape[0])  # 0: no rows this step

    model = resnet_batchnorm_eval().model.train()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1)), RowsIfAny(linear(1))], model=model)
    _step(cockpit, model, *_data())
    values = cockpit.get_output()[0]
    assert "NormTest" not in values and values["RowsIfAny"] == 0
    (note,) = values["checks"]["notes"]
    assert note.startswith("per-sample quantities ['NormTest'] left out: BatchNorm2d in training mode")
    assert note.endswith("; ['RowsIfAny'] computed without them")
    model.eval()
    model.zero_grad()
    _step(cockpit, model, *_data(), step=1)
    assert cockpit.get_output()[1]["RowsIfAny"] == 4 and "NormTest" in cockpit.get_output()[1]


def test_an_embedding_scaled_by_the_batch_id_counts_leaves_the_per_sample_quantities_out_with_a_note():
    """nn.Embedding(scale_grad_by_freq=True) divides each id's gradient by its count in the whole batch: a row's
    gradient depends on the other rows (found outside the tests: every step invalid, nothing stored, the reason
    naming other causes). Now like BatchNorm in training mode: a note names the option, the rest is stored."""
    from cockpit_like.quantities import GradNorm, Loss

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 4, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(12, 3)).double()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1)), GradNorm(linear(1)), Loss(linear(1))], model=model)
    ids, labels = torch.tensor([[1, 1, 2], [1, 3, 4], [5, 6, 1], [2, 2, 2]]), torch.tensor([0, 1, 2, 0])
    outputs = model(ids)
    losses = nn.functional.cross_entropy(outputs, labels, reduction="none")
    with cockpit(0, info={"batch_size": 4, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    values = cockpit.get_output()[0]
    assert values["checks"]["valid"] and "NormTest" not in values
    assert "Embedding(scale_grad_by_freq=True)" in values["checks"]["notes"][0]
    expected = [float(p.grad.norm()) for p in model.parameters()]
    assert values["GradNorm"] == pytest.approx(expected, rel=1e-12)


def test_backpack_assertion_becomes_an_explained_error():
    # BackPACK asserts on average pooling without count_include_pad inside its curvature extensions
    model = extend(nn.Sequential(nn.Conv2d(2, 3, 3), nn.AvgPool2d(2, count_include_pad=False), nn.Flatten(), nn.Linear(3, 3)).double())
    cockpit = Cockpit(model.parameters(), quantities=[HessTrace(linear(1))])
    with pytest.raises(UnsupportedLayerError) as error:
        _step(cockpit, model, *_data(), lossfunc=extend(nn.CrossEntropyLoss()))
    message = str(error.value)
    assert "AssertionError" in message and "DiagHessian()" in message
    assert "curvature='auto'" in message
    assert isinstance(error.value.__cause__, AssertionError)


def test_auto_curvature_avoids_backpack_on_a_model_it_cannot_handle():
    model = extend(nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 3)).double())  # no DiagHessian for GELU
    quantity = HessTrace(linear(1), curvature="auto")
    cockpit = Cockpit(model.parameters(), quantities=[quantity], model=model)
    assert quantity.method == "hutchinson" and cockpit.create_graph(0)
    assert quantity.settings() == {"curvature": "auto", "computed_with": "hutchinson", "hutchinson_samples": 4}
    _step(cockpit, model, *_data((4,)), lossfunc=extend(nn.CrossEntropyLoss()))
    assert len(cockpit.get_output()[0]["HessTrace"]) == 4
    # the explicit exact diagonal on the same model: BackPACK's failure, explained
    explicit = Cockpit(model.parameters(), quantities=[HessTrace(linear(1), curvature="diag_h")], model=model)
    with pytest.raises(UnsupportedLayerError, match="curvature='auto'"):
        _step(explicit, model, *_data((4,)), lossfunc=extend(nn.CrossEntropyLoss()))


class _Table(nn.Module):
    """Returns a learned ``[T, d]`` table without a batch dimension (broadcast over the rows later)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 4, dtype=torch.float64))

    def forward(self, x):
        return self.table * 1.0


class _WithTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.positions = _Table()
        self.head = nn.Linear(20, 3).double()

    def forward(self, x):
        return self.head((x + self.positions(x)).flatten(1))


def test_a_table_without_batch_dimension_climbs_to_the_model():
    """``_Table``'s output has no batch dimension: its per-sample gradients come from the model's call."""
    ratios = _sum_of_squares_against_loop(_WithTable(), *_data((5, 4)))
    assert ratios == pytest.approx([1.0] * len(ratios), rel=1e-9)


class _PositionTable(nn.Module):
    """Token embeddings plus ``nn.Embedding`` of ``torch.arange(T)`` (``[T, d]``, no batch dimension), as T5's
    relative position bias and many hand-written transformers do."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(7, 4).double(), nn.Embedding(5, 4).double()
        self.head = nn.Linear(20, 3).double()

    def forward(self, ids):
        return self.head((self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))).flatten(1))


@pytest.mark.parametrize("batch", [1, 3])
def test_an_embedding_without_batch_dimension_at_one_row_and_more(batch):
    """At batch 1 the whole output of a call is that row's: an embedding of ``torch.arange(T)`` gets its rows
    (before, batch 1 was refused, "no batch dimension of size 1", where batch 2 and more climbed to the model;
    outside trial 14: T5 at batch 1)."""
    ids = torch.randint(0, 7, (batch, 5), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 3, (batch,), generator=torch.Generator().manual_seed(1))
    ratios = _sum_of_squares_against_loop(_PositionTable(), ids, labels, batch_size=batch)
    assert ratios == pytest.approx([1.0] * len(ratios), rel=1e-9)


class _ReturnsLoss(nn.Module):
    """A model that returns the mean loss: no module call around ``_Table`` has the batch dimension."""

    def __init__(self):
        super().__init__()
        self.inner = _WithTable()

    def forward(self, x, labels):
        return nn.functional.cross_entropy(self.inner.head((x + self.inner.positions(x)).flatten(1)), labels)


def test_no_enclosing_call_with_the_batch_is_named_with_the_quantities():
    model = _ReturnsLoss()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1))], model=model)
    inputs, labels = _data((5, 4))
    loss = model(inputs, labels)
    with pytest.raises(RuntimeError) as error, cockpit(0, info={"loss": loss, "batch_size": 4}):
        loss.backward()
    message = str(error.value)
    assert "_Table" in message and "'inner.positions'" in message and "no batch dimension" in message
    assert "'NormTest'" in message and "no enclosing module" in message and "inner.positions.table" in message


class _Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


@pytest.mark.parametrize("model, shape", [
    (lambda: nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)), (3, 5)),  # a short last batch of 3
    (_Sequence, (3, 6, 4)),  # [B, T, F] with T = the wrong batch size
])  # fmt: skip
def test_a_wrong_batch_size_is_named_with_both_numbers(model, shape):
    """info['batch_size'] of 6 (the loader's nominal size) where the step's rows are 3, without
    individual_losses: the error says that batch_size is likely wrong (it blamed the model's structure)."""
    torch.manual_seed(0)
    model = model().double()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1))], model=model)
    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.randint(0, 3, shape[:-1])
    out = model(x)
    loss = nn.functional.cross_entropy(out.reshape(-1, 3), y.reshape(-1))
    with pytest.raises(UncoveredParameterError) as error, cockpit(0, info={"loss": loss, "batch_size": 6}):
        loss.backward()
    message = str(error.value)
    assert "info['batch_size'] is 6, but every tensor" in message and "has 3 rows" in message
    assert "likely wrong" in message and "len(targets)" in message and "compute the loss outside" not in message
    assert "short last batch" in message and "MAML" not in message


def _maml_step(cockpit, model, tasks=6, support=5, query=5, step=0):
    """One MAML meta-step: per task, one inner SGD step with create_graph=True on its support rows, then the loss
    of the adapted weights on its query rows (torch.func.functional_call); one loss per task."""
    from torch.func import functional_call

    params, names = list(model.parameters()), [name for name, _ in model.named_parameters()]
    generator = torch.Generator().manual_seed(step)
    losses = []
    for _ in range(tasks):
        xs, xq = torch.randn(support, 10, generator=generator), torch.randn(query, 10, generator=generator)
        ys, yq = torch.randint(0, 4, (support,), generator=generator), torch.randint(0, 4, (query,), generator=generator)
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(xs), ys), params, create_graph=True)
        adapted = {name: p - 0.4 * g for name, p, g in zip(names, params, grads)}
        losses.append(nn.functional.cross_entropy(functional_call(model, adapted, (xq,)), yq))
    losses = torch.stack(losses)
    with cockpit(step, info={"batch_size": tasks, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()


@pytest.mark.parametrize("support", [5, 10])
def test_maml_with_one_loss_per_task_is_told_that_tasks_are_not_rows(support):
    """Sixth round: MAML with 6 tasks of 5 query rows and info['batch_size'] = 6 raised BatchSizeMismatchError
    saying batch_size was likely a short last batch's (with 10 support rows: an error blaming the model's
    structure). Per-sample gradients are not defined for tasks that are not rows of a model call: the step
    leaves the per-sample quantities out with a note that says so, and the others are stored."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 4))
        cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1)), GradNorm(linear(1))], model=model)
        _maml_step(cockpit, model, support=support)
    finally:
        torch.set_default_dtype(torch.float32)
    output = cockpit.get_output()[0]
    assert "NormTest" not in output
    expected = [float(p.grad.norm()) for p in model.parameters()]
    assert output["GradNorm"] == pytest.approx(expected, rel=1e-12)
    (note,) = [n for n in output["checks"]["notes"] if "left out" in n]
    rows = "on 5 rows each" if support == 5 else "on 5 / 10 rows"
    assert f"the model ran 12 times in this step's forward pass, {rows}" in note, note
    assert "not the rows of a model call" in note and "MAML" in note and "GradNorm" in note
    assert "likely wrong" not in note


def test_rows_a_multiple_of_the_batch_size_are_named_as_groups():
    """One call on 30 rows with one loss per 5 rows and info['batch_size'] = 6: not a short last batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1))], model=model)
    x, y = torch.randn(30, 10, dtype=torch.float64), torch.randint(0, 4, (30,))
    losses = nn.functional.cross_entropy(model(x), y, reduction="none").reshape(6, 5).mean(1)
    with pytest.raises(UncoveredParameterError) as error:
        with cockpit(0, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    message = str(error.value)
    assert "has 30 rows" in message and "6 x 5" in message and "[6, 5, ...]" in message, message
    assert "'batch_size': 30" in message and "short last batch" not in message


class _Outside(nn.Module):
    """Uses a child's weight without calling the child (and owns no parameter itself)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 3)

    def forward(self, x):
        return nn.functional.linear(x, self.inner.weight, self.inner.bias)


def test_a_parameter_used_outside_its_module_is_computed_by_the_caller():
    """The model reads ``inner``'s weight without calling ``inner``: its own call computes them."""
    torch.manual_seed(0)
    ratios = _sum_of_squares_against_loop(_Outside().double(), *_data((4,)))
    assert ratios == pytest.approx([1.0] * len(ratios), rel=1e-9)


def test_parameters_the_loss_does_not_use():
    model = nn.Sequential(nn.Linear(4, 3)).double()
    unused = nn.Linear(2, 2).double()
    cockpit = Cockpit([*model.parameters(), *unused.parameters()], quantities=[NormTest(linear(1))], model=model)
    _step(cockpit, model, *_data((4,)))  # issue 34: zero rows for the unused parameters (it was an error)
    values = cockpit.get_output()[0]
    assert values["checks"]["valid"] and values["checks"]["no_gradient"] == ["param_2", "param_3"]
    assert "NormTest" in values


def test_hessian_vector_products_need_the_math_attention_kernel():
    """Steps out of order: the forward pass of a HessMaxEV step ran the fused attention kernel."""
    from tests.zoo import gpt2

    problem = gpt2()
    model = problem.model
    cockpit = Cockpit(model.parameters(), quantities=[HessMaxEV(lambda step: step == 5)], model=model)
    for step in (0, 5):  # the cockpit expects step 1 after step 0, so the forward of step 5 is not prepared
        model.zero_grad()  # (a step with stale gradients fails its checks and runs no curvature)
        tokens, targets = problem.batch(3, step)
        outputs = model(tokens)
        loss = problem.sample_losses(outputs, targets).mean()
        if step == 5:
            with pytest.raises(RuntimeError, match="no second derivative") as error:
                with cockpit(step, info={"loss": loss}):
                    loss.backward(create_graph=cockpit.create_graph(step))
            assert "sdpa_kernel" in str(error.value) and "model=model" in str(error.value)
        else:
            with cockpit(step, info={"loss": loss}):
                loss.backward()


def test_an_operation_without_second_derivative_names_itself_and_the_quantities_that_need_one():
    """nn.EmbeddingBag's backward has no derivative: the error names the operation and the step's quantities
    that need Hessian-vector products (not TICDiag, whose GGN diagonal does not), and gives no attention advice."""
    from cockpit_like.quantities import HessTrace, TICDiag

    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(10, 4), nn.Linear(4, 3)).double()
    ids, labels = torch.randint(0, 10, (6, 3)), torch.randint(0, 3, (6,))
    every = linear(1)
    quantities = [HessMaxEV(every), HessTrace(every, curvature="hutchinson"), TICDiag(every, curvature="ggn")]
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    outputs = model(ids)
    loss = nn.functional.cross_entropy(outputs, labels)
    with pytest.raises(RuntimeError, match="no second derivative") as error:
        with cockpit(0, info={"loss": loss, "outputs": outputs, "batch_size": 6}):
            loss.backward(create_graph=cockpit.create_graph(0))
    text = str(error.value)
    assert "'_embedding_bag_backward'" in text
    assert "quantities of step 0 that need them: HessMaxEV, HessTrace." in text
    assert "TICDiag" not in text.split("need them:")[1]
    assert "attention" not in text and "sdpa_kernel" not in text
    assert "Leave them out" in text and "nn.Embedding followed by" in text


def test_an_attention_kernel_without_second_derivative_keeps_the_kernel_advice():
    from cockpit_like.backends.hvp import NoSecondDerivativeError

    cause = RuntimeError("the derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented")
    error = NoSecondDerivativeError("HessMaxEV", cause).for_step(3, ("HessMaxEV",))
    assert error.kernel and "sdpa_kernel" in str(error) and "model=model" in str(error)
    assert "'_scaled_dot_product_flash_attention_for_cpu_backward'" in str(error)


def test_model_argument_must_be_a_module():
    with pytest.raises(ValueError, match="model=...") as error:
        Cockpit([torch.ones(1, requires_grad=True)], model="not a model")
    assert "nn.Module" in str(error.value)


def test_graph_steps_use_the_math_attention_kernel():
    """The fused CPU attention kernel has no double backward; on HessMaxEV steps the cockpit avoids it."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    model = nn.Sequential(layer, nn.Flatten(), nn.Linear(8 * 5, 3)).double()
    cockpit = Cockpit(model.parameters(), quantities=configuration("full", linear(2)), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        inputs, labels = _data((5, 8))
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = nn.functional.cross_entropy(outputs, labels)
        info = {"batch_size": 4, "loss": loss, "individual_losses": nn.functional.cross_entropy(outputs, labels, reduction="none"), "optimizer": optimizer}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    output = cockpit.get_output()
    assert isinstance(output[0]["HessMaxEV"], float) and isinstance(output[2]["HessMaxEV"], float)


def test_dropout_inside_a_recomputed_module_leaves_the_per_sample_quantities_out():
    """MultiheadAttention has no per-layer rule; with attention dropout its recomputation would differ: the
    per-sample quantities are left out of the step with a note that names the dropout and the fix (since
    2026-11-29; the run stopped before), and the run goes on."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, dropout=0.2, batch_first=True).double()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.head = attention, nn.Linear(8, 3).double()

        def forward(self, x):
            return self.head(self.attention(x, x, x, need_weights=False)[0].mean(1))

    model = Model()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1))], model=model)
    _step(cockpit, model, *_data((5, 8)))
    assert "NormTest" not in cockpit.get_output().get(0, {})
    (note,) = [n for n in cockpit.checks[0]["notes"] if "left out" in n]
    assert "dropout=0.2" in note and "'attention'" in note and ".eval()" in note
    attention.eval()  # no dropout: works
    _step(cockpit, model, *_data((5, 8)), step=1)
    assert 1 in cockpit.get_output()


# ---- regressions: silent wrong numbers found by reproduction --------------------------------------------
def _sum_of_squares_against_loop(model, inputs, labels, batch_size=None, call=lambda model, x: model(x)):
    """``cockpit / brute force`` of each parameter's summed per-sample squared gradient."""
    from cockpit_like.backends.per_sample_stats import SumOfSquares
    from cockpit_like.context import get_record
    from cockpit_like.quantities.quantity import SingleStepQuantity

    class Probe(SingleStepQuantity):
        def per_sample_stats(self, step):
            return [SumOfSquares()]

        def _compute(self, step, params, loss):
            return [s.clone() for s in get_record(step).stat(SumOfSquares())]

    params = list(model.parameters())
    probe = Probe(linear(1))
    cockpit = Cockpit(params, [probe])  # discovery
    loss = nn.functional.cross_entropy(call(model, inputs), labels)
    info = {"loss": loss} if batch_size is None else {"loss": loss, "batch_size": batch_size}
    with cockpit(0, info=info):
        loss.backward()
    batch = len(labels)
    reference = [torch.zeros_like(p) for p in params]
    for i in range(batch):
        rows = torch.autograd.grad(nn.functional.cross_entropy(call(model, inputs[i : i + 1]), labels[i : i + 1]) / batch, params)
        for r, g in zip(reference, rows):
            r += g**2
    return [float(got.sum() / want.sum()) for got, want in zip(probe.output[0], reference)]


class _TinyViT(nn.Module):
    """A class token owned by the model itself (its fallback) around an encoder whose attention has a rule."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 8, dtype=torch.float64))
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=torch.float64)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x):
        return self.head(self.encoder(torch.cat([self.cls.expand(len(x), 1, 8), x], 1))[:, 0])


def test_a_child_weight_is_claimed_once():
    """The attention rule claims out_proj; the model's own fallback must not claim it again."""
    torch.manual_seed(0)
    ratios = _sum_of_squares_against_loop(_TinyViT(), *_data((5, 8)))
    assert ratios == pytest.approx([1.0] * len(ratios), rel=1e-9)


class _KeywordModel(nn.Module):
    """Called with keyword inputs only, positions of shape [1, T] (as Hugging Face models are)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(7, 4).double(), nn.Embedding(6, 4).double()
        self.head = nn.Linear(4, 3).double()

    def forward(self, input_ids=None):
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        return self.head((self.tokens(input_ids) + self.positions(positions)).mean(1))


def test_discovery_knows_the_batch_of_a_keyword_only_call():
    torch.manual_seed(0)
    model = _KeywordModel()
    tokens = torch.randint(0, 7, (4, 6))
    labels = torch.randint(0, 3, (4,))
    # found by PyTorch's global pre-hook, which sees no keyword inputs
    ratios = _sum_of_squares_against_loop(model, tokens, labels, call=lambda m, x: m(input_ids=x))
    assert ratios == pytest.approx([1.0] * len(ratios), rel=1e-9)


class _Unbatched(nn.Module):
    def __init__(self):
        super().__init__()
        self.positions = nn.Embedding(6, 4).double()
        self.head = nn.Linear(4, 3).double()

    def forward(self, x):
        return self.head((x + self.positions(torch.arange(x.shape[1]))).mean(1))


def test_an_output_without_batch_dimension_is_exact_not_a_wrong_number():
    torch.manual_seed(0)
    ratios = _sum_of_squares_against_loop(_Unbatched(), *_data((6, 4)))
    assert ratios == pytest.approx([1.0] * len(ratios), rel=1e-9)


def test_forward_passes_on_the_live_model_before_the_step_are_told_apart():
    """Brute-force passes (forward + autograd.grad) on the live model after the cockpit was made: the
    step keeps only the calls its loss depends on (graph reachability over kept node objects)."""
    from cockpit_like.quantities import NormTest as _NormTest
    from tests.zoo import gpt2, per_sample_grads_loop

    problem = gpt2()
    model = problem.model
    params = list(model.parameters())
    quantity = _NormTest(linear(1))
    cockpit = Cockpit(params, quantities=[quantity, HessMaxEV(linear(1))], model=model)
    inputs, targets = problem.batch(5, 1)
    grads = per_sample_grads_loop(problem, inputs, targets, params)  # five recorded forward passes
    loss = problem.sample_losses(problem.forward(model, inputs), targets).mean()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"loss": loss, "batch_size": 5}):
            loss.backward(create_graph=True)
    from tests.test_gradient_tests import reference_tests

    assert quantity.get_output()[0] == pytest.approx(reference_tests(grads)["NormTest"], rel=1e-8)


_LIVE_PASSES = """
import sys, warnings
warnings.filterwarnings("ignore")
import torch
from cockpit_like import Cockpit
from cockpit_like.quantities import HessMaxEV, NormTest
from tests.zoo import gpt2, per_sample_grads_loop
problem = gpt2()
model = problem.model
params = list(model.parameters())
cockpit = Cockpit(params, quantities=[NormTest(lambda s: True), HessMaxEV(lambda s: True)], model=model)
inputs, targets = problem.batch(5, 1)
per_sample_grads_loop(problem, inputs, targets, params)
loss = problem.sample_losses(problem.forward(model, inputs), targets).mean()
with cockpit(0, info={"loss": loss, "batch_size": 5}):
    loss.backward(create_graph=True)
print("tracked", sorted(key for key in cockpit.get_output()[0] if key != "checks"))  # checks: the math attention note
"""


def test_graph_reachability_in_a_fresh_interpreter():
    """Brute-force passes on the live model, then a graph step: the step keeps its own calls.

    With torch 2.11 (a GPU machine) the graph walk once stopped after 4 of ~155 nodes, because it
    let node objects die and a new node's object reused a freed id; every call then looked
    unreachable. The walk now keeps its node objects. (torch 2.13 here rarely reuses the ids.)"""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _LIVE_PASSES], capture_output=True, text=True, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tracked ['HessMaxEV', 'NormTest']" in done.stdout


# ---- climbing: where the rows can be told apart (issue 22) ----------------------------------------------
class _Counter(nn.Module):
    """A layer whose output depends on how often it ran (state outside its inputs): not re-runnable."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.scale * self.calls


def test_a_rerun_that_does_not_reproduce_the_forward_pass_leaves_the_per_sample_quantities_out():
    """A module whose output depends on state it keeps across calls: its row-by-row re-run does not reproduce
    the step; the per-sample quantities are left out with a note that names it (an error until 2026-11-29)."""
    model = nn.Sequential(_Counter(), nn.Linear(4, 3).double())
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1))], model=model)
    _step(cockpit, model, *_data((4,)))
    assert "NormTest" not in cockpit.get_output().get(0, {})
    assert any(re.search(r"_Counter: re-running it row by row .* did not reproduce", n) for n in cockpit.checks[0]["notes"])


class _EncoderDecoder(nn.Module):
    """Returns the encoder's output too, which its decoder reads (as BART's model does), and a table
    without batch dimension before the encoder: the table cannot climb to this module."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4).double()
        self.table = _Table()
        self.decoder = nn.Linear(4, 4).double()

    def forward(self, x):
        encoded = torch.tanh(self.encoder(x + self.table(x)))
        return encoded, self.decoder(encoded)


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _EncoderDecoder()
        self.head = nn.Linear(20, 3).double()

    def forward(self, x):
        encoded, decoded = self.body(x)
        return self.head((decoded + 0.1 * encoded).flatten(1))


def test_a_call_whose_outputs_feed_each_other_is_not_climbed_to():
    """``body`` returns ``encoded`` and uses it itself: its gradient counts that use, so the table
    climbs on to the model's call, and the numbers are the loop's."""
    torch.manual_seed(0)
    ratios = _sum_of_squares_against_loop(_Head(), *_data((5, 4)))
    assert ratios == pytest.approx([1.0] * len(ratios), rel=1e-9)



def test_a_sequence_first_transformer_gets_the_batch_first_hint():
    """``nn.TransformerEncoderLayer`` without ``batch_first`` on ids ``[T, B]``: the error says where the batch is
    and names ``batch_first=True`` (it said only that the outputs had no batch dimension)."""
    torch.manual_seed(0)
    rows, tokens, width = 5, 7, 8

    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, width)
            layer = nn.TransformerEncoderLayer(width, 2, 16, dropout=0.0)
            self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.head = nn.Linear(width, 3)

        def forward(self, ids):  # [T, B]
            return self.head(self.enc(self.emb(ids)).mean(0))

    model = SequenceFirst()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(lambda s: True)], model=model)
    ids, y = torch.randint(0, 11, (tokens, rows)), torch.randint(0, 3, (rows,))
    losses = nn.functional.cross_entropy(model(ids), y, reduction="none")
    loss = losses.mean()
    with pytest.raises(UncoveredParameterError) as caught:
        with cockpit(0, info={"batch_size": rows, "individual_losses": losses, "loss": loss}):
            loss.backward()
    message = str(caught.value)
    assert "dimension 1 of these outputs" in message and "batch_first=True" in message


def test_sequence_first_ids_with_another_length_get_the_batch_first_hint():
    """Ids [T, B] with T = 5, B = 3 into an nn.Embedding: the BatchSizeMismatchError said the correct batch size
    was likely wrong (seventh round of outside trials); it now names the sequence-first layout and batch_first."""
    from cockpit_like.backends.hooks import BatchSizeMismatchError

    torch.manual_seed(0)

    class WordModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(7, 4)
            self.out = nn.Linear(4, 7)

        def forward(self, ids):  # [T, B] -> [T, B, V]
            return self.out(self.e(ids))

    model = WordModel()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(lambda s: True)], model=model)
    ids = torch.randint(0, 7, (5, 3))
    logits = model(ids)
    losses = nn.functional.cross_entropy(logits.permute(1, 2, 0), ids.t(), reduction="none").mean(1)
    with pytest.raises(BatchSizeMismatchError, match="run sequence-first .*batch_first=True"):
        with cockpit(0, info={"batch_size": 3, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()


def test_graphs_flattened_into_their_nodes_are_refused_with_the_dense_layout_as_the_fix():
    """A PyTorch-Geometric-style GNN (the graphs' nodes in one [nodes, d] tensor, pooled per graph by index): no
    call has the batch's rows, and the error said to compute the loss outside the model, which it already was
    (outside trial 8). It names the packed layout and the dense one that works."""

    class ScatterGNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.head = nn.Linear(3, 8), nn.Linear(8, 2)

        def forward(self, x, batch, graphs):
            h = torch.relu(self.l1(x))
            return self.head(torch.zeros(graphs, h.shape[1]).index_add(0, batch, h))

    torch.manual_seed(0)
    model = ScatterGNN()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1))], model=model)
    batch = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    out = model(torch.randn(10, 3), batch, 4)
    losses = nn.functional.cross_entropy(out, torch.tensor([0, 1, 0, 1]), reduction="none")
    with pytest.raises(UncoveredParameterError, match=r"graphs flattened into their nodes .* \[B, N, d\] padded, with a mask"):
        with cockpit(0, info={"batch_size": 4, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()


class _HardConcrete(nn.Module):
    """An L0 gate (hard-concrete) whose noise is drawn inside ``forward``, with a parameter of its own."""

    def __init__(self, width):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.zeros(width, dtype=torch.float64))

    def forward(self, h):
        u = torch.rand_like(h).clamp(1e-6, 1 - 1e-6)
        return h * torch.sigmoid((torch.log(u) - torch.log(1 - u) + self.log_alpha) / 0.5)


def _gated_run(with_cockpit: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), _HardConcrete(8), nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model) if with_cockpit else None
    caught = []
    for step in range(3):
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
        optimizer.zero_grad()
        rows = F.cross_entropy(model(x), y, reduction="none")
        if cockpit is None:
            rows.mean().backward()
        else:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                with cockpit(step, info={"batch_size": 8, "individual_losses": rows, "loss": rows.mean(),
                                         "optimizer": optimizer}):
                    rows.mean().backward()
            caught += [str(w.message) for w in seen if "left out" in str(w.message)]
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], torch.rand(1), cockpit, caught


def test_random_numbers_drawn_inside_a_module_leave_the_per_sample_quantities_out_and_the_run_alone():
    """Outside trial 20: a hard-concrete gate drawing its noise inside forward stopped the run at step 0
    (UncoveredParameterError). Its re-run cannot reproduce the step, so the per-sample quantities are left out of
    every step with a note naming it (told once as a warning), the others stored; the run is the same as without
    the cockpit (the re-run's draws are not the user's)."""
    plain, plain_next, _, _ = _gated_run(False)
    tracked, tracked_next, cockpit, told = _gated_run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, tracked)) and torch.equal(plain_next, tracked_next)
    output = cockpit.get_output()
    assert all("NormTest" not in output[step] and "GradNorm" in output[step] for step in range(3))
    assert all(any("_HardConcrete: re-running it row by row" in note for note in cockpit.checks[step]["notes"])
               for step in range(3))
    assert len(told) == 1
