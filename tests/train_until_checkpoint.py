"""Test driver: train the small test config in this process, recording every checkpoint written,
and optionally exit hard (os._exit, no clean-up of any kind) at checkpoint K.

    python tests/train_until_checkpoint.py RUN_DIR MODEL_DIR LOG_FILE TAG KILL_AFTER [override ...]

KILL_AFTER = 0: never. K: right after checkpoint K is written (a background write is waited for
first, so the checkpoint is whole). K:mid: in the middle of checkpoint K's write, once its files are
in its temporary directory and before the rename, as a power cut would (the writer's thread calls
os._exit while the training loop has gone on). Each save call appends "TAG STEP" to LOG_FILE (flushed
and fsynced before any exit). The package is not changed: dapo.checkpoint's functions are wrapped from here.
"""

from __future__ import annotations

import os
import sys
import threading


def main() -> None:
    run_dir, model_dir, log_file, tag, kill_after, *overrides = sys.argv[1:]
    kill_after, _, mid_write = kill_after.partition(":")
    kill_after = int(kill_after)

    import dapo.training
    from conftest import small_config  # tests/ is this script's directory, so it is on sys.path
    from dapo.checkpoint import save as checkpoint_save
    from dapo.checkpoint import saver

    real_save, real_complete = saver.save_checkpoint, checkpoint_save._complete
    returned = threading.Event()  # checkpoint K's save call has returned and is logged: the loop has gone on

    def save_then_maybe_die(run_dir, step, **kwargs):
        path = real_save(run_dir, step, **kwargs)
        if step == kill_after and not mid_write and kwargs.get("writer") is not None:
            kwargs["writer"].wait()  # the checkpoint is whole on disk
        with open(log_file, "a") as f:
            f.write(f"{tag} {step}\n")
            f.flush()
            os.fsync(f.fileno())
        if step == kill_after:
            returned.set()
        if step == kill_after and not mid_write:
            os._exit(1)  # as a power cut would: no finally blocks, no atexit, no flushing
        return path

    def die_before_the_rename(run_dir, tmp, final, keep):
        if final.name == f"step_{kill_after:06d}":
            returned.wait(timeout=300)  # however the threads are scheduled, the loop is past the save call
            os._exit(1)
        return real_complete(run_dir, tmp, final, keep)

    saver.save_checkpoint = save_then_maybe_die  # where the run's saves call it
    if mid_write:
        checkpoint_save._complete = die_before_the_rename
    dapo.training.train(small_config(run_dir, model_dir, *overrides))


if __name__ == "__main__":
    main()
