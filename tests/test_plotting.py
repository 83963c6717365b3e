"""The cockpit dashboard, rendered headless (Agg) and checked by content."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from tests.helpers import make_problem, train  # noqa: E402

from cockpit_like import Cockpit, CockpitPlotter, quantities  # noqa: E402
from cockpit_like.plotting import RunData, save_dashboard  # noqa: E402
from cockpit_like.plotting.data import smooth  # noqa: E402
from cockpit_like.plotting.instruments import PRIMARY, SECONDARY  # noqa: E402
from cockpit_like.utils.configuration import PRESETS, configuration  # noqa: E402
from cockpit_like.utils.schedules import linear  # noqa: E402

STEPS = 6
PRIMARY_TITLES = {instrument.title for instrument in PRIMARY.values()}


# ---- helpers to read a figure -------------------------------------------------------------
def raw_points(ax, name: str) -> int:
    lines = [line for line in ax.get_lines() if line.get_gid() == f"raw:{name}"]
    assert len(lines) == 1, f"expected one raw series {name!r}, found {len(lines)}"
    return len(lines[0].get_xdata())


def raw_data(ax) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {
        line.get_gid(): (np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float))
        for line in ax.get_lines()
        if (line.get_gid() or "").startswith(("raw:", "smooth:"))
    }


def blank(ax) -> bool:
    return any(text.get_gid() == "not-tracked" for text in ax.texts)


def blank_keys(plotter) -> set[str]:
    return {key for key, ax in plotter.axes.items() if blank(ax)}


def run_cockpit(quantity_list, steps=STEPS, problem="mlp", log=True, stream_to=None):
    model, lossfunc, individual = make_problem(problem)
    cockpit = Cockpit(model.parameters(), quantities=quantity_list, stream_to=stream_to)
    train(model, lossfunc, individual, cockpit, problem, steps=steps)
    if log:
        cockpit.log(steps - 1, epoch_count=0, train_loss=0.5, learning_rate=0.1)
    return cockpit


def stored_steps(cockpit, name: str) -> int:
    return sum(1 for values in cockpit.get_output().values() if values.get(name) is not None)


def expected_blanks(names: set[str], logged: bool) -> set[str]:
    instruments = {**PRIMARY}
    blanks = set()
    for key, instrument in instruments.items():
        if key in ("learning_rate", "loss", "accuracy"):
            continue
        if not any(name in names for name in instrument.quantities):
            blanks.add(key)
    if not logged:
        blanks.add("learning_rate")
    if not logged and "Loss" not in names:
        blanks.add("loss")
    blanks.add("accuracy")  # the runs here never log accuracies
    return blanks


# ---- every configuration, live and from the log -------------------------------------------------
@pytest.mark.filterwarnings("ignore:Using backward")
@pytest.mark.parametrize("label", sorted(PRESETS))
def test_every_configuration_live_and_from_log(label, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantity_list = configuration(label)
    cockpit = run_cockpit(quantity_list, stream_to=tmp_path / "run")
    names = {name for values in cockpit.get_output().values() for name in values}
    logpath = cockpit.write(tmp_path / "run")
    cockpit.close()

    live = CockpitPlotter()
    fig = live.plot(cockpit, show_plot=False)
    assert {ax.get_title() for ax in fig.axes} >= PRIMARY_TITLES - {"Gradient element histogram", "Gradient × parameter"}
    assert set(live.axes) == set(PRIMARY)
    assert blank_keys(live) == expected_blanks(names, logged=True)

    # one raw point per tracked step
    axes = live.axes
    for key, name in (("grad_norm", "GradNorm"), ("loss", "Loss"), ("distance", "Distance"),
                      ("distance", "UpdateSize"), ("grad_tests", "NormTest"), ("grad_tests", "InnerTest"),
                      ("grad_tests", "OrthoTest"), ("hess_trace", "HessTrace"), ("tic", "TICDiag"),
                      ("hess_max_ev", "HessMaxEV")):
        if name in names:
            assert raw_points(axes[key], name) == stored_steps(cockpit, name)
    assert stored_steps(cockpit, "UpdateSize") == STEPS - 1
    assert "fits" in axes["alpha"].get_legend().get_title().get_text()
    assert f"{stored_steps(cockpit, 'Alpha')} fits" in axes["alpha"].get_legend().get_title().get_text()
    assert raw_points(axes["learning_rate"], "learning_rate") == 1

    # the log (full and streaming form) gives the same picture
    for source in (logpath, str(tmp_path / "run"), cockpit.stream_path):
        other = CockpitPlotter()
        other.plot(source, show_plot=False)
        assert blank_keys(other) == blank_keys(live)
        for key in PRIMARY:
            ours, theirs = raw_data(live.axes[key]), raw_data(other.axes[key])
            assert ours.keys() == theirs.keys(), key
            for gid in ours:
                np.testing.assert_allclose(theirs[gid][0], ours[gid][0])
                np.testing.assert_allclose(theirs[gid][1], ours[gid][1], rtol=1e-6, equal_nan=True)
        if "GradHist1d" in names:
            mesh_live = live.axes["hist_1d"].patches[0].get_path().vertices
            mesh_file = other.axes["hist_1d"].patches[0].get_path().vertices
            np.testing.assert_allclose(mesh_file, mesh_live, rtol=1e-6)


def test_only_some_quantities(tmp_path):
    cockpit = run_cockpit([quantities.Loss(linear(2)), quantities.GradNorm(linear(3))], log=False)
    plotter = CockpitPlotter()
    plotter.plot(cockpit, show_plot=False)
    assert raw_points(plotter.axes["loss"], "Loss") == 3  # steps 0, 2, 4
    assert raw_points(plotter.axes["grad_norm"], "GradNorm") == 2  # steps 0, 3
    assert blank_keys(plotter) == set(PRIMARY) - {"loss", "grad_norm"}
    for key in blank_keys(plotter):
        texts = [t.get_text() for t in plotter.axes[key].texts]
        assert "not tracked" in texts
    assert "add Alpha to track it, or no step stored one yet (cockpit.checks)" in [
        t.get_text().replace("\n", " ") for t in plotter.axes["alpha"].texts]
    # every hint fits its panel (outside trial 9: up to 346 px wide in 185 px panels, over the neighbours)
    figure = plotter.fig if hasattr(plotter, "fig") else next(iter(plotter.axes.values())).get_figure()
    renderer = figure.canvas.get_renderer()
    for key in blank_keys(plotter):
        box = plotter.axes[key].get_window_extent(renderer)
        for text in plotter.axes[key].texts:
            extent = text.get_window_extent(renderer)
            assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1, (key, text.get_text())


def test_grad_norm_is_norm_over_all_parameters():
    cockpit = run_cockpit([quantities.GradNorm(linear(1))], log=False)
    plotter = CockpitPlotter()
    plotter.plot(cockpit, show_plot=False)
    (steps, values), = [v for k, v in raw_data(plotter.axes["grad_norm"]).items() if k.startswith("raw:")]
    expected = [math.sqrt(sum(n**2 for n in out["GradNorm"])) for out in cockpit.get_output().values()]
    np.testing.assert_allclose(values, expected)
    np.testing.assert_array_equal(steps, np.arange(STEPS))


# ---- synthetic data: secondary screen, KFAC, odd values ---------------------------------------------
def synthetic(steps: int = 30, blocks: int = 3) -> dict:
    rng = np.random.default_rng(0)
    edges2 = [np.linspace(-1, 1, 5).tolist(), np.linspace(-2, 2, 4).tolist()]
    out = {}
    for t in range(steps):
        out[t] = {
            "Loss": float(2 - t / steps),
            "MeanGSNR": float(rng.random()),
            "CABS": float(10 + t),
            "EarlyStopping": float(-1 + t / steps),
            "MyQuantity": float(t),
            "KFACTrace": {"trace": [1.0] * blocks, "trace_total": float(blocks), "frobenius": [0.5] * blocks,
                          "frobenius_total": 0.5 * blocks},
            "GradHist2d": {
                "hist": np.ones((4, 3)).tolist(), "edges": edges2, "param_groups": blocks,
                **{f"param_{i}": {"hist": (np.ones((4, 3)) * i).tolist(), "edges": edges2} for i in range(blocks)},
            },
        }
    out[steps - 1]["Alpha"] = math.nan
    return out


def test_secondary_screen():
    data = synthetic()
    plotter = CockpitPlotter(secondary_screen=True)
    fig = plotter.plot(data, show_plot=False)
    assert tuple(fig.get_size_inches()) == (16.0, 14.0)
    titles = {ax.get_title() for ax in fig.axes}
    assert {instrument.title for instrument in SECONDARY.values()} <= titles
    assert {f"Layer {i}: grad × param" for i in range(3)} <= titles
    axes = plotter.axes
    for key, name in (("mean_gsnr", "MeanGSNR"), ("cabs", "CABS"), ("early_stopping", "EarlyStopping"),
                      ("custom", "MyQuantity"), ("kfac_trace", "KFACTrace")):
        assert raw_points(axes[key], name) == 30
    # per-layer histograms show each block's own counts
    mesh = [c for c in axes["layer_hist_2"].collections if c.get_gid() == "hist2d:param_2"][0]
    np.testing.assert_allclose(np.ravel(mesh.get_array()), np.log10(1 + 2 * np.ones(12)))
    assert not blank(axes["hist_2d"])
    # the primary figure has no secondary panels
    primary = CockpitPlotter()
    primary.plot(data, show_plot=False)
    assert set(primary.axes) == set(PRIMARY)
    assert tuple(primary.fig.get_size_inches()) == (16.0, 9.0)


def test_secondary_screen_not_tracked():
    plotter = CockpitPlotter(secondary_screen=True)
    plotter.plot({0: {"Loss": 1.0}}, show_plot=False)
    assert {"mean_gsnr", "cabs", "early_stopping", "custom"} <= blank_keys(plotter)
    assert not any(key.startswith("layer_hist") for key in plotter.axes)


def test_empty_and_nan_data():
    plotter = CockpitPlotter()
    plotter.plot({}, show_plot=False)
    assert blank_keys(plotter) == set(PRIMARY)
    assert "no data yet" in plotter.fig._suptitle.get_text()
    data = {0: {"Alpha": math.nan, "Loss": math.nan}, 1: {"Alpha": -1, "Loss": 1.0}, 2: {"Alpha": 50.0}}
    plotter.plot(data, show_plot=False)
    legend = plotter.axes["alpha"].get_legend().get_title().get_text()
    assert "3 fits" in legend and "1 NaN" in legend and "1 beyond" in legend
    assert raw_points(plotter.axes["loss"], "Loss") == 2


def test_alpha_histogram_counts_every_value():
    values = [-0.5, -0.4, 0.1, 0.2, 0.3, 0.9, 1.2, -1.0, 0.0, 0.05]
    plotter = CockpitPlotter()
    plotter.plot({t: {"Alpha": v} for t, v in enumerate(values)}, show_plot=False)
    ax = plotter.axes["alpha"]
    stairs = {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith("alpha:")}
    assert set(stairs) == {"alpha:all", "alpha:last"}
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0] == f"all: median {np.median(values):+.2f}"
    assert labels[1] == f"last 1: median {values[-1]:+.2f}"
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "undershoot" in texts and "overshoot" in texts


def test_repeated_calls_update_one_figure():
    data = {t: {"Loss": 1.0 / (t + 1)} for t in range(5)}
    plotter = CockpitPlotter()
    fig = plotter.plot(data, show_plot=False)
    count = len(fig.axes)
    data.update({t: {"Loss": 1.0 / (t + 1)} for t in range(5, 9)})
    assert plotter.plot(data, show_plot=False) is fig
    assert len(fig.axes) == count
    assert raw_points(plotter.axes["loss"], "Loss") == 9
    assert len([line for line in plotter.axes["loss"].get_lines() if line.get_gid() == "raw:Loss"]) == 1


def test_discard_and_log_iter():
    data = {t: {"Loss": 1.0 / (t + 1)} for t in range(10)}
    plotter = CockpitPlotter()
    plotter.plot(data, show_plot=False, discard=3, show_log_iter=True)
    assert raw_points(plotter.axes["loss"], "Loss") == 4
    assert plotter.axes["loss"].get_xscale() == "symlog"
    assert plotter.fig._suptitle.get_text() == "Cockpit: live run (step 3)"
    plotter.plot(data, show_plot=False, plot_title="my run")
    assert plotter.fig._suptitle.get_text() == "my run"
    assert plotter.axes["loss"].get_xscale() == "linear"


def test_headless_show_falls_back(tmp_path):
    import cockpit_like.plotting.plotter as module

    module._warned_headless = False
    plotter = CockpitPlotter()
    with pytest.warns(UserWarning, match="save_plot=True"):
        plotter.plot({0: {"Loss": 1.0}}, show_plot=True, block=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned only once
        plotter.plot({0: {"Loss": 1.0}}, show_plot=True)


def test_headless_warning_names_the_cockpits_own_stream(tmp_path):
    """It suggested `cockpit-like watch runs/NAME.jsonl`, a placeholder, where the cockpit streams to a known
    path (outside trial 8); without a stream it says how to make one."""
    import cockpit_like.plotting.plotter as module

    cockpit = run_cockpit([quantities.Loss(linear(1))], steps=2, log=False)
    module._warned_headless = False
    with pytest.warns(UserWarning, match=r"cockpit-like watch RUN.jsonl -o live.png`, from a Cockpit made with stream_to"):
        CockpitPlotter().plot(cockpit, show_plot=True)
    import torch

    cockpit = Cockpit([torch.zeros(1, requires_grad=True)], quantities=[quantities.Loss(linear(1))],
                      stream_to=tmp_path / "mine")  # fmt: skip
    module._warned_headless = False
    with pytest.warns(UserWarning, match=f"cockpit-like watch {tmp_path / 'mine'}.jsonl -o live.png"):
        CockpitPlotter().plot(cockpit, show_plot=True)


def test_saving(tmp_path):
    data = {0: {"Loss": 1.0}, 1: {"Loss": 0.5}}
    plotter = CockpitPlotter()
    plotter.plot(data, show_plot=False, save_plot=True, savedir=tmp_path / "figs")
    assert plotter.last_saved == tmp_path / "figs" / "cockpit.png"
    assert plotter.last_saved.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plotter.plot(data, show_plot=False, save_plot=True, savedir=tmp_path, savename="run",
                 savename_append="__step_1", savefig_kwargs={"format": "pdf", "dpi": 50})
    assert plotter.last_saved == tmp_path / "run__step_1.pdf"
    assert plotter.last_saved.read_bytes()[:4] == b"%PDF"
    plotter.plot(data, show_plot=False, save_plot=True, savedir=tmp_path, savefig_kwargs={"format": "svg"})
    assert "<svg" in (tmp_path / "cockpit.svg").read_text()[:1000]


def test_saving_next_to_the_log(tmp_path):
    cockpit = run_cockpit([quantities.Loss(linear(1))], steps=3, log=False)
    cockpit.write(tmp_path / "logs" / "run")
    plotter = CockpitPlotter()
    plotter.plot(str(tmp_path / "logs" / "run"), show_plot=False, save_plot=True)
    assert plotter.last_saved == tmp_path / "logs" / "cockpit.png"
    path = save_dashboard(tmp_path / "logs" / "run.json")
    assert path == tmp_path / "logs" / "run.png" and path.is_file()
    path = save_dashboard(tmp_path / "logs" / "run", tmp_path / "other" / "dash.pdf", secondary_screen=True)
    assert path == tmp_path / "other" / "dash.pdf" and path.read_bytes()[:4] == b"%PDF"


def test_cockpit_format_log(tmp_path):
    """A log in Cockpit's own format (json_tricks arrays) plots like ours."""
    hist = {"__ndarray__": [1.0, 5.0, 2.0], "dtype": "float32", "shape": [3]}
    edges = {"__ndarray__": [-1.0, 0.0, 0.5, 1.0], "dtype": "float32", "shape": [4]}
    log = {str(t): {"Loss": 1.0 - t / 10, "GradNorm": [0.1, 0.2], "GradHist1d": {"hist": hist, "edges": edges}}
           for t in range(4)}
    (tmp_path / "cockpit_log.json").write_text(json.dumps(log))
    plotter = CockpitPlotter()
    plotter.plot(tmp_path / "cockpit_log", show_plot=False)
    assert raw_points(plotter.axes["loss"], "Loss") == 4
    assert not blank(plotter.axes["hist_1d"])
    heights = plotter.axes["hist_1d"].patches[0].get_path().vertices[:, 1]
    assert heights.max() == pytest.approx(5.0)


