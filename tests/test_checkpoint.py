"""Checkpoints and model directories from elsewhere are data, never code: a crafted
torch.distributed.checkpoint index or shard entry is refused before anything in it runs, `dapo
export` copies no symlinked file, a model directory's own Python files run only when
model.trust_remote_code says so, and a fresh start never writes into an earlier run."""

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import make_policy, small_config
from dapo import checkpoint, cli
from dapo.checkpoint import files as checkpoint_files
from dapo.checkpoint import save as checkpoint_save
from dapo.checkpoint import shards as checkpoint_shards
from dapo.checkpoint import weights as checkpoint_weights
from dapo.checkpoint import writer as checkpoint_writer
from dapo.runtime.files import CheckpointError


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
    checkpoint_shards.save_shards({"model": model.state_dict()}, step_dir / "shards")
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
    out = checkpoint_weights.export_hf(step, tmp_path / "out")
    exported, original = load_file(out / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)


def test_a_shard_entry_that_runs_code_is_refused(tmp_path):
    """Non-tensor entries (an optimizer's param_groups) are pickles inside the shard files; torch's
    default planner loads them with weights_only=False."""
    marker = tmp_path / "pwned"
    hostile = {"optim": {"lr": RunsCommand(f"touch {marker}"), "w": torch.ones(2)}}
    checkpoint_shards.save_shards(hostile, tmp_path / "shards")
    state = {"optim": {"lr": 0.0, "w": torch.zeros(2)}}
    with pytest.raises(CheckpointError, match=r"entry 'optim.lr' needs more than plain data"):
        checkpoint_shards.load_shards(state, tmp_path / "shards")
    assert not marker.exists()


def test_plain_shard_entries_still_load(tmp_path):
    saved = {
        "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "foreach": None, "params": ["w"]}]},
        "w": torch.arange(4.0),
    }
    checkpoint_shards.save_shards(saved, tmp_path / "shards")
    state = {
        "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "foreach": False, "params": []}]},
        "w": torch.zeros(4),
    }
    checkpoint_shards.load_shards(state, tmp_path / "shards")
    assert state["optim"] == saved["optim"] and torch.equal(state["w"], saved["w"])


def test_an_index_pointing_outside_the_shards_directory_is_refused(tiny_model_dir, tmp_path):
    step = sharded_checkpoint(tiny_model_dir, tmp_path / "step_000001")
    index = step / "shards" / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.pt"
    index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"points an entry at '../../secret.pt', outside the shards"):
        checkpoint_weights.export_hf(step, tmp_path / "out")


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
    with pytest.raises(CheckpointError, match=r"model_meta is a symbolic link"):
        checkpoint_weights.export_hf(step, tmp_path / "out")
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
    code = cli.main(
        [
            "train",
            "configs/demo.yaml",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path}",
            *SMALL_OVERRIDES,
            "run.resume=false",
            "run.keep_checkpoints=1",
            "train.total_steps=1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "holds an earlier run" in err and "give a new run.name, or set run.overwrite=true" in err
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert [p.name for p in checkpoint_files.list_checkpoints(run_dir)] == ["step_000002"]


def test_overwrite_moves_the_earlier_run_aside_whole(tiny_model_dir, tmp_path):
    from conftest import small_config
    from dapo.reporting.run_log import read_metrics
    from dapo.training import train

    run_dir = tmp_path / "t"
    earlier_run(run_dir)
    train(
        small_config(
            tmp_path,
            tiny_model_dir,
            "run.resume=false",
            "run.overwrite=true",
            "run.keep_checkpoints=1",
            "train.total_steps=1",
        )
    )
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("t.")]
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert [p.name for p in checkpoint_files.list_checkpoints(aside)] == ["step_000002"]
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    assert [p.name for p in checkpoint_files.list_checkpoints(run_dir)] == ["step_000001"]


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
    config.update(
        model_type="not_in_transformers",
        auto_map={"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"},
    )
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "configuration_x.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PretrainedConfig\nclass XConfig(PretrainedConfig):\n    model_type "
        "= 'not_in_transformers'\n"
    )
    return model_dir


