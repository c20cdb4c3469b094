"""Where metrics go: metrics.jsonl (always), and as run.loggers says the console (progress bar + one
line per step), TensorBoard and the experiment trackers (``trackers``: W&B, MLflow); a few decoded
samples per step in samples/step_NNNNNN.md, and every response of each evaluation in
samples/step_NNNNNN.<benchmark>.responses.jsonl. The libraries' own logging (train.log) is ``dapo.runtime.libraries``'s.

Every row is logged under the project's names and, beside them, under verl's names for the same
quantities (``VERL_NAMES``; the table with the fine print is docs/metrics.md), so a run can be laid
beside a dashboard of the reference recipe.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _float(v) -> float:
    return float(v.item()) if hasattr(v, "item") else float(v)


# verl's metric name -> the project's name for the same quantity (docs/metrics.md says where they differ)
VERL_NAMES: dict[str, str] = {
    "actor/pg_loss": "actor/pg_loss",
    "actor/pg_clipfrac_lower": "actor/clipfrac_dual",
    "actor/ppo_kl": "actor/approx_kl",
    "actor/entropy": "actor/entropy",
    "actor/kl_loss": "actor/kl_loss",
    "actor/grad_norm": "actor/grad_norm",
    "actor/lr": "actor/lr",
    "critic/score/mean": "reward/score_mean",
    "critic/score/max": "reward/score_max",
    "critic/score/min": "reward/score_min",
    "critic/rewards/mean": "reward/score_mean",  # no KL term in the reward: rewards = scores
    "critic/rewards/max": "reward/score_max",
    "critic/rewards/min": "reward/score_min",
    "critic/advantages/mean": "actor/adv_token_mean",
    "critic/advantages/max": "actor/adv_token_max",
    "critic/advantages/min": "actor/adv_token_min",
    "critic/returns/mean": "actor/adv_token_mean",  # GRPO with gamma = lambda = 1: returns = advantages
    "critic/returns/max": "actor/adv_token_max",
    "critic/returns/min": "actor/adv_token_min",
    "response_length/mean": "rollout/response_length_mean",
    "response_length/max": "rollout/response_length_max",
    "response_length/min": "rollout/response_length_min",
    "response_length/clip_ratio": "rollout/response_length_clip_frac",
    "prompt_length/mean": "rollout/prompt_length_mean",
    "prompt_length/max": "rollout/prompt_length_max",
    "prompt_length/min": "rollout/prompt_length_min",
    "prompt_length/clip_ratio": "rollout/prompt_length_clip_frac",
    "train/num_gen_batches": "sampling/gen_rounds",
    "timing_s/gen": "perf/time_generate_s",
    "timing_s/reward": "perf/time_reward_s",
    "timing_s/old_log_prob": "perf/time_old_logprob_s",
    "timing_s/update_actor": "perf/time_update_s",
    "timing_s/testing": "perf/time_eval_s",
    "timing_s/save_checkpoint": "perf/time_checkpoint_s",
    "timing_s/step": "perf/time_step_s",
    "rollout_corr/rollout_is_mean": "rollout/is_weight_mean",
    "rollout_corr/rollout_is_ratio_fraction_high": "rollout/is_truncated_frac",
}
# verl counts a token as clipped when the clipped term won, on either side: the project's two fractions summed
VERL_SUMS: dict[str, tuple[str, ...]] = {"actor/pg_clipfrac": ("actor/clipfrac_high", "actor/clipfrac_low")}
_EVAL_AVG = re.compile(r"^eval/(?P<bench>.+)/avg@(?P<n>\d+)$")


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl (given the run directory or the file); [] before the first."""
    path = Path(run_dir)
    path = path if path.suffix == ".jsonl" else path / "metrics.jsonl"
    return [json.loads(line) for line in complete_lines(path.read_text())] if path.exists() else []


def complete_lines(text: str) -> list[str]:
    """The non-blank lines of a metrics file, less a last line cut short: a row still being written (read while the
    run logs) or cut off by a kill. A cut row is never valid JSON (its closing brace is its last character), and a
    whole one without its newline (a file written by hand) is kept."""
    *lines, last = text.split("\n")
    if last.strip():
        with contextlib.suppress(json.JSONDecodeError):
            json.loads(last)
            lines.append(last)
    return [line for line in lines if line.strip()]