def test_draw_errors_are_shown_not_raised():
    data = {0: {"GradHist1d": {"hist": [1.0, 2.0], "edges": "broken"}, "Loss": 1.0}}
    plotter = CockpitPlotter()
    plotter.plot(data, show_plot=False)
    assert any(t.get_gid() == "draw-error" for t in plotter.axes["hist_1d"].texts)
    assert raw_points(plotter.axes["loss"], "Loss") == 1
    with pytest.raises(ValueError):
        CockpitPlotter().plot(data, show_plot=False, debug=True)


def test_instruments_do_not_mutate_data():
    data = synthetic()
    before = copy.deepcopy(data)
    plotter = CockpitPlotter(secondary_screen=True)
    plotter.plot(data, show_plot=False)
    assert json.dumps(data, sort_keys=True, default=str) == json.dumps(before, sort_keys=True, default=str)


def test_bad_source():
    with pytest.raises(TypeError, match="a Cockpit, a path to a cockpit log"):
        CockpitPlotter().plot(42, show_plot=False)
    with pytest.raises(FileNotFoundError, match="no cockpit log"):
        CockpitPlotter().plot("/nonexistent/run", show_plot=False)


def test_run_data_and_smoothing():
    data = RunData({"3": {"A": 1.0}, "1": {"A": None, "B": [3.0, 4.0]}, 2: {"A": 2.0}}, discard=2)
    assert list(data.steps) == [1, 2]
    steps, values = data.scalar("A")
    np.testing.assert_array_equal(steps, [2]) and np.testing.assert_array_equal(values, [2.0])
    np.testing.assert_allclose(data.block_norm("B")[1], [5.0])
    np.testing.assert_allclose(data.block_sum("B")[1], [7.0])
    np.testing.assert_allclose(smooth(np.array([1.0, 2.0, np.nan, 4.0]), 3), [1.5, 1.5, np.nan, 4.0])  # no bridge
    flat = smooth(np.full(50, 2.0))
    np.testing.assert_allclose(flat, 2.0)


