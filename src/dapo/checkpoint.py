"""Atomic checkpoints: everything a killed run needs to continue exactly where it stopped.

    <run>/checkpoints/step_000020/
        model/              Hugging Face format (config, safetensors, tokenizer): loadable anywhere
        trainer_state.pt    optimizer, scheduler, sampler position, dynamic-sampling buffer, RNG, counters
        config.yaml         the resolved config
Under FSDP (several ranks) the weights are saved in shards instead, each rank writing its own:

    <run>/checkpoints/step_000020/
        shards/             torch.distributed.checkpoint: model and AdamW state, one file per rank
        model_meta/         Hugging Face config and tokenizer; `dapo export` joins them with the shards
        trainer_state.pt    as above (rank 0's), without the optimizer
        config.yaml
Every rank must see the same directory (one filesystem shared by the nodes).

A LoRA run (model.lora.rank set) saves its adapters, not the base: ``adapter/`` instead of ``model/``
(peft's format: adapter_config.json, adapter_model.safetensors, and the tokenizer), and its AdamW
state is the adapters'; under FSDP ``shards/`` hold the adapters alone and ``adapter/`` their config.
``adapter/adapter_config.json`` is what marks a checkpoint as LoRA: resuming one in a run without
LoRA, or the reverse, stops with a one-line error.

A checkpoint is written under a temporary name and renamed when complete, so a directory named
step_* is always whole; a crash mid-write leaves only a .tmp_* directory, removed on the next save. A
write that fails (a full disk) removes its partial files and stops the run with one line naming the
checkpoint a restart resumes from (an asynchronous write's failure is raised at the next save or at
the end of training).

Each checkpoint ends with ``manifest.json`` (checkpoint_files.py); resuming, ``dapo export`` and ``dapo eval --run``
verify it before they trust one: ``resume_point`` picks the newest that verifies and moves damaged ones aside
(``damaged.step_*``), ``check_whole`` refuses a damaged one.

Any checkpoint resumes at any world size (``load_policy``): one process's on N ranks, N ranks' in one
process or on M ranks, the model and AdamW state resharded by torch.distributed.checkpoint.
A single process can write it in a background thread (checkpoint_writer.py, run.async_checkpoint):
the small trainer state is copied when save_checkpoint is called, the weights and optimizer state
are written from live memory, and the loop waits for the write before its next update changes them.
Reading the weights back in the form they were written, and ``dapo export``, are checkpoint_weights.py's;
the shards' own reading and writing checkpoint_shards.py's; where a run's checkpoints are checkpoint_files.py's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch

from dapo import checkpoint_files, checkpoint_shards, lora, parallel
from dapo.checkpoint_files import (
    MANIFEST,
    Unverified,
    checkpoint_dir,
    list_checkpoints,
    readable_as_umask,
    tree,
    verify,
    write_manifest,
)
from dapo.checkpoint_shards import CheckpointError
from dapo.checkpoint_weights import check_kind, is_sharded, load_policy_weights, one_process_state
from dapo.checkpoint_writer import CheckpointWriter, failure, write_failed

log = logging.getLogger(__name__)
# where a run's checkpoints are (checkpoint_files.py), also asked of this module by its callers
latest_checkpoint, step_of = checkpoint_files.latest_checkpoint, checkpoint_files.step_of

DAMAGED_PREFIX = "damaged."  # a checkpoint that failed verification, moved aside: damaged.step_000020
# trainer-state entries an asynchronous save writes from live memory: only the update changes them
LIVE_STATE_KEYS = ("policy",)


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, dist: parallel.Dist | None = None) -> None:
    """Create the run directory. A fresh start (resume=false) never writes into an earlier run: its
    metrics.jsonl would be truncated and the checkpoint rotation would mix (and delete) steps of
    both. It stops instead, or with ``overwrite`` first moves the earlier run aside, whole."""
    from dapo.config import ConfigError

    d = dist or parallel.Dist()
    run_dir = Path(run_dir)
    earlier = not resume and _holds_results(run_dir)
    if earlier and not overwrite:
        raise ConfigError(
            f"run.resume=false but {run_dir} holds an earlier run (checkpoints or metrics.jsonl); "
            f"give a new run.name, or set run.overwrite=true to move it aside to "
            f"{run_dir.name}.<date-time> first, or drop run.resume=false to continue it"
        )
    parallel.barrier(d)  # every rank has looked before rank 0 moves anything
    if d.is_main:
        if earlier:
            aside = _unused(run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}"))
            os.rename(run_dir, aside)  # not os.replace: never onto an existing directory
            print(f"run.overwrite=true: moved the earlier run {run_dir} to {aside}")
        run_dir.mkdir(parents=True, exist_ok=True)
    parallel.barrier(d)


def _holds_results(run_dir: Path) -> bool:
    """Whether a run directory holds anything of value: a checkpoint or a metrics row."""
    metrics = run_dir / "metrics.jsonl"
    return any(checkpoint_dir(run_dir).glob("step_*")) or (metrics.exists() and metrics.stat().st_size > 0)


@contextlib.contextmanager
def removed_if_start_fails(run_dir: Path):
    """Around a run's start: when it fails before anything of value was written (no checkpoint, no
    metrics row), remove the run directory, and the parents it made, if this run created them. An
    earlier run's directory is never touched."""
    run_dir = Path(run_dir)
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # innermost first
    try:
        yield
    except BaseException:
        if created and run_dir.is_dir() and not _holds_results(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            for parent in created[1:]:
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only while empty
        raise


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
        # the trainer state (sampler, buffer, RNG: small) is copied now.
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
        checkpoint_shards.save_shards(shards, tmp / "shards")  # a rank's failure is raised on every rank
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


def load_trainer_state(path: Path) -> dict:
    file = Path(path) / "trainer_state.pt"
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: say which and what to do
        raise CheckpointError(
            f"checkpoint {file} is unreadable ({type(err).__name__}); delete that step directory to resume "
            "from the one before, or start afresh with run.resume=false run.overwrite=true"
        ) from err


def load_policy(policy, path: Path, policy_state: dict) -> None:
    """Everything of ``policy`` a checkpoint holds (weights, AdamW state, float32 masters, schedule) into it,
    whatever the number of ranks that wrote it and the number that reads it.

    At the world size's own format (one process: model/ or adapter/ and the trainer state; several ranks:
    shards) it loads as written, bit for bit. Across the two, the state goes through whole tensors keyed by
    parameter name, which torch.distributed.checkpoint shards for the ranks (one process to N) or joins
    from the shards (N to one); N ranks to M read the shards resharded."""
    check_kind(path, policy.model_cfg.lora)
    if is_sharded(path) == policy.dist.sharded:
        load_policy_weights(policy, path)  # first: a crafted shard index is refused before anything else is read
        policy.load_trainer_state(_policy_part(path, policy_state))
        return
    if policy.dist.sharded:  # one process -> N ranks
        policy_state = _policy_part(path, policy_state)
        weights, optimizer = one_process_state(policy, path, policy_state)
        policy_state = {k: v for k, v in policy_state.items() if k not in ("optimizer", "master_weights")}
    else:  # N ranks -> one process
        whole = checkpoint_shards.read_shards(Path(path) / "shards")
        weights, optimizer = whole["model"], whole["optim"]
    policy.load_full_state(weights, optimizer)
    policy.load_trainer_state(_policy_part(path, policy_state))  # the schedule and the skipped updates


def _policy_part(path: Path, policy_state: dict | None) -> dict:
    if not isinstance(policy_state, dict) or "scheduler" not in policy_state:
        raise CheckpointError(
            f"{Path(path) / 'trainer_state.pt'} holds no optimizer schedule (its 'policy' entry); the "
            "checkpoint is incomplete or foreign: delete its step directory to resume from the one "
            "before, or use another"
        )
    return policy_state


def check_whole(path: Path) -> str | None:
    """Raise CheckpointError naming the file and what differs when checkpoint ``path`` is damaged; return a
    one-line note when it cannot be verified (no manifest), else None. For ``dapo export`` and ``dapo eval``."""
    try:
        why = verify(path)
    except Unverified:
        return f"note: checkpoint {path} has no {MANIFEST} (written before checkpoints had one): not verified"
    if why is not None:
        before = [p for p in list_checkpoints(Path(path).parent.parent) if p != Path(path)]
        raise CheckpointError(
            f"checkpoint {path} is damaged: {why}"
            + (f"; an earlier checkpoint of the run: {before[-1]}" if before else "")
        )
    return None


def resume_point(run_dir: Path, *, refuse_damaged: bool = False, dist: parallel.Dist | None = None):
    """The newest checkpoint of ``run_dir`` that verifies (None: none) and the lines to say about the ones
    passed over, decided by rank 0 and the same on every rank. A damaged checkpoint is moved aside to
    damaged.step_NNNNNN, not deleted (it may be worth a look); with ``refuse_damaged`` the run stops instead
    (CheckpointError), leaving it where it is."""
    d = dist or parallel.Dist()
    answer = _resume_point(Path(run_dir), refuse_damaged) if d.is_main else None
    path, lines, error = parallel.broadcast_object(answer, d)
    if error is not None:
        raise CheckpointError(error)
    return path, lines


def _resume_point(run_dir: Path, refuse_damaged: bool) -> tuple[Path | None, list[str], str | None]:
    lines: list[str] = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            why = verify(path)
        except Unverified:
            lines.append(
                f"checkpoint {path} has no {MANIFEST} (written before checkpoints had one): resumed unverified"
            )
            return path, lines, None
        if why is None:
            return path, lines, None
        if refuse_damaged:
            error = (
                f"checkpoint {path} is damaged: {why}; run.resume_damaged=refuse, so the run stops: look at it, "
                f"then remove it (or set run.resume_damaged=skip) to resume from the checkpoint before it"
            )
            return None, lines, error
        aside = _unused(path.with_name(DAMAGED_PREFIX + path.name))
        os.rename(path, aside)
        lines.append(f"checkpoint {path} is damaged: {why}; moved aside to {aside.name}, not deleted")
    return None, lines, None


def _unused(path: Path) -> Path:
    """``path``, or where it exists the first of path-1, path-2, ... that does not: a name to move something aside
    to (an earlier run, a damaged checkpoint) without replacing anything."""
    aside = path
    for k in range(1, 1000):
        if not aside.exists():
            break
        aside = path.with_name(f"{path.name}-{k}")
    return aside


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