def load_answering_yes(model_dir: Path, **kwargs) -> subprocess.CompletedProcess:
    """Load the directory in a fresh process whose stdin answers 'y' to any question."""
    code = (
        "import sys; from dapo.model.loading import load_model_and_tokenizer\n"
        f"load_model_and_tokenizer({str(model_dir)!r}, **{kwargs!r})"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    return subprocess.run(
        [sys.executable, "-c", code], input="y\n" * 10, capture_output=True, text=True, env=env, timeout=300
    )


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


# ---- asynchronous checkpoints -------------------------------------------------------------------
def trained_policy(tiny_model_dir, tmp_path, dtype="bfloat16"):
    """A policy after one AdamW step (so the optimizer has state; bf16: float32 masters too)."""
    policy = make_policy(small_config(tmp_path, tiny_model_dir, f"model.dtype={dtype}"))
    for p in policy.master or policy.model.parameters():
        p.grad = torch.randn_like(p)
    policy.optimizer.step()
    policy._sync_from_master()
    return policy


def save(policy, run_dir, step, writer=None, **state):
    return checkpoint.save_checkpoint(
        run_dir,
        step,
        model=policy.model,
        tokenizer=policy.tokenizer,
        trainer_state={"policy": policy.trainer_state(), **state},
        config_yaml="run: {}\n",
        keep=2,
        writer=writer,
    )


def files_of(step_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(step_dir)): p.read_bytes() for p in sorted(step_dir.rglob("*")) if p.is_file()}


def assert_same_state(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y)
    else:
        assert a == b


def test_async_and_sync_checkpoints_are_the_same_files(tiny_model_dir, tmp_path):
    policy = trained_policy(tiny_model_dir, tmp_path)
    state = {"sampler": {"epoch": 1, "pos": 5}, "buffer": [{"ids": torch.arange(4), "rewards": [1.0, -1.0]}]}
    rng = random.getstate(), torch.get_rng_state()
    sync = save(policy, tmp_path / "sync", 1, **state)  # no writer: written before the call returns
    random.setstate(rng[0]), torch.set_rng_state(rng[1])  # the RNG state is saved too: the same for both
    writer = checkpoint_writer.CheckpointWriter(asynchronous=True)
    for step in (1, 2):  # the second save reuses the first one's buffers
        asynchronous = save(policy, tmp_path / "async", step, writer, **state)
        writer.wait()
        random.setstate(rng[0]), torch.set_rng_state(rng[1])
        a, b = files_of(sync), files_of(asynchronous)
        assert a.keys() == b.keys() and "model/model.safetensors" in a and "model/tokenizer.json" in a
        # the trainer state holds the step, and the manifest its checksum
        assert [
            name for name in a if a[name] != b[name] and name not in ("trainer_state.pt", checkpoint_files.MANIFEST)
        ] == []
        sa, sb = (checkpoint.load_trainer_state(p) for p in (sync, asynchronous))
        assert sb.pop("step") == step and sa.pop("step") == 1
        assert_same_state(sa, sb)  # tensor for tensor: AdamW state, float32 masters, RNG, sampler, buffer
    assert len(sa["policy"]["master_weights"]) > 0 and sa["policy"]["optimizer"]["state"]
    # what the model directory holds loads as the model was: tied embeddings saved once, as save_pretrained does
    restored = make_policy(small_config(tmp_path, tiny_model_dir, "model.dtype=bfloat16"))
    checkpoint_weights.load_model_weights(restored.model, asynchronous)
    assert all(torch.equal(p, q) for p, q in zip(restored.model.parameters(), policy.model.parameters()))


