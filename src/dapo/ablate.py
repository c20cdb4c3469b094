"""The paper's ablation (DAPO Table 1 and Figs. 2-6), rerun: every row x seed is an ordinary training run.

    dapo ablate                                              # small scale: configs/ablation/base.yaml, all rows
    dapo ablate --seeds 5 --jobs 2 --out runs/ablation
    dapo ablate --base configs/dapo_qwen2.5_32b.yaml model.path=/models/Qwen2.5-32B --jobs 1
    dapo ablate --rows-dir configs/distillation teacher.path=runs/demo/teacher   # DAPO beside distillation

Rows are the files ``configs/ablation/<k>_<name>.yaml``; each names the previous one as ``base:``
and switches one technique, and they hold only technique switches, so the same rows apply on top of
any base preset (which holds the scale: model, data, lengths, batch, steps, evaluation). The last
row is the DAPO preset's algorithm exactly.

Layout of ``--out``:
    base_model/          one evaluation of the initial model (every row starts from it: step 0)
    <row>/seed<k>/       a normal run directory (metrics.jsonl, checkpoints/, train.log, done.json)
    report.md            the table: held-out avg@n per row, mean and 95% t-interval over seeds
    report.json          the same numbers, machine-readable
    figures/*.png        accuracy, entropy, length, clip fractions, up-clipped probability,
                         all-correct / all-wrong group shares against training steps
A finished run (done.json with the same resolved config) is skipped; an unfinished one resumes
from its latest checkpoint, so an interrupted study continues where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dapo.config import PRESET_DIR, Config, ConfigError, dump_yaml, load_config, resolve_preset
from dapo.reporting.run_log import held_out_keys, read_metrics
from dapo.runtime.threads import usable_cpus

ROW_FILE = re.compile(r"^(\d+)_[\w-]+\.yaml$")
# what each row adds, and its AIME 2024 avg@32 in the paper's Table 1 (Qwen2.5-32B)
ROW_LABELS = {
    "1_grpo": ("naive GRPO", 30),
    "2_overlong_filtering": ("+ overlong filtering", 36),
    "3_clip_higher": ("+ clip-higher", 38),
    "4_soft_overlong": ("+ soft overlong punishment", 41),
    "5_token_loss": ("+ token-level loss", 42),
    "6_dynamic_sampling": ("+ dynamic sampling (the paper's DAPO row)", 50),
    "7_no_kl": ("- KL loss", None),
    "8_no_overlong_filtering": ("- overlong filtering (DAPO as the reference runs it)", None),
    # configs/objectives/: DAPO's recipe with each surrogate (dapo ablate --rows-dir configs/objectives)
    "1_dapo": ("DAPO (clipped token ratio)", 50),
    "2_gspo": ("GSPO (clipped sequence ratio)", None),
    "3_cispo": ("CISPO (clipped, detached token weight)", None),
    # configs/distillation/: DAPO beside on-policy distillation (dapo ablate --rows-dir configs/distillation
    # teacher.path=DIR)
    "2_distill": ("pure on-policy distillation (the teacher's term alone)", None),
    "3_dapo_teacher": ("DAPO + the teacher's per-token term", None),
    "4_distill_full": ("pure on-policy distillation, the teacher's full KL in the loss", None),
}
# two-sided 97.5% quantiles of Student's t, by degrees of freedom (for the 95% interval over seeds)
_T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    15: 2.131,
    20: 2.086,
    30: 2.042,
}


@dataclass
class Run:
    row: str
    seed: int
    cfg: Config

    @property
    def dir(self) -> Path:
        return self.cfg.run_dir


def find_rows(rows_dir: Path, select: list[str] | None = None) -> list[Path]:
    """Row files in order; ``select`` picks by number (``3``), short name (``clip_higher``) or file
    stem (``3_clip_higher``)."""
    found = sorted(
        (p for p in Path(rows_dir).glob("*.yaml") if ROW_FILE.match(p.name)),
        key=lambda p: int(ROW_FILE.match(p.name).group(1)),
    )
    if not found:
        raise ConfigError(f"--rows-dir {rows_dir}: no row files named <k>_<name>.yaml")
    if not select:
        return found
    by_key = {
        **{p.stem.split("_", 1)[1]: p for p in found},
        **{p.stem: p for p in found},
        **{ROW_FILE.match(p.name).group(1): p for p in found},
    }
    missing = [s for s in select if s not in by_key]
    if missing:
        raise ConfigError(
            f"--rows {' '.join(missing)}: no such row; give a number, a name or a file stem: "
            f"{', '.join(p.stem.split('_', 1)[1] for p in found)} (or 1..{len(found)})"
        )
    return [by_key[s] for s in select]


def plan(
    base: Path, rows: list[Path], seeds: list[int], out: Path, overrides: list[str], steps: int | None = None
) -> tuple[Run, list[Run]]:
    """The base-model evaluation run and one run per (seed, row), seed-major so early seeds finish first."""
    extra = list(overrides) + ([f"train.total_steps={steps}"] if steps is not None else [])
    runs = []
    for seed in seeds:
        for row in rows:
            cfg = load_config(
                [base, row],
                extra
                + [
                    f"run.dir={out / row.stem}",
                    f"run.name=seed{seed}",
                    f"train.seed={seed}",
                    f"data.seed={seed}",
                    f"rollout.seed={seed}",
                    "eval.before_train=false",
                    "run.progress=false",
                    "run.resume=true",
                ],
            )
            runs.append(Run(row.stem, seed, cfg))
    # the initial model is the same for every row and seed: evaluate it once, as step 0 of every curve
    base_cfg = load_config(
        [base],
        extra
        + [
            f"run.dir={out}",
            "run.name=base_model",
            "train.total_steps=0",
            "eval.before_train=true",
            "run.progress=false",
            "algo.kl_coef=0",
        ],
    )
    return Run("base_model", 0, base_cfg), runs


def is_done(run: Run) -> bool:
    done = run.dir / "done.json"
    return done.exists() and json.loads(done.read_text()).get("config") == dump_yaml(run.cfg)


def conflicts(run: Run) -> bool:
    """Whether ``run.dir`` holds a run of another config. Only the length may differ (a longer study
    continues each run from its checkpoint); anything else would resume, and report, a run of
    another setting (e.g. a row whose definition changed)."""
    path = run.dir / "ablation_config.yaml"
    if not path.exists():
        return False
    import yaml

    old, new = yaml.safe_load(path.read_text()), yaml.safe_load(dump_yaml(run.cfg))
    for cfg in (old, new):
        cfg.get("train", {}).pop("total_steps", None)
    return old != new


def execute(run: Run, threads: int) -> float:
    """Train (or resume) one run in a child process with ``threads`` torch threads; returns its wall time."""
    run.dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run.dir / "ablation_config.yaml"
    cfg_path.write_text(dump_yaml(run.cfg))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    with open(run.dir / "train.log", "a") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "dapo.training", str(cfg_path)], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"run {run.dir} failed (exit {proc.returncode}); see {run.dir / 'train.log'}")
    prev = (
        json.loads((run.dir / "done.json").read_text()).get("wall_s", 0.0) if (run.dir / "done.json").exists() else 0.0
    )
    (run.dir / "done.json").write_text(json.dumps({"config": dump_yaml(run.cfg), "wall_s": prev + wall}))
    return wall


def run_all(base_run: Run, runs: list[Run], jobs: int, threads: int = 0, log=print) -> float:
    """Every unfinished run, ``jobs`` at a time; returns the wall time of this call."""
    threads = threads or max(1, usable_cpus() // max(1, jobs))
    todo = [r for r in [base_run, *runs] if not is_done(r)]
    stale = [str(r.dir) for r in todo if conflicts(r)]
    if stale:
        raise ConfigError(
            f"{len(stale)} run directories hold runs of another config (e.g. {stale[0]}); "
            "give a new --out or delete them"
        )
    skipped = len(runs) + 1 - len(todo)
    log(f"{len(todo)} runs to do ({skipped} already finished), {jobs} at a time with {threads} thread(s) each")
    t0 = time.perf_counter()

    def one(run: Run) -> None:
        log(f"start  {run.row}/seed{run.seed}" if run is not base_run else "start  base-model evaluation")
        wall = execute(run, threads)
        log(f"done   {run.dir}  ({wall:.0f} s)")

    if base_run in todo:  # step 0 of every curve; cheap, and the rows need the same evaluation
        one(base_run)
        todo.remove(base_run)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for fut in [pool.submit(one, r) for r in todo]:
            fut.result()
    return time.perf_counter() - t0


# ---- the report --------------------------------------------------------------------------------


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean and the 95% Student-t interval over seeds (a single seed has no interval: nan)."""
    n = len(values)
    if n == 0:
        return (math.nan, math.nan, math.nan)
    m = sum(values) / n
    if n == 1:
        return (m, math.nan, math.nan)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    df = n - 1
    t = _T975.get(df) or _T975[max(k for k in _T975 if k <= df)]
    half = t * sd / math.sqrt(n)
    return (m, m - half, m + half)