def held_out_keys(rows: dict | list[dict]) -> list[str]:
    """The held-out accuracy keys (``eval/<benchmark>/avg@<n>``) in a row or rows, sorted."""
    rows = [rows] if isinstance(rows, dict) else rows
    return sorted({k for r in rows for k in r if _EVAL_AVG.match(k)})


def with_verl_names(metrics: dict) -> dict:
    """``metrics`` plus each quantity verl logs under another name (the project's names stay)."""
    out = dict(metrics)
    for verl, ours in VERL_NAMES.items():
        if ours in metrics and verl not in out:
            out[verl] = metrics[ours]
    for verl, parts in VERL_SUMS.items():
        if all(p in metrics for p in parts):
            out[verl] = sum(_float(metrics[p]) for p in parts)
    for key, value in metrics.items():
        if found := _EVAL_AVG.match(key):  # mean accuracy over n samples per problem; verl names it by data source
            out[f"val-core/{found['bench']}/acc/mean@{found['n']}"] = value
    return out


def _held_out(row: dict, key: str) -> str:
    ci = f" [{100 * row[key + '_ci_low']:.1f}, {100 * row[key + '_ci_high']:.1f}]" if key + "_ci_low" in row else ""
    ungraded = row.get(key.rpartition("/")[0] + "/ungraded")  # samples grading gave up on: not in the figure
    return f"{100 * row[key]:.1f}%{ci}" + (f" ({ungraded:.0f} ungraded)" if ungraded else "")


def held_out_line(row: dict) -> str:
    """``arith avg@4 45.1% [40.2, 50.0]`` for each held-out benchmark in a logged row."""
    return ", ".join(
        f"{_EVAL_AVG.match(k)['bench']} avg@{_EVAL_AVG.match(k)['n']} {_held_out(row, k)}" for k in held_out_keys(row)
    )


def _generation_line(rows: list[dict]) -> str | None:
    """What the run's generation cost against what it trained on: tokens per trained token, the seconds spent on
    groups dynamic sampling dropped, and what screening dropped (algo.screen_samples)."""
    steps = [r for r in rows if "sampling/tokens_generated" in r]
    if not steps:
        return None
    total = {k: sum(r.get(k, 0.0) for r in steps) for k in _GENERATION_KEYS}
    generated, trained = total["sampling/tokens_generated"], total["sampling/tokens_trained"]
    # nothing trained (every group dropped): a ratio to zero would say nothing
    per = (
        f"{generated / trained:.2f} tokens generated per token trained"
        if trained
        else f"{generated:,.0f} tokens generated, none trained"
    )
    line = (
        f"generation: {per}; "
        f"{total['sampling/dropped_gen_s']:.0f} s of "
        f"{total['perf/time_generate_s']:.0f} s generating went to dropped groups "
        f"({100 * total['sampling/dropped_gen_s'] / max(total['perf/time_generate_s'], 1e-9):.0f}%)"
    )
    if screened := total["sampling/screened"]:
        out = total["sampling/screened_out_all_correct"] + total["sampling/screened_out_all_wrong"]
        saved = total["sampling/screen_saved_tokens"]
        line += (
            f"; screening dropped {out:.0f} of {screened:.0f} prompts after their first responses, saving about "
            f"{saved:.0f} tokens ({100 * saved / max(saved + total['sampling/tokens_generated'], 1):.0f}% of what "
            "complete groups would have cost)"
        )
        if audited := total["sampling/screen_audited"]:
            line += (
                f"; of {audited:.0f} dropped prompts completed to audit, "
                f"{total['sampling/screen_audit_informative']:.0f} would have been informative"
            )
    return line


_GENERATION_KEYS = (
    "sampling/tokens_generated",
    "sampling/tokens_trained",
    "sampling/dropped_gen_s",
    "perf/time_generate_s",
    "sampling/screened",
    "sampling/screened_out_all_correct",
    "sampling/screened_out_all_wrong",
    "sampling/screen_saved_tokens",
    "sampling/screen_audited",
    "sampling/screen_audit_informative",
)


