"""The cockpit dashboard: :class:`CockpitPlotter` and :func:`save_dashboard`."""

from __future__ import annotations

import base64
import io
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from cockpit_like.plotting.data import RunData, load_source
from cockpit_like.plotting.instruments import DrawOptions
from cockpit_like.plotting.curvature_instruments import CURVATURE_INSTRUMENTS
from cockpit_like.plotting.layout import MAX_LAYER_PANELS, PRIMARY_SIZE, SECONDARY_SIZE, Layout, build_layout
from cockpit_like.plotting.spike_instruments import has_post_mortem
from cockpit_like.utils.jupyter import in_jupyter_kernel

__all__ = ["CockpitPlotter", "DashboardFigure", "save_dashboard", "interactive_backend", "in_jupyter_kernel"]

_warned_headless = False

#: resolution of the image a notebook shows (16 x 9 inches -> 1280 x 720 pixels)
NOTEBOOK_DPI = 80


def interactive_backend() -> bool:
    """Whether matplotlib's current backend opens windows (False for Agg, PDF, ...)."""
    backend = str(matplotlib.get_backend()).lower()
    try:
        from matplotlib.backends import BackendFilter, backend_registry

        interactive = backend_registry.list_builtin(BackendFilter.INTERACTIVE)
    except ImportError:  # matplotlib < 3.9
        from matplotlib import rcsetup

        interactive = rcsetup.interactive_bk
    return backend in {name.lower() for name in interactive} or backend.startswith("module://ipympl")


