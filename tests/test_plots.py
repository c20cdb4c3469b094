"""The training plot of a run that has not trained yet: empty panels say so, without a warning."""

import warnings

from dapo.reporting.plots import plot_training


def test_a_run_with_nothing_trained_plots_without_warnings(tmp_path):
    # a one-step run whose step found no informative group: held-out accuracy only, no trained-batch metrics
    rows = [{"step": 0, "eval/word/avg@2": 0.125}, {"step": 1, "eval/word/avg@2": 0.125}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = plot_training(rows, tmp_path / "plots" / "training.png")
    assert out.stat().st_size > 10_000
