"""What a newcomer meets first: the console (library messages in train.log), one-line errors that leave
nothing behind, --help with its defaults, launch-ray's checks before it waits, files others can read."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import SMALL_OVERRIDES
from dapo import ablate, checkpoint, cli
from dapo.checkpoint import weights as checkpoint_weights
from dapo.cluster import Placement, check_fits
from dapo.config import ConfigError, load_config
from dapo.runtime.libraries import close_library_logging, setup_library_logging

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def library_logging():
    yield setup_library_logging
    close_library_logging()


# ---- library logging -------------------------------------------------------------------------------
def test_library_info_goes_to_the_run_log_and_warnings_also_to_the_console(
    tmp_path, capsys, library_logging, monkeypatch
):
    monkeypatch.setenv("DAPO_VERBOSE", "0")  # and restored after: --verbose sets it
    path = library_logging(tmp_path, "warning")
    assert path == tmp_path / "train.log"
    log = logging.getLogger("vllm.engine.x")
    log.info("kv cache sized")
    log.warning("the GPU ran out of memory")
    log.warning("Chat template warmup failed")  # provoked on purpose by skip_tokenizer_init: file only
    logging.getLogger("transformers.modeling_utils").info("loading weights")
    logging.getLogger("torch.distributed.c10d").info("rendezvous done")
    err = capsys.readouterr().err
    assert err.splitlines() == ["WARNING (vllm.engine.x): the GPU ran out of memory"]
    text = path.read_text()
    for message in (
        "kv cache sized",
        "the GPU ran out of memory",
        "Chat template warmup failed",
        "loading weights",
        "rendezvous done",
    ):
        assert message in text


def test_verbose_and_log_level_bring_library_messages_back(tmp_path, capsys, library_logging, monkeypatch):
    monkeypatch.setenv("DAPO_VERBOSE", "0")  # and restored after: --verbose sets it
    library_logging(tmp_path, "info")
    logging.getLogger("ray.x").info("node started")
    assert "node started" in capsys.readouterr().err
    monkeypatch.setenv("DAPO_VERBOSE", "1")
    library_logging(tmp_path, "warning")
    logging.getLogger("vllm.x").warning("Chat template warmup failed")
    logging.getLogger("vllm.x").info("kv cache sized")
    err = capsys.readouterr().err
    assert "Chat template warmup failed" in err and "kv cache sized" in err


def test_a_library_that_prints_through_its_own_handler_is_routed_too(tmp_path, capsys, library_logging, monkeypatch):
    monkeypatch.setenv("DAPO_VERBOSE", "0")  # and restored after: --verbose sets it
    own = logging.getLogger("vllm")  # as vLLM configures itself when VLLM_CONFIGURE_LOGGING=1
    own.addHandler(logging.StreamHandler(sys.stdout))
    own.propagate = False
    library_logging(tmp_path, "warning")
    own.info("quiet")
    out = capsys.readouterr()
    assert "quiet" not in out.out + out.err and "quiet" in (tmp_path / "train.log").read_text()
    assert own.propagate and not own.handlers


def test_a_console_sent_to_train_log_gets_each_warning_once(tmp_path):
    """`dapo ablate` sends a run's console to its train.log, where the library log goes too."""
    code = (
        "import logging, sys; from pathlib import Path; from dapo.runtime.libraries import setup_library_logging\n"
        "setup_library_logging(Path(sys.argv[1]), 'warning')\n"
        "logging.getLogger('vllm.x').warning('the GPU ran out of memory')\n"
    )
    with open(tmp_path / "train.log", "a") as log:
        subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            env={**os.environ, "PYTHONPATH": str(REPO / "src"), "DAPO_VERBOSE": "0"},
        )
    assert (tmp_path / "train.log").read_text().count("the GPU ran out of memory") == 1


def test_log_level_is_checked():
    with pytest.raises(ConfigError, match=r"run.log_level='loud': choose debug, info, warning or error"):
        load_config("configs/demo.yaml", ["run.log_level=loud"])


