"""Writing a checkpoint: atomically, synchronously or in the background, whole or sharded (``dapo.checkpoint``'s
docstring says what a checkpoint holds), and the RNG state it carries."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import torch

from dapo.checkpoint.files import checkpoint_dir, list_checkpoints, write_manifest
from dapo.checkpoint.shards import save_shards
from dapo.checkpoint.writer import CheckpointWriter, failure, write_failed
from dapo.model import lora
from dapo.runtime import parallel
from dapo.runtime.files import readable_as_umask, tree

log = logging.getLogger(__name__)
# trainer-state entries an asynchronous save writes from live memory: only the update changes them
LIVE_STATE_KEYS = ("policy",)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def restore_dropout(config_json: Path, model) -> None:
    """Write the dropout values ``model`` was loaded with back into a saved ``config.json``: a checkpoint or
    an export is the user's model, trained without dropout but configured as it came."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft adapters
    saved = base.__dict__.get("_dapo_dropout")
    if not saved or not Path(config_json).exists():
        return
    data = json.loads(Path(config_json).read_text())
    for path, value in saved.items():
        node = data
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    Path(config_json).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model,
    tokenizer,
    trainer_state: dict,
    config_yaml: str,
    keep: int,
    shards: dict | None = None,
    dist: parallel.Dist | None = None,
    writer: CheckpointWriter | None = None,
) -> Path:
    """Write the checkpoint of ``step`` (its final path is returned); with ``shards`` (FSDP) every rank
    calls this and writes its own part, synchronously.

    With an asynchronous ``writer`` the call returns once the small trainer state is copied (the RNG
    included, as it is now); a background thread writes it with the model's weights and
    ``trainer_state["policy"]`` (optimizer, scheduler) as they are in memory, so the caller must not
    change those before ``writer.wait()``. The directory appears under its final name only when whole, as in the
    synchronous case: a process killed mid-write leaves the previous checkpoint and a .tmp_* directory. Without a writer
    the checkpoint is written before the call returns."""
    d = dist or parallel.Dist()
    writer = writer or CheckpointWriter(asynchronous=False)
    writer.wait()  # one write in flight at most; an error of the previous write is raised here
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    state = {"rng": rng_state(), **trainer_state, "step": step}  # the RNG as the step left it (or as given)
    if shards is not None:
        _save_sharded(run_dir, tmp, final, model, tokenizer, shards, state, config_yaml, keep, d)
        return final
    weights_dir = lora.ADAPTER_DIR if lora.is_adapted(model) else "model"
    files = {
        **{f"{weights_dir}/{name}": data for name, data in writer.tokenizer_files(tokenizer).items()},
        "config.yaml": config_yaml.encode(),
    }
    if writer.asynchronous:
        # The weights and the policy's optimizer state are written from live memory, not copied: a copy
        # (1.6 GB for a 135M model in float32 with AdamW) costs about what the write does. The caller
        # keeps them unchanged until writer.wait() (the loop waits before its next update); the rest of
        # the trainer state (prompt order, held-over groups, RNG: small) is copied now.
        live = {k: state.pop(k) for k in LIVE_STATE_KEYS if k in state}
        weights = lora.adapter_state(model) if lora.is_adapted(model) else model.state_dict()
        state = {**writer.snapshot(state), **live}
        writer.start(final, lambda: _write(run_dir, tmp, final, model, weights, files, state, keep))
    else:
        try:
            _write(run_dir, tmp, final, model, None, files, state, keep)
        except Exception as err:
            raise write_failed(final, failure(err)) from err
    return final


def _save_sharded(
    run_dir: Path, tmp: Path, final: Path, model, tokenizer, shards: dict, state: dict, config_yaml: str, keep: int, d
) -> None:
    """An FSDP checkpoint: every rank writes its shards, rank 0 the rest and the rename; a failure on any rank
    stops every rank with the same CheckpointError."""
    if d.is_main:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    parallel.barrier(d)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    error = None
    try:
        save_shards(shards, tmp / "shards")  # a rank's failure is raised on every rank
    except (Exception, CheckpointException) as err:
        error = err
    if d.is_main and error is None:
        try:
            model.config.save_pretrained(tmp / "model_meta")
            restore_dropout(tmp / "model_meta" / "config.json", model)
            tokenizer.save_pretrained(tmp / "model_meta")
            if lora.is_adapted(model):  # the adapters' shape and scale; their weights are in the shards
                lora.save_adapter(model, tmp / lora.ADAPTER_DIR, weights={})
            torch.save(state, tmp / "trainer_state.pt")
            (tmp / "config.yaml").write_text(config_yaml)
            _complete(run_dir, tmp, final, keep)
        except Exception as err:
            error = err
    if d.is_main and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    # rank 0 has renamed the directory, or says why not, before anyone goes on: every rank stops alike
    said = parallel.broadcast_object(None if error is None else failure(error), d)
    if said is not None:
        raise write_failed(final, said) from error


def _write(
    run_dir: Path, tmp: Path, final: Path, model, weights: dict | None, files: dict[str, bytes], state: dict, keep: int
) -> None:
    """A single-process checkpoint: the model in Hugging Face format, or a peft model's adapters
    (``weights``: the state dict to write, None: the model's own), ``files`` (path in the checkpoint:
    content), the trainer state; then renamed."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if lora.is_adapted(model):
            lora.save_adapter(model, tmp / lora.ADAPTER_DIR, weights)
        else:
            model.save_pretrained(tmp / "model", state_dict=weights)  # tied weights, format: as the model saves itself
            restore_dropout(tmp / "model" / "config.json", model)
        for name, data in files.items():
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        torch.save(state, tmp / "trainer_state.pt")
        _complete(run_dir, tmp, final, keep)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint: on a full disk, the space it holds is needed
        raise


def _complete(run_dir: Path, tmp: Path, final: Path, keep: int) -> None:
    """Modes, fsync, rename: from here ``final`` is a whole checkpoint; then the rotation."""
    root = tmp.parent
    write_manifest(tmp)  # last: what it lists is what the directory holds
    readable_as_umask(tree(tmp))
    _fsync_tree(tmp)
    if final.exists():  # same step saved twice (e.g. end of run right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)  # the rename itself reaches the disk
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp_step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    """Every file's data and every directory's entries (the names of what was written) to the disk."""
    for p in tree(path):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        elif p.is_dir():
            _fsync_dir(p)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