def test_package_import_does_not_load_matplotlib():
    code = "import sys, cockpit_like; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_secondary_screen_shows_logged_curvature_when_tracked():
    """A run with the logged-curvature quantities gets their row on the secondary screen, drawn from data."""
    from cockpit_like.plotting.curvature_instruments import CURVATURE_INSTRUMENTS

    model, lossfunc, individual = make_problem("mlp")
    tracked = [
        quantities.HessSpectralDensity(linear(1)),
        quantities.EKFACSpectrum(linear(1)),
        quantities.SelfInfluence(linear(1), damping=1e-3, k=2),
        quantities.PreconditionedGradNorm(linear(1), damping=1e-3),
        quantities.Loss(linear(1)),
    ]
    cockpit = Cockpit(model.parameters(), quantities=tracked)
    train(model, lossfunc, individual, cockpit, "mlp", steps=3, batch_size=8)
    plotter = CockpitPlotter(secondary_screen=True)
    plotter.plot(cockpit, show_plot=False)
    assert set(CURVATURE_INSTRUMENTS) <= set(plotter.axes)
    assert not blank_keys(plotter) & set(CURVATURE_INSTRUMENTS)
    assert raw_points(plotter.axes["preconditioned_grad_norm"], "PreconditionedGradNorm") == 3
    # without those quantities the row is absent, and it appears once they are in the data
    plain = CockpitPlotter(secondary_screen=True)
    plain.plot({0: {"Loss": 1.0}}, show_plot=False)
    assert not set(CURVATURE_INSTRUMENTS) & set(plain.axes)
    plain.plot(cockpit, show_plot=False)
    assert set(CURVATURE_INSTRUMENTS) <= set(plain.axes)


