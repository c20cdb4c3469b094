"""run.loggers: the console and TensorBoard switches, and the experiment trackers (W&B offline, MLflow
on SQLite and file stores) read back with their own clients: the config as parameters, every step's
metrics equal to metrics.jsonl, the run's files, resume into the same tracker run, failures that do
not stop training."""

import importlib.util
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from rich.console import Console

from conftest import SMALL_OVERRIDES
from dapo.config import ConfigError, load_config
from dapo.reporting import trackers
from dapo.reporting.run_log import read_metrics
from dapo.reporting.trackers import flat_params, mlflow_metric_name

REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("mlflow") is None:  # looked up, not imported: every worker collects this file
    pytest.skip("mlflow is not installed", allow_module_level=True)


def small_config(run_dir, model_dir, *extra):
    """conftest's small training config, read from the repository whatever the working directory (the
    MLflow tests work in tmp_path: a SQLite store keeps its artefacts in ./mlruns)."""
    return load_config(
        REPO / "configs/demo.yaml", [f"model.path={model_dir}", f"run.dir={run_dir}", *SMALL_OVERRIDES, *extra]
    )


def run_training(cfg, console_text: io.StringIO | None = None) -> dict:
    from dapo.training import train

    console = Console(file=console_text or io.StringIO(), width=400, highlight=False)
    return train(cfg, console=console)


def mlflow_run(run_dir: Path):
    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=state["where"])
    return client, client.get_run(state["run_id"])


def artefacts(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for a in client.list_artifacts(run_id, path):
        out += artefacts(client, run_id, a.path) if a.is_dir else [a.path]
    return out


def assert_history_equals_metrics(client, run_id: str, rows: list[dict]) -> None:
    """Every key of every metrics.jsonl row, at its step, in MLflow: the same value, exactly once."""
    for key in {k for r in rows for k in r if k != "step"}:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, mlflow_metric_name(key)))
        assert history == [(r["step"], r[key]) for r in rows if key in r], key


# ---- names and parameters --------------------------------------------------------------------------
def test_mlflow_metric_names_change_only_what_mlflow_refuses():
    from mlflow.utils.validation import validate_param_and_metric_name

    assert mlflow_metric_name("eval/aime2024/avg@32") == "eval/aime2024/avg_at_32"
    assert mlflow_metric_name("val-core/arith/acc/mean@4") == "val-core/arith/acc/mean_at_4"
    assert mlflow_metric_name("eval/arith/pass@2") == "eval/arith/pass_at_2"
    assert mlflow_metric_name("actor/pg_loss") == "actor/pg_loss"
    assert mlflow_metric_name("perf/time_step_s") == "perf/time_step_s"
    assert mlflow_metric_name("eval/my bench (v2)/avg@4") == "eval/my bench _v2_/avg_at_4"
    for name in ("eval/aime2024/avg@32", "eval/x+y/maj@8", "a#b%c"):
        assert not validate_param_and_metric_name(name)
        assert validate_param_and_metric_name(mlflow_metric_name(name))


def test_flat_params_name_each_setting_as_its_override_and_spell_values_as_yaml():
    cfg = load_config("configs/demo.yaml", ["algo.eps_high=0.28"])
    params = flat_params(
        {
            "algo": {"eps_high": 0.28, "dual_clip": None},
            "train": {"betas": [0.9, 0.999]},
            "run": {"resume": True, "name": "demo", "wandb": {"mode": None}},
        }
    )
    assert params == {
        "algo.eps_high": "0.28",
        "algo.dual_clip": "null",
        "train.betas": "[0.9, 0.999]",
        "run.resume": "true",
        "run.name": "demo",
        "run.wandb.mode": "null",
    }
    from dapo.config import to_dict

    every = flat_params(to_dict(cfg))
    # every value reads back as the dotted override it names
    again = load_config("configs/demo.yaml", [f"{k}={v}" for k, v in every.items()])
    assert to_dict(again) == to_dict(cfg)


