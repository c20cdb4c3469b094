"""Reading a checkpoint back: the trainer state, the policy at any world size, and which checkpoint a run resumes
from (the newest that verifies against its manifest; damaged ones moved aside or refused)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dapo.checkpoint.files import DAMAGED_PREFIX, MANIFEST, Unverified, list_checkpoints, unused_name, verify
from dapo.checkpoint.shards import read_shards
from dapo.checkpoint.weights import check_kind, is_sharded, load_policy_weights, one_process_state
from dapo.runtime import parallel
from dapo.runtime.files import CheckpointError


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
        whole = read_shards(Path(path) / "shards")
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
        aside = unused_name(path.with_name(DAMAGED_PREFIX + path.name))
        os.rename(path, aside)
        lines.append(f"checkpoint {path} is damaged: {why}; moved aside to {aside.name}, not deleted")
    return None, lines, None
