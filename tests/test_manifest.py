"""Checkpoints verified before they are trusted: every checkpoint ends with a manifest of its files (size,
CRC-32); a damaged one (truncated, zeroed, missing or extra files, in the weights, the trainer state with its
AdamW state, or a sharded checkpoint's shards) is named in one line, passed over on resume (moved aside, not
deleted) or refused, and refused by `dapo export` and `dapo eval --run`; one written before manifests resumes
with a line saying it was not verified."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import small_config  # noqa: E402
from dapo import checkpoint, cli  # noqa: E402
from dapo.checkpoint import files as checkpoint_files  # noqa: E402
from dapo.runtime.files import CheckpointError  # noqa: E402
from test_checkpoint import sharded_checkpoint  # noqa: E402

RUN = ["train.total_steps=2", "run.save_every=1"]


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A 2-step one-process run with a checkpoint at each step, and a sharded checkpoint with its manifest."""
    from dapo.training import train

    root = tmp_path_factory.mktemp("manifest")
    train(small_config(root, tiny_model_dir, *RUN))
    sharded = sharded_checkpoint(tiny_model_dir, root / "sharded" / "step_000001")
    checkpoint_files.write_manifest(sharded)
    return root / "t", sharded


def damage(path: Path, how: str) -> None:
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "zeroed":  # same size, a block of zeros (a sparse copy, a lost write)
        data = bytearray(path.read_bytes())
        data[len(data) // 3 : len(data) // 3 + 4096] = bytes(min(4096, len(data) - len(data) // 3))
        path.write_bytes(bytes(data))
    elif how == "missing":
        path.unlink()
    elif how == "extra":
        (path.parent / ("extra_" + path.name)).write_bytes(b"not written by the run")


TARGETS = {  # what is damaged: the file, relative to the checkpoint
    "model weights": "model/model.safetensors",
    "trainer and optimizer state": "trainer_state.pt",
    "shard": "shards/__0_0.distcp",
    "manifest": checkpoint_files.MANIFEST,
}
WHAT = {
    "truncated": r"is \d+ bytes, the manifest says \d+",
    "zeroed": r"has CRC-32 [0-9a-f]{8}, the manifest says [0-9a-f]{8} \(same size",
    "missing": r"is missing \(\d+ bytes in the manifest\)",
    "extra": r"is not in the manifest",
}


@pytest.mark.parametrize("how", list(WHAT))
@pytest.mark.parametrize("target", list(TARGETS))
def test_each_kind_of_damage_is_named_with_the_file(trained, tmp_path, target, how):
    run_dir, sharded = trained
    source = sharded if target == "shard" else run_dir / "checkpoints" / "step_000002"
    step = tmp_path / source.name
    shutil.copytree(source, step)
    assert checkpoint_files.verify(step) is None
    damage(step / TARGETS[target], how)
    if (target, how) == ("manifest", "missing"):  # as a checkpoint written before manifests: trusted, unverified
        with pytest.raises(checkpoint_files.Unverified):
            checkpoint_files.verify(step)
        return
    why = checkpoint_files.verify(step)
    print(f"\n{target:28} {how:9} -> {why}")
    if target == "manifest":  # the manifest's own damage
        if how == "extra":
            assert re.fullmatch(r"extra_manifest\.json is not in the manifest", why)
        else:
            assert why == f"{checkpoint_files.MANIFEST} is unreadable (JSONDecodeError)"
        return
    name = (
        TARGETS[target] if how != "extra" else str(Path(TARGETS[target]).parent / f"extra_{Path(TARGETS[target]).name}")
    )
    assert why.startswith(name.removeprefix("./") + " "), why
    assert re.search(WHAT[how], why), why


def test_every_file_is_in_the_manifest_with_its_size(trained):
    run_dir, sharded = trained
    for step in (run_dir / "checkpoints" / "step_000002", sharded):
        listed = json.loads((step / checkpoint_files.MANIFEST).read_text())["files"]
        on_disk = {p.relative_to(step).as_posix(): p.stat().st_size for p in step.rglob("*") if p.is_file()}
        on_disk.pop(checkpoint_files.MANIFEST)
        assert {name: v["bytes"] for name, v in listed.items()} == on_disk


def copy_run(run_dir: Path, root: Path) -> Path:
    shutil.copytree(run_dir, root / "t")
    return root / "t"


def test_resume_passes_over_a_damaged_checkpoint_and_moves_it_aside(trained, tiny_model_dir, tmp_path, capsys):
    from dapo.training import train

    run_dir = copy_run(trained[0], tmp_path)
    damage(run_dir / "checkpoints" / "step_000002" / "model" / "model.safetensors", "truncated")
    capsys.readouterr()
    train(small_config(tmp_path, tiny_model_dir, *RUN))  # resumes from step 1, trains step 2 again
    out = capsys.readouterr().out.replace("\n", "")  # the console wraps long lines
    assert re.search(r"step_000002 is damaged: model/model.safetensors is \d+ bytes, the manifest says \d+", out)
    assert "moved aside to damaged.step_000002, not deleted" in out
    assert "resumed from" in out and "step_000001 (step 1)" in out
    assert (run_dir / "checkpoints" / "damaged.step_000002" / "model" / "model.safetensors").is_file()  # kept
    assert checkpoint_files.verify(run_dir / "checkpoints" / "step_000002") is None  # written again, whole
    # the step trained again from step 1 reaches the weights the undamaged run had
    from safetensors.torch import load_file

    again = load_file(str(run_dir / "checkpoints" / "step_000002" / "model" / "model.safetensors"))
    before = load_file(str(trained[0] / "checkpoints" / "step_000002" / "model" / "model.safetensors"))
    assert all(torch.equal(again[k], before[k]) for k in before)


def test_refusing_a_damaged_checkpoint_stops_in_one_line_and_leaves_it(trained, tiny_model_dir, tmp_path, capsys):
    run_dir = copy_run(trained[0], tmp_path)
    damage(run_dir / "checkpoints" / "step_000002" / "trainer_state.pt", "zeroed")
    args = [f"model.path={tiny_model_dir}", f"run.dir={tmp_path}", "run.name=t", "run.resume_damaged=refuse"]
    from conftest import SMALL_OVERRIDES

    assert cli.main(["train", "configs/demo.yaml", *SMALL_OVERRIDES, *args[:2], *args[3:], *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    print("\n" + err[-1])
    assert err[-1].startswith(f"error: checkpoint {run_dir}/checkpoints/step_000002 is damaged: trainer_state.pt has")
    assert "run.resume_damaged=refuse" in err[-1]
    assert (run_dir / "checkpoints" / "step_000002").is_dir()


def test_a_checkpoint_without_a_manifest_still_resumes_with_a_line(trained, tiny_model_dir, tmp_path, capsys):
    from dapo.training import train

    run_dir = copy_run(trained[0], tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "step_000002")
    (run_dir / "checkpoints" / "step_000001" / checkpoint_files.MANIFEST).unlink()  # as written before manifests
    capsys.readouterr()
    train(small_config(tmp_path, tiny_model_dir, *RUN))
    out = capsys.readouterr().out.replace("\n", "")  # the console wraps long lines
    assert "step_000001 has no manifest.json (written before checkpoints had one): resumed unverified" in out
    assert "step_000001 (step 1)" in out


def test_export_and_eval_refuse_a_damaged_checkpoint_in_one_line(trained, tmp_path, capsys):
    run_dir = copy_run(trained[0], tmp_path)
    step = run_dir / "checkpoints" / "step_000002"
    damage(step / "model" / "model.safetensors", "zeroed")
    assert cli.main(["export", str(step), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint {step} is damaged: model/model.safetensors has")
    assert not (tmp_path / "out").exists()
    assert cli.main(["eval", "--run", str(run_dir), "eval.num_problems=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is damaged: model/model.safetensors has CRC-32" in err[0], err
    assert f"an earlier checkpoint of the run: {run_dir}/checkpoints/step_000001" in err[0]


def test_check_whole_of_an_unverified_checkpoint_is_a_note(trained, tmp_path):
    step = tmp_path / "step_000002"
    shutil.copytree(trained[0] / "checkpoints" / "step_000002", step)
    (step / checkpoint_files.MANIFEST).unlink()
    assert "not verified" in checkpoint.check_whole(step)
    with pytest.raises(CheckpointError):
        shutil.copytree(trained[0] / "checkpoints" / "step_000001", tmp_path / "b" / "step_000001")
        damage(tmp_path / "b" / "step_000001" / "trainer_state.pt", "missing")
        checkpoint.check_whole(tmp_path / "b" / "step_000001")
