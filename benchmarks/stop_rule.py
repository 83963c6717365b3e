#!/usr/bin/env python
"""The Lanczos stop rule against exact references on many models (issue 37, item 1).

For each model this script takes a few SGD steps (float64) with
``HessMaxEV`` and ``HessEigenvalues`` tracked (both read the step's one
shared decomposition, :class:`~cockpit_like.backends.curvature_engine.LanczosNeed`,
with its defaults: ``rtol = 1e-2``) and, at each step, computes an exact
reference of the Hessian of the same mean loss at the same parameters on an
independent copy of the model:

- ``dense``: the Hessian from ``D`` exact Hessian-vector products (double
  backprop on unit vectors), symmetrised, ``torch.linalg.eigvalsh``
  (``D <= --dense-limit``);
- ``eigsh``: :func:`scipy.sparse.linalg.eigsh` (``which="LA"`` and ``"SA"``,
  ``tol = 1e-10``) on exact Hessian-vector products (larger ``D``).

Synthetic symmetric matrices (clustered, near-tied and indefinite spectra in a
random orthogonal basis, including the spectra the issue reports) run the
same engine function (:func:`~cockpit_like.functional.krylov.lanczos_decomposition`
from the cockpit's probes) against ``eigvalsh``.

A step *agrees* when the largest and the smallest Ritz value and HessMaxEV's
value (the eigenvalue of largest magnitude, Cockpit's definition; where the two
ends' magnitudes are within the tolerance of each other either is accepted)
are within the claimed tolerance ``rtol * max|theta|`` of the reference. The
rule was set on the ``dev`` models (``tests/zoo.py``, the test helpers' MLP and
CNN, synthetic spectra) and is reported separately on the ``held-out`` ones
(Hugging Face configs of ``tests/hf_zoo.py`` and architectures added here:
LSTM, vanilla RNN, a ReLU/BatchNorm CNN, wav2vec2, SegFormer, ConvNeXt, Swin,
DistilBERT, Whisper's encoder where transformers builds them). A third group,
``outside-4``, holds an outside tester's architectures (round 4; defined in
``benchmarks/stop_rule_outside4.py`` as the tester built them, batch 5),
including the model of its report ``p01`` on which HessMaxEV stored a missed
top eigenvalue as converged; it was added after the rule was fixed and is
reported, not tuned on. ``--groups`` selects groups.

    python benchmarks/stop_rule.py --json benchmarks/results/stop_rule.json --docs docs/curvature.md

``--docs`` rewrites the table between the markers ``<!-- stop-rule table -->``
and ``<!-- /stop-rule table -->`` in that file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

DTYPE = torch.float64
BEGIN, END = "<!-- stop-rule table -->", "<!-- /stop-rule table -->"


# ---- synthetic spectra ------------------------------------------------------------------------
def synthetic_spectra() -> dict[str, list[float]]:
    """Name -> leading eigenvalues; the rest of the spectrum is a bulk (added in :func:`synthetic_matrix`)."""
    return {
        "wav2vec2-like cluster": [0.703, -0.670, 0.670, -0.667],
        "segformer-like +-tie": [7.95, -7.89],
        "exact +-tie": [5.0, -5.0],
        "degenerate top pair": [3.0, 3.0, 2.97],
        "triple near-tie": [1.0, 0.995, 0.99],
        "top 1% above the second": [2.0, 1.98, 1.5],
        "negative dominant": [-4.0, 1.0],
        "one outlier": [10.0],
        "many outliers": [4.0, 3.9, 3.8, 3.7, 3.6, 3.5, 3.4, 3.3],
        "flat bulk only": [],
        "tiny top gap, big bottom": [1.0, 0.999, -6.0],
        "clustered negatives": [0.5, -1.0, -0.99, -0.98],
    }


def synthetic_matrix(leading: list[float], n: int, seed: int) -> torch.Tensor:
    """``Q diag(leading + bulk) Q^T`` with a random orthogonal ``Q`` and a bulk in ``[-0.3, 0.3] * scale``."""
    generator = torch.Generator().manual_seed(seed)
    scale = max([abs(x) for x in leading], default=1.0)
    bulk = (torch.rand(n - len(leading), generator=generator, dtype=DTYPE) * 2 - 1) ** 3 * 0.3 * scale
    spectrum = torch.cat([torch.tensor(leading, dtype=DTYPE), bulk])
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=DTYPE))
    return (q * spectrum) @ q.T


# ---- models -----------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    group: str  # "dev", "held-out" or "outside-4"
    factory: object  # seed -> tests.zoo.Problem
    batch_size: int | None = None  # None: the command line's --batch-size


def _classification(features, classes):
    def batch(size, seed):
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(size, *features, generator=generator, dtype=DTYPE)
        return inputs, torch.randint(0, classes, (size,), generator=generator)

    return batch


def _ce(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


class _LastStep(nn.Module):
    def __init__(self, rnn, width, classes):
        super().__init__()
        self.rnn, self.head = rnn, nn.Linear(width, classes)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _problem(model, batch, losses=_ce, forward=None):
    from tests.zoo import Problem

    return Problem(model.to(DTYPE), batch, losses, forward or (lambda m, x: m(x)))


def lstm(seed):
    torch.manual_seed(seed)
    return _problem(_LastStep(nn.LSTM(4, 6, batch_first=True), 6, 3), _classification((5, 4), 3))


def vanilla_rnn(seed):
    torch.manual_seed(seed)
    return _problem(_LastStep(nn.RNN(4, 7, batch_first=True), 7, 3), _classification((5, 4), 3))


def relu_bn_cnn(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    )
    return _problem(model, _classification((3, 8, 8), 5))


def small_cnn_3c3d(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 4 * 4, 10), nn.ReLU(), nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 4),
    )
    return _problem(model, _classification((3, 10, 10), 4))


def _hf_image(model_class, config, classes, shape):
    def factory(seed):
        torch.manual_seed(seed)
        model = model_class(config()).to(DTYPE).eval()

        def forward(m, x):
            out = m(pixel_values=x).logits
            return out.mean(dim=(-2, -1)) if out.dim() == 4 else out

        return _problem(model, _classification(shape, classes), _ce, forward)

    return factory


def _hf_audio(seed):
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    torch.manual_seed(seed)
    config = Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, num_labels=3, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0, classifier_proj_size=8, apply_spec_augment=False,
    )
    model = Wav2Vec2ForSequenceClassification(config).to(DTYPE).eval()
    return _problem(model, _classification((200,), 3), _ce, lambda m, x: m(input_values=x).logits)


def _segformer(seed):
    from transformers import SegformerConfig, SegformerForImageClassification

    config = lambda: SegformerConfig(  # noqa: E731
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        patch_sizes=[3, 3], strides=[2, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
        drop_path_rate=0.0, decoder_hidden_size=16, num_labels=3,
    )
    return _hf_image(SegformerForImageClassification, config, 3, (3, 16, 16))(seed)


def _convnext(seed):
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = lambda: ConvNextConfig(  # noqa: E731
        num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
        drop_path_rate=0.0,
    )
    return _hf_image(ConvNextForImageClassification, config, 3, (3, 16, 16))(seed)


def _swin(seed):
    from transformers import SwinConfig, SwinForImageClassification

    config = lambda: SwinConfig(  # noqa: E731
        image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1], num_heads=[1, 2],
        window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0, num_labels=3,
    )
    return _hf_image(SwinForImageClassification, config, 3, (3, 16, 16))(seed)


def _distilbert(seed):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(seed)
    config = DistilBertConfig(vocab_size=40, max_position_embeddings=16, n_layers=2, n_heads=2, dim=16,
                              hidden_dim=24, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
                              num_labels=3)
    model = DistilBertForSequenceClassification(config).to(DTYPE).eval()

    def batch(size, seed):
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(3, 40, (size, 5), generator=generator), torch.randint(0, 3, (size,), generator=generator)

    return _problem(model, batch, _ce, lambda m, x: m(input_ids=x).logits)


def cases() -> list[Case]:
    from tests import helpers
    from tests.hf_zoo import HF_ZOO
    from tests.zoo import ZOO

    made = [Case(f"zoo/{name}", "dev", factory) for name, factory in ZOO.items()]

    def helper(problem):
        def factory(seed):
            model_factory, shape, classes = helpers.PROBLEMS[problem]
            return _problem(model_factory(seed=seed), _classification(shape, classes))

        return factory

    made += [Case(f"helpers/{name}", "dev", helper(name)) for name in helpers.PROBLEMS]
    made += [Case(f"hf/{name}", "held-out", factory) for name, factory in HF_ZOO.items()]
    made += [
        Case("new/lstm", "held-out", lstm),
        Case("new/vanilla_rnn", "held-out", vanilla_rnn),
        Case("new/relu_bn_cnn", "held-out", relu_bn_cnn),
        Case("new/cnn_3c3d_small", "held-out", small_cnn_3c3d),
        Case("new/wav2vec2", "held-out", _hf_audio),
        Case("new/segformer", "held-out", _segformer),
        Case("new/convnext", "held-out", _convnext),
        Case("new/swin", "held-out", _swin),
        Case("new/distilbert", "held-out", _distilbert),
    ]
    from benchmarks.stop_rule_outside4 import BATCH, OUTSIDE4

    made += [Case(f"outside4/{name}", "outside-4", factory, BATCH) for name, factory in OUTSIDE4.items()]
    return made


GROUPS = ("dev", "held-out", "outside-4")


# ---- references -------------------------------------------------------------------------------
def _math_attention():
    import contextlib

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


def exact_extremes(problem, model, inputs, targets, dense_limit: int) -> dict:
    """``{"largest", "smallest", "method", "dimension"}`` of the Hessian of the mean loss at ``model``'s parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    with _math_attention():
        loss = problem.sample_losses(problem.forward(model, inputs), targets).mean()
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    # parameters the loss does not use (BigBird's unused pooler) or uses linearly: zero rows of the Hessian
    used = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
    sizes = [p.numel() for p in params]
    dimension = sum(sizes)

    def hvp(vector: torch.Tensor) -> torch.Tensor:
        pieces = [piece.reshape(p.shape) for piece, p in zip(vector.split(sizes), params)]
        with _math_attention():
            out = torch.autograd.grad([grads[i] for i in used], params, [pieces[i] for i in used],
                                      retain_graph=True, allow_unused=True)
        return torch.cat([(torch.zeros_like(p) if o is None else o).reshape(-1) for o, p in zip(out, params)])

    if dimension <= dense_limit:
        eye = torch.eye(dimension, dtype=DTYPE)
        hessian = torch.stack([hvp(eye[i]) for i in range(dimension)])
        values = torch.linalg.eigvalsh((hessian + hessian.T) / 2)
        return {"largest": float(values[-1]), "smallest": float(values[0]), "method": "dense", "dimension": dimension}
    import numpy as np
    from scipy.sparse.linalg import LinearOperator, eigsh

    operator = LinearOperator(
        (dimension, dimension), dtype=np.float64,
        matvec=lambda v: hvp(torch.from_numpy(np.ascontiguousarray(v).reshape(-1)).to(DTYPE)).numpy(),
    )
    start = np.random.default_rng(0).standard_normal(dimension)
    largest = eigsh(operator, k=1, which="LA", tol=1e-10, v0=start, ncv=min(dimension, 40))[0][0]
    smallest = eigsh(operator, k=1, which="SA", tol=1e-10, v0=start, ncv=min(dimension, 40))[0][0]
    return {"largest": float(largest), "smallest": float(smallest), "method": "eigsh", "dimension": dimension}