def _png(fig: Figure, dpi: float, colors: int | None = None) -> bytes:
    """The PNG of ``fig``; with ``colors``, quantized to a palette of that many colours (3-5x smaller)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    if colors is None:
        return buffer.getvalue()
    from PIL import Image  # matplotlib's own dependency

    buffer.seek(0)
    quantized = Image.open(buffer).convert("RGB").quantize(colors)
    small = io.BytesIO()
    quantized.save(small, format="png", optimize=True)
    return small.getvalue()


def _execution_count() -> int | None:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return None if shell is None else getattr(shell, "execution_count", None)


class DashboardFigure(Figure):
    """The dashboard's figure where no window shows it: a matplotlib ``Figure`` that IPython shows as an image.

    In a notebook, a cell whose last expression is this figure (or
    ``display(fig)``) shows it as a PNG, with or without ``%matplotlib
    inline``. In the cell where :meth:`CockpitPlotter.plot` has just updated
    its live display, it shows nothing more: that display *is* the picture
    (so ``plotter.plot(cockpit)`` as a cell's last expression, or
    ``display(plotter.plot(cockpit))`` in a loop, leaves one image, updated
    in place). In a later cell, ``plotter.fig`` shows a still copy.
    """

    #: resolution of the PNG shown by IPython
    notebook_dpi: float = NOTEBOOK_DPI
    #: colours of its palette (None: full colour)
    notebook_colors: int | None = None
    #: the execution count of the cell whose live display shows this figure (None: not shown live)
    _cockpit_like_live_in: int | None = None

    def _repr_png_(self) -> bytes:
        return _png(self, self.notebook_dpi, self.notebook_colors)

    def _ipython_display_(self) -> None:
        if self._cockpit_like_live_in is not None and self._cockpit_like_live_in == _execution_count():
            return  # the live display of this cell already shows this figure
        from IPython.display import display

        display({"image/png": base64.b64encode(self._repr_png_()).decode("ascii"), "text/plain": repr(self)},
                raw=True)


def _layer_panels(data: RunData) -> int:
    last = data.last("GradHist2d")
    if last is None or not isinstance(last[1], dict):
        return 0
    count = sum(1 for key in last[1] if key.startswith("param_") and key != "param_groups")
    return min(count, MAX_LAYER_PANELS)


class CockpitPlotter:
    """Draws the cockpit dashboard from a live :class:`~cockpit_like.Cockpit` or a log file.

    Args:
        secondary_screen: also draw the secondary screen (MeanGSNR, CABS,
            EarlyStopping, other scalar quantities and per-layer 2-D
            histograms); the figure grows from 16 x 9 to 16 x 14 inches.
        figsize: override the figure size in inches.
        notebook_dpi: resolution of the image shown in a Jupyter notebook
            (default 80: 1280 x 720 pixels for the primary screen).
        notebook_colors: quantize that image to a palette of this many
            colours (e.g. 64: 3-5x smaller, for slow links to a remote kernel
            or notebooks saved with their outputs; about 0.1 s more per
            update); default None: full colour.

    Where it shows (``show_plot=True``), decided at the first :meth:`plot` call:

    - an interactive matplotlib backend (Qt, Tk, macOS, ``nbagg``, ``ipympl``'s
      ``widget``): a window or canvas, redrawn in place;
    - otherwise, in a Jupyter kernel (the default ``inline`` backend, no
      magic needed): **one image display per plotter and cell**, replaced in
      place at each call (a display handle: ``display_data`` at the cell's
      first call, then ``update_display_data``); the title carries the last
      step. A cell run again shows a new display. See docs/notebooks.md;
    - otherwise (a script under Agg, CI, ssh): nothing is shown, and one
      warning says how to save the picture instead.

    Attributes:
        fig: the figure of the last :meth:`plot` call (reused by later calls).
        axes: ``{instrument key: Axes}`` of that figure.
        data: the :class:`~cockpit_like.plotting.data.RunData` read by the last
            :meth:`plot` or :meth:`read` call (what the gauges of
            :mod:`cockpit_like.instruments` draw).
        show_log_iter: the ``show_log_iter`` of the last :meth:`plot` call.
        last_saved: the path written by the last ``save_plot=True`` call.
        last_timing: seconds spent in the last call, split into ``read``,
            ``draw`` (instruments) and ``render`` (canvas draw, save, show);
            in a notebook also ``notebook_png`` (the PNG of the display, part
            of ``render``).
        last_image_bytes: the size of the last notebook image in bytes.
        display_handle: the IPython display handle of the notebook image
            (``None`` outside notebooks and before the first call).

    Example:
        >>> plotter = CockpitPlotter()
        >>> for step in range(steps):
        ...     ...  # training with the cockpit
        ...     if step % 50 == 0:
        ...         plotter.plot(cockpit)                       # live window
        >>> plotter.plot("logs/run", show_plot=False, save_plot=True, savedir="figs")
    """

    def __init__(self, secondary_screen: bool = False, figsize: tuple[float, float] | None = None,
                 notebook_dpi: float = NOTEBOOK_DPI, notebook_colors: int | None = None):
        if isinstance(notebook_dpi, bool) or not (isinstance(notebook_dpi, (int, float)) and notebook_dpi > 0):
            raise ValueError(f"CockpitPlotter(notebook_dpi={notebook_dpi!r}): need a positive number of dots per inch, e.g. 80")
        if notebook_colors is not None and (isinstance(notebook_colors, bool) or not isinstance(notebook_colors, int)
                                            or not 2 <= notebook_colors <= 256):
            raise ValueError(f"CockpitPlotter(notebook_colors={notebook_colors!r}): need None (full colour) or a "
                             "palette size from 2 to 256, e.g. 64")
        if not (isinstance(secondary_screen, int) and secondary_screen in (0, 1)
                or type(secondary_screen).__module__ == "numpy" and getattr(secondary_screen, "dtype", None) is not None
                and secondary_screen.dtype.kind == "b"):  # a bool (numpy's too), or 0 / 1
            source = isinstance(secondary_screen, (str, os.PathLike)) or hasattr(secondary_screen, "get_output")
            raise TypeError(
                f"CockpitPlotter(secondary_screen=...): takes True or False, got {secondary_screen!r:.80} "
                f"({type(secondary_screen).__name__})"
                + (". The cockpit or log to draw goes to plot(), not to the constructor: "
                   "CockpitPlotter().plot(cockpit)" if source else "")
            )
        self.notebook_dpi = float(notebook_dpi)
        self.notebook_colors = notebook_colors
        self.secondary_screen = bool(secondary_screen)
        self.figsize = tuple(figsize) if figsize is not None else (SECONDARY_SIZE if secondary_screen else PRIMARY_SIZE)
        self.fig: Figure | None = None
        self.axes: dict[str, Any] = {}
        self.last_saved: Path | None = None
        self.last_timing: dict[str, float] = {}
        self.data: RunData | None = None
        self.show_log_iter = False
        self.debug = False
        self._layout: Layout | None = None
        self._windowed = False
        #: the IPython display handle of the live notebook image (None: not shown in a notebook yet)
        self.display_handle = None
        self.last_image_bytes: int | None = None
        self._display_cell: int | None = None

    # ---- figure management -------------------------------------------------------
    def _figure(self, show_plot: bool) -> Figure:
        if self.fig is not None:
            if not self._windowed:
                return self.fig
            import matplotlib.pyplot as plt

            if plt.fignum_exists(self.fig.number):
                return self.fig
            self.fig, self._layout = None, None  # the window was closed: open a new one
        if show_plot and interactive_backend():
            try:
                import matplotlib.pyplot as plt

                self.fig = plt.figure(figsize=self.figsize)
                self._windowed = True
                return self.fig
            except Exception as error:  # e.g. a GUI backend without a display
                warnings.warn(f"[cockpit_like] cannot open a plot window ({error}); drawing off-screen. Set "
                              "MPLBACKEND=Agg to draw off-screen without trying, and pass save_plot=True to "
                              "write the picture to a file",
                              RuntimeWarning, stacklevel=3)
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        self.fig = DashboardFigure(figsize=self.figsize)
        self.fig.notebook_dpi = self.notebook_dpi
        self.fig.notebook_colors = self.notebook_colors
        FigureCanvasAgg(self.fig)
        self._windowed = False
        return self.fig

    def _ensure_layout(self, fig: Figure, data: RunData) -> Layout:
        layers = _layer_panels(data) if self.secondary_screen else 0
        curvature = self.secondary_screen and any(
            data.has(name) for instrument in CURVATURE_INSTRUMENTS.values() for name in instrument.quantities
        )
        post_mortem = has_post_mortem(data)
        if self._layout is None or (self._layout.layer_panels, self._layout.curvature_row,
                                    self._layout.post_mortem) != (layers, curvature, post_mortem):
            fig.clear()
            fig.patches.clear()
            self._layout = build_layout(fig, self.secondary_screen, layers, curvature, post_mortem)
            self.axes = dict(self._layout.axes)
        return self._layout

    # ---- reading -----------------------------------------------------------------------
    def read(self, source: Any, discard: int | None = None) -> RunData:
        """Read ``source`` (as in :meth:`plot`) into :attr:`data` without drawing; return it.

        For dashboards of your own, built from :mod:`cockpit_like.instruments`::

            plotter.read("logs/run")
            alpha_gauge(plotter, fig, grid[0, 0])
        """
        self.data, _ = load_source(source, discard)
        return self.data

    def _read_tracking_results(self, source: Any, discard: int | None = None) -> None:
        """Cockpit's name for :meth:`read`."""
        self.read(source, discard)

    # ---- the public call -------------------------------------------------------------
    def plot(
        self,
        source: Any,
        show_plot: bool = True,
        block: bool = False,
        save_plot: bool = False,
        savedir: str | os.PathLike | None = None,
        savename: str = "cockpit",
        savename_append: str | None = None,
        savefig_kwargs: dict | None = None,
        show_log_iter: bool = False,
        discard: int | None = None,
        plot_title: str | None = None,
        debug: bool = False,
    ) -> Figure:
        """Draw (or redraw in place) the dashboard.

        Args:
            source: a :class:`~cockpit_like.Cockpit` (live), a path to a log
                (``.json``/``.jsonl``, with or without the suffix), or an
                output dict ``{step: {name: value}}``.
            show_plot: show the dashboard, updated in place on later calls: in
                a window with an interactive backend, as one image display in
                a Jupyter notebook (see the class docstring). Headless (Agg
                outside a kernel) nothing is shown and a one-time warning
                suggests ``save_plot=True``.
            block: block until the window is closed (only with ``show_plot``).
            save_plot: write the figure to ``savedir/savename[savename_append].<format>``.
            savedir: folder for the file; default: the log's folder when
                ``source`` is a path, else the current folder. Created if needed.
            savename: file name without extension.
            savename_append: text appended to ``savename`` (e.g. ``"__step_100"``).
            savefig_kwargs: passed to ``Figure.savefig``; ``format`` picks the
                file type and extension (default ``"png"``), e.g.
                ``{"format": "pdf", "dpi": 150}``.
            show_log_iter: logarithmic step axis in the time series.
            discard: only use steps ``<= discard``.
            plot_title: the figure title (default: the log name and the last step).
            debug: print timings per instrument and re-raise drawing errors
                (otherwise an instrument that fails shows the error in its panel).

        Returns:
            The matplotlib figure (a :class:`DashboardFigure` where no window
            shows it: in a notebook it renders as an image, and adds nothing
            in the cell whose live display it just updated); ``None`` when ``source`` is a cockpit on a
            DistributedDataParallel rank that keeps no output (only its
            ``log_rank`` plots, docs/distributed.md).
        """
        if getattr(source, "keeps_output", True) is False:
            return None
        self._stream = getattr(source, "stream_path", None) if not isinstance(source, (str, os.PathLike, dict)) else (
            str(source) if str(source).endswith(".jsonl") else None)  # fmt: skip
        start = time.perf_counter()
        data, logpath = load_source(source, discard)
        self.data, self.show_log_iter, self.debug = data, bool(show_log_iter), bool(debug)
        read = time.perf_counter()
        fig = self._figure(show_plot)
        layout = self._ensure_layout(fig, data)
        options = DrawOptions(log_iter=show_log_iter)
        for key, instrument in layout.instruments.items():
            ax = layout.axes[key]
            began = time.perf_counter()
            ax.cla()
            ax.set_facecolor("white")  # cla() keeps a blank panel's grey
            for spine in ax.spines.values():
                spine.set_color("black")
            try:
                instrument.draw(ax, data, options)
            except Exception as error:
                if debug:
                    raise
                ax.cla()
                ax.set_title(instrument.title, fontsize=10, fontweight="bold")
                ax.text(0.5, 0.5, f"could not draw:\n{type(error).__name__}: {error}", transform=ax.transAxes,
                        ha="center", va="center", fontsize=7, color="#b00000", wrap=True, gid="draw-error")
            if debug:
                print(f"[cockpit_like|plot] {key}: {1e3 * (time.perf_counter() - began):.1f} ms")
        fig.suptitle(self._title(plot_title, data, logpath), fontsize=13, fontweight="bold", y=0.997, va="top")
        drawn = time.perf_counter()

        self.last_timing = {}
        if save_plot:
            self.last_saved = self._save(fig, logpath, savedir, savename, savename_append, savefig_kwargs)
            if debug:
                print(f"[cockpit_like|plot] saved {self.last_saved}")
        if show_plot:
            self._show(fig, block)
        end = time.perf_counter()
        self.last_timing = {"read": read - start, "draw": drawn - read, "render": end - drawn, "total": end - start,
                            **self.last_timing}
        if debug:
            print(
                "[cockpit_like|plot] "
                + ", ".join(f"{name} {1e3 * value:.0f} ms" for name, value in self.last_timing.items())
            )
        return fig

    # ---- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _title(plot_title: str | None, data: RunData, logpath: str | None) -> str:
        if plot_title is not None:
            return plot_title
        name = Path(logpath).name if logpath else "live run"
        last = max(data.steps) if data.steps else None
        title = f"Cockpit: {name}" + (f" (step {last})" if last is not None else " (no data yet)")
        skipped, _ = data.values("skipped")  # steps a GradScaler skipped (docs/your_training_loop.md)
        if skipped:
            title += f" | {len(skipped)} step{'s' if len(skipped) > 1 else ''} skipped by the GradScaler (last: {skipped[-1]})"
        return title + _checks_note(data)

    @staticmethod
    def _save(fig: Figure, logpath, savedir, savename: str, savename_append, savefig_kwargs) -> Path:
        kwargs = dict(savefig_kwargs or {})
        fmt = str(kwargs.pop("format", "png")).lower()
        if savedir is None:
            savedir = Path(logpath).parent if logpath else Path.cwd()
        folder = Path(savedir)
        from cockpit_like.logs import make_folder

        make_folder(folder, "the dashboard image")
        path = folder / f"{savename}{savename_append or ''}.{fmt}"
        kwargs.setdefault("facecolor", "white")
        fig.savefig(path, format=fmt, **kwargs)
        return path

    def _show_in_notebook(self, fig: Figure) -> None:
        """Show ``fig`` in this plotter's notebook display: created by the first call in a cell, replaced by
        the later calls in that cell (a cell run again has lost its old outputs, so it gets a new display)."""
        from IPython.display import display

        began = time.perf_counter()
        png = _png(fig, self.notebook_dpi, self.notebook_colors)
        bundle = {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": fig.get_suptitle() or repr(fig)}
        cell = _execution_count()
        if self.display_handle is None or self._display_cell != cell:
            self.display_handle = display(bundle, raw=True, display_id=True)
            self._display_cell = cell
        else:
            self.display_handle.update(bundle, raw=True)
        if isinstance(fig, DashboardFigure):
            fig._cockpit_like_live_in = cell
        self.last_timing["notebook_png"] = time.perf_counter() - began
        self.last_image_bytes = len(png)

    def _show(self, fig: Figure, block: bool) -> None:
        global _warned_headless
        if not self._windowed:
            if in_jupyter_kernel():
                self._show_in_notebook(fig)
                return
            if not _warned_headless:
                _warned_headless = True
                stream = getattr(self, "_stream", None)
                follow = (f"follow the stream with `cockpit-like watch {stream} -o live.png`" if stream else
                          "follow a stream with `cockpit-like watch RUN.jsonl -o live.png`, from a Cockpit made "
                          "with stream_to='RUN'")  # fmt: skip
                warnings.warn(
                    "[cockpit_like] the cockpit is drawn but not shown: matplotlib's backend "
                    f"({matplotlib.get_backend()}) opens no window and this is not a Jupyter kernel (a script "
                    f"under Agg, CI, ssh). To see it, pass plot(..., save_plot=True) to write an image (or {follow}); "
                    "pass show_plot=False to draw without showing and without this warning.",
                    UserWarning,
                    stacklevel=3,
                )
            return
        import matplotlib.pyplot as plt

        if block:
            plt.show(block=True)
            return
        if not getattr(fig, "_cockpit_like_shown", False):
            fig._cockpit_like_shown = True
            plt.show(block=False)
        fig.canvas.draw_idle()
        fig.canvas.flush_events()


def _checks_note(data: RunData) -> str:
    """What the self-checks said (docs/your_training_loop.md#self-checks): the steps stored without numbers
    because a check failed, and the frozen parameters and ones without a gradient at the last step."""
    steps, records = data.values("checks")
    records = [r for r in records if isinstance(r, dict)]
    invalid = [(s, r) for s, r in zip(steps, records) if r.get("valid") is False]
    note = ""
    if invalid:
        step, record = invalid[-1]
        kinds = ", ".join(sorted({f.get("check", "?") for f in record.get("failed", [])}))
        note += f" | {len(invalid)} step{'s' if len(invalid) > 1 else ''} failed a self-check, numbers left out (last: {step}, {kinds})"
    if records:
        last = records[-1]
        frozen, missing = len(last.get("frozen") or []), len(last.get("no_gradient") or [])
        if frozen:
            note += f" | {frozen} frozen parameter{'s' if frozen > 1 else ''}"
        if missing:
            note += f" | {missing} without a gradient"
    return note


def save_dashboard(
    logpath: str | os.PathLike,
    output: str | os.PathLike | None = None,
    secondary_screen: bool = False,
    plot_title: str | None = None,
    show_log_iter: bool = False,
    progress: bool | None = False,
    **savefig_kwargs: Any,
) -> Path:
    """Render a saved run to an image file and return its path.

    Args:
        logpath: the log (``.json``/``.jsonl``, with or without the suffix).
        output: where to write; default: next to the log, with the log's
            name and ``.png`` (``runs/mlp.json`` -> ``runs/mlp.png``). The
            suffix picks the format (``.pdf``, ``.svg``, ...).
        secondary_screen: include the secondary screen.
        plot_title: figure title (default: the log name and last step).
        show_log_iter: logarithmic step axis.
        progress: a progress bar while the log is read (as in
            :func:`cockpit_like.read_log`; ``cockpit-like plot`` passes None).
        **savefig_kwargs: passed to ``Figure.savefig`` (e.g. ``dpi=150``).
    """
    from cockpit_like.logs import _resolve, read_log

    resolved = _resolve(logpath)
    target = Path(output) if output is not None else resolved.with_suffix(".png")
    fmt = target.suffix.lstrip(".").lower() or "png"
    if not target.suffix:
        target = target.with_name(target.name + ".png")
    plotter = CockpitPlotter(secondary_screen=secondary_screen)
    steps = read_log(resolved, progress=progress)
    if plot_title is None:
        plot_title = CockpitPlotter._title(None, RunData(steps), str(resolved))
    plotter.plot(
        steps, show_plot=False, save_plot=True, savedir=target.parent, savename=target.stem,
        savefig_kwargs={"format": fmt, **savefig_kwargs}, plot_title=plot_title,
        show_log_iter=show_log_iter,
    )
    return plotter.last_saved