# ---- series that coincide stay visible (issue 35) ---------------------------------------------------
def _equal_series_log(steps: int = 40) -> dict:
    """Every panel with several series gets series equal to 1e-9 (the norm and orthogonality tests of a GPT-2
    run were 0.908 and 0.902: one line hid the other)."""
    log = {}
    for step in range(steps):
        v = 0.9 + 0.05 * math.sin(step / 5)
        values = {
            "NormTest": v, "InnerTest": v + 1e-9, "OrthoTest": v - 1e-9,
            "Distance": [v], "UpdateSize": [v],
            "TICDiag": v, "TICTrace": v,
            "KFACTrace": {"trace_total": v, "frobenius_total": v},
            "SelfInfluence": {"max": v, "mean": v},
            "PreconditionedGradNorm": {"value": v, "grad_norm_squared": v},
            "MyFirst": v, "MySecond": v, "MyThird": v,
            "Loss": v,
        }
        if step % 10 == 9:
            values.update(train_loss=v, valid_loss=v, test_loss=v, train_accuracy=v, valid_accuracy=v, test_accuracy=v)
        log[step] = values
    return log


def _series_lines(ax) -> list:
    """The lines of an instrument's series: labelled, tagged with a gid, not reference lines."""
    return [line for line in ax.get_lines()
            if line.get_gid() and not line.get_label().startswith("_") and len(line.get_xdata())]