def _largest_magnitude(largest: float, smallest: float) -> float:
    return largest if abs(largest) >= abs(smallest) else smallest


def judge(largest: float, smallest: float, top: float, bottom: float, value: float, scale: float, rtol: float) -> dict:
    """Whether the extreme Ritz values and HessMaxEV's value are within the claimed tolerance of the reference."""
    tolerance = rtol * scale
    error_value = abs(value - _largest_magnitude(largest, smallest))
    if abs(abs(largest) - abs(smallest)) <= tolerance:  # the ends' magnitudes tie: either is accepted
        error_value = min(abs(value - largest), abs(value - smallest))
    magnitude_ok = error_value <= tolerance
    return {
        "tolerance": tolerance,
        "error_top": top - largest,
        "error_bottom": bottom - smallest,
        "error_hessmaxev": error_value,
        "within": bool(abs(top - largest) <= tolerance and abs(bottom - smallest) <= tolerance and magnitude_ok),
    }


# ---- runs -------------------------------------------------------------------------------------
def run_model(case: Case, steps: int, batch_size: int, dense_limit: int, rtol: float, probes: int) -> list[dict]:
    from cockpit_like import Cockpit
    from cockpit_like.quantities import HessEigenvalues, HessMaxEV
    from cockpit_like.utils import schedules

    problem = case.factory(0)
    reference_problem = case.factory(0)  # a copy without the cockpit's hooks
    model, twin = problem.model, reference_problem.model
    schedule = schedules.linear(1)
    maxev, extremes = HessMaxEV(schedule), HessEigenvalues(schedule, probes=probes)
    maxev._probes = probes  # HessMaxEV takes the engine's default; the same need as HessEigenvalues
    params = [p for p in model.parameters() if p.requires_grad]
    cockpit = Cockpit(params, quantities=[maxev, extremes], model=model)
    optimizer = torch.optim.SGD(params, lr=0.05)
    batch_size = case.batch_size or batch_size
    rows = []
    for step in range(steps):
        inputs, targets = problem.batch(batch_size, 100 + step)
        twin.load_state_dict(model.state_dict())
        reference = exact_extremes(reference_problem, twin, inputs, targets, dense_limit)
        optimizer.zero_grad()
        loss = problem.sample_losses(problem.forward(model, inputs), targets).mean()
        with cockpit(step, info={"loss": loss, "batch_size": batch_size}):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
        for p in params:
            p.grad = None
        value = extremes.get_output()[step]
        scale = max(abs(value["largest"]), abs(value["smallest"]))
        row = {
            "model": case.name, "group": case.group, "step": step, "batch_size": batch_size,
            "dimension": reference["dimension"],
            "reference": reference["method"], "largest": reference["largest"], "smallest": reference["smallest"],
            "top": value["largest"], "bottom": value["smallest"], "hessmaxev": maxev.get_output()[step],
            "products": value["products"], "converged": value["converged"],
        }
        row.update(judge(reference["largest"], reference["smallest"], row["top"], row["bottom"], row["hessmaxev"], scale, rtol))
        rows.append(row)
    return rows