def test_an_async_checkpoint_holds_the_trainer_state_of_the_call(tiny_model_dir, tmp_path, monkeypatch):
    """The loop changes its own state (buffer, RNG) while the write runs; the checkpoint holds it as it
    was when save_checkpoint was called, and is renamed only when whole. The weights and AdamW state
    are written from live memory: the loop waits for the write before it changes them (next test)."""
    policy = trained_policy(tiny_model_dir, tmp_path, dtype="float32")
    release, real_write = threading.Event(), checkpoint_save._write
    monkeypatch.setattr(checkpoint_save, "_write", lambda *args: (release.wait(), real_write(*args)))
    weights = {k: v.clone() for k, v in policy.model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in policy.optimizer.state.values()]
    buffer = [{"ids": torch.arange(4), "logp": [-0.5, -1.5]}]
    rng = torch.get_rng_state()
    writer = checkpoint_writer.CheckpointWriter(asynchronous=True)
    path = save(policy, tmp_path / "run", 1, writer, buffer=buffer)
    buffer[0]["ids"].add_(10)  # the next step: the buffer's contents change, the RNG moves on
    buffer[0]["logp"].append(0.0)
    torch.rand(3)
    assert not path.exists()  # still being written: nothing under the final name
    release.set()
    writer.wait()
    assert checkpoint_files.list_checkpoints(tmp_path / "run") == [path]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp_*"))
    from safetensors.torch import load_file

    saved = load_file(str(path / "model" / "model.safetensors"))
    assert saved.keys() and all(torch.equal(saved[k], weights[k]) for k in saved)
    state = checkpoint.load_trainer_state(path)
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(state["policy"]["optimizer"]["state"].values(), moments))
    assert torch.equal(state["buffer"][0]["ids"], torch.arange(4)) and state["buffer"][0]["logp"] == [-0.5, -1.5]
    assert torch.equal(state["rng"]["torch"], rng)


def test_training_waits_for_an_async_write_before_the_next_update(tiny_model_dir, tmp_path, monkeypatch):
    """A slow background write overlaps the next step's generation; its update must not start before
    the write ends, or the checkpoint would mix two steps' weights. Each checkpoint equals a synchronous run's."""
    from dapo.training import train

    real_write = checkpoint_save._write
    monkeypatch.setattr(checkpoint_save, "_write", lambda *args: (time.sleep(1.0), real_write(*args)))
    runs = {}
    for mode in ("false", "true"):
        cfg = small_config(
            tmp_path / mode,
            tiny_model_dir,
            "train.total_steps=3",
            "run.save_every=1",
            "run.keep_checkpoints=3",
            "eval.before_train=false",
            "eval.benchmarks=[]",
            f"run.async_checkpoint={mode}",
        )
        train(cfg)
        runs[mode] = cfg.run_dir
    from safetensors.torch import load_file

    for step in (1, 2, 3):
        a, b = (runs[m] / "checkpoints" / f"step_{step:06d}" for m in ("false", "true"))
        wa, wb = (load_file(str(p / "model" / "model.safetensors")) for p in (a, b))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), step
        sa, sb = (checkpoint.load_trainer_state(p) for p in (a, b))
        assert_same_state(sa["policy"], sb["policy"])


def test_a_failed_background_write_is_raised_and_the_previous_checkpoint_kept(tiny_model_dir, tmp_path, monkeypatch):
    policy = trained_policy(tiny_model_dir, tmp_path, dtype="float32")
    run_dir = tmp_path / "run"
    writer = checkpoint_writer.CheckpointWriter(asynchronous=True)
    first = save(policy, run_dir, 1, writer)
    writer.wait()
    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        if ".tmp_step_000002" in str(f):
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_save.torch, "save", disk_full)
    save(policy, run_dir, 2, writer)  # returns: the write fails in the background ...
    with pytest.raises(
        CheckpointError,
        match=r"step_000002 failed \(OSError: .*No space left.*partial "
        r"files were removed and starting the run again resumes from .*step_000001, which is whole",
    ):
        save(policy, run_dir, 3, writer)  # ... and the next save raises it, before writing anything
    assert checkpoint_files.list_checkpoints(run_dir) == [first]  # the previous checkpoint is whole and still there
    assert not (run_dir / "checkpoints" / ".tmp_step_000002").exists()  # the partial one, removed by the failed write
    checkpoint_weights.load_model_weights(make_policy(small_config(tmp_path, tiny_model_dir)).model, first)
    monkeypatch.setattr(checkpoint_save.torch, "save", real_save)
    writer.wait()  # raised once
    third = save(policy, run_dir, 3, writer)
    writer.wait()
    assert checkpoint_files.list_checkpoints(run_dir) == [first, third]
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))  # the partial one removed by the next whole save