MULTI_SERIES_PANELS = {"grad_tests": 3, "distance": 2, "tic": 2, "kfac_trace": 2, "loss": 4, "accuracy": 3,
                       "custom": 3, "self_influence": 2, "preconditioned_grad_norm": 2}


def test_equal_series_differ_by_style_and_show_through():
    plotter = CockpitPlotter(secondary_screen=True)
    plotter.plot(_equal_series_log(), show_plot=False, debug=True)
    found = {}
    for key, ax in plotter.axes.items():
        lines = _series_lines(ax)
        if len(lines) < 2:
            continue
        found[key] = len(lines)
        styles = [(str(line.get_linestyle()), line.get_marker()) for line in lines]
        assert len(set(styles)) == len(lines), f"{key}: series share a line style and marker: {styles}"
        stacked = sorted(lines, key=lambda line: line.get_zorder())
        assert [line.get_zorder() for line in stacked] == sorted({line.get_zorder() for line in lines}), key
        assert stacked[0].get_linestyle() == "-"
        assert all(line.get_linestyle() not in ("-", "None") for line in stacked[1:]), (
            f"{key}: a solid line on top hides the ones below")
        assert all(line.get_alpha() is not None and line.get_alpha() < 1 for line in lines), key
        assert all(line.get_markerfacecolor() == "none" for line in lines), key
        legend = ax.get_legend()
        assert legend is not None
        handles = {text.get_text(): handle for text, handle in zip(legend.get_texts(), legend.legend_handles)}
        for line in lines:  # the legend shows each series as drawn
            assert handles[line.get_label()].get_linestyle() == line.get_linestyle(), (key, line.get_label())
    assert found == MULTI_SERIES_PANELS


def test_a_single_series_keeps_a_plain_line():
    plotter = CockpitPlotter()
    plotter.plot({step: {"GradNorm": [1.0 + step]} for step in range(10)}, show_plot=False)
    (line,) = _series_lines(plotter.axes["grad_norm"])
    assert line.get_linestyle() == "-" and line.get_marker() in ("None", "", None) and line.get_alpha() is None


