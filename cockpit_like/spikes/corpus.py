"""A spike corpus: small runs with faults injected at known steps and rows, plus healthy runs.

Each :class:`SpikeRun` trains a tiny model (architectures and data of
:mod:`cockpit_like.corpus_generator`) for ``steps`` optimizer steps under a
cockpit that tracks only :class:`~cockpit_like.spikes.PostMortem` at every
step, with ``info["sample_ids"]`` = the rows' data-set indices (injected rows
get negative ids, so a post-mortem's rows can be checked). Faults, injected
at step ``onset``:

==================  ====================================================================  ===============
fault               what the generator does at ``onset``                                   expected cause
==================  ====================================================================  ===============
``garbage-row``     one row's input replaced by noise 30x the data's scale (random          bad-rows
                    tokens for the language model) with a random label
``repeated-row``    one such garbage row repeated in a quarter of the batch (one id)        bad-rows
``flipped-batch``   every label of the batch replaced by a wrong one (random next tokens)   bad-rows
``scaled-row``      one row's input multiplied by 1e3 (not for token inputs)                bad-rows
``lr-jump``         the learning rate multiplied by 20 from ``onset`` on                    learning-rate
``fp16-overflow``   (a run trained under ``torch.autocast("cpu", torch.float16)`` with a    precision
                    ``GradScaler``) one row's input x1e8, beyond fp16's range, at
                    ``onset`` and the 2 steps after it: the scaler skips 3 steps in a
                    row and its scale drops 8x
==================  ====================================================================  ===============

Per architecture of :data:`FP16_ARCHS` two healthy runs are also trained in
fp16 with a ``GradScaler`` (``info["grad_scaler"]`` declared), so that the
skipped-steps trigger is measured for false alarms. Not for the language
models (token inputs cannot be scaled past fp16's range); the transformer on
digits joined once ``nn.MultiheadAttention``'s hook rule recomputed the layer
under the step's autocast (before, it stopped the run with a dtype error).

:func:`gpt2_small_runs` is a slice of its own: GPT-2 small (the Hugging Face
``GPT2Config()`` defaults built from the config, 124M parameters, dropout
off), batch 8 x 64 tokens, Adam, 18 steps, the fault at step 12 or 13; held
out (never used to set a threshold).

:func:`spike_runs` draws the runs of one half: architectures are split into
a **tuning** half (thresholds may be set on it) and a **held-out** half (only
reported), see :data:`SPLIT`. :func:`train_spike_run` trains one run and
returns plain data (post-mortems, losses, timing); :func:`score` scores
runs. ``benchmarks/spike_corpus.py`` runs both halves and writes the table of
``docs/spikes.md``.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from cockpit_like.corpus_generator import GeneratedRun, _data, _loss, _model, _optimizer, scheduled_rate

__all__ = ["SPLIT", "FAULTS", "FP16_ARCHS", "SpikeRun", "spike_runs", "gpt2_small_runs", "train_spike_run", "score",
           "EXPECTED_CAUSE", "replay"]

#: architectures per half: thresholds are set on "tuning", figures reported on "held-out"
SPLIT = {"tuning": ("mlp", "cnn", "gru"), "held-out": ("resnet-gn", "transformer", "gpt")}
FAULTS = ("garbage-row", "repeated-row", "flipped-batch", "scaled-row", "lr-jump", "fp16-overflow")
EXPECTED_CAUSE = {"garbage-row": "bad-rows", "repeated-row": "bad-rows", "flipped-batch": "bad-rows",
                  "scaled-row": "bad-rows", "lr-jump": "learning-rate", "fp16-overflow": "precision"}
#: architectures trained in fp16 (healthy and ``fp16-overflow`` runs): not the language models (module docstring)
FP16_ARCHS = ("mlp", "cnn", "gru", "resnet-gn", "transformer")
#: the ``fp16-overflow`` row's input is multiplied by this (beyond fp16's largest value, 65504) ...
OVERFLOW_SCALE = 1e8
#: ... at the onset and the steps after it, this many in all
OVERFLOW_STEPS = 3
#: the GPT-2 small slice: sequences of this many tokens (plus one for the targets), batch, steps
GPT2_LENGTH, GPT2_BATCH, GPT2_STEPS = 64, 8, 18
#: garbage rows are noise this many times the data's standard deviation
GARBAGE_SCALE = 30.0
_DATA = {"mlp": "blobs-ce", "cnn": "digits-ce", "resnet-gn": "digits-ce", "gru": "signs-ce",
         "transformer": "digits-ce", "gpt": "tokens-lm"}
_LR = {("mlp", "momentum"): 0.05, ("mlp", "adam"): 3e-3, ("cnn", "momentum"): 0.04, ("cnn", "adam"): 3e-3,
       ("resnet-gn", "momentum"): 0.04, ("resnet-gn", "adam"): 3e-3, ("gru", "momentum"): 0.05,
       ("gru", "adam"): 5e-3, ("transformer", "momentum"): 0.05, ("transformer", "adam"): 3e-3,
       ("gpt", "momentum"): 0.3, ("gpt", "adam"): 1e-2, ("gpt2-small", "adam"): 3e-4}
#: a post-mortem this many steps after the onset (or fewer) is the fault's spike
CATCH_WITHIN = 5


@dataclass(frozen=True)
class SpikeRun:
    """One run of the spike corpus (see the module docstring)."""

    arch: str
    optimizer: str
    schedule: str
    lr: float
    batch: int
    seed: int
    fault: str | None = None
    onset: int = 0
    row: int = 0
    steps: int = 60
    settings: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    #: "fp32", or "fp16": trained under ``torch.autocast("cpu", torch.float16)`` with a ``GradScaler``
    precision: str = "fp32"

    @property
    def name(self) -> str:
        name = f"{self.arch}/{self.optimizer}/{self.schedule}/{self.fault or 'healthy'}@{self.onset}/s{self.seed}"
        return name + ("/fp16" if self.precision == "fp16" else "")

    def generated(self) -> GeneratedRun:
        """The :class:`~cockpit_like.corpus_generator.GeneratedRun` whose data, model and schedule it uses."""
        options = {"lr_jump": 20.0} if self.fault == "lr-jump" else {}
        return GeneratedRun(family=f"{self.arch}/{self.optimizer}/{self.schedule}", arch=self.arch,
                            optimizer=self.optimizer, schedule=self.schedule, data=_DATA.get(self.arch, "tokens-lm"),
                            lr=self.lr,
                            batch=self.batch, seed=self.seed, fault=None, onset=self.onset, steps=self.steps,
                            options=options)


def spike_runs(half: str, healthy_per_arch: int = 8, faulty_per_fault: int = 2, seed: int = 0,
               steps: int = 60) -> list[SpikeRun]:
    """The runs of one half (``"tuning"`` or ``"held-out"``): per architecture ``healthy_per_arch`` healthy
    runs and ``faulty_per_fault`` runs of each fault that fits it, optimizer, schedule, onset and row drawn."""
    if half not in SPLIT:
        raise ValueError(f"spike_runs: half must be one of {list(SPLIT)}, got {half!r}")
    rng = random.Random(f"{half}-{seed}")
    runs = []
    for arch in SPLIT[half]:
        faults = [None] * healthy_per_arch + [f for f in FAULTS for _ in range(faulty_per_fault)
                                              if not (f == "scaled-row" and arch == "gpt") and f != "fp16-overflow"]
        for fault in faults:
            optimizer = rng.choice(("momentum", "adam"))
            schedule = rng.choice(("constant", "warmup-cosine"))
            batch = 32
            runs.append(SpikeRun(arch=arch, optimizer=optimizer, schedule=schedule,
                                 lr=_LR[(arch, optimizer)] * rng.uniform(0.7, 1.3), batch=batch,
                                 seed=rng.randrange(10_000), fault=fault, onset=rng.randrange(30, steps - 10),
                                 row=rng.randrange(batch), steps=steps))
    # the fp16 runs, drawn from a stream of their own (the fp32 runs above stay the draws they were)
    rng = random.Random(f"{half}-{seed}-fp16")
    for arch in [a for a in SPLIT[half] if a in FP16_ARCHS]:
        for fault in [None] * 2 + ["fp16-overflow"] * faulty_per_fault:
            optimizer, schedule, batch = rng.choice(("momentum", "adam")), rng.choice(("constant", "warmup-cosine")), 32
            runs.append(SpikeRun(arch=arch, optimizer=optimizer, schedule=schedule,
                                 lr=_LR[(arch, optimizer)] * rng.uniform(0.7, 1.3), batch=batch,
                                 seed=rng.randrange(10_000), fault=fault, onset=rng.randrange(30, steps - 10),
                                 row=rng.randrange(batch), steps=steps, precision="fp16"))
    return runs


def gpt2_small_runs(seed: int = 0, healthy: int = 2,
                    faults: tuple[str, ...] = ("garbage-row", "repeated-row", "flipped-batch", "lr-jump")) -> list[SpikeRun]:
    """The GPT-2 small slice (held out): ``healthy`` healthy runs and one run of each of ``faults``; Adam, a
    constant or warmup-cosine schedule, batch :data:`GPT2_BATCH` x :data:`GPT2_LENGTH` tokens, :data:`GPT2_STEPS`
    steps, the onset at step 12 or 13 (the detector's warmup is 10 tracked steps)."""
    rng = random.Random(f"gpt2-small-{seed}")
    runs = []
    for fault in [None] * healthy + list(faults):
        runs.append(SpikeRun(arch="gpt2-small", optimizer="adam", schedule=rng.choice(("constant", "warmup-cosine")),
                             lr=_LR[("gpt2-small", "adam")] * rng.uniform(0.7, 1.3), batch=GPT2_BATCH,
                             seed=rng.randrange(10_000), fault=fault, onset=rng.randrange(12, 14),
                             row=rng.randrange(GPT2_BATCH), steps=GPT2_STEPS))
    return runs


class _GPT2Small(torch.nn.Module):
    """GPT-2 small built from the Hugging Face ``GPT2Config()`` defaults (dropout off): tokens in, logits out."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.gpt = GPT2LMHeadModel(GPT2Config(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))

    def forward(self, tokens):
        return self.gpt(tokens, use_cache=False).logits


def _gpt2_data(seed: int) -> torch.Tensor:
    """512 sequences of the corpus's token recurrence (16 symbols, :func:`~cockpit_like.corpus._sequences`),
    ``GPT2_LENGTH + 1`` long, each symbol mapped to a fixed token of GPT-2's 50257."""
    from cockpit_like.corpus import _sequences

    symbols = _sequences(seed, 512, GPT2_LENGTH + 1, 16)
    vocabulary = torch.randperm(50257, generator=torch.Generator().manual_seed(seed))[:16]
    return vocabulary[symbols]


def _garbage(x: torch.Tensor, scale: float, generator: torch.Generator, vocab: int | None) -> torch.Tensor:
    if vocab is not None:
        return torch.randint(0, vocab, x.shape, generator=generator)
    return torch.randn(x.shape, generator=generator) * GARBAGE_SCALE * scale


def _wrong(y: torch.Tensor, classes: int, generator: torch.Generator) -> torch.Tensor:
    return (y + torch.randint(1, classes, y.shape, generator=generator)) % classes


def train_spike_run(run: SpikeRun, **post_args: Any) -> dict[str, Any]:
    """Train ``run`` with :class:`~cockpit_like.spikes.PostMortem` (``post_args``: its arguments) at every step;
    return ``{"run", "post_mortems": [[step, post-mortem]], "series": [[step, loss, grad norm, rate]], "losses",
    "seconds", "injected_ids", "nbytes"}``. With ``record_all=True`` (what the benchmark trains with) a
    post-mortem is stored at every step after the warmup, and :func:`replay` scores any settings exactly."""
    from cockpit_like import Cockpit
    from cockpit_like.spikes.postmortem import PostMortem
    from cockpit_like.utils.schedules import linear

    started = time.perf_counter()
    generated = run.generated()
    torch.manual_seed(run.seed)
    if run.arch == "gpt2-small":
        inputs, targets, in_features, out_features = _gpt2_data(run.seed), None, 50257, 50257
    else:
        inputs, targets, in_features, out_features = _data(generated)
    tokens = targets is None
    vocab = out_features if tokens else None
    classes = 2 if generated.data == "signs-ce" else out_features
    scale = 1.0 if tokens else float(inputs.float().std())
    model = _GPT2Small().train() if run.arch == "gpt2-small" else _model(generated, in_features, out_features)
    fp16 = run.precision == "fp16"
    if fp16 and (tokens or run.arch not in FP16_ARCHS):
        raise ValueError(f"{run.name}: fp16 runs are for {FP16_ARCHS} (module docstring)")
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    optimizer = _optimizer(generated, model.parameters())
    post = PostMortem(linear(1), **post_args)
    cockpit = Cockpit(list(model.parameters()), quantities=[post], model=model)
    generator = torch.Generator().manual_seed(run.seed + 1)
    losses, injected, series = [], [], []
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(run.steps):
            for group in optimizer.param_groups:
                group["lr"] = scheduled_rate(generated, step)
            rows = torch.randint(0, len(inputs), (run.batch,), generator=generator)
            x = inputs[rows].clone()
            if tokens:
                x, y = x[:, :-1], x[:, 1:].clone()
            else:
                y = targets[rows].clone()
            ids = rows.clone()
            if step == run.onset and run.fault in ("garbage-row", "repeated-row", "scaled-row"):
                copies = [run.row] if run.fault != "repeated-row" else [(run.row + k) % run.batch
                                                                        for k in range(run.batch // 4)]
                if run.fault == "scaled-row":
                    x[run.row] = x[run.row] * 1e3
                else:
                    row_x = _garbage(x[run.row], scale, generator, vocab)
                    row_y = _garbage(y[run.row], 1.0, generator, vocab) if tokens else \
                        torch.randint(0, classes, (), generator=generator)
                    for r in copies:
                        x[r], y[r] = row_x, row_y
                ids[copies] = -1
                injected = [-1]
            if run.fault == "fp16-overflow" and run.onset <= step < run.onset + OVERFLOW_STEPS:
                x[run.row] = x[run.row] * OVERFLOW_SCALE
                ids[run.row] = -1
                injected = [-1]
            if step == run.onset and run.fault == "flipped-batch":
                y = torch.randint(0, vocab, y.shape, generator=generator) if tokens else _wrong(y, classes, generator)
                ids = -1 - torch.arange(run.batch)
                injected = ids.tolist()
            optimizer.zero_grad()
            model.train()
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                outputs = model(x)
            individual = _loss(generated, outputs.float(), y)
            loss = individual.mean()
            losses.append(float(loss))
            info = {"batch_size": run.batch, "loss": loss, "optimizer": optimizer, "individual_losses": individual,
                    "sample_ids": ids}
            if fp16:
                info["grad_scaler"] = scaler
            try:
                with cockpit(step, info=info):
                    (scaler.scale(loss) if fp16 else loss).backward()
            except Exception as failure:  # the cockpit stopped the run: kept, and reported by the benchmark
                error = {"step": step, "error": f"{type(failure).__name__}: {str(failure)[:300]}"}
                break
            summary = post.buffer.steps[-1] if post.buffer.steps else None
            if summary is not None and summary["step"] == step:  # (a skipped step, a failed check: not tracked)
                series.append([step, summary["loss"], summary["grad_norm"], max(g["lr"] for g in optimizer.param_groups),
                               post.detector.last_skipped])
            if fp16:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
    found = [[int(s), v["PostMortem"]] for s, v in sorted(cockpit.get_output().items()) if "PostMortem" in v]
    return {"run": asdict(run), "name": run.name, "post_mortems": found, "series": series, "losses": losses,
            "steps_trained": len(series),
            "seconds": time.perf_counter() - started, "injected_ids": injected, "nbytes": post.nbytes, "error": error}


def replay(result: dict[str, Any], detector: dict[str, Any] | None = None,
           causes: dict[str, Any] | None = None) -> list[tuple[int, dict[str, Any]]]:
    """The post-mortems a :class:`~cockpit_like.spikes.PostMortem` with the detector settings ``detector``
    (:class:`~cockpit_like.spikes.SpikeDetector`'s arguments; defaults: its own) and the cause settings
    ``causes`` (:func:`~cockpit_like.spikes.causes.name_cause`) would have stored in a run trained with
    ``record_all=True``: the same detector runs over the run's series, and at each spike the stored
    post-mortem of that step is named again. Exact: the evidence does not depend on the settings."""
    from cockpit_like.spikes.causes import name_cause
    from cockpit_like.spikes.detector import SpikeDetector

    spikes = SpikeDetector(**{**SpikeDetector().settings(), **(detector or {})})
    stored = {int(step): post for step, post in result["post_mortems"]}
    kept = []
    for step, loss, grad_norm, rate, *skipped in result["series"]:
        found = spikes.update(step, loss, grad_norm, rate, skipped=skipped[0] if skipped else 0)
        if found is None:
            continue
        post = stored[int(step)]
        verdict = name_cause(post, **(causes or {}))
        kept.append((int(step), {**post, "trigger": found, "cause": verdict["cause"], "why": verdict["why"],
                                 "strength": verdict["strength"], "checks": verdict["checks"],
                                 "suspects": verdict["suspects"]}))
    return kept


def _first_caught(result: dict[str, Any], found: list) -> tuple[int, dict[str, Any]] | None:
    onset = result["run"]["onset"]
    for step, post in found:
        if onset <= step <= onset + CATCH_WITHIN:
            return step, post
    return None


def _rows_at_onset(results: list[dict[str, Any]]) -> tuple[int, int, int]:
    """``(by share, by loss, runs)``: of the runs with a one-row or repeated-row fault (``garbage-row``,
    ``repeated-row``, ``scaled-row``) recorded with ``record_all=True``, those whose onset step has an injected row
    among the top 3 by share (by loss), spike or not (the row ranking on its own, apart from the detector)."""
    hits = by_loss = runs = 0
    for result in results:
        if result["run"]["fault"] not in ("garbage-row", "repeated-row", "scaled-row"):
            continue
        stored = {int(step): post for step, post in result["post_mortems"]}
        post = stored.get(int(result["run"]["onset"]))
        if post is None:  # (not recorded with record_all, or the onset step was not tracked)
            continue
        runs += 1
        hits += any(row["id"] in set(result["injected_ids"]) for row in post["rows_by_share"][:3])
        by_loss += any(row["id"] in set(result["injected_ids"]) for row in post["rows_by_loss"][:3])
    return hits, by_loss, runs


def score(results: list[dict[str, Any]], detector: dict[str, Any] | None = None,
          causes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Score runs trained with ``record_all=True`` as :func:`replay` with ``detector`` and ``causes`` settings gives
    them: detection, the injected rows among the top 3 (by share; by loss beside it), the cause, and healthy runs
    (and faulty runs before their onset) with a post-mortem."""
    at_onset = _rows_at_onset(results)
    results = [{**r, "post_mortems": replay(r, detector, causes)} for r in results]
    healthy = [r for r in results if r["run"]["fault"] is None]
    faulty = [r for r in results if r["run"]["fault"] is not None]
    table: dict[str, Any] = {"healthy_runs": len(healthy),
                             "healthy_with_post_mortem": sum(bool(r["post_mortems"]) for r in healthy),
                             "faulty_runs": len(faulty),
                             "early_alarms": sum(any(s < r["run"]["onset"] for s, _ in r["post_mortems"]) for r in faulty),
                             "stopped_by_cockpit": [f"{r['name']} at step {r['error']['step']}: {r['error']['error'][:120]}"
                                                    for r in results if r.get("error")]}
    caught, rows_total, rows_top3, rows_top3_loss, rows_suspects, causes_right, by_fault = 0, 0, 0, 0, 0, 0, {}
    for result in faulty:
        fault = result["run"]["fault"]
        entry = by_fault.setdefault(fault, {"runs": 0, "caught": 0, "top3": 0, "cause_right": 0, "causes": {}})
        entry["runs"] += 1
        hit = _first_caught(result, result["post_mortems"])
        if hit is None:
            continue
        _, post = hit
        caught += 1
        entry["caught"] += 1
        right = post["cause"] == EXPECTED_CAUSE[fault]
        causes_right += right
        entry["cause_right"] += right
        entry["causes"][post["cause"]] = entry["causes"].get(post["cause"], 0) + 1
        if EXPECTED_CAUSE[fault] == "bad-rows":
            injected = set(result["injected_ids"])
            rows_total += 1
            top = any(row["id"] in injected for row in post["rows_by_share"][:3])
            rows_top3 += top
            entry["top3"] += top
            rows_top3_loss += any(row["id"] in injected for row in post["rows_by_loss"][:3])
            rows_suspects += any(row.get("id") in injected for row in post.get("suspects", [])[:3])
    table.update(caught=caught, row_spikes=rows_total, row_faults_at_onset=at_onset[0], row_faults_at_onset_by_loss=at_onset[1],
                 row_faults=at_onset[2], rows_in_top3=rows_top3, rows_in_top3_by_loss=rows_top3_loss,
                 rows_in_suspects=rows_suspects,
                 cause_right=causes_right, by_fault=by_fault,
                 seconds=sum(r["seconds"] for r in results))
    table["top3_rate"] = rows_top3 / rows_total if rows_total else math.nan
    table["cause_rate"] = causes_right / caught if caught else math.nan
    table["healthy_alarm_rate"] = table["healthy_with_post_mortem"] / len(healthy) if healthy else math.nan
    table["detection_rate"] = caught / len(faulty) if faulty else math.nan
    return table
