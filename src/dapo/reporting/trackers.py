"""Experiment trackers, Weights & Biases and MLflow: the rows of metrics.jsonl, the resolved config and
the run's files, sent where a team follows its runs (``run.loggers``).

Each tracker's package is imported only when ``run.loggers`` names it (``pip install 'dapo[wandb]'``,
``'dapo[mlflow]'``), and only rank 0 opens one. What each receives:

  parameters  the resolved config (config.yaml): W&B as its nested config, MLflow as one parameter per
              setting (``algo.eps_high`` = ``0.28``, values spelled as in YAML: null, true, [0.9, 0.999])
  metrics     every row of metrics.jsonl at its step under the same names; MLflow refuses ``@``
              (``avg@32``) and a few other characters: ``mlflow_metric_name`` says how they are spelled there
  files       at the end of the run config.yaml, metrics.jsonl, plots/training.png and samples/; ``dapo
              eval --run`` adds its report (eval.md, eval.json, per-problem rows) under eval/step_NNNNNN/

A run resumed from a checkpoint continues the same tracker runs: ``<run>/trackers.json`` keeps each
tracker's run id and the last step it logged, so the steps the resumed run does again (those after
the checkpoint, logged before the interruption) are not logged twice. A tracker that fails during
the run (network, server) does not stop training: its first failure is reported in one line,
metrics.jsonl keeps every step, and it is tried again at each step (a line says when it logs again).
A tracker that cannot start (not installed, not logged in, no such server) stops the run at start.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from dapo.config import Config, ConfigError, MlflowConfig, WandbConfig, to_dict
from dapo.reporting.run_log import read_metrics
from dapo.runtime.libraries import route_library_logger

STATE_FILE = "trackers.json"
# logger name -> (the module it imports, the pip extra that installs it)
PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
# what the end of a run sends, relative to the run directory (files or folders; missing ones are skipped)
RUN_FILES = ("config.yaml", "metrics.jsonl", "plots", "samples")

# MLflow (on Linux and macOS) takes letters, digits, _ - . / : and space in a metric name
_MLFLOW_REFUSED = re.compile(r"[^\w\-./: ]")
_MLFLOW_MAX_PARAM = 6000  # characters of a parameter value MLflow stores


class TrackerError(RuntimeError):
    """A tracker named in run.loggers could not start; the message says what to change."""


def mlflow_metric_name(key: str) -> str:
    """A metrics.jsonl name as MLflow stores it: ``@`` becomes ``_at_`` (``eval/aime2024/avg@32`` ->
    ``eval/aime2024/avg_at_32``, as verl spells it for MLflow) and any other character MLflow refuses
    becomes ``_``; every other name is unchanged."""
    return _MLFLOW_REFUSED.sub("_", key.replace("@", "_at_"))


def check_installed(loggers: list[str]) -> None:
    """Stop before anything is built when a tracker in run.loggers is not installed."""
    for name in loggers:
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name][0]) is None:
            raise ConfigError(
                f"run.loggers={','.join(loggers)}: {name} is not installed; "
                f"pip install 'dapo[{PACKAGES[name][1]}]', or leave {name} out of run.loggers"
            )


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """``{"algo": {"eps_high": 0.28}}`` -> ``{"algo.eps_high": "0.28"}``: each setting as its dotted
    override names it, its value as YAML spells it (null, true, [0.9, 0.999])."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flat_params(value, f"{prefix}{key}.")
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            out[f"{prefix}{key}"] = text if len(text) <= _MLFLOW_MAX_PARAM else text[: _MLFLOW_MAX_PARAM - 3] + "..."
    return out


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def _files(base: Path, names, under: str = "") -> list[tuple[Path, str]]:
    """(file, its name in the tracker) for the files under ``names`` (files or folders relative to
    ``base``, folders walked, missing ones skipped), named by their path from ``base``, in ``under``."""
    out = []
    for name in names:
        path = base / name
        found = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
        out += [(p, str(Path(under) / p.relative_to(base))) for p in found]
    return out


