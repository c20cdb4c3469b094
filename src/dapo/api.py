"""The Python API: ``train`` and ``evaluate`` from a script, with your own data and reward function.

    from dapo import load_config, train, evaluate

    def reward(response: str, ground_truth: str) -> float:   # at the top level of a module or script
        return 1.0 if response.strip().endswith(ground_truth) else -1.0

    if __name__ == "__main__":                                # the reward workers run the script again
        cfg = load_config("demo", ["train.total_steps=5", "run.name=mine"])
        result = train(cfg, reward_fn=reward, train_data=[{"problem": "2 + 2 = ?", "answer": "4"}, ...])
        print(result.run_dir, result.eval_after)
        print(evaluate(result.run_dir, "arith", reward_fn=reward).avg)

A configuration is a ``Config``: ``load_config(preset, overrides)`` reads a preset by name or path with
dotted overrides exactly as ``dapo train`` does, and its fields can be set in Python before ``train``
(which checks a copy, as the command line does). Everything else (run directory, checkpoints,
resume, logs) is what ``dapo train`` does with the same config.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dapo import training
from dapo.checkpoint import latest_checkpoint, removed_if_start_fails
from dapo.config import Config, ConfigError, config_from_dict, load_config, to_dict
from dapo.config.shipped import shipped
from dapo.data.files import DataRead, read_data, rows_read
from dapo.data.train_sets import read_settings
from dapo.evaluation import Benchmark, EvalResult, evaluate_model, load_benchmark, write_report
from dapo.reporting.run_log import read_metrics, run_summary
from dapo.rewards import pool as reward_pool
from dapo.rewards.setup import one_reward_function
from dapo.runtime.files import CheckpointError

RewardFn = Callable[[str, str], "float | tuple[float, bool]"]
# a file, folder, dataset id (or benchmark name), or rows: {"problem": ..., "answer": ...} dicts or a datasets.Dataset
Data = "str | os.PathLike | Sequence[dict] | datasets.Dataset"


@dataclass
class TrainResult:
    """What ``train`` returns: where the run is, and its metrics as ``metrics.jsonl`` holds them."""

    run_dir: Path
    metrics: dict  # the last row: the final step's metrics, with eval/* when it evaluated
    history: list[dict] = field(repr=False)  # every row; step 0 is the evaluation before training
    wall_s: float = 0.0

    @property
    def eval_before(self) -> dict:
        """The held-out figures before training (eval/<benchmark>/avg@n, its interval, pass@k, maj@n)."""
        return _eval_of([r for r in self.history if r.get("step") == 0])

    @property
    def eval_after(self) -> dict:
        """The held-out figures of the last evaluation."""
        return _eval_of([r for r in self.history if r.get("step", 0) > 0])

    def summary(self) -> str:
        """The lines ``dapo train`` ends with: held-out accuracy before and after, wall time, files."""
        return "\n".join(run_summary(self.history, wall_s=self.wall_s, run_dir=self.run_dir))


def _eval_of(rows: list[dict]) -> dict:
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    return {k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {}


def train(
    cfg: Config,
    *,
    reward_fn: RewardFn | None = None,
    train_data: Data | None = None,
    eval_data: Data | None = None,
    tool_env=None,
) -> TrainResult:
    """Train (or resume) the run ``cfg`` describes; returns its run directory and metrics.

    reward_fn: grades every response instead of reward.grader: ``(response, ground_truth) -> score``
        (a float, counted correct when > 0) or ``(score, correct)``; the score is the reward, before
        the overlong penalty. It runs in the reward worker processes under reward.timeout_s, like the
        built-in graders: a call that runs out of time or crashes scores algo.wrong_reward (counted in
        reward/timeouts and reward/worker_crashes). Define it at the top level of a module, or of your
        script with the training code under ``if __name__ == "__main__":`` (the workers run the
        script again to find it). cfg.reward.function names one by module and name instead (not both).
    train_data: instead of data.train_files / the built-in task: a file, folder or Hugging Face dataset id (what
        ``dapo train`` reads, in any of its layouts), a list of dicts such as ``{"problem": ..., "answer": ...}``,
        or a ``datasets.Dataset``.
    eval_data: instead of eval.benchmarks: one benchmark name, file, dataset id, list of such dicts or Dataset.
    tool_env: your own tool, for multi-turn rollouts (``dapo.tools.Environment``): an object with ``stop``, the
        texts after which a turn ends, and ``step(response_so_far)``, which returns the text to append (its
        tokens are context, never trained on), ``dapo.tools.DONE`` to end the response, or None to let the model
        write on. It gets the Python tool's token handling and limits (tools.max_turns, max_calls, output_chars,
        timeout_s per step; docs/tools.md). It runs in this process, in threads: a step past tools.timeout_s is
        answered with a time-out and left to finish.

    A run given lists or a reward function resumes when ``train`` is called again with the same ones
    (config.yaml records the config only).
    """
    _not_in_a_reward_worker("train")
    cfg = _checked(cfg)
    one_reward_function(cfg, reward_fn)
    if reward_fn is not None:
        reward_pool.pickle_reward_fn(reward_pool.REWARD_FN, reward_fn)  # a lambda fails here, before any work
    inputs = training.RunInputs(reward_fn=reward_fn, tool_env=tool_env)
    if train_data is not None:
        inputs.train_examples = _examples(train_data, "train_data", cfg)
    if eval_data is not None:
        inputs.eval_sets = [_benchmark(eval_data, cfg)]
    t0 = time.perf_counter()
    with removed_if_start_fails(cfg.run_dir), _no_progress_bars():
        training.train(cfg, inputs=inputs)
    rows = read_metrics(cfg.run_dir)
    return TrainResult(cfg.run_dir, rows[-1] if rows else {}, rows, time.perf_counter() - t0)


def evaluate(
    model: str | os.PathLike,
    data: Data,
    *,
    cfg: Config | None = None,
    reward_fn: RewardFn | None = None,
    out_dir: str | os.PathLike | None = None,
) -> EvalResult:
    """Evaluate a model on one benchmark; returns its ``EvalResult`` (``avg`` = avg@n, ``ci``, ``pass_at``,
    ``maj``, ``per_problem``; ``metrics()`` as training logs them).

    model: a Hugging Face model directory, a Hugging Face Hub model id (at cfg.model.revision), a run directory
        (its latest checkpoint) or a checkpoint.
    data: a benchmark name (``aime2024``, ``arith``, ...), a data file, folder or Hugging Face dataset id, a list of
        ``{"problem": ..., "answer": ...}`` dicts, or a ``datasets.Dataset``.
    cfg: the sampling and grading settings (eval.n, eval.temperature, reward.grader, ...); default: the
        run's config.yaml for a run or checkpoint, else the defaults.
    reward_fn: as for ``train`` (it replaces the reward.function of a run's config.yaml). out_dir: also write
        eval.json, eval.md and the per-problem rows there.
    """
    _not_in_a_reward_worker("evaluate")
    model_dir, saved = _model_to_evaluate(model)
    if cfg is None and saved is not None and reward_fn is not None:  # the caller's reward_fn replaces the run's
        cfg = load_config(saved, ["reward.function=null"])
    cfg = _checked(cfg) if cfg is not None else load_config(saved) if saved is not None else Config()
    if reward_fn is not None:
        reward_pool.pickle_reward_fn(reward_pool.REWARD_FN, reward_fn)
    with _no_progress_bars():
        (result,) = evaluate_model(model_dir, [_benchmark(data, cfg)], cfg, reward_fn=reward_fn)
    if out_dir is not None:
        write_report([result], Path(out_dir))
    return result


def _checked(cfg) -> Config:
    """A checked copy of ``cfg``: each field read back as ``load_config`` reads a preset, so a wrong type
    or value raises ConfigError naming the key."""
    if not isinstance(cfg, Config):
        raise TypeError(
            f"cfg: expected a dapo.Config, got {type(cfg).__name__}; "
            "read a preset with dapo.load_config('demo', ['train.total_steps=5'])"
        )
    return config_from_dict(to_dict(cfg))


def _examples(data, name: str, cfg: Config, split: str = "train") -> DataRead:
    """How ``data`` (a file, folder or dataset id; a list of rows or a ``datasets.Dataset``) reads under data.*."""
    if isinstance(data, (str, os.PathLike)):
        return read_data(data, split=split, **read_settings(cfg.data))
    return rows_read(data, name=name, **read_settings(cfg.data))


def _benchmark(data, cfg: Config) -> tuple[Benchmark, list]:
    """(Benchmark, examples): a registered name, a file or a dataset id as ``dapo eval`` reads them, or rows (a
    list or a ``datasets.Dataset``), sampled as a data file is (eval.* where set, else n=4, temperature 1, top-p 1)."""
    e = cfg.eval
    if isinstance(data, (str, os.PathLike)):
        return load_benchmark(str(data), num_problems=e.num_problems, **read_settings(cfg.data))
    read = _examples(data, "eval_data", cfg, split="test")
    bench = Benchmark("eval_data", None, n=4, top_p=1.0, max_response_tokens=None, read=read)
    return bench, read.examples[: e.num_problems]


def _model_to_evaluate(model) -> tuple[Path, Path | None]:
    """(model directory, the run's config.yaml when there is one) for a model directory, a hub model id (left for
    the loader to fetch), a checkpoint (runs/NAME/checkpoints/step_N) or a run directory (its latest checkpoint)."""
    from dapo.model.directory import is_hub_id

    path = shipped(model)
    if (path / "config.json").is_file() or (not path.exists() and is_hub_id(model)):
        return path, None
    ckpt = path if (path / "trainer_state.pt").exists() else latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(
            f"model={str(model)!r}: not a Hugging Face model directory (config.json), a "
            "checkpoint or a run directory with checkpoints; give one of these"
        )
    if not (ckpt / "model").is_dir():
        raise CheckpointError(f"{ckpt} is sharded; run `dapo export {ckpt} OUT_DIR` and evaluate OUT_DIR")
    saved = ckpt / "config.yaml"
    return ckpt / "model", saved if saved.is_file() else None


@contextlib.contextmanager
def _no_progress_bars():
    """Without transformers' per-file load and save bars, as under `dapo train` (they would drown the
    step lines); the caller's setting is back afterwards."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _not_in_a_reward_worker(what: str) -> None:
    if reward_pool.IN_WORKER:
        raise RuntimeError(
            f"dapo.{what}() was called while a reward worker ran your script to find its reward_fn; "
            "put the script's training code under if __name__ == '__main__':"
        )


__all__ = ["ConfigError", "RewardFn", "TrainResult", "evaluate", "train"]