def test_equal_gradient_tests_are_all_visible_in_the_picture():
    """Rendered: the pixels of each test's colour are there, although the three series are equal."""
    from matplotlib.colors import to_rgb

    from cockpit_like.plotting.instruments import COLORS

    plotter = CockpitPlotter()
    fig = plotter.plot(_equal_series_log(), show_plot=False)
    ax = plotter.axes["grad_tests"]
    ax.get_legend().remove()
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(float) / 255
    box = ax.get_window_extent()
    height = image.shape[0]
    panel = image[int(height - box.y1):int(height - box.y0), int(box.x0):int(box.x1)]
    for name in ("blue", "orange", "green"):  # NormTest, InnerTest, OrthoTest at alpha 0.9 over white
        expected = 0.9 * np.asarray(to_rgb(COLORS[name])) + 0.1
        close = np.all(np.abs(panel - expected) < 0.12, axis=-1)  # antialiased edges blend
        assert close.sum() > 50, f"the {name} series is hidden ({close.sum()} pixels)"


def test_notebook_image_options():
    import io

    from PIL import Image

    from cockpit_like.plotting import DashboardFigure

    plotter = CockpitPlotter(notebook_dpi=40, notebook_colors=64)
    fig = plotter.plot(_equal_series_log(), show_plot=False)
    assert isinstance(fig, DashboardFigure)
    small = Image.open(io.BytesIO(fig._repr_png_()))
    assert small.size == (640, 360) and small.mode == "P" and len(small.getcolors()) <= 64
    quantized = fig._repr_png_()
    fig.notebook_colors = None
    full = fig._repr_png_()
    assert Image.open(io.BytesIO(full)).mode == "RGBA" and len(full) > 2 * len(quantized)
    for bad in ({"notebook_dpi": 0}, {"notebook_dpi": True}, {"notebook_colors": 1}, {"notebook_colors": 300},
                {"notebook_colors": 64.0}):
        with pytest.raises(ValueError, match="CockpitPlotter"):
            CockpitPlotter(**bad)


def test_a_terminal_ipython_is_not_a_kernel(monkeypatch):
    """The dashboard goes to a notebook display only in a kernel; ``ipython`` in a terminal is headless."""
    IPython = pytest.importorskip("IPython")
    from cockpit_like.utils.jupyter import in_jupyter_kernel

    assert not in_jupyter_kernel()  # pytest: no shell

    class Shell:
        config = {}

    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell())
    assert not in_jupyter_kernel()  # a terminal shell
    Shell.kernel = object()
    assert in_jupyter_kernel()
    del Shell.kernel
    Shell.config = {"IPKernelApp": {}}
    assert in_jupyter_kernel()


def test_estimated_values_are_drawn_with_their_error_band():
    """Where the log keeps a standard error beside a value (``checks["standard_errors"]``), its panel shades
    ``value ± 2`` standard errors; a band that reaches 0 keeps the axis linear; exact values have no band."""
    import matplotlib.pyplot as plt

    from cockpit_like.plotting.instruments import DrawOptions, draw_hess_trace, draw_tic

    def entry(error):
        return {"standard_errors": {"HessTrace": {"standard_error": error, "estimator": "hutchinson", "samples": 4,
                                                  "reliable": True}}}  # fmt: skip

    values = {0: [10.0, 5.0], 1: [100.0, 20.0], 2: [10000.0, 5000.0]}  # totals 15, 120, 15000: three decades
    narrow = RunData({step: {"HessTrace": v, "checks": entry(1.0)} for step, v in values.items()})
    fig, ax = plt.subplots()
    draw_hess_trace(ax, narrow, DrawOptions())
    (band,) = [c for c in ax.collections if c.get_gid() == "band:HessTrace"]
    ys = np.concatenate([path.vertices[:, 1] for path in band.get_paths()])
    assert ys.min() == pytest.approx(15 - 2) and ys.max() == pytest.approx(15000 + 2)
    assert ax.get_yscale() == "log"
    plt.close(fig)

    wide = RunData({step: {"HessTrace": v, "checks": entry(10.0)} for step, v in values.items()})  # 15 - 20 < 0
    fig, ax = plt.subplots()
    draw_hess_trace(ax, wide, DrawOptions())
    assert [c for c in ax.collections if c.get_gid() == "band:HessTrace"]
    assert ax.get_yscale() == "linear"
    plt.close(fig)

    exact = RunData({step: {"HessTrace": v} for step, v in values.items()})  # no error kept: no band
    fig, ax = plt.subplots()
    draw_hess_trace(ax, exact, DrawOptions())
    assert not [c for c in ax.collections if (c.get_gid() or "").startswith("band:")]
    assert ax.get_yscale() == "log"
    draw_tic(ax, exact, DrawOptions())  # a panel whose quantity has no entry draws none either
    plt.close(fig)


def test_a_logged_estimated_run_renders_its_bands(tmp_path):
    """End to end: a run with Hutchinson's HessTrace writes a log whose dashboard shades the band."""
    cockpit = run_cockpit([quantities.HessTrace(linear(1), curvature="hutchinson"), quantities.Loss(linear(1))])
    path = cockpit.write(tmp_path / "run")
    plotter = CockpitPlotter()
    plotter.plot(str(path), show_plot=False)
    ax = plotter.axes["hess_trace"]
    assert [c for c in ax.collections if c.get_gid() == "band:HessTrace"]