def run_synthetic(name: str, leading: list[float], steps: int, n: int, rtol: float, max_products: int,
                  probes: int) -> list[dict]:
    """``steps`` solves of one spectrum (different bases and probes: seeds ``step``), the engine's function and probes."""
    from cockpit_like.backends.curvature_engine import start_vectors, step_generator
    from cockpit_like.functional.krylov import lanczos_decomposition

    rows = []
    for step in range(steps):
        matrix = synthetic_matrix(leading, n, seed=1000 * step + len(name))
        exact = torch.linalg.eigvalsh(matrix)
        probe = start_vectors(probes, n, DTYPE, "cpu", step_generator(step, "lanczos probes"))
        decomposition = lanczos_decomposition(lambda v: matrix @ v, probe, max_products=max_products, rtol=rtol, probes=probes)
        values = decomposition.ritz_values()
        top, bottom = float(values[-1]), float(values[0])
        value = top if abs(top) >= abs(bottom) else bottom
        scale = max(abs(top), abs(bottom))
        row = {
            "model": f"synthetic/{name}", "group": "dev", "step": step, "dimension": n, "reference": "dense",
            "largest": float(exact[-1]), "smallest": float(exact[0]), "top": top, "bottom": bottom,
            "hessmaxev": value, "products": decomposition.num_products, "converged": decomposition.converged,
        }
        row.update(judge(row["largest"], row["smallest"], top, bottom, value, scale, rtol))
        rows.append(row)
    return rows