def run_summary(rows: list[dict], *, wall_s: float, run_dir: Path, plot: Path | None = None) -> list[str]:
    """The lines a finished run ends with: held-out accuracy before and after (95% bootstrap interval
    over problems), wall time, where the files are."""
    evals = [r for r in rows if held_out_keys(r)]
    shown = [
        n
        for n in ("metrics.jsonl", "config.yaml", "tensorboard/", "wandb/", "samples/", "checkpoints/")
        if (Path(run_dir) / n).exists()
    ]
    lines = [f"run directory: {run_dir}  ({', '.join(shown)})"]
    if plot is not None:
        lines.append(f"plot: {plot}")
    lines.append(f"wall time: {wall_s:.0f} s")
    if line := _generation_line(rows):
        lines.append(line)
    if not evals:
        lines.append("held-out accuracy: not measured (eval.benchmarks is empty)")
    for key in held_out_keys(evals):
        first, last = [r for r in evals if key in r][0], [r for r in evals if key in r][-1]
        name = f"{_EVAL_AVG.match(key)['bench']} avg@{_EVAL_AVG.match(key)['n']}"
        if first["step"] == 0 and last["step"] > 0:
            lines.append(
                f"held-out accuracy: {name} {_held_out(first, key)} before -> {_held_out(last, key)} "
                f"after step {last['step']}  (95% CI)"
            )
        else:
            lines.append(f"held-out accuracy: {name} {_held_out(last, key)} at step {last['step']}  (95% CI)")
    return lines