# ---- non-finite values are marked, and no curve passes through them ----------------------------------------
def _brute_smooth(values: list[float], window: int) -> list[float]:
    """The centred moving average of each finite value over its neighbours up to ``window // 2`` away on either
    side, stopping at the first non-finite one (NaN at non-finite values), by loops."""
    half, result = window // 2, []
    for i, value in enumerate(values):
        if not math.isfinite(value):
            result.append(math.nan)
            continue
        taken = [value]
        for direction in (-1, 1):
            for j in range(i + direction, i + direction * (half + 1), direction):
                if not 0 <= j < len(values) or not math.isfinite(values[j]):
                    break
                taken.append(values[j])
        result.append(sum(taken) / len(taken))
    return result


def test_smoothing_does_not_reach_across_non_finite_values():
    generator = np.random.default_rng(0)
    for trial in range(20):
        values = generator.normal(size=int(generator.integers(1, 60)))
        for index in generator.choice(len(values), size=min(len(values), 4), replace=False):
            values[index] = generator.choice([np.nan, np.inf, -np.inf, values[index]])
        window = int(generator.choice([3, 5, 7]))
        np.testing.assert_allclose(smooth(values, window), _brute_smooth(values.tolist(), window), equal_nan=True)


def _kind(value: float) -> str | None:
    if math.isnan(value):
        return "NaN"
    return None if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def _norm(blocks):
    return math.sqrt(sum(x * x for x in blocks))


# (panel, series name, stored key, stored value of the panel's value v, the panel's value of what is stored)
NONFINITE_SERIES = [
    ("loss", "Loss", "Loss", lambda v: v, lambda x: x),
    ("loss", "train_loss", "train_loss", lambda v: v, lambda x: x),
    ("accuracy", "valid_accuracy", "valid_accuracy", lambda v: v, lambda x: x),
    ("grad_norm", "GradNorm", "GradNorm", lambda v: [v, 0.5], _norm),
    ("distance", "Distance", "Distance", lambda v: [0.25, v], _norm),
    ("distance", "UpdateSize", "UpdateSize", lambda v: [v], _norm),
    ("grad_tests", "NormTest", "NormTest", lambda v: v, lambda x: x),
    ("grad_tests", "InnerTest", "InnerTest", lambda v: v, lambda x: x),
    ("grad_tests", "OrthoTest", "OrthoTest", lambda v: v, lambda x: x),
    ("hess_max_ev", "HessMaxEV", "HessMaxEV", lambda v: v, lambda x: x),
    ("hess_trace", "HessTrace", "HessTrace", lambda v: [v, 2.0], sum),
    ("kfac_trace", "KFACTrace", "KFACTrace", lambda v: {"trace_total": v, "frobenius_total": 1.0},
     lambda x: x["trace_total"]),
    ("tic", "TICDiag", "TICDiag", lambda v: v, lambda x: x),
    ("tic", "TICTrace", "TICTrace", lambda v: v, lambda x: x),
    ("learning_rate", "learning_rate", "learning_rate", lambda v: v, lambda x: x),
    ("mean_gsnr", "MeanGSNR", "MeanGSNR", lambda v: v, lambda x: x),
    ("cabs", "CABS", "CABS", lambda v: v, lambda x: x),
    ("early_stopping", "EarlyStopping", "EarlyStopping", lambda v: v, lambda x: x),
    ("custom", "MyQuantity", "MyQuantity", lambda v: v, lambda x: x),
    ("self_influence", "SelfInfluence.max", "SelfInfluence", lambda v: {"max": v, "mean": 1.0}, lambda x: x["max"]),
    ("preconditioned_grad_norm", "PreconditionedGradNorm", "PreconditionedGradNorm",
     lambda v: {"value": v, "grad_norm_squared": 1.0}, lambda x: x["value"]),
]
LOGGED = {"train_loss", "valid_accuracy", "learning_rate"}  # drawn as lines through their points, no smoothing