class WandbTracker:
    name = "wandb"

    def __init__(self, settings: WandbConfig, run_dir: Path, *, run_name: str, config: dict | None, run_id: str | None):
        import wandb

        # W&B's own records go to its debug.log under <run>/wandb/; in train.log they would repeat
        logging.getLogger("wandb").propagate = False
        try:
            self.run = wandb.init(
                project=settings.project or os.environ.get("WANDB_PROJECT") or "dapo",
                entity=settings.entity,
                name=settings.name or run_name,
                mode=settings.mode,  # None: WANDB_MODE, else online
                dir=str(run_dir),
                id=run_id,
                resume="allow" if run_id else None,
                config=config,
                reinit="create_new",  # a run of its own even where the process has another (a notebook's)
                settings=wandb.Settings(quiet=True),
            )
        except Exception as err:
            raise TrackerError(
                f"run.loggers: wandb could not start a run ({_first_line(err)}); log in with "
                "`wandb login`, or set run.wandb.mode=offline (files under the run directory, "
                "uploaded later by `wandb sync`), or leave wandb out of run.loggers"
            ) from err
        self.run_id = self.run.id
        # online: the run's page; offline: the folder `wandb sync` takes
        self.where = (
            "nowhere (run.wandb.mode or WANDB_MODE is disabled)"
            if self.run.settings.mode == "disabled"
            else self.run.url or str(Path(self.run.dir).parent)
        )

    def log(self, step: int, row: dict) -> None:
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def log_files(self, files: list[tuple[Path, str]]) -> None:
        # copied into the run's files/ folder, where W&B uploads them from: saved from elsewhere, W&B
        # would link each and print a warning per call
        if self.run.settings.mode == "disabled":  # its folder is a temporary one, outside the run
            return
        for path, name in files:
            if name == "config.yaml":  # W&B keeps the run's config (given to init) in a file of this name
                continue
            target = Path(self.run.dir) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            self.run.save(str(target), base_path=self.run.dir, policy="now")

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)

    def release(self) -> None:
        """Let go of a run reopened to add files (dapo eval)."""
        self.run.finish()


class MlflowTracker:
    name = "mlflow"

    def __init__(
        self,
        settings: MlflowConfig,
        run_dir: Path,
        *,
        run_name: str,
        config: dict | None,
        run_id: str | None,
        warn=print,
    ):
        import mlflow
        from mlflow.entities import Param

        route_library_logger("mlflow")
        route_library_logger("alembic")  # MLflow's SQL stores create their tables with it
        try:
            self.client = mlflow.MlflowClient(tracking_uri=settings.tracking_uri)  # None: MLflow's own resolution
            self.where = settings.tracking_uri or mlflow.get_tracking_uri()
            self.run_id = run_id if run_id and self._exists(run_id) else None
            if self.run_id is None and config is None:  # reopening a run that is not there (dapo eval)
                return
            if self.run_id is None:
                self.run_id = self.client.create_run(
                    self._experiment_id(settings), run_name=run_name, tags={"run_dir": str(run_dir.resolve())}
                ).info.run_id
            elif config is not None:
                self.client.update_run(self.run_id, status="RUNNING")
            if config is not None:
                logged = self.client.get_run(self.run_id).data.params
                params = flat_params(config)
                # a run's parameters cannot change; a resumed run with other settings says which kept their first value
                changed = sorted(k for k in params if k in logged and logged[k] != params[k])
                if changed:
                    warn(
                        f"mlflow: parameters keep the values of the run's first start: "
                        f"{', '.join(f'{k}={logged[k]} (now {params[k]})' for k in changed)}; "
                        "the config.yaml artefact has the current ones"
                    )
                self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items() if k not in logged])
        except Exception as err:
            uri = settings.tracking_uri or mlflow.get_tracking_uri()
            # MLflow 3 explains its file-store switch at the end of a long message: said first here
            switch = (
                "set MLFLOW_ALLOW_FILE_STORE=true to open a file store, or "
                if "MLFLOW_ALLOW_FILE_STORE" in str(err)
                else ""
            )
            raise TrackerError(
                f"run.loggers: mlflow could not log to {uri}; {switch}set run.mlflow.tracking_uri "
                "(or MLFLOW_TRACKING_URI), pip install 'dapo[mlflow]' for SQLite stores, or leave "
                f"mlflow out of run.loggers ({_first_line(err)})"
            ) from err

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def _experiment_id(self, settings: MlflowConfig) -> str:
        from mlflow.exceptions import MlflowException

        name = settings.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "dapo"
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # created meanwhile by another run (the ablation's runs start together)
            return self.client.get_experiment_by_name(name).experiment_id

    def log(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id,
            metrics=[Metric(mlflow_metric_name(k), float(v), now, step) for k, v in row.items() if k != "step"],
        )

    def log_files(self, files: list[tuple[Path, str]]) -> None:
        for path, name in files:
            folder = str(Path(name).parent)
            self.client.log_artifact(self.run_id, str(path), artifact_path=None if folder == "." else folder)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)

    def release(self) -> None:
        """Nothing to let go of: the client holds no run open (the run keeps the status training left)."""


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """The run's trackers behind one ``log``: the logger (log.RunLogger) hands each logged row over."""

    def __init__(self, run_dir: Path, trackers: list, last_step: dict[str, int], *, warn=print, info=print):
        self.run_dir = Path(run_dir)
        self.trackers = trackers
        self.last_step = last_step
        self.warn, self.info = warn, info
        self.failing: dict[str, int] = {}  # tracker -> the first step it failed to log, while it fails
        self._save_state()

    def _save_state(self) -> None:
        if not self.trackers:
            return
        state = {
            t.name: {"run_id": t.run_id, "last_step": self.last_step.get(t.name, -1), "where": t.where}
            for t in self.trackers
        }
        tmp = self.run_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        os.replace(tmp, self.run_dir / STATE_FILE)

    def _attempt(self, tracker, what: str, step: int, fn, *args) -> bool:
        try:
            fn(*args)
        except Exception as err:
            if tracker.name not in self.failing:
                self.failing[tracker.name] = step
                self.warn(
                    f"{tracker.name}: could not log {what} ({_first_line(err)}); training goes on, "
                    f"metrics.jsonl has every step, and {tracker.name} is tried again at each step"
                )
            return False
        if tracker.name in self.failing:
            self.info(
                f"{tracker.name}: logging again from step {step} (steps {self.failing.pop(tracker.name)}"
                f" to {step - 1} are in metrics.jsonl only)"
            )
        return True

    def log(self, step: int, row: dict) -> None:
        logged = False
        for t in self.trackers:
            if step > self.last_step.get(t.name, -1) and self._attempt(t, f"step {step}", step, t.log, step, row):
                self.last_step[t.name] = step
                logged = True
        if logged:
            self._save_state()

    def log_run_files(self, title: str) -> None:
        """At the end of the run: the training plot (plots/training.png, written here), config.yaml,
        metrics.jsonl and samples/."""
        if not self.trackers:
            return
        from dapo.reporting.plots import plot_training

        rows = read_metrics(self.run_dir)
        if rows:
            plot_training(rows, self.run_dir / "plots" / "training.png", title=title)
        files = _files(self.run_dir, RUN_FILES)
        step = max(self.last_step.values(), default=0)
        for t in self.trackers:
            self._attempt(t, "the run's files", step, t.log_files, files)

    def close(self, status: str = "FINISHED") -> None:
        """End each tracker's run: FINISHED, FAILED (an error) or KILLED (Ctrl-C)."""
        for t in self.trackers:
            self._attempt(t, "the end of the run", self.last_step.get(t.name, 0), t.close, status)
        self.trackers = []


