"""Tracked values to TensorBoard, Weights & Biases and MLflow.

Every exporter takes each step's values, turns them into scalars and
histograms (:func:`cockpit_like.integrations.flatten.flatten`: ``"Loss"``,
``"GradNorm/param_0"``, ``"GradHist1d"``, ...) and writes them under the
cockpit's step; with ``image_every=N`` it also renders the dashboard every
``N`` steps and stores it as an image. Two ways to use one:

- live, attached to a cockpit (each tracked step is exported as it is
  computed; a two-step quantity such as UpdateSize arrives one step later,
  under its own step)::

      exporter = TensorBoardExporter("runs/tb").attach(cockpit)
      ...                                   # train
      exporter.close()

- from a saved log (``.json`` or ``.jsonl``)::

      export_log("runs/mine.json", "tensorboard", "runs/tb")
      # or: cockpit-like export runs/mine.json --to tensorboard runs/tb

Where things go:

- TensorBoard (``torch.utils.tensorboard.SummaryWriter``): scalars, histograms
  (counts and bin edges as stored; TensorBoard's sum and sum of squares of a
  histogram are computed from the bin centres), the dashboard as image
  ``"dashboard"``. TensorBoard stores scalars as float32.
- Weights & Biases: one ``run.log`` per step with the step under
  ``"global_step"`` (defined as the x-axis of every exported key, so values that
  arrive one step late land at their own step); histograms as
  ``wandb.Histogram``; the dashboard as ``wandb.Image``. Pass ``run=`` to log
  into your own run; otherwise ``wandb.init(mode=...)`` with ``mode`` from
  ``WANDB_MODE``, else ``"offline"``.
- MLflow (``MlflowClient``): scalars as metrics (``log_batch``), histograms as
  JSON artifacts ``histograms/<tag>/step_<step>.json`` (MLflow has no
  histogram type), the dashboard as ``dashboard/step_<step>.png``. A
  ``file:`` tracking URI sets ``MLFLOW_ALLOW_FILE_STORE=true`` (MLflow 3 keeps
  its file store only on request).
- Texts (a loss-spike post-mortem, :mod:`cockpit_like.spikes`): TensorBoard
  ``add_text``, W&B ``wandb.Html`` (preformatted), MLflow the artifact
  ``texts/<tag>/step_<step>.txt``; its summary numbers go as scalars.

The packages are imported only when an exporter is created.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cockpit_like.integrations.flatten import flatten
from cockpit_like.logs import decode, encode
from cockpit_like.utils.progress import progress as progress_bar

__all__ = ["Exporter", "TensorBoardExporter", "WandbExporter", "MLflowExporter", "EXPORTERS", "MissingPackage",
           "export_log", "make_exporter"]


class MissingPackage(ImportError):
    """An exporter's package is not installed (or does not import); the message says what to install.

    Attributes:
        package: the package the exporter imports (``"wandb"``).
        install: the command that installs it (``"pip install wandb"``).
    """

    def __init__(self, exporter: str, package: str, distribution: str, extra: str, error: ImportError):
        self.package, self.install = package, f"pip install {distribution}"
        super().__init__(f"{exporter} needs the {package} package, which is not installed or does not import "
                         f"({error}); install it with: {self.install} (or pip install 'cockpit_like[{extra}]')")


class Exporter:
    """Base class: turns steps into scalars, histograms and images; subclasses write them.

    Args:
        image_every: render the dashboard at steps that are multiples of this
            (0: never). Rendering takes about a second; keep it sparse.
        prefix: put before every tag (e.g. ``"cockpit/"``).
        secondary_screen: render the dashboard with its secondary screen.
        dpi: resolution of the dashboard image (the figure is 16 x 9 inches).
    """

    def __init__(self, *, image_every: int = 0, prefix: str = "", secondary_screen: bool = False, dpi: float = 60):
        if isinstance(image_every, bool) or not isinstance(image_every, int) or image_every < 0:
            raise ValueError(f"{type(self).__name__}(image_every=...): a step interval >= 0 (0: no images), got {image_every!r}")
        self.image_every = image_every
        self.prefix = prefix
        self.secondary_screen = secondary_screen
        self.dpi = dpi
        self._cockpit = None
        self._seen: dict[int, dict[str, Any]] = {}  # only kept for images of a saved log
        self._imaged: set[int] = set()
        self._plotter = None
        self.closed = False

    # ---- sources ------------------------------------------------------------------
    def attach(self, cockpit) -> Exporter:
        """Export every step ``cockpit`` tracks from now on (returns ``self``)."""
        if not callable(getattr(cockpit, "add_listener", None)):
            raise TypeError(
                f"{type(self).__name__}.attach(cockpit): takes a running Cockpit, got {cockpit!r:.80} "
                f"({type(cockpit).__name__}). To export a saved log use "
                "cockpit_like.integrations.exporters.export_log(path, to, directory) or `cockpit-like export LOG "
                "--to ... DIR`; exporter.write_log(read_log(path)) also works"
            )
        if self._cockpit is not None:
            raise RuntimeError(f"{type(self).__name__} is already attached to a cockpit")
        self._cockpit = cockpit
        cockpit.add_listener(self.write)
        return self

    def detach(self) -> None:
        """Stop following the attached cockpit."""
        if self._cockpit is not None:
            self._cockpit.remove_listener(self.write)
            self._cockpit = None

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        """Export ``values`` stored under ``step`` (a whole step, or a piece of it)."""
        if self.closed:
            raise RuntimeError(f"{type(self).__name__}: write after close()")
        values = decode(encode(dict(values)))  # the form a log gives back: lists, NaN as floats
        flat = flatten(values, self.prefix)
        if flat.scalars:
            self._write_scalars(step, flat.scalars)
        if flat.histograms:
            self._write_histograms(step, flat.histograms)
        if flat.texts:
            self._write_texts(step, flat.texts)
        if self.image_every and step % self.image_every == 0 and step not in self._imaged and self._cockpit is not None:
            self._imaged.add(step)
            self._write_image(step, self._render(self._cockpit))

    def write_log(self, steps: Mapping[int, Mapping[str, Any]], progress: bool | None = False) -> int:
        """Export a whole saved run ``{step: values}`` in step order; return the number of steps."""
        ordered = sorted(steps)
        shown: dict[int, Mapping[str, Any]] = {}
        for step in progress_bar(ordered, len(ordered), f"export to {self.kind}", progress):
            self.write(step, steps[step])
            shown[step] = steps[step]
            if self.image_every and step % self.image_every == 0 and step not in self._imaged:
                self._imaged.add(step)
                self._write_image(step, self._render(shown))
        return len(ordered)

    # ---- the dashboard --------------------------------------------------------------
    def _render(self, source: Any) -> np.ndarray:
        """The dashboard of ``source`` (a cockpit or ``{step: values}``) as an RGB uint8 array."""
        from cockpit_like.plotting import CockpitPlotter

        if self._plotter is None:
            self._plotter = CockpitPlotter(secondary_screen=self.secondary_screen)
        fig = self._plotter.plot(source, show_plot=False)
        fig.set_dpi(self.dpi)
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()

    # ---- what subclasses write --------------------------------------------------------
    kind = "?"

    def _write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def _write_histograms(self, step: int, histograms: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        raise NotImplementedError

    def _write_image(self, step: int, image: np.ndarray) -> None:
        raise NotImplementedError

    def _write_texts(self, step: int, texts: dict[str, str]) -> None:
        """Texts (a loss-spike post-mortem); the default writes nothing."""

    def _finish(self) -> None:
        pass

    def close(self) -> None:
        """Detach, flush and close (idempotent)."""
        if self.closed:
            return
        self.detach()
        self._finish()
        self.closed = True

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TensorBoardExporter(Exporter):
    """Writes to TensorBoard event files in ``log_dir`` (``pip install cockpit_like[tensorboard]``).

    Args:
        log_dir: the folder (created); view with ``tensorboard --logdir log_dir``.
        writer: a ``SummaryWriter`` of your own instead (then ``log_dir`` is ignored
            and :meth:`close` only flushes it).
        **options: see :class:`Exporter`.
    """

    kind = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike | None = None, *, writer: Any = None, **options: Any):
        super().__init__(**options)
        if writer is None:
            if log_dir is None:
                raise ValueError("TensorBoardExporter: give log_dir (a folder) or writer=SummaryWriter(...)")
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise MissingPackage("TensorBoardExporter", "tensorboard", "tensorboard", "tensorboard", error) from error
            _check_folder(log_dir, "TensorBoardExporter(log_dir)")
            writer, self._owns_writer = SummaryWriter(log_dir=os.fspath(log_dir)), True
        else:
            self._owns_writer = False
        self.writer = writer
        self.log_dir = writer.log_dir

    def _write_scalars(self, step, scalars):
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def _write_histograms(self, step, histograms):
        for tag, (counts, edges) in histograms.items():
            centres = (edges[:-1] + edges[1:]) / 2
            self.writer.add_histogram_raw(
                tag, min=float(edges[0]), max=float(edges[-1]), num=float(counts.sum()),
                sum=float(counts @ centres), sum_squares=float(counts @ centres**2),
                bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(), global_step=step,
            )

    def _write_image(self, step, image):
        self.writer.add_image(f"{self.prefix}dashboard", image, global_step=step, dataformats="HWC")

    def _write_texts(self, step, texts):
        for tag, text in texts.items():  # indented: TensorBoard's markdown shows it as a code block
            self.writer.add_text(tag, "\n".join("    " + line for line in text.splitlines()), global_step=step)

    def _finish(self):
        self.writer.flush()
        if self._owns_writer:
            self.writer.close()


class WandbExporter(Exporter):
    """Logs to a Weights & Biases run (``pip install cockpit_like[wandb]``).

    Args:
        directory: ``wandb.init(dir=...)`` (created): W&B puts the run folder in its ``wandb`` folder there,
            ``directory/wandb/offline-run-<time>-<id>`` (:attr:`run_dir`).
        run: a run of your own (from ``wandb.init``) instead; :meth:`close` then
            leaves it open.
        mode: ``"offline"``, ``"online"`` or ``"disabled"``; default
            ``WANDB_MODE`` if set, else ``"offline"`` (upload later with ``wandb sync``).
        **init_kwargs: more ``wandb.init`` arguments (``project``, ``name``, ...;
            ``settings`` defaults to ``wandb.Settings(console="off")``: no capture
            of the process's output), and the options of :class:`Exporter`.
    """

    kind = "wandb"
    step_key = "global_step"

    def __init__(self, directory: str | os.PathLike | None = None, *, run: Any = None, mode: str | None = None,
                 image_every: int = 0, prefix: str = "", secondary_screen: bool = False, dpi: float = 60,
                 **init_kwargs: Any):
        super().__init__(image_every=image_every, prefix=prefix, secondary_screen=secondary_screen, dpi=dpi)
        try:
            import wandb
        except ImportError as error:
            raise MissingPackage("WandbExporter", "wandb", "wandb", "wandb", error) from error
        self._wandb = wandb
        if run is None:
            if directory is not None:
                _check_folder(directory, "WandbExporter(directory)")
                Path(directory).mkdir(parents=True, exist_ok=True)
                init_kwargs["dir"] = os.fspath(directory)
            init_kwargs.setdefault("project", "cockpit_like")
            init_kwargs.setdefault("settings", wandb.Settings(console="off"))  # leave the training's stdout alone
            run, self._owns_run = wandb.init(mode=mode or os.environ.get("WANDB_MODE", "offline"), **init_kwargs), True
        else:
            self._owns_run = False
        self.run = run
        self._defined: set[str] = set()

    @property
    def run_dir(self) -> str:
        """The run's local folder (``.../wandb/offline-run-<time>-<id>``)."""
        return str(Path(self.run.dir).parent)

    def _log(self, step: int, row: dict[str, Any]) -> None:
        for key in row:
            if key not in self._defined:
                self.run.define_metric(key, step_metric=self.step_key)
                self._defined.add(key)
        self.run.log({self.step_key: step, **row})

    def _write_scalars(self, step, scalars):
        self._log(step, scalars)

    def _write_histograms(self, step, histograms):
        self._log(step, {tag: self._wandb.Histogram(np_histogram=(counts, edges)) for tag, (counts, edges) in histograms.items()})

    def _write_image(self, step, image):
        self._log(step, {f"{self.prefix}dashboard": self._wandb.Image(image)})

    def _write_texts(self, step, texts):
        import html

        self._log(step, {tag: self._wandb.Html(f"<pre>{html.escape(text)}</pre>") for tag, text in texts.items()})

    def _finish(self):
        if self._owns_run:
            self.run.finish()


class MLflowExporter(Exporter):
    """Logs to an MLflow run (``pip install cockpit_like[mlflow]``; ``mlflow-skinny`` is enough).

    Args:
        tracking_uri: where runs are stored, e.g. ``"file:/tmp/mlruns"`` (a local
            folder) or a tracking server; default MLflow's own.
        experiment: experiment name (created if missing).
        run_id: log into this existing run instead of a new one (left open on
            :meth:`close`).
        run_name: name of a new run.
        **options: see :class:`Exporter`.
    """

    kind = "mlflow"

    def __init__(self, tracking_uri: str | None = None, *, experiment: str = "cockpit_like", run_id: str | None = None,
                 run_name: str | None = None, **options: Any):
        super().__init__(**options)
        if tracking_uri is not None and str(tracking_uri).startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError as error:
            raise MissingPackage("MLflowExporter", "mlflow", "mlflow-skinny", "mlflow", error) from error
        self._metric = Metric
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        if run_id is None:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
            run_id, self._owns_run = self.client.create_run(experiment_id, run_name=run_name).info.run_id, True
        else:
            self._owns_run = False
        self.run_id = run_id

    def _write_scalars(self, step, scalars):
        import time

        now = int(time.time() * 1000)
        metrics = [self._metric(tag, value, now, step) for tag, value in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def _write_histograms(self, step, histograms):
        for tag, (counts, edges) in histograms.items():
            document = {"step": step, "counts": counts.tolist(), "edges": edges.tolist()}
            self.client.log_dict(self.run_id, document, f"histograms/{tag}/step_{step:07d}.json")

    def _write_image(self, step, image):
        self.client.log_image(self.run_id, image, artifact_file=f"dashboard/step_{step:07d}.png")

    def _write_texts(self, step, texts):
        for tag, text in texts.items():
            self.client.log_text(self.run_id, text, f"texts/{tag}/step_{step:07d}.txt")

    def _finish(self):
        if self._owns_run:
            self.client.set_terminated(self.run_id)


#: ``--to`` names of :func:`export_log` and ``cockpit-like export``.
EXPORTERS = {"tensorboard": TensorBoardExporter, "wandb": WandbExporter, "mlflow": MLflowExporter}


def _check_folder(directory: str | os.PathLike, what: str) -> None:
    """A ValueError where ``directory`` is an existing file (the exporter writes a folder there)."""
    if Path(directory).exists() and not Path(directory).is_dir():
        raise ValueError(
            f"{what}: {os.fspath(directory)} is a file, not a folder; give a folder for the exported run (it is "
            "created if missing), e.g. runs/tb"
        )


def make_exporter(to: str, directory: str | os.PathLike, **options: Any) -> Exporter:
    """An exporter of kind ``to`` writing under ``directory``.

    TensorBoard: event files in ``directory``; W&B: the run folder in
    ``directory/wandb`` (offline unless ``WANDB_MODE`` says otherwise); MLflow: a file
    store at ``directory`` (``file:`` URI), unless ``options`` give ``tracking_uri``.
    """
    if to not in EXPORTERS:
        raise ValueError(f"unknown export target {to!r}; choose one of {', '.join(EXPORTERS)}")
    _check_folder(directory, f"the {to} export folder (DIR)")
    if to == "mlflow":
        options.setdefault("tracking_uri", Path(directory).resolve().as_uri())
        return MLflowExporter(**options)
    return EXPORTERS[to](directory, **options)


def export_log(log: str | os.PathLike, to: str, directory: str | os.PathLike, *, progress: bool | None = False,
               **options: Any) -> Exporter:
    """Export a saved log (``.json``/``.jsonl``, suffix optional) with :func:`make_exporter`.

    Returns the closed exporter (``log_dir``, ``run_dir`` or ``run_id`` say where it went).
    """
    from cockpit_like.logs import read_log

    steps = read_log(log)
    exporter = make_exporter(to, directory, **options)
    try:
        exporter.write_log(steps, progress=progress)
    finally:
        exporter.close()
    return exporter