def _eval_key(rows: list[dict]) -> str | None:
    return next(iter(held_out_keys(rows)), None)


def collect(out: Path, runs: list[Run]) -> dict:
    """Per row: per seed metrics rows of finished runs (base-model evaluation prepended as step 0)."""
    base_rows = read_metrics(out / "base_model")
    data: dict[str, dict[int, list[dict]]] = {}
    for run in runs:
        rows = read_metrics(run.dir) if is_done(run) else []  # a partial run would cut every curve short
        if rows:
            data.setdefault(run.row, {})[run.seed] = [r for r in base_rows if r.get("step") == 0][-1:] + rows
    return data


def summarize(data: dict, runs: list[Run]) -> list[dict]:
    summary = []
    for row in dict.fromkeys(r.row for r in runs):
        seeds = data.get(row, {})
        finished = {r.seed: seeds[r.seed] for r in runs if r.row == row and r.seed in seeds and is_done(r)}
        key = _eval_key([r for rows in finished.values() for r in rows])
        # per seed, the held-out accuracy at every evaluation after step 0
        curves = [[r[key] for r in rows if key in r and r["step"] > 0] for rows in finished.values()] if key else []
        curves = [c for c in curves if c]
        accs = [c[-1] for c in curves]
        # one evaluation is noisy (a few points between neighbouring evaluations on 800 samples);
        # the mean of the last three is the steadier reading of where a row ends, and the mean of
        # all of them rewards getting there sooner (the area under the accuracy curve)
        last3 = [sum(c[-3:]) / len(c[-3:]) for c in curves]
        area = [sum(c) / len(c) for c in curves]
        train_rows = {s: [r for r in rows if r["step"] > 0] for s, rows in finished.items()}

        def last(metric: str, k: int = 5) -> float:  # mean of the last k steps, then over seeds
            vals = []
            for rows in train_rows.values():
                tail = [r[metric] for r in rows if metric in r][-k:]
                if tail:
                    vals.append(sum(tail) / len(tail))
            return sum(vals) / len(vals) if vals else math.nan

        def total_of(metric: str) -> float:
            vals = [sum(r.get(metric, 0.0) for r in rows) for rows in train_rows.values()]
            return sum(vals) / len(vals) if vals else math.nan

        label, paper = ROW_LABELS.get(row, (row, None))
        m, lo, hi = mean_ci(accs)
        m3, lo3, hi3 = mean_ci(last3)
        summary.append(
            {
                "row": row,
                "label": label,
                "paper_aime_avg32": paper,
                "seeds": sorted(finished),
                "metric": key,
                "acc_per_seed": accs,
                "acc_mean": m,
                "acc_ci95": [lo, hi],
                "acc_last3_per_seed": last3,
                "acc_last3_mean": m3,
                "acc_last3_ci95": [lo3, hi3],
                "acc_all_evals_mean": _mean(area),
                "entropy_last5": last("actor/entropy"),
                "response_length_last5": last("rollout/response_length_mean"),
                "truncated_frac_last5": last("rollout/truncated_frac"),
                "samples_generated": total_of("sampling/samples_generated"),
                "gen_rounds": total_of("sampling/gen_rounds"),
                "wall_s": _mean(
                    [
                        json.loads((r.dir / "done.json").read_text())["wall_s"]
                        for r in runs
                        if r.row == row and (r.dir / "done.json").exists()
                    ]
                ),
            }
        )
    return summary


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _fmt(x: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{scale * x:{spec}}{unit}"


def _pct(x: float | None) -> str:
    return _fmt(x, ".1f", 100.0)


def report_table(summary: list[dict], base_acc: float | None) -> str:
    metric = next((s["metric"] for s in summary if s["metric"]), "eval avg@n")
    lines = [
        f"| row | held-out {metric.split('/', 1)[-1] if metric else 'accuracy'} (%) | 95% interval | "
        "last 3 evaluations (%) | 95% interval | all evaluations (%) | seeds | "
        "paper (AIME 2024 avg@32) | entropy (last 5 steps) | response length | truncated | samples "
        "generated | wall s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if base_acc is not None:
        lines.append(f"| base model (step 0) | {_pct(base_acc)} | | | | | | | | | | | |")

    def ci(bounds):
        lo, hi = bounds
        return "n/a" if math.isnan(lo) else f"[{_pct(lo)}, {_pct(hi)}]"

    for s in summary:
        lines.append(
            f"| {s['label']} | {_pct(s['acc_mean'])} | {ci(s['acc_ci95'])} | {_pct(s['acc_last3_mean'])} | "
            f"{ci(s['acc_last3_ci95'])} | {_pct(s['acc_all_evals_mean'])} | {len(s['seeds'])} | "
            f"{s['paper_aime_avg32'] if s['paper_aime_avg32'] is not None else '-'} | "
            f"{_fmt(s['entropy_last5'], '.3f')} | "
            f"{_fmt(s['response_length_last5'], '.1f')} | {_fmt(s['truncated_frac_last5'], '.1f', 100.0, '%')} | "
            f"{_fmt(s['samples_generated'], ',.0f')} | {_fmt(s['wall_s'], '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def write_report(out: Path, runs: list[Run], *, command: str = "", wall_s: float | None = None) -> Path:
    from dapo.reporting.plots import plot_ablation

    out = Path(out)
    data = collect(out, runs)
    summary = summarize(data, runs)
    base_rows = read_metrics(out / "base_model")
    key = _eval_key(base_rows)
    base_acc = base_rows[0][key] if key else None
    labels = {s["row"]: s["label"] for s in summary}
    figures = plot_ablation(data, labels, out / "figures")
    text = ["# Ablation report", ""]
    if command:
        text += [f"Command: `{command}`", ""]
    if wall_s is not None:
        text += [f"Wall time of this invocation: {wall_s / 60:.1f} min", ""]
    text += [
        "Held-out accuracy is the final evaluation of each run; mean over seeds with a 95% Student-t",
        'interval over seeds (seed-to-seed spread, not sampling error). "Last 3 evaluations" averages',
        'each run\'s last three evaluations first (steadier than one); "all evaluations" averages every',
        "evaluation after step 0 (higher when a row gets there sooner). Entropy, response length and",
        "truncated share are means over the last 5 training steps; samples generated is the total per run",
        "(dynamic sampling generates more per step).",
        "",
        report_table(summary, base_acc),
        "## Figures",
        "",
    ]
    text += [f"![{p.stem}](figures/{p.name})" for p in figures]
    (out / "report.md").write_text("\n".join(text) + "\n")
    (out / "report.json").write_text(
        json.dumps({"base_model_acc": base_acc, "rows": summary, "wall_s": wall_s, "command": command}, indent=2)
    )
    return out / "report.md"


# ---- command line ------------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every run, e.g. train.lr=1e-4")
    p.add_argument("--base", default="configs/ablation/base.yaml", help="the preset that holds the scale")
    p.add_argument("--rows-dir", default=None, help="where the row files are (default: the project's configs/ablation)")
    p.add_argument(
        "--rows",
        nargs="*",
        default=None,
        help="rows to run, by number (1), name (grpo) or file stem (1_grpo) (default: all)",
    )
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per row; every seed is one run per row")
    p.add_argument("--steps", type=int, default=None, help="override train.total_steps (default: the preset's)")
    p.add_argument("--out", default="runs/ablation", help="study directory")
    p.add_argument("--jobs", type=int, default=0, help="runs in parallel (default: one per CPU core, 1 on a GPU)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (default: CPU cores / jobs)")
    p.add_argument("--report-only", action="store_true", help="only rebuild report.md and figures from the runs")


def main_args(args) -> int:
    base = resolve_preset(args.base)
    rows_dir = Path(args.rows_dir) if args.rows_dir else PRESET_DIR / "ablation"
    rows = find_rows(rows_dir, args.rows)
    if args.seeds < 1:
        raise ConfigError(f"--seeds {args.seeds}: give at least 1")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: give at least 1")
    out = Path(args.out)
    base_run, runs = plan(base, rows, list(range(args.seeds)), out, args.overrides, args.steps)
    argv = getattr(args, "argv", None)
    if argv is None:
        argv = sys.argv[2:] if sys.argv[1:2] == ["ablate"] else sys.argv[1:]
    command = "dapo ablate " + " ".join(argv)
    wall = None
    if not args.report_only:
        jobs = args.jobs
        if jobs <= 0:
            import torch

            jobs = 1 if torch.cuda.is_available() else usable_cpus()
        wall = run_all(base_run, runs, jobs, args.threads)
    report = write_report(out, runs, command=command, wall_s=wall)
    print(report.read_text())
    print(f"report: {report}  figures: {out / 'figures'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dapo.ablate", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    args.argv = argv
    return main_args(args)


if __name__ == "__main__":
    sys.exit(main())
