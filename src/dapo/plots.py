"""PNG figures from a run's metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_training(rows: list[dict], out: Path, title: str = "") -> Path:
    """Reward, held-out accuracy, entropy and response length against training steps."""
    eval_keys = sorted({k for r in rows for k in r if k.startswith("eval/") and "/avg@" in k})
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
        if keys:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