def test_training_raises_a_failed_last_checkpoint_write(tiny_model_dir, tmp_path, monkeypatch):
    from dapo.training import train

    real_write = checkpoint_save._write

    def failing(run_dir, tmp, final, *args):
        if final.name == "step_000002":
            raise OSError(5, "Input/output error")
        return real_write(run_dir, tmp, final, *args)

    monkeypatch.setattr(checkpoint_save, "_write", failing)
    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        "train.total_steps=2",
        "run.save_every=1",
        "eval.before_train=false",
        "run.async_checkpoint=true",
    )
    with pytest.raises(CheckpointError, match="step_000002 failed"):
        train(cfg)
    assert [p.name for p in checkpoint_files.list_checkpoints(cfg.run_dir)] == ["step_000001"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_during_a_checkpoint_stops_the_run_in_one_line_and_a_restart_resumes(
    tiny_model_dir, tmp_path, monkeypatch, capsys, asynchronous
):
    """The disk fills while step 2's checkpoint is written (its trainer state half on disk): the run stops
    with one line, the partial directory is gone, step 1's checkpoint is whole and loads, and the same
    command resumes from it. Written in the background, the failure stops the run at the next save."""
    import errno

    from conftest import SMALL_OVERRIDES

    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        if ".tmp_step_000002" in str(f):
            Path(f).write_bytes(b"\0" * 512)  # what fitted before the disk was full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    command = [
        "train",
        "configs/demo.yaml",
        f"model.path={tiny_model_dir}",
        f"run.dir={tmp_path}",
        *SMALL_OVERRIDES,
        "train.total_steps=3",
        "run.save_every=1",
        "run.keep_checkpoints=3",
        f"run.async_checkpoint={str(asynchronous).lower()}",
    ]
    monkeypatch.setattr(checkpoint_save.torch, "save", disk_full)
    monkeypatch.setenv("COLUMNS", "500")  # the console's lines unwrapped
    capsys.readouterr()
    assert cli.main(command) == 2
    out, err = capsys.readouterr()
    run_dir, first = tmp_path / "t", tmp_path / "t" / "checkpoints" / "step_000001"
    errors = [line for line in err.splitlines() if line.strip()]
    with capsys.disabled():
        print(f"\n{'async' if asynchronous else 'sync'} checkpoint, disk full at step 2: {errors}")
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(
        f"error: writing checkpoint {run_dir / 'checkpoints' / 'step_000002'} failed (OSError: "
        f"[Errno {errno.ENOSPC}] No space left on device"
    )
    assert (
        f"its partial files were removed and starting the run again resumes from {first}, which is whole" in errors[0]
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]  # no .tmp_step_000002
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == ([1, 2] if asynchronous else [1])  # asynchronous: step 3 stopped at its save, before logging
    assert checkpoint.load_trainer_state(first)["step"] == 1
    checkpoint_weights.load_model_weights(make_policy(small_config(tmp_path, tiny_model_dir)).model, first)
    monkeypatch.setattr(checkpoint_save.torch, "save", real_save)  # space freed
    assert cli.main(command) == 0
    assert f"resumed from {first} (step 1)" in capsys.readouterr().out
    assert [p.name for p in checkpoint_files.list_checkpoints(run_dir)] == ["step_000001", "step_000002", "step_000003"]


def test_a_collection_state_in_the_earlier_flat_layout_is_read_onto_the_same_values():
    from dapo.collect.base import CollectionState

    order, held = {"seed": 0, "shuffle": True, "epoch": 1, "position": 5, "num_examples": 9}, [{"group_size": 4}]
    flat = {"sampler": order, "gen_rounds": 7, "keep_rate": 0.5, "buffer": held, "step": 3, "rng": {}}
    state = CollectionState.from_trainer_state(flat)
    assert (state.prompt_order, state.gen_rounds, state.keep_rate, state.held_over, state.ahead) == (
        order,
        7,
        0.5,
        held,
        None,
    )
    saved = {CollectionState.KEY: state.to_state(), "step": 3}
    assert CollectionState.from_trainer_state(saved) == state and "ahead" not in saved[CollectionState.KEY]
