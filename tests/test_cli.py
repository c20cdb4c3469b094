"""What a newcomer meets first: the console (library messages in train.log), one-line errors that leave
nothing behind, --help with its defaults, launch-ray's checks before it waits, files others can read."""

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import SMALL_OVERRIDES

from dapo import ablate, checkpoint, cli
from dapo.cluster import Placement, check_fits
from dapo.config import ConfigError, load_config
from dapo.log import close_library_logging, setup_library_logging

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def library_logging():
    yield setup_library_logging
    close_library_logging()


# ---- file modes ------------------------------------------------------------------------------------
@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


def test_checkpoints_and_exports_follow_the_umask(tiny_model_dir, tmp_path, umask_022):
    from dapo.policy import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    step = checkpoint.save_checkpoint(tmp_path / "run", 1, model=model, tokenizer=tokenizer, trainer_state={},
                                      config_yaml="{}\n", keep=1)
    assert _mode(step) == 0o755 and _mode(step / "model") == 0o755
    assert _mode(step / "model" / "model.safetensors") == 0o644
    assert {_mode(p) for p in step.rglob("*") if p.is_file()} == {0o644}
    out = checkpoint.export_hf(step, tmp_path / "exported")
    assert _mode(out) == 0o755 and _mode(out / "model.safetensors") == 0o644
    # into a directory of the user's: what was written follows the umask, the rest keeps its mode
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    mine.chmod(0o700)
    (mine / "secret.txt").write_text("x")
    (mine / "secret.txt").chmod(0o600)
    checkpoint.export_hf(step, mine)
    assert _mode(mine) == 0o700 and _mode(mine / "secret.txt") == 0o600
    assert _mode(mine / "model.safetensors") == 0o644
