"""Atomic checkpoints: everything a killed run needs to continue exactly where it stopped.

    <run>/checkpoints/step_000020/
        model/              Hugging Face format (config, safetensors, tokenizer): loadable anywhere
        trainer_state.pt    optimizer, scheduler, sampler position, dynamic-sampling buffer, RNG, counters
        config.yaml         the resolved config
A checkpoint is written under a temporary name and renamed when complete, so a directory named
step_* is always whole; a crash mid-write leaves only a .tmp_* directory, removed on the next save.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import torch

STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / "trainer_state.pt").exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


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


def save_checkpoint(run_dir: Path, step: int, *, model, tokenizer, trainer_state: dict, config_yaml: str, keep: int) -> Path:
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / "trainer_state.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    _fsync_tree(tmp)
    if final.exists():  # same step saved twice (e.g. end of run right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp_step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_trainer_state(path: Path) -> dict:
    file = Path(path) / "trainer_state.pt"
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: say which and what to do
        raise RuntimeError(
            f"checkpoint {file} is unreadable ({type(err).__name__}); delete that step directory to resume "
            "from the one before, or set run.resume=false"
        ) from err


def load_model_weights(model, path: Path) -> None:
    """Copy the HF-format weights saved in ``path/model`` into an already built model."""
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(Path(path) / "model", dtype=next(model.parameters()).dtype)
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")


def _fsync_tree(path: Path) -> None:
    for p in Path(path).rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
