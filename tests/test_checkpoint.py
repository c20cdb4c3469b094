"""Checkpoints and model directories from elsewhere are data, never code: a crafted
torch.distributed.checkpoint index or shard entry is refused before anything in it runs, `dapo
export` copies no symlinked file, a model directory's own Python files run only when
model.trust_remote_code says so, and a fresh start never writes into an earlier run."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo import checkpoint, cli, parallel


class RunsCommand:
    """Pickles as a call to os.system: what a crafted checkpoint file would hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def sharded_checkpoint(tiny_model_dir: Path, step_dir: Path) -> Path:
    """A real sharded checkpoint of the tiny model, written by one process (what `dapo export` reads)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    parallel.save_shards({"model": model.state_dict()}, step_dir / "shards")
    shutil.copytree(tiny_model_dir, step_dir / "model_meta", ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save({"step": 1}, step_dir / "trainer_state.pt")
    return step_dir


def test_export_refuses_a_metadata_file_that_runs_code(tiny_model_dir, tmp_path, capsys):
    marker = tmp_path / "pwned"
    step = sharded_checkpoint(tiny_model_dir, tmp_path / "step_000001")
    (step / "shards" / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    capsys.readouterr()
    assert cli.main(["export", str(step), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert err.count("\n") == 1 and "posix.system" in err and "not checkpoint metadata" in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_export_of_a_genuine_sharded_checkpoint_still_works(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    step = sharded_checkpoint(tiny_model_dir, tmp_path / "step_000001")
    out = checkpoint.export_hf(step, tmp_path / "out")
    exported, original = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)


def test_a_shard_entry_that_runs_code_is_refused(tmp_path):
    """Non-tensor entries (an optimizer's param_groups) are pickles inside the shard files; torch's
    default planner loads them with weights_only=False."""
    marker = tmp_path / "pwned"
    parallel.save_shards({"optim": {"lr": RunsCommand(f"touch {marker}"), "w": torch.ones(2)}}, tmp_path / "shards")
    state = {"optim": {"lr": 0.0, "w": torch.zeros(2)}}
    with pytest.raises(parallel.CheckpointError, match=r"entry 'optim.lr' needs more than plain data"):
        parallel.load_shards(state, tmp_path / "shards")
    assert not marker.exists()


def test_plain_shard_entries_still_load(tmp_path):
    saved = {"optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "foreach": None, "params": ["w"]}]},
             "w": torch.arange(4.0)}
    parallel.save_shards(saved, tmp_path / "shards")
    state = {"optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "foreach": False, "params": []}]},
             "w": torch.zeros(4)}
    parallel.load_shards(state, tmp_path / "shards")
    assert state["optim"] == saved["optim"] and torch.equal(state["w"], saved["w"])


def test_an_index_pointing_outside_the_shards_directory_is_refused(tiny_model_dir, tmp_path):
    step = sharded_checkpoint(tiny_model_dir, tmp_path / "step_000001")
    index = step / "shards" / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.pt"
    index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(parallel.CheckpointError, match=r"points an entry at '../../secret.pt', outside the shards"):
        checkpoint.export_hf(step, tmp_path / "out")


def test_export_refuses_a_link_to_a_file_outside_the_checkpoint(tiny_model_dir, tmp_path, capsys):
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    step = tmp_path / "step_000002"
    shutil.copytree(tiny_model_dir, step / "model")
    torch.save({"step": 2}, step / "trainer_state.pt")
    (step / "model" / "chat_template.jinja").symlink_to(secret)
    assert cli.main(["export", str(step), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"chat_template.jinja is a symbolic link (to {secret})" in err
    exported = [p for p in (tmp_path / "out").rglob("*") if p.is_file()] if (tmp_path / "out").exists() else []
    assert not any("PRIVATE KEY" in p.read_text(errors="replace") for p in exported)


def test_export_refuses_a_linked_directory_in_a_sharded_checkpoint(tiny_model_dir, tmp_path):
    step = sharded_checkpoint(tiny_model_dir, tmp_path / "step_000001")
    elsewhere = tmp_path / "elsewhere"
    (step / "model_meta").rename(elsewhere)
    (step / "model_meta").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(parallel.CheckpointError, match=r"model_meta is a symbolic link"):
        checkpoint.export_hf(step, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- a run directory is never reused by a fresh start ------------------------------------------------
def earlier_run(run_dir: Path) -> None:
    """What a finished 2-step run leaves: two metrics lines and its newest checkpoint."""
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    torch.save({"step": 2}, run_dir / "checkpoints" / "step_000002" / "trainer_state.pt")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')


def test_fresh_start_in_an_earlier_run_refuses_and_keeps_it(tiny_model_dir, tmp_path, capsys):
    from conftest import SMALL_OVERRIDES

    run_dir = tmp_path / "t"
    earlier_run(run_dir)
    code = cli.main(["train", "configs/demo.yaml", f"model.path={tiny_model_dir}", f"run.dir={tmp_path}",
                     *SMALL_OVERRIDES, "run.resume=false", "run.keep_checkpoints=1", "train.total_steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "holds an earlier run" in err and "give a new run.name, or set run.overwrite=true" in err
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == ["step_000002"]


def test_overwrite_moves_the_earlier_run_aside_whole(tiny_model_dir, tmp_path):
    from conftest import small_config

    from dapo.log import read_metrics
    from dapo.train import train

    run_dir = tmp_path / "t"
    earlier_run(run_dir)
    train(small_config(tmp_path, tiny_model_dir, "run.resume=false", "run.overwrite=true", "run.keep_checkpoints=1",
                       "train.total_steps=1"))
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("t.")]
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert [p.name for p in checkpoint.list_checkpoints(aside)] == ["step_000002"]
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == ["step_000001"]


def test_resume_and_fresh_starts_in_new_directories_are_untouched(tmp_path):
    earlier_run(tmp_path / "t")
    checkpoint.prepare_run_dir(tmp_path / "t", resume=True, overwrite=False)  # continuing is what resume means
    checkpoint.prepare_run_dir(tmp_path / "new", resume=False, overwrite=False)
    assert (tmp_path / "new").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["new", "t"]


# ---- Python files shipped in a model directory ------------------------------------------------------
def remote_code_model_dir(tiny_model_dir: Path, root: Path, marker: Path) -> Path:
    """The tiny model with a config.json that names its own configuration code, which leaves a marker."""
    model_dir = root / "remote-model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="not_in_transformers",
                  auto_map={"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"})
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "configuration_x.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PretrainedConfig\nclass XConfig(PretrainedConfig):\n    model_type = 'not_in_transformers'\n")
    return model_dir


def load_answering_yes(model_dir: Path, **kwargs) -> subprocess.CompletedProcess:
    """Load the directory in a fresh process whose stdin answers 'y' to any question."""
    code = ("import sys; from dapo.models import load_model_and_tokenizer\n"
            f"load_model_and_tokenizer({str(model_dir)!r}, **{kwargs!r})")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    return subprocess.run([sys.executable, "-c", code], input="y\n" * 10, capture_output=True, text=True,
                          env=env, timeout=300)


def test_a_model_directorys_own_code_never_runs_by_default(tiny_model_dir, tmp_path):
    """Left unset, transformers asks on the terminal whether to run the directory's code, and a 'y'
    (here piped in) runs it; dapo says no up front."""
    marker = tmp_path / "ran"
    out = load_answering_yes(remote_code_model_dir(tiny_model_dir, tmp_path, marker))
    assert out.returncode != 0 and not marker.exists()
    assert "trust_remote_code=True" in out.stderr


def test_trust_remote_code_is_a_setting(tiny_model_dir, tmp_path):
    from conftest import small_config

    marker = tmp_path / "ran"
    model_dir = remote_code_model_dir(tiny_model_dir, tmp_path, marker)
    assert small_config(tmp_path, model_dir).model.trust_remote_code is False
    assert small_config(tmp_path, model_dir, "model.trust_remote_code=true").model.trust_remote_code
    load_answering_yes(model_dir, trust_remote_code=True)  # fails later (no modeling_x.py): the code did run
    assert marker.exists()