# ---- errors in one line, nothing left behind ------------------------------------------------------
def test_a_missing_model_is_one_line_exit_2_and_leaves_no_run_directory(tmp_path, capsys):
    runs = tmp_path / "runs"
    code = cli.main(
        ["train", "configs/demo.yaml", f"model.path={tmp_path / 'nope'}", f"run.dir={runs}", *SMALL_OVERRIDES]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: model.path="), err
    assert not runs.exists()


def test_a_failed_start_keeps_an_earlier_runs_directory(tmp_path, capsys):
    run_dir = tmp_path / "t"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    code = cli.main(
        ["train", "configs/demo.yaml", f"model.path={tmp_path / 'nope'}", f"run.dir={tmp_path}", *SMALL_OVERRIDES]
    )
    assert code == 2 and capsys.readouterr().err.count("\n") == 1
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_a_damaged_sharded_checkpoint_is_one_line(tiny_model_dir, tmp_path, capsys):
    # a whole sharded checkpoint resumes in one process (tests/test_elastic.py); one without its shards' index
    # says so, and what to do, in one line
    step = tmp_path / "t" / "checkpoints" / "step_000001"
    (step / "shards").mkdir(parents=True)
    torch.save({"step": 1}, step / "trainer_state.pt")
    code = cli.main(
        ["train", "configs/demo.yaml", f"model.path={tiny_model_dir}", f"run.dir={tmp_path}", *SMALL_OVERRIDES]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "shards/.metadata" in err and "the checkpoint is incomplete or damaged: delete its step directory" in err
    assert (step / "trainer_state.pt").exists()  # the earlier run is untouched


def test_verbose_adds_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DAPO_VERBOSE", "0")  # and restored after: --verbose sets it
    code = cli.main(
        [
            "train",
            "configs/demo.yaml",
            f"model.path={tmp_path / 'nope'}",
            f"run.dir={tmp_path / 'r'}",
            *SMALL_OVERRIDES,
            "--verbose",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" in err and err.splitlines()[-1].startswith("error: model.path=")


def test_errors_of_the_package_are_one_line_and_faults_of_libraries_are_not():
    from dapo.config import DataConfig
    from dapo.data.train_sets import load_train_examples

    with pytest.raises(ValueError) as ours:
        load_train_examples(DataConfig(task="chess"))  # built in code, past the config's own check
    assert cli.user_error(ours.value) == f"error: {ours.value}"
    with pytest.raises(ValueError) as theirs:
        int("x")
    assert cli.user_error(theirs.value) is None
    assert cli.user_error(FileNotFoundError("a\n  b")) == "error: a b"
    assert cli.user_error(KeyError("k")) is None


# ---- --help ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command, expected",
    [
        (
            "ablate",
            [
                "(default: 5)",
                "(default: runs/ablation)",
                "(default: configs/ablation/base.yaml)",
                "8 rows x 5 seeds",
                "about 30 minutes",
                "name (grpo)",
            ],
        ),
        ("launch-ray", ["(default: auto)", "(default: 1)", "--address local", "1 for CPU workers"]),
        ("import-model", ["(default: float32)"]),
        ("train", ["--verbose", "runs/"]),
        ("demo", ["--verbose", "minutes"]),
        ("export", ["--trust-remote-code", "--verbose"]),
    ],
)
def test_help_says_the_defaults(command, expected, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for piece in expected:
        assert piece in text, (piece, text)


def test_rows_by_short_name_number_or_file_stem():
    rows_dir = REPO / "configs" / "ablation"
    assert ablate.find_rows(rows_dir, ["grpo"]) == [rows_dir / "1_grpo.yaml"]
    assert ablate.find_rows(rows_dir, ["3", "3_clip_higher", "no_kl"]) == [
        rows_dir / "3_clip_higher.yaml",
        rows_dir / "3_clip_higher.yaml",
        rows_dir / "7_no_kl.yaml",
    ]
    with pytest.raises(ConfigError, match=r"--rows dapo: no such row; .*grpo, overlong_filtering"):
        ablate.find_rows(rows_dir, ["dapo"])


# ---- launch-ray ------------------------------------------------------------------------------------
def test_a_placement_larger_than_the_cluster_says_what_to_change():
    two_cores = [{"CPU": 2.0}]
    check_fits(Placement(nodes=1, workers_per_node=2, gpus_per_worker=0.0, cpus_per_worker=1.0), two_cores)
    with pytest.raises(
        ConfigError,
        match=r"2 worker\(s\) x 4 CPUs = 8 CPUs, the Ray cluster has 2 .*"
        r"lower --cpus-per-worker \(to 1 or less\), or give the private cluster "
        r"more slots with --num-cpus",
    ):
        check_fits(
            Placement(nodes=1, workers_per_node=2, gpus_per_worker=0.0, cpus_per_worker=4.0), two_cores, local=True
        )
    with pytest.raises(ConfigError, match=r"8 GPUs, the Ray cluster has 0 .*--cpu-workers-per-node"):
        check_fits(Placement(nodes=1, workers_per_node=8, gpus_per_worker=1.0, cpus_per_worker=1.0), [{"CPU": 64.0}])
    with pytest.raises(ConfigError, match=r"add nodes"):  # 3 CPUs, but on no single node
        check_fits(
            Placement(nodes=1, workers_per_node=1, gpus_per_worker=0.0, cpus_per_worker=3.0),
            [{"CPU": 2.0}, {"CPU": 2.0}],
        )


# ---- file modes ------------------------------------------------------------------------------------
@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


def test_checkpoints_and_exports_follow_the_umask(tiny_model_dir, tmp_path, umask_022):
    from dapo.model.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    step = checkpoint.save_checkpoint(
        tmp_path / "run", 1, model=model, tokenizer=tokenizer, trainer_state={}, config_yaml="{}\n", keep=1
    )
    assert _mode(step) == 0o755 and _mode(step / "model") == 0o755
    assert _mode(step / "model" / "model.safetensors") == 0o644
    assert {_mode(p) for p in step.rglob("*") if p.is_file()} == {0o644}
    out = checkpoint_weights.export_hf(step, tmp_path / "exported")
    assert _mode(out) == 0o755 and _mode(out / "model.safetensors") == 0o644
    # into a directory of the user's: what was written follows the umask, the rest keeps its mode
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    mine.chmod(0o700)
    (mine / "secret.txt").write_text("x")
    (mine / "secret.txt").chmod(0o600)
    checkpoint_weights.export_hf(step, mine)
    assert _mode(mine) == 0o700 and _mode(mine / "secret.txt") == 0o600
    assert _mode(mine / "model.safetensors") == 0o644


def test_help_of_a_command_with_settings_shows_the_first_settings_defaults_and_the_reference(capsys):
    from dapo.config import Config

    defaults = Config()
    for command in ("train", "demo", "launch-ray", "ablate"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([command, "--help"])
        out = capsys.readouterr().out
        assert f"  train.lr={defaults.train.lr!r} " in out and "train.lr=1e-06 " in out, command
        assert "  algo.eps_high=0.28 " in out and "  run.dir=runs " in out
        assert "  rollout.backend=hf" in out and "generation engine: hf, vllm, auto" in out
        assert "  eval.benchmarks=[arith] " in out and "  eval.every_steps=null " in out
        text = " ".join(out.split())
        assert 'docs/reference/config.md ("Configuration reference" in the manual)' in text
        assert text.endswith(
            "Sections: model, model.lora, data, rollout, reward, algo, teacher, train, eval, tools, run, run.wandb, "
            "run.mlflow"
        )
        assert "schema.py" not in out
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["export", "--help"])
    assert "docs/reference/config.md" not in capsys.readouterr().out


def test_the_help_reads_its_defaults_from_the_config_tree(monkeypatch):
    from dapo.config import Config, summary

    def other_defaults():
        cfg = Config()
        cfg.train.lr = 3e-5
        return cfg

    monkeypatch.setattr(summary, "Config", other_defaults)
    assert "  train.lr=3e-05 " in summary.settings_summary()


# ---- the command's frame: --version, a misspelt command, eval's own help ---------------------------------------------


def test_version_prints_the_version_and_the_commit_of_the_checkout(capsys):
    import dapo

    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"dapo {dapo.__version__} (commit {head.stdout.strip()})\n"


@pytest.mark.parametrize(
    "typed, meant",
    [("trian", "did you mean train? "), ("evl", "did you mean eval? "), ("exprot", "did you mean export? ")],
)
def test_a_misspelt_command_is_told_the_nearest_one(typed, meant, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main([typed, "configs/demo.yaml"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"dapo: error: unknown command {typed!r}; {meant}the commands are train, demo, export, import-model, "
        "tool-run, launch-ray, eval, ablate (dapo --help)"
    )
    assert cli.misspelt_command(["zzzz"]) == (
        "unknown command 'zzzz'; the commands are train, demo, export, import-model, tool-run, launch-ray, eval, "
        "ablate (dapo --help)"
    )
    assert cli.misspelt_command(["train", "x"]) is None and cli.misspelt_command(["--version"]) is None


def test_eval_help_shows_evaluations_own_settings_with_the_defaults_it_runs_with(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["eval", "--help"])
    out = capsys.readouterr().out
    settings = out.split("the settings dapo eval reads")[1]
    # without --run or a preset, dapo eval runs AIME 2024 with the benchmark's own sampling (n=32 etc.)
    assert "  eval.benchmarks=[aime2024] " in settings and "  eval.n=null " in settings
    assert "  reward.grader=auto " in settings and "  data.overlong_prompts=drop " in settings
    assert "  eval.seed=1234 " in settings and "  rollout.backend=hf " in settings
    # the training settings are not evaluation's
    assert "train.lr" not in out and "algo.eps_high" not in out and "eval.benchmarks=[arith]" not in out


def test_eval_refuses_model_and_run_together_in_one_line(tmp_path, capsys):
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    assert cli.main(["eval", "--model", str(tmp_path / "m"), "--run", str(run)]) == 2
    assert capsys.readouterr().err == (
        "error: dapo eval: give --model DIR or --run RUN_DIR, not both (--run evaluates the run's latest checkpoint "
        "with the run's config)\n"
    )


def test_a_warning_keeps_its_line_whole_when_the_console_is_not_a_terminal(tmp_path):
    import io

    from rich.console import Console

    from dapo.reporting.run_log import RunLogger

    sink = io.StringIO()
    logger = RunLogger(
        tmp_path / "run", total_steps=4, tensorboard=False, progress=False, console=Console(file=sink, width=40)
    )
    text = "warning (step 3): dynamic sampling hit algo.max_gen_rounds=2 with 1/4 prompts kept; raise it"
    logger.warn(text)
    assert text + "\n" in sink.getvalue() and len(text) > 40


def test_a_row_cut_off_mid_write_is_left_out_when_read_and_dropped_on_resume(tmp_path):
    """A reader polling a running run, or a run killed while writing a row, meets a last line cut short: not a row
    yet. Reading leaves it out (it raised before), and resuming drops it with the rows past the checkpoint. A whole
    row without its newline (a file written by hand) is read."""
    import json

    from dapo.reporting.run_log import RunLogger, read_metrics

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "eval/arith/avg@1": 0.25}, {"step": 1, "x": 1.5}, {"step": 2, "x": 2.5}]
    full = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(full + '{"step": 3, "x": 0.74999')
    assert read_metrics(run) == rows
    RunLogger(run, total_steps=4, start_step=1, tensorboard=False, progress=False)
    assert (run / "metrics.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in rows[:2])
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "samples"]  # no temporary file left
    (run / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]))  # by hand, no last newline
    assert read_metrics(run) == rows[:2]


def test_the_generation_line_gives_no_ratio_when_nothing_was_trained():
    from dapo.reporting.run_log import _generation_line

    row = {"sampling/tokens_generated": 1536.0, "sampling/dropped_gen_s": 3.0, "perf/time_generate_s": 4.0}
    none = _generation_line([{**row, "sampling/tokens_trained": 0.0}] * 2)
    assert (
        none == "generation: 3,072 tokens generated, none trained; 6 s of 8 s generating went to dropped groups (75%)"
    )
    some = _generation_line([{**row, "sampling/tokens_trained": 512.0}])
    assert some.startswith("generation: 3.00 tokens generated per token trained; 3 s of 4 s")