class RunLogger:
    # (metric, column label, format, what it is): the step line's columns, explained once per run
    SUMMARY = (
        (
            "rollout/acc_mean",
            "train acc",
            "{:.3f}",
            "share of this step's sampled responses graded right (training prompts, not the held-out set)",
        ),
        (
            "reward/score_mean",
            "reward",
            "{:+.3f}",
            "mean reward of the trained groups (+1/-1 plus the overlong penalty)",
        ),
        ("rollout/response_length_mean", "len", "{:.1f}", "mean response tokens"),
        ("actor/entropy", "ent", "{:.3f}", "mean token entropy"),
        ("actor/clipfrac_high", "clip+", "{:.3f}", "share of tokens clipped at 1 + eps_high"),
        ("sampling/gen_rounds", "rounds", "{:.0f}", "generation rounds dynamic sampling needed"),
        ("perf/time_step_s", "s", "{:.1f}", "seconds for the step"),
    )
    LEGEND = "columns: " + " | ".join(f"{label} = {meaning}" for _, label, _, meaning in SUMMARY)
    # a run with a teacher (teacher.coef > 0) also shows how far the student is from it
    TEACHER_COLUMN = ("teacher/reverse_kl_mean", "rkl", "{:.3f}", "mean per-token reverse KL to the teacher")

    def __init__(
        self,
        run_dir: Path | None,
        *,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        progress: bool = True,
        step_lines: bool = True,
        console: Console | None = None,
    ):
        """``run_dir`` None: a logger that writes nothing, files or console (ranks other than 0 under FSDP: rank 0
        writes the run's files and lines). ``step_lines``: print each step's line and each evaluation (run.loggers'
        console); warnings, errors and the closing summary print either way. ``trackers`` (set after): W&B, MLflow."""
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.console = Console(quiet=True) if run_dir is None else console or Console(highlight=False)
        self.metrics_path = None if run_dir is None else self.run_dir / "metrics.jsonl"
        self.step_lines = step_lines
        self.trackers = None
        self._legend_shown = False
        self._eval_files: dict[int, list[Path]] = {}  # evaluations' responses files not yet named on the console
        if self.run_dir is not None:
            (self.run_dir / "samples").mkdir(parents=True, exist_ok=True)
            self._truncate_after(start_step)
        self.tb = None
        if tensorboard and self.run_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
            except ImportError:
                self.console.print(
                    "[yellow]tensorboard is not installed; metrics go to metrics.jsonl only[/]", soft_wrap=True
                )
        self.progress = None
        if progress and step_lines and self.run_dir is not None and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step)

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint we continue from (all of them when
        starting from scratch, or a restarted run would log its step-0 evaluation twice), and a row a kill cut off.
        The file is replaced whole, so that a reader polling it never sees it half written."""
        if not self.metrics_path.exists():
            return
        lines = complete_lines(self.metrics_path.read_text())
        keep = [line for line in lines if step > 0 and json.loads(line).get("step", 0) <= step]
        partial = self.metrics_path.with_name(self.metrics_path.name + ".tmp")
        partial.write_text("".join(line + "\n" for line in keep))
        os.replace(partial, self.metrics_path)

    def log(self, step: int, metrics: dict) -> dict:
        row = {"step": step, **{k: _float(v) for k, v in sorted(with_verl_names(metrics).items())}}
        if self.metrics_path is None:
            return row
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.trackers is not None:
            self.trackers.log(step, row)
        return row

    def step_line(self, step: int, total: int, row: dict) -> None:
        if not self.step_lines:
            return
        taught = self.TEACHER_COLUMN[0] in row
        if not self._legend_shown:
            _, label, _, meaning = self.TEACHER_COLUMN
            self.console.print(self.LEGEND + (f" | {label} = {meaning}" if taught else ""), style="dim", soft_wrap=True)
            self._legend_shown = True
        parts = [f"step {step}/{total}"]
        for key, label, fmt, _ in self.SUMMARY + ((self.TEACHER_COLUMN,) if taught else ()):
            if key in row:
                parts.append(f"{label} {fmt.format(row[key])}")
        self.console.print(" | ".join(parts), soft_wrap=True)
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def info(self, text: str) -> None:
        self.console.print(text, soft_wrap=True)  # a line as written (a path in it stays whole), as the step lines

    def held_out(self, step: int, row: dict) -> None:
        """An evaluation on the console as it happens (every metric of it is in metrics.jsonl), with
        the files holding its responses."""
        if self.step_lines and held_out_keys(row):
            self.console.print(f"held-out at step {step}: {held_out_line(row)}", soft_wrap=True)
            for path in self._eval_files.pop(step, []):
                self.console.print(f"  responses: {path}", soft_wrap=True, markup=False)

    def write_eval_responses(self, step: int, result) -> Path | None:
        """An evaluation's sampled responses (an ``EvalResult``), one JSON line each, in
        samples/step_NNNNNN.<benchmark>.responses.jsonl; ``held_out`` names the file."""
        if self.run_dir is None:
            return None
        path = write_responses(result, self.run_dir / "samples" / f"step_{step:06d}.{result.name}.responses.jsonl")
        self._eval_files.setdefault(step, []).append(path)
        return path

    def warn(self, text: str) -> None:
        # whole, never wrapped at a width: a warning read in a log file or a pipe keeps its lines as written
        self.console.print(f"[yellow]{escape(text)}[/]", soft_wrap=True)

    @contextlib.contextmanager
    def warnings_of(self, step: int):
        """Python warnings raised inside the block (e.g. dynamic sampling's round cap), printed once
        each with the step they belong to instead of going to stderr unattributed."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            yield
        for w in caught:
            self.warn(f"warning (step {step}): {w.message}")

    def write_samples(self, step: int, records: list[dict]) -> None:
        if self.run_dir is None:
            return
        lines = [f"# step {step}\n"]
        for i, r in enumerate(records):
            lines.append(
                f"## sample {i}  (reward {r['reward']:+.3f}, acc {r['acc']:.0f}, pred {r['pred']!r}, "
                f"ground truth {r['ground_truth']!r}, {r['length']} tokens{', truncated' if r['truncated'] else ''}"
                + (f", sampled by weights version {r['policy_version']}" if "policy_version" in r else "")
                + ")\n"
            )
            lines.append("```text\n" + r["prompt"] + "\n```\n")
            lines.append("```text\n" + r["response"] + "\n```\n")
        (self.run_dir / "samples" / f"step_{step:06d}.md").write_text("\n".join(lines))

    def log_run_files(self, title: str) -> None:
        """The end of the run, for the trackers: its plot and files."""
        if self.trackers is not None:
            self.trackers.log_run_files(title)

    def close(self, status: str = "FINISHED") -> None:
        """``status``: how the run ended, for the trackers (FINISHED, FAILED or KILLED)."""
        if self.progress is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()
        if self.trackers is not None:
            self.trackers.close(status)


def write_responses(result, path: Path) -> Path:
    """Every sampled response of ``result`` (an ``EvalResult``), one JSON line each (id, sample, prompt, response,
    extracted_answer, ground_truth, correct, length_tokens, truncated), in ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in result.responses)
    return path