def _nonfinite_run(steps: int = 60) -> dict:
    """Every per-step series of the dashboards with a NaN, an inf and a -inf at steps of its own (logged figures
    every 5 steps)."""
    output: dict[int, dict] = {step: {} for step in range(steps)}
    for index, (_, _, key, store, _) in enumerate(NONFINITE_SERIES):
        every = 5 if key in LOGGED - {"learning_rate"} else 1
        at = range(0, steps, every)
        bad = {2 + index: math.nan, 27 + index: math.inf, 50 + index % 10: -math.inf}  # (21 series, 60 steps)
        bad = {step // every * every: value for step, value in bad.items()}
        if index == 0:
            bad.update({3: math.nan, 4: math.nan})  # several of a kind, side by side
        for step in at:
            value = bad.get(step, 1.0 + 0.5 * math.sin(step / 4 + index))
            output[step][key] = store(value)
    return output


def _expected(output: dict, key: str, reduce) -> tuple[list[int], list[float]]:
    steps = sorted(step for step in output if key in output[step])
    return steps, [float(reduce(output[step][key])) for step in steps]


def test_every_series_panel_marks_its_non_finite_steps_live_and_from_a_log(tmp_path):
    """The outside trial: a NaN and an inf loss were invisible (the smoothed line went through them, no mark).
    Every panel with a per-step series marks each NaN / inf / -inf step (a marker with its kind, a vertical line
    and a label), and its smoothed curve breaks there; checked against the stored values, live and from a log."""
    from cockpit_like.logs import write_log

    output = _nonfinite_run()
    path = write_log(tmp_path / "run", output, {})
    pictures = []
    for source in (output, str(path)):
        plotter = CockpitPlotter(secondary_screen=True)
        plotter.plot(source, show_plot=False)
        pictures.append(plotter)
    for plotter in pictures:
        series_panels = {key for key, ax in plotter.axes.items()
                         if any((line.get_gid() or "").startswith("raw:") for line in ax.get_lines())}
        assert series_panels == {panel for panel, *_ in NONFINITE_SERIES}  # every panel with a series is tested
        for panel, name, key, _, reduce in NONFINITE_SERIES:
            ax = plotter.axes[panel]
            steps, values = _expected(output, key, reduce)
            assert sum(_kind(value) is not None for value in values) >= 3  # (a norm turns -inf into inf)
            for kind in ("NaN", "inf", "-inf"):
                at = [step for step, value in zip(steps, values) if _kind(value) == kind]
                markers = [line for line in ax.get_lines() if line.get_gid() == f"nonfinite:{name}:{kind}"]
                if not at:
                    assert not markers, (panel, name, kind)
                    continue
                assert len(markers) == 1, (panel, name, kind)
                np.testing.assert_array_equal(markers[0].get_xdata(), at)
                assert markers[0].get_label().endswith(f": {kind} ({len(at)} step{'s' if len(at) > 1 else ''})")
                lines = [c for c in ax.collections if c.get_gid() == f"nonfinite-line:{name}:{kind}"]
                assert len(lines) == 1 and [segment[0][0] for segment in lines[0].get_segments()] == at
                labels = [t.get_text() for t in ax.texts if t.get_gid() == f"nonfinite-label:{name}:{kind}"]
                assert labels == [kind + (f" ×{len(at)}" if len(at) > 1 else "")]
            if name in LOGGED:
                continue
            smoothed = [line for line in ax.get_lines() if line.get_gid() == f"smooth:{name}"]
            assert len(smoothed) == 1
            np.testing.assert_array_equal(smoothed[0].get_xdata(), steps)
            window = max(3, (len(values) // 15) | 1)  # docs/instruments.md: about a fifteenth, odd, at least 3
            np.testing.assert_allclose(smoothed[0].get_ydata(), _brute_smooth(values, window), equal_nan=True)


def test_a_finite_run_has_no_non_finite_marks():
    output = {step: {"Loss": 1.0 / (step + 1), "GradNorm": [1.0, 2.0]} for step in range(10)}
    plotter = CockpitPlotter()
    plotter.plot(output, show_plot=False)
    for ax in plotter.axes.values():
        gids = [artist.get_gid() or "" for artist in (*ax.get_lines(), *ax.collections, *ax.texts)]
        assert not [gid for gid in gids if gid.startswith("nonfinite")]


def test_the_repro_loss_panel_shows_nan_and_inf():
    """The outside tester's repro: Loss 1 - 0.01 s with NaN at step 4 and inf at step 6."""
    steps = {s: {"Loss": 1.0 - 0.01 * s} for s in range(10)}
    steps[4]["Loss"], steps[6]["Loss"] = math.nan, math.inf
    plotter = CockpitPlotter()
    plotter.plot(steps, show_plot=False)
    ax = plotter.axes["loss"]
    marks = {line.get_gid(): line.get_xdata().tolist() for line in ax.get_lines()
             if (line.get_gid() or "").startswith("nonfinite:")}
    assert marks == {"nonfinite:Loss:NaN": [4], "nonfinite:Loss:inf": [6]}
    smoothed = next(line for line in ax.get_lines() if line.get_gid() == "smooth:Loss").get_ydata()
    assert np.isnan(smoothed[[4, 6]]).all()
    assert smoothed[5] == pytest.approx(0.95) and smoothed[3] == pytest.approx((0.98 + 0.97) / 2)
    assert {"NaN", "inf"} <= {t.get_text() for t in ax.texts}


def test_alpha_note_counts_nan_and_inf_apart():
    plotter = CockpitPlotter()
    plotter.plot({0: {"Alpha": math.nan}, 1: {"Alpha": math.inf}, 2: {"Alpha": -math.inf}, 3: {"Alpha": 0.5}},
                 show_plot=False)
    note = plotter.axes["alpha"].get_legend().get_title().get_text()
    assert "4 fits" in note and "1 NaN" in note and "1 inf" in note and "1 -inf" in note