# ---- report -----------------------------------------------------------------------------------
def summary(rows: list[dict], rtol: float = 1e-2) -> dict:
    out = {}
    for group in [g for g in GROUPS if any(r["group"] == g for r in rows)] + ["all"]:
        chosen = [r for r in rows if group == "all" or r["group"] == group]
        converged = [r for r in chosen if r["converged"]]
        # of the converged steps, relative to max|theta| (the tolerance's scale): the extreme Ritz values and HessMaxEV
        errors = [max(abs(r["error_top"]), abs(r["error_bottom"]), r["error_hessmaxev"]) * rtol / r["tolerance"]
                  for r in converged if r["tolerance"] > 0]
        out[group] = {
            "models": len({r["model"] for r in chosen}),
            "steps": len(chosen),
            "converged": len(converged),
            "converged_within": sum(r["within"] for r in converged),
            "unconverged": len(chosen) - len(converged),
            "median_products": sorted(r["products"] for r in chosen)[len(chosen) // 2] if chosen else None,
            "largest_error": max(errors, default=None),
        }
    return out


def markdown(rows: list[dict], failures: list[str], rtol: float, header: str) -> str:
    stats = summary(rows, rtol)
    lines = [header, ""]
    lines.append("| group | models | steps | say converged | of those within rtol * max abs(theta) | not converged | "
                 "largest error of a converged step, % of max abs(theta) | median products |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for group, s in stats.items():
        share = f"{s['converged_within']} ({100 * s['converged_within'] / max(s['converged'], 1):.1f}%)"
        error = "-" if s["largest_error"] is None else f"{100 * s['largest_error']:.2f}"
        lines.append(f"| {group} | {s['models']} | {s['steps']} | {s['converged']} | {share} | {s['unconverged']} | "
                     f"{error} | {s['median_products']} |")
    lines += ["", f"Per model and step (reference: exact largest / smallest eigenvalue; engine: the extreme Ritz values; "
              f"error relative to max abs(theta); tolerance rtol = {rtol:g}):", ""]
    lines.append("| model | group | D | ref | step | largest | engine | smallest | engine | HessMaxEV | products | converged | within |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['group']} | {r['dimension']} | {r['reference']} | {r['step']} | {r['largest']:.5g} | "
            f"{r['top']:.5g} | {r['smallest']:.5g} | {r['bottom']:.5g} | {r['hessmaxev']:.5g} | {r['products']} | "
            f"{'yes' if r['converged'] else 'no'} | {'yes' if r['within'] else '**no**'} |"
        )
    if failures:
        lines += ["", "Models that could not run (left out of the counts):", ""]
        lines += [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def _outside_batch() -> int:
    from benchmarks.stop_rule_outside4 import BATCH

    return BATCH


def write_docs(path: Path, table: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} markers to write the table between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="SGD steps (solves) per model")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--dense-limit", type=int, default=800, help="largest D with a dense reference")
    parser.add_argument("--synthetic-size", type=int, default=1500, help="dimension of the synthetic matrices")
    parser.add_argument("--only", default=None, help="comma-separated substrings of model names to run")
    parser.add_argument("--groups", default=",".join(GROUPS),
                        help=f"comma-separated groups to run (default: all of {', '.join(GROUPS)})")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--docs", type=Path, default=None, help="rewrite the table in this markdown file")
    parser.add_argument("--probes", type=int, default=None, help="start vectors (default: the engine's)")
    parser.add_argument("--rule", choices=["residual", "gap-estimate"], default="residual",
                        help="gap-estimate: the rule before issue 37 (min(r, r^2/gap) of the Ritz values found), for comparison")
    parser.add_argument("--dry-run", action="store_true", help="list the models and exit")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from cockpit_like.backends.curvature_engine import DEFAULT_PROBES, DEFAULT_RTOL
    from cockpit_like.functional.krylov import KrylovDecomposition

    probes = DEFAULT_PROBES if args.probes is None else args.probes
    if args.rule == "gap-estimate":
        KrylovDecomposition.error_bounds = KrylovDecomposition.error_estimates  # the old stop rule, measured only
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    groups = args.groups.split(",")
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise SystemExit(f"unknown groups {sorted(unknown)}; known: {', '.join(GROUPS)}")
    chosen = [c for c in cases() if c.group in groups]
    spectra = synthetic_spectra() if "dev" in groups else {}
    if args.only:
        keys = args.only.split(",")
        chosen = [c for c in chosen if any(k in c.name for k in keys)]
        spectra = {n: s for n, s in spectra.items() if any(k in f"synthetic/{n}" for k in keys)}
    if args.dry_run:
        for c in chosen:
            print(c.group, c.name)
        for n in spectra:
            print("dev", f"synthetic/{n}")
        return 0
    rows, failures = [], []
    started = time.time()
    for name, leading in spectra.items():
        rows += run_synthetic(name, leading, args.steps, args.synthetic_size, DEFAULT_RTOL, 100, probes)
        print(f"synthetic/{name}: {[(r['products'], r['converged'], r['within']) for r in rows[-args.steps:]]}", flush=True)
    for case in chosen:
        try:
            got = run_model(case, args.steps, args.batch_size, args.dense_limit, DEFAULT_RTOL, probes)
        except Exception as error:  # noqa: BLE001 - a model that cannot be built or run here is reported
            failures.append(f"{case.name}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            print("FAILED", failures[-1], flush=True)
            continue
        rows += got
        print(f"{case.name}: {[(r['products'], r['converged'], r['within']) for r in got]}", flush=True)
    header = (
        f"Regenerated by `python benchmarks/stop_rule.py --docs docs/curvature.md` "
        f"({args.steps} steps per model, batch {args.batch_size} (outside-4: {_outside_batch()}, the tester's), "
        f"{probes} start vectors, stop rule: {args.rule}, "
        f"torch {torch.__version__}, "
        f"{time.time() - started:.0f} s on 1 thread)."
    )
    print(json.dumps(summary(rows, DEFAULT_RTOL), indent=1))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "failures": failures, "summary": summary(rows, DEFAULT_RTOL)}, indent=1))
    if args.docs:
        write_docs(args.docs, markdown(rows, failures, DEFAULT_RTOL, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