def run_status(exc_type) -> str:
    """How a run ended, as the trackers record it, from the exception that ended it (None: none)."""
    return "FINISHED" if exc_type is None else "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"


def read_state(run_dir: Path) -> dict:
    path = Path(run_dir) / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def open_trackers(cfg: Config, *, start_step: int, warn=print, info=print) -> Trackers:
    """The trackers run.loggers names, started: a run resumed from a checkpoint (start_step > 0)
    continues the tracker runs it logged to; a run from step 0 starts new ones."""
    check_installed(cfg.run.loggers)
    run_dir = cfg.run_dir
    state = read_state(run_dir) if start_step > 0 else {}
    config = to_dict(cfg)
    trackers, last_step = [], {}
    try:
        for name in cfg.run.loggers:
            if name not in TRACKERS:
                continue
            before = state.get(name, {})
            kw = {"warn": warn} if name == "mlflow" else {}
            tracker = TRACKERS[name](
                getattr(cfg.run, name), run_dir, run_name=cfg.run.name, config=config, run_id=before.get("run_id"), **kw
            )
            trackers.append(tracker)
            if before.get("run_id") is not None and tracker.run_id == before["run_id"]:
                last_step[name] = before.get("last_step", -1)
            elif before.get("run_id") is not None:
                warn(f"{name}: run {before['run_id']} was not found; logging to a new run {tracker.run_id}")
            info(f"{name}: run {tracker.run_id} at {tracker.where}")
    except BaseException:
        Trackers(run_dir, trackers, last_step).close("FAILED")
        raise
    return Trackers(run_dir, trackers, last_step, warn=warn, info=info)


def log_eval_report(cfg: Config, run_dir: Path, out_dir: Path, *, warn=print) -> list[str]:
    """``dapo eval --run``'s report (every file in out_dir) into the tracker runs of the training run
    (those in run.loggers and in its trackers.json), under its path in the run directory
    (eval/step_NNNNNN/). Returns the trackers that took it; a failure is reported, not raised: the
    report is on disk either way."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    state = read_state(run_dir)
    names = [n for n in cfg.run.loggers if n in TRACKERS and state.get(n, {}).get("run_id")]
    try:
        under = str(out_dir.resolve().relative_to(run_dir.resolve()))
    except ValueError:  # a report written elsewhere (--out) goes where `dapo eval --run` would have put it
        under = f"eval/{out_dir.name}"
    done = []
    for name in names:
        try:
            check_installed([name])
            tracker = TRACKERS[name](
                getattr(cfg.run, name), run_dir, run_name=cfg.run.name, config=None, run_id=state[name]["run_id"]
            )
            if tracker.run_id is None:
                raise TrackerError(f"run {state[name]['run_id']} was not found")
            tracker.log_files(_files(out_dir, sorted(p.name for p in out_dir.iterdir()), under))
            tracker.release()
            done.append(name)
        except Exception as err:
            warn(f"{name}: the report was not logged ({_first_line(err)}); it is in {out_dir}")
    return done
