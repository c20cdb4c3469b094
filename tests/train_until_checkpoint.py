"""Test driver: train the small test config in this process, recording every checkpoint written,
and optionally exit hard (os._exit, no clean-up of any kind) right after checkpoint K is written.

    python tests/train_until_checkpoint.py RUN_DIR MODEL_DIR LOG_FILE TAG KILL_AFTER [override ...]

KILL_AFTER = 0: never. Each checkpoint appends "TAG STEP" to LOG_FILE (flushed and fsynced before
any exit). The package is not changed: dapo.checkpoint.save_checkpoint is wrapped from here.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    run_dir, model_dir, log_file, tag, kill_after, *overrides = sys.argv[1:]
    kill_after = int(kill_after)

    from conftest import small_config  # tests/ is this script's directory, so it is on sys.path

    import dapo.train
    from dapo import checkpoint

    real_save = checkpoint.save_checkpoint

    def save_then_maybe_die(run_dir, step, **kwargs):
        path = real_save(run_dir, step, **kwargs)
        with open(log_file, "a") as f:
            f.write(f"{tag} {step}\n")
            f.flush()
            os.fsync(f.fileno())
        if step == kill_after:
            os._exit(1)  # as a power cut would: no finally blocks, no atexit, no flushing
        return path

    checkpoint.save_checkpoint = save_then_maybe_die
    if hasattr(dapo.train, "save_checkpoint"):  # should train.py ever import the name itself
        dapo.train.save_checkpoint = save_then_maybe_die
    dapo.train.train(small_config(run_dir, model_dir, *overrides))


if __name__ == "__main__":
    main()
