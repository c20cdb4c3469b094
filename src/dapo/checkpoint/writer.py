"""Writing a single-process checkpoint in a background thread (run.async_checkpoint), and the one line a failed
write ends the run with. What is written is ``save``'s (``save_checkpoint``)."""

from __future__ import annotations

import copy as copy_module
import logging
import tempfile
import threading
import time
from pathlib import Path

import torch

from dapo.checkpoint.files import list_checkpoints
from dapo.runtime.files import CheckpointError

log = logging.getLogger("dapo.checkpoint")


def failure(err: BaseException) -> str:
    """What went wrong, in a few words; for torch.distributed.checkpoint's report of every rank's failure
    (their tracebacks), the first failing rank's error."""
    failures = getattr(err, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict) and failures:
        rank, (first, *_) = min(failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {type(first).__name__}: {first}"
    return f"{type(err).__name__}: {err}"


def write_failed(final: Path, why: str) -> CheckpointError:
    """The one line for a checkpoint write that failed (a full disk, a lost mount), its partial files removed."""
    before = [p for p in list_checkpoints(final.parent.parent) if p != final]
    then = (
        f"starting the run again resumes from {before[-1]}, which is whole"
        if before
        else "there is no earlier checkpoint, so starting the run again starts from step 0"
    )
    return CheckpointError(
        f"writing checkpoint {final} failed ({why}); its partial files were "
        f"removed and {then}: free space on that disk (or fix the cause) first"
    )


class CheckpointWriter:
    """Writes single-process checkpoints, in a background thread when ``asynchronous``, one at a time.

    ``snapshot`` copies the small part of what is saved (prompt order, held-over groups, RNG) into CPU buffers kept from
    one save to the next, so the training loop can go on changing it; the weights and optimizer state
    are written as they are, and the loop waits for the write before it changes them. ``start`` runs the
    write in a thread; ``wait`` (called by the next save, and at the end of training) joins it and raises
    its error, if it failed. The thread is not a daemon: an interpreter that exits normally waits for it.
    """

    def __init__(self, asynchronous: bool = True):
        self.asynchronous = asynchronous
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._target: Path | None = None
        self._buffers: dict = {}
        self._tokenizer: tuple | None = None  # (tokenizer, its files)
        self.write_s: float | None = None  # how long the last finished background write took

    def tokenizer_files(self, tokenizer) -> dict[str, bytes]:
        """The files ``tokenizer.save_pretrained`` writes, made once per tokenizer (they do not change)."""
        if self._tokenizer is None or self._tokenizer[0] is not tokenizer:
            with tempfile.TemporaryDirectory() as tmp:
                tokenizer.save_pretrained(tmp)
                files = {str(p.relative_to(tmp)): p.read_bytes() for p in sorted(Path(tmp).rglob("*")) if p.is_file()}
            self._tokenizer = (tokenizer, files)
        return self._tokenizer[1]

    def snapshot(self, obj):
        """``obj`` (dicts, lists, tuples of tensors and plain values) with every tensor copied to the CPU,
        into this writer's reused buffers; tensors that share memory (tied weights) share their copy."""
        old, new, seen = self._buffers, {}, {}

        def copy(x, key):
            if isinstance(x, torch.Tensor):
                alias = (
                    x.untyped_storage().data_ptr(),
                    x.storage_offset(),
                    tuple(x.shape),
                    x.stride(),
                    x.dtype,
                    x.device,
                )
                if x.numel() and alias in seen:
                    return seen[alias]
                buf = old.get(key)
                if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
                    buf = torch.empty(x.shape, dtype=x.dtype, device="cpu")
                buf.copy_(x.detach())
                new[key] = seen[alias] = buf
                return buf
            if isinstance(x, dict):
                return {k: copy(v, (*key, k)) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(copy(v, (*key, i)) for i, v in enumerate(x))
            return copy_module.deepcopy(x)

        out = copy(obj, ())
        self._buffers = new
        return out

    def start(self, target: Path, write) -> None:
        self.wait()
        self._target = target

        def run():
            t0 = time.perf_counter()
            try:
                write()
            except BaseException as err:  # kept for the main thread: a failed write is never silent
                self._error = err
            else:
                self.write_s = time.perf_counter() - t0
                log.info("checkpoint %s written in %.2f s (in the background)", target, self.write_s)

        self._thread = threading.Thread(target=run, name=f"dapo-checkpoint-{target.name}")
        self._thread.start()

    def wait(self) -> None:
        """Until the write in flight is done; raises CheckpointError if it failed (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise write_failed(self._target, failure(err)) from err

    def take_write_s(self) -> float | None:
        """The duration of the last finished background write, once (None: none since the last call)."""
        s, self.write_s = self.write_s, None
        return s