# ---- the config ------------------------------------------------------------------------------------
def test_loggers_default_parse_and_refuse_unknown_names():
    assert load_config("configs/demo.yaml").run.loggers == ["console", "tensorboard"]
    cfg = load_config(
        "configs/demo.yaml", ["run.loggers=console,mlflow", "run.wandb.mode=offline", "run.mlflow.experiment=exp"]
    )
    assert cfg.run.loggers == ["console", "mlflow"] and cfg.run.wandb.mode == "offline"
    assert cfg.run.mlflow.experiment == "exp" and cfg.run.mlflow.tracking_uri is None
    assert load_config("configs/demo.yaml", ["run.loggers=[]"]).run.loggers == []
    with pytest.raises(
        ConfigError,
        match=r"^run.loggers=console,neptune: 'neptune' is not one of console, "
        r"tensorboard, wandb, mlflow$",
    ):
        load_config("configs/demo.yaml", ["run.loggers=console,neptune"])
    with pytest.raises(ConfigError, match=r"^run.wandb.mode='cloud': choose online, offline or disabled$"):
        load_config("configs/demo.yaml", ["run.wandb.mode=cloud"])
    with pytest.raises(ConfigError, match=r"run.tensorboard: no longer a setting; .*run.loggers=console"):
        load_config("configs/demo.yaml", ["run.tensorboard=false"])


