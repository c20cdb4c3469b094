"""PNG figures from a run's metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from dapo.reporting.run_log import held_out_keys  # noqa: E402


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_training(rows: list[dict], out: Path, title: str = "") -> Path:
    """Reward, held-out accuracy, entropy and response length against training steps."""
    eval_keys = held_out_keys(rows)
    panels = [
        ("reward (trained batch)", ["reward/score_mean", "rollout/acc_mean"]),
        ("held-out accuracy", eval_keys),
        ("entropy", ["actor/entropy"]),
        ("response length (tokens)", ["rollout/response_length_mean"]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, keys) in zip(axes.flat, panels):
        for key in keys:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 15 else None, label=key)
        ax.set_title(name)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
        else:  # e.g. a run whose only step had nothing to train on
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# quantity -> (metrics key, y label, file stem); the training-dynamics figures of the DAPO paper
ABLATION_FIGURES = [
    ("eval", "held-out accuracy (avg@n)", "accuracy"),
    ("actor/entropy", "entropy of the trained tokens", "entropy"),  # Fig. 2b, 4a
    ("rollout/response_length_mean", "mean response length (tokens)", "response_length"),  # Fig. 4b
    ("rollout/truncated_frac", "share of responses truncated at the limit", "truncated_frac"),
    ("actor/clipfrac_high", "share of tokens clipped at 1 + eps_high", "clipfrac_high"),
    ("actor/clipfrac_low", "share of tokens clipped at 1 - eps_low", "clipfrac_low"),
    ("actor/up_clipped_prob_max", "max probability of an up-clipped token", "up_clipped_prob_max"),  # Fig. 3a
    ("actor/up_clipped_prob_mean", "mean probability of up-clipped tokens", "up_clipped_prob_mean"),
    ("actor/token_prob_mean", "mean probability of the trained tokens", "token_prob_mean"),
    ("sampling/all_correct_frac", "share of groups with accuracy 1", "all_correct_frac"),  # Fig. 3b
    ("sampling/all_wrong_frac", "share of groups with accuracy 0", "all_wrong_frac"),
    ("rollout/acc_mean", "training accuracy (every generated sample)", "train_accuracy"),
]


def _smooth(ys: list[float], window: int) -> list[float]:
    """Trailing moving average, so per-step noise does not hide the trend."""
    out = []
    for i in range(len(ys)):
        part = ys[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def _band(curves: list[tuple[list[int], list[float]]]):
    """Mean, min and max over seeds at the steps every seed has."""
    common = sorted(set.intersection(*(set(xs) for xs, _ in curves)))
    at = [dict(zip(xs, ys)) for xs, ys in curves]
    mean = [sum(a[s] for a in at) / len(at) for s in common]
    return common, mean, [min(a[s] for a in at) for s in common], [max(a[s] for a in at) for s in common]


def _curves(seed_rows: dict, key: str, x_key: str | None, smooth: int) -> list[tuple[list, list[float]]]:
    """One (xs, ys) curve per seed (``seed_rows``: seed -> metrics rows): ``key`` against the step, or with ``x_key``
    against the samples generated up to it; training metrics smoothed, held-out accuracy ("eval") as measured."""
    curves = []
    for rows_ in seed_rows.values():
        if key == "eval":
            k = next(iter(held_out_keys(rows_)), None)
            pts = [(r["step"], r[k]) for r in rows_ if k and k in r]
        else:
            # a step where nothing was clipped at the top has no up-clipped probability (logged as 0)
            pts = [
                (r["step"], r[key])
                for r in rows_
                if key in r
                and r["step"] > 0
                and not (key.startswith("actor/up_clipped") and r.get("actor/clipfrac_high", 1.0) == 0)
            ]
        if x_key is not None:  # x = cumulative samples generated up to that step
            cum, total = {0: 0.0}, 0.0
            for r in rows_:
                if r["step"] > 0:
                    total += r.get(x_key, 0.0)
                    cum[r["step"]] = total
            pts = [(cum.get(s, 0.0), y) for s, y in pts]
        if pts:
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            curves.append((xs, ys if key == "eval" else _smooth(ys, smooth)))
    return curves


def _draw_row(ax, curves: list, color, label: str, *, markers: bool, per_seed: bool) -> None:
    """An ablation row's line: the mean over seeds shaded from min to max, or (``per_seed``) each seed's own."""
    if per_seed:  # seeds generate different numbers of samples: plot each seed
        for j, (xs, ys) in enumerate(curves):
            ax.plot(xs, ys, color=color, alpha=0.8, marker="o", ms=3, label=label if j == 0 else None)
        return
    xs, mean, lo, hi = _band(curves)
    ax.plot(xs, mean, color=color, label=label, marker="o" if markers else None, ms=3)
    if len(curves) > 1:
        ax.fill_between(xs, lo, hi, color=color, alpha=0.15)


def plot_ablation(data: dict, labels: dict, out_dir: Path, smooth: int = 5) -> list[Path]:
    """One PNG per quantity, one line per ablation row: the mean over seeds, shaded from min to max.

    ``data`` maps row -> seed -> metrics rows. Per-step training metrics are smoothed with a
    ``smooth``-step trailing mean; held-out accuracy is plotted as measured. Held-out accuracy is
    also drawn against the number of samples generated (dynamic sampling generates more per step).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    colors = plt.get_cmap("tab10")
    specs = [(key, ylabel, stem, None) for key, ylabel, stem in ABLATION_FIGURES]
    specs.append(("eval", "held-out accuracy (avg@n)", "accuracy_vs_samples", "sampling/samples_generated"))
    for key, ylabel, stem, x_key in specs:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        drawn = False
        for i, row in enumerate(data):
            curves = _curves(data[row], key, x_key, smooth)
            if curves:
                _draw_row(
                    ax, curves, colors(i % 10), labels.get(row, row), markers=key == "eval", per_seed=x_key is not None
                )
                drawn = True
        if not drawn:  # still one figure per quantity, so reports always link the same files
            ax.text(0.5, 0.5, "no data (e.g. nothing was clipped)", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("samples generated" if x_key else "training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