def test_a_tracker_not_installed_stops_the_cli_in_one_line_before_the_run_directory(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    import importlib.util

    from dapo.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code = main(
        [
            "train",
            "configs/demo.yaml",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path}",
            "run.name=t",
            "run.loggers=console,wandb",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [
        "error: run.loggers=console,wandb: wandb is not installed; pip install 'dapo[wandb]', "
        "or leave wandb out of run.loggers"
    ]
    assert not (tmp_path / "t").exists()


def test_a_tracker_that_cannot_start_stops_the_run_in_one_line(tmp_path, tiny_model_dir, capsys):
    from dapo.cli import main

    code = main(
        [
            "train",
            "configs/demo.yaml",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path}",
            "run.name=t",
            "run.loggers=mlflow",
            "run.mlflow.tracking_uri=nosuchscheme://x",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
        "error: run.loggers: mlflow could not log to nosuchscheme://x; set run.mlflow.tracking_uri"
    )
    assert not (tmp_path / "t").exists()  # a run that fails before its first step leaves nothing


def test_importing_the_training_loop_imports_no_tracker():
    code = "import sys, dapo.training, dapo.reporting.trackers; print(sorted({'wandb', 'mlflow'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert out.stdout.strip() == "[]"


# ---- console and TensorBoard ------------------------------------------------------------------------
def test_without_console_no_step_lines_and_without_tensorboard_no_directory(tmp_path, tiny_model_dir):
    quiet, loud = io.StringIO(), io.StringIO()
    run_training(
        small_config(tmp_path / "a", tiny_model_dir, "run.loggers=tensorboard", "eval.before_train=true"), quiet
    )
    run_training(small_config(tmp_path / "b", tiny_model_dir, "run.loggers=console"), loud)
    a, b = tmp_path / "a" / "t", tmp_path / "b" / "t"
    assert "step 1/2" not in quiet.getvalue() and "held-out at step" not in quiet.getvalue()
    assert "step 1/2 | train acc" in loud.getvalue() and "step 2/2 | train acc" in loud.getvalue()
    assert any((a / "tensorboard").iterdir()) and not (b / "tensorboard").exists()
    assert [r["step"] for r in read_metrics(a)] == [0, 1, 2] and [r["step"] for r in read_metrics(b)] == [1, 2]
    assert not (a / "trackers.json").exists() and not (a / "plots").exists()  # no tracker, nothing for one


def test_the_logger_of_other_ranks_writes_nothing_and_returns_the_row(tmp_path, monkeypatch, capsys):
    from dapo.reporting.run_log import RunLogger

    monkeypatch.chdir(tmp_path)
    logger = RunLogger(None, total_steps=2)
    row = logger.log(1, {"actor/entropy": 0.5, "rollout/response_length_mean": 7})
    assert row == {"step": 1, "actor/entropy": 0.5, "response_length/mean": 7.0, "rollout/response_length_mean": 7.0}
    logger.step_line(1, 2, row)
    logger.info("a line")
    logger.warn("a warning")
    with logger.warnings_of(1):
        warnings.warn("capped", RuntimeWarning, stacklevel=1)
    logger.write_samples(1, [])
    logger.close()
    out = capsys.readouterr()
    assert out.out == out.err == "" and list(tmp_path.iterdir()) == []


# ---- MLflow ------------------------------------------------------------------------------------------
def test_mlflow_sqlite_store_from_the_environment_gets_params_every_step_and_the_files(
    tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # MLflow keeps a SQLite store's artefacts in ./mlruns
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    text = io.StringIO()
    run_training(
        small_config(tmp_path / "runs", tiny_model_dir, "run.loggers=console,mlflow", "eval.before_train=true"), text
    )
    run_dir = tmp_path / "runs" / "t"
    client, run = mlflow_run(run_dir)
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"]["where"] == f"sqlite:///{tmp_path}/mlflow.db"
    assert run.info.status == "FINISHED" and run.info.run_name == "t"
    assert client.get_experiment(run.info.experiment_id).name == "dapo"
    params = run.data.params
    assert params["algo.eps_high"] == "0.28" and params["train.total_steps"] == "2"
    assert params["rollout.backend"] == "hf" and params["run.loggers"] == '["console", "mlflow"]'
    assert params["train.betas"] == "[0.9, 0.999]" and params["rollout.top_k"] == "null"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/arith/avg@2" in rows[0]
    assert_history_equals_metrics(client, run.info.run_id, rows)
    assert run.data.metrics["eval/arith/avg_at_2"] == rows[-1]["eval/arith/avg@2"]
    files = artefacts(client, run.info.run_id)
    assert files == [
        "config.yaml",
        "metrics.jsonl",
        "plots/training.png",
        "samples/step_000000.arith.responses.jsonl",
        "samples/step_000001.md",
        "samples/step_000002.arith.responses.jsonl",
        "samples/step_000002.md",
    ]
    local = Path(client.download_artifacts(run.info.run_id, "metrics.jsonl", str(tmp_path / "down")))
    assert local.read_text() == (run_dir / "metrics.jsonl").read_text()
    assert f"mlflow: run {run.info.run_id} at sqlite:///" in text.getvalue()


def test_mlflow_file_store_and_experiment_from_the_config(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind this switch
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = tmp_path / "store"
    run_training(
        small_config(
            tmp_path / "runs",
            tiny_model_dir,
            "run.loggers=mlflow",
            f"run.mlflow.tracking_uri={store}",
            "run.mlflow.experiment=trackers-test",
        )
    )
    run_dir = tmp_path / "runs" / "t"
    client, run = mlflow_run(run_dir)
    assert client.get_experiment(run.info.experiment_id).name == "trackers-test"
    assert (store / run.info.experiment_id / run.info.run_id).is_dir()  # the file store's own layout
    assert run.data.params["train.prompts_per_step"] == "4"
    assert_history_equals_metrics(client, run.info.run_id, read_metrics(run_dir))
    assert "plots/training.png" in artefacts(client, run.info.run_id)


def test_mlflow_resume_continues_the_same_run_without_logging_a_redone_step_twice(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Steps 1..3 with checkpoints at 2 and 3; step 3's checkpoint is lost (as when a run is killed
    between a step's metrics and its checkpoint), so the resumed run (to step 4) redoes step 3."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    base = ["run.loggers=console,mlflow", "run.save_every=2", "run.keep_checkpoints=3"]
    run_training(small_config(tmp_path / "runs", tiny_model_dir, *base, "train.total_steps=3"))
    run_dir = tmp_path / "runs" / "t"
    _, first = mlflow_run(run_dir)
    first_rows = read_metrics(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")
    text = io.StringIO()
    run_training(small_config(tmp_path / "runs", tiny_model_dir, *base, "train.total_steps=4"), text)
    client, run = mlflow_run(run_dir)
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # one value per step; step 3 is the first attempt's (the run is deterministic: the same, timings aside)
    logged = first_rows[:3] + rows[3:]
    assert_history_equals_metrics(client, run.info.run_id, logged)
    assert rows[2]["reward/score_mean"] == first_rows[2]["reward/score_mean"]
    assert run.data.params["train.total_steps"] == "3"  # a parameter keeps its first value, and the run says so
    assert "train.total_steps=3 (now 4)" in text.getvalue()
    assert "resumed from" in text.getvalue()


def test_a_failing_tracker_warns_once_and_training_goes_on(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    real_log = trackers.MlflowTracker.log

    def flaky(self, step, row):
        if step in (2, 3):
            raise ConnectionError("server unreachable")
        real_log(self, step, row)

    monkeypatch.setattr(trackers.MlflowTracker, "log", flaky)
    text = io.StringIO()
    run_training(
        small_config(tmp_path / "runs", tiny_model_dir, "run.loggers=console,mlflow", "train.total_steps=4"), text
    )
    run_dir = tmp_path / "runs" / "t"
    out = text.getvalue()
    assert out.count("could not log") == 1
    assert "mlflow: could not log step 2 (ConnectionError: server unreachable); training goes on" in " ".join(
        out.split()
    )
    assert "mlflow: logging again from step 4 (steps 2 to 3 are in metrics.jsonl only)" in " ".join(out.split())
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    client, run = mlflow_run(run_dir)
    assert_history_equals_metrics(client, run.info.run_id, [rows[0], rows[3]])
    assert run.info.status == "FINISHED"


def test_a_run_that_fails_is_marked_failed(tmp_path, tiny_model_dir, monkeypatch):
    from dapo import training as train_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    real_step = train_module.train_step

    def failing_step(run, step):
        if step == 2:
            raise RuntimeError("boom")
        return real_step(run, step)

    monkeypatch.setattr(train_module, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        run_training(small_config(tmp_path / "runs", tiny_model_dir, "run.loggers=mlflow"))
    client, run = mlflow_run(tmp_path / "runs" / "t")
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "perf/time_step_s")] == [1]


def test_dapo_eval_of_a_run_logs_its_report_into_the_run(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from dapo.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    run_training(small_config(tmp_path / "runs", tiny_model_dir, "run.loggers=mlflow"))
    run_dir = tmp_path / "runs" / "t"
    assert main(["eval", "--run", str(run_dir), "eval.num_problems=2", "eval.n=2"]) == 0
    client, run = mlflow_run(run_dir)
    report = [f for f in artefacts(client, run.info.run_id) if f.startswith("eval/")]
    assert report == [
        "eval/step_000002/arith.problems.jsonl",
        "eval/step_000002/arith.responses.jsonl",
        "eval/step_000002/eval.json",
        "eval/step_000002/eval.md",
    ]
    local = client.download_artifacts(run.info.run_id, "eval/step_000002/eval.md", str(tmp_path / "down"))
    assert Path(local).read_text() == (run_dir / "eval" / "step_000002" / "eval.md").read_text()
    assert run.info.status == "FINISHED"


def test_only_rank_0_opens_the_trackers(tmp_path, tiny_model_dir, monkeypatch):
    """The loggers each rank of a 2-rank job sets up (``run_setup.setup_loggers``, as under torchrun): rank 1's writes
    nothing and opens no tracker; rank 0's the one MLflow run (logging every step once: the SQLite test above)."""
    import contextlib
    import types

    from dapo import run_setup
    from dapo.runtime import parallel

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store: no database to create
    store = f"run.mlflow.tracking_uri={tmp_path / 'store'}"
    cfg = small_config(tmp_path / "runs", tiny_model_dir, "run.loggers=console,mlflow", store)
    saver = types.SimpleNamespace(writer=types.SimpleNamespace(wait=lambda: None))  # no checkpoint write to wait on
    text, opened = io.StringIO(), []
    for rank in (1, 0):
        with contextlib.ExitStack() as stack:
            if rank == 0:
                cfg.run_dir.mkdir(parents=True)  # the run's start makes it, on rank 0
            d, console = parallel.Dist(rank=rank, world_size=2), Console(file=text, width=400)
            logger = run_setup.setup_loggers(cfg, d, stack, console, start_step=0, saver=saver)
            assert logger.log(1, {"actor/entropy": 0.5})["actor/entropy"] == 0.5
            opened.append(logger.trackers is not None)
            if rank == 1:
                assert list(tmp_path.iterdir()) == [] and text.getvalue() == ""
    assert opened == [False, True]
    client, run = mlflow_run(cfg.run_dir)
    assert len(client.search_runs([run.info.experiment_id])) == 1 and run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "actor/entropy")] == [0.5]


# ---- Weights & Biases, offline -------------------------------------------------------------------------
def wandb_records(path: Path) -> list:
    """The records of an offline run's ``.wandb`` file, as wandb's own protobuf messages. The file is
    a LevelDB-style log (a 7-byte header, then 32 KiB blocks of chunks, each with a 7-byte header:
    CRC32C, length, kind 1 = whole, 2/3/4 = first/middle/last part); wandb 0.31 reads it only in its
    Go core, so the framing is undone here and the records parsed with wandb's Record message."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def finished_wandb_records(path: Path, timeout_s: float = 120.0) -> list:
    """``wandb_records`` once the file holds the run's exit record: wandb's service process writes the file after
    ``finish()`` returns, and on a busy machine its last blocks can come seconds later."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = wandb_records(path)
        except Exception:  # noqa: BLE001 - a chunk half written: read again
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_logged(run_dir: Path, run_id: str) -> tuple[dict, dict[int, dict], set[str]]:
    """(config, {step: history row}, files) of every offline run directory of ``run_id``."""
    config, history, files = {}, {}, set()
    for path in sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        for r in finished_wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                config |= {i.key: json.loads(i.value_json) for i in r.run.config.update}
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                step = row.pop("_step")
                assert step not in history, f"step {step} logged twice"
                history[step] = {k: v for k, v in row.items() if not k.startswith("_")}
            elif kind == "files":
                files |= {f.path for f in r.files.files}
    return config, history, files


def test_wandb_offline_run_under_the_run_directory_and_resumed_into_the_same_run(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "")  # no credentials reach this test
    base = ["run.loggers=console,wandb", "run.wandb.mode=offline", "eval.before_train=true"]
    run_training(small_config(tmp_path / "runs", tiny_model_dir, *base))
    run_dir = tmp_path / "runs" / "t"
    state = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    run_id = state["run_id"]
    first_dirs = list(run_dir.glob(f"wandb/offline-run-*-{run_id}"))
    assert len(first_dirs) == 1 and state["where"] == str(first_dirs[0]) and state["last_step"] == 2
    config, history, files = wandb_logged(run_dir, run_id)
    assert config["algo"]["eps_high"] == 0.28 and config["train"]["total_steps"] == 2
    assert config["run"]["loggers"] == ["console", "wandb"]
    rows = read_metrics(run_dir)
    assert sorted(history) == [0, 1, 2]
    for row in rows:  # the names and values of metrics.jsonl, '@' included
        assert history[row["step"]] == {k: v for k, v in row.items() if k != "step"}
    assert {"metrics.jsonl", "plots/training.png", "samples/step_000001.md", "samples/step_000002.md"} <= files
    saved = first_dirs[0] / "files"
    assert (saved / "metrics.jsonl").read_text() == (run_dir / "metrics.jsonl").read_text()
    assert (saved / "samples" / "step_000002.md").read_text() == (run_dir / "samples" / "step_000002.md").read_text()

    run_training(small_config(tmp_path / "runs", tiny_model_dir, *base, "train.total_steps=4"))
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"]["run_id"] == run_id
    assert len(list(run_dir.glob(f"wandb/offline-run-*-{run_id}"))) == 2  # `wandb sync` uploads both into one run
    config, history, _ = wandb_logged(run_dir, run_id)
    rows = read_metrics(run_dir)
    assert sorted(history) == [0, 1, 2, 3, 4] and [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for row in rows[3:]:
        assert history[row["step"]] == {k: v for k, v in row.items() if k != "step"}
    assert config["train"]["total_steps"] == 4


def test_wandb_disabled_writes_nothing_and_trains(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("wandb")
    # (not WANDB_MODE: W&B reads its variables once per process, at its first run, maybe another test's)
    run_training(small_config(tmp_path / "runs", tiny_model_dir, "run.loggers=wandb", "run.wandb.mode=disabled"))
    run_dir = tmp_path / "runs" / "t"
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert not (run_dir / "wandb").exists()
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"]["where"].startswith("nowhere")
