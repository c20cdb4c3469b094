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

Each checkpoint ends with ``manifest.json`` (written last, inside the directory before its rename): every other
file's size and CRC-32. ``verify`` compares a checkpoint with it; resuming, ``dapo export`` and ``dapo eval --run``
do so before they trust one (a copy cut short, a full disk on the other side, bit rot). ``resume_point`` picks the
newest checkpoint that verifies and moves damaged ones aside (``damaged.step_*``).

Any checkpoint resumes at any world size (``load_policy``): one process's on N ranks, N ranks' in one
process or on M ranks, the model and AdamW state resharded by torch.distributed.checkpoint.
A single process can write it in a background thread (``CheckpointWriter``, run.async_checkpoint):
the small trainer state is copied when save_checkpoint is called, the weights and optimizer state
are written from live memory, and the loop waits for the write before its next update changes them.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import json
import logging
import os
import random
import re
import shutil
import tempfile
import threading
import time
import zlib
from pathlib import Path

import torch

from dapo import lora, parallel
from dapo.parallel import CheckpointError

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{6,})$")
MANIFEST = "manifest.json"  # every other file of a checkpoint: its size and CRC-32 (verify)
DAMAGED_PREFIX = "damaged."  # a checkpoint that failed verification, moved aside: damaged.step_000020
# trainer-state entries an asynchronous save writes from live memory: only the update changes them
LIVE_STATE_KEYS = ("policy",)


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and STEP_DIR.match(p.name) and ((p / "trainer_state.pt").exists() or (p / MANIFEST).exists())
    ]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(Path(path).name).group(1))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, dist: parallel.Dist | None = None) -> None:
    """Create the run directory. A fresh start (resume=false) never writes into an earlier run: its
    metrics.jsonl would be truncated and the checkpoint rotation would mix (and delete) steps of
    both. It stops instead, or with ``overwrite`` first moves the earlier run aside, whole."""
    from dapo.config import ConfigError

    d = dist or parallel.Dist()
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    earlier = not resume and (
        any(checkpoint_dir(run_dir).glob("step_*")) or (metrics.exists() and metrics.stat().st_size > 0)
    )
    if earlier and not overwrite:
        raise ConfigError(
            f"run.resume=false but {run_dir} holds an earlier run (checkpoints or metrics.jsonl); "
            f"give a new run.name, or set run.overwrite=true to move it aside to "
            f"{run_dir.name}.<date-time> first, or drop run.resume=false to continue it"
        )
    parallel.barrier(d)  # every rank has looked before rank 0 moves anything
    if d.is_main:
        if earlier:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            aside = run_dir.with_name(f"{run_dir.name}.{stamp}")
            for k in range(1, 1000):
                if not aside.exists():
                    break
                aside = run_dir.with_name(f"{run_dir.name}.{stamp}-{k}")
            os.rename(run_dir, aside)  # not os.replace: never onto an existing directory
            print(f"run.overwrite=true: moved the earlier run {run_dir} to {aside}")
        run_dir.mkdir(parents=True, exist_ok=True)
    parallel.barrier(d)


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
        metrics = run_dir / "metrics.jsonl"
        results = any(checkpoint_dir(run_dir).glob("step_*")) or (metrics.exists() and metrics.stat().st_size > 0)
        if created and run_dir.is_dir() and not results:
            shutil.rmtree(run_dir, ignore_errors=True)
            for parent in created[1:]:
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only while empty
        raise


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def readable_as_umask(paths) -> None:
    """Give files and directories the modes the user's umask asks for (0644 and 0755 under umask 022).
    save_pretrained writes its weights 0600 and mkdtemp makes 0700: a model meant for sharing would be
    readable by its owner only."""
    mask = umask()
    for p in paths:
        p = Path(p)
        if p.is_symlink():
            continue
        if p.is_dir():
            p.chmod(0o777 & ~mask)
        elif p.is_file():
            executable = p.stat().st_mode & 0o100
            p.chmod((0o777 if executable else 0o666) & ~mask)


def _tree(path: Path) -> list[Path]:
    return [Path(path), *Path(path).rglob("*")]


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
    if shards is None:
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
    if d.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    parallel.barrier(d)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    error = None
    try:
        parallel.save_shards(shards, tmp / "shards")  # a rank's failure is raised on every rank
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
    return final


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
    readable_as_umask(_tree(tmp))
    _fsync_tree(tmp)
    if final.exists():  # same step saved twice (e.g. end of run right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)  # the rename itself reaches the disk
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp_step_*"):
        shutil.rmtree(stale, ignore_errors=True)


class CheckpointWriter:
    """Writes single-process checkpoints, in a background thread when ``asynchronous``, one at a time.

    ``snapshot`` copies the small part of what is saved (sampler, buffer, RNG) into CPU buffers kept from
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


def is_sharded(path: Path) -> bool:
    return (Path(path) / "shards").is_dir()


def is_lora(path: Path) -> bool:
    """Whether a checkpoint holds LoRA adapters (its adapter config says so) rather than full weights."""
    return (Path(path) / lora.ADAPTER_DIR / lora.CONFIG_FILE).is_file()


def check_kind(path: Path, lora_cfg) -> None:
    """A checkpoint resumes only a run of its kind: full weights a run without LoRA, adapters a LoRA run
    whose ``model.lora`` gives them the same shape and scale. Else a CheckpointError saying what to change."""
    path = Path(path)
    if is_lora(path) and not lora_cfg.enabled:
        raise CheckpointError(
            f"checkpoint {path} holds LoRA adapters ({lora.ADAPTER_DIR}/) and this run has "
            "model.lora.rank=null: set model.lora as the run that saved it had (its config.yaml), "
            f"or train on the merged model in a new run (dapo export {path} OUT_DIR, then "
            "model.path=OUT_DIR and another run.name)"
        )
    if lora_cfg.enabled and not is_lora(path):
        raise CheckpointError(
            f"checkpoint {path} holds full weights (no {lora.ADAPTER_DIR}/) and this run has "
            f"model.lora.rank={lora_cfg.rank}: drop model.lora.rank to resume it, or put adapters "
            f"on its weights in a new run (dapo export {path} OUT_DIR, then model.path=OUT_DIR and "
            "another run.name)"
        )
    if lora_cfg.enabled:
        lora.check_settings(path / lora.ADAPTER_DIR, lora_cfg)


def load_shards(path: Path, shards: dict) -> dict:
    """Fill ``shards`` (this rank's model and optimizer state, any number of ranks) from a sharded checkpoint
    written by any number of ranks (a one-process one goes through ``load_policy``)."""
    if not is_sharded(path):
        raise CheckpointError(f"checkpoint {path} holds no shards/ (written by one process); load it with load_policy")
    parallel.load_shards(shards, Path(path) / "shards")
    return shards


def export_hf(
    path: Path, out_dir: Path, *, trust_remote_code: bool = False, adapter: bool = False, base: Path | None = None
) -> Path:
    """A checkpoint's weights as one Hugging Face model directory (config, safetensors, tokenizer);
    Python files in its model_meta/ (or the base model's directory) run only with ``trust_remote_code``.

    A LoRA checkpoint exports the merged model (its base, from ``base`` or the adapter config's
    base_model_name_or_path, with W + scale * B A in every adapted layer), or with ``adapter`` the adapters
    alone in peft's format (adapter_config.json, adapter_model.safetensors: ``PeftModel.from_pretrained``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, out_dir = Path(path), Path(out_dir)
    refuse_links(path)
    before = set(_tree(out_dir)) if out_dir.exists() else set()
    if adapter and not is_lora(path):
        raise CheckpointError(f"{path} holds full weights, not LoRA adapters: drop --adapter to export the model")
    if is_lora(path) and (not adapter or is_sharded(path)):
        return _export_lora(path, out_dir, before, adapter=adapter, base=base, trust_remote_code=trust_remote_code)
    weights_dir = path / (lora.ADAPTER_DIR if adapter else "model")
    if (weights_dir / ("adapter_config.json" if adapter else "config.json")).exists():  # single-process: already one
        mode = out_dir.stat().st_mode & 0o7777 if before else None
        shutil.copytree(weights_dir, out_dir, dirs_exist_ok=True)
        # what was copied (and the directory, if made here); the rest of an existing directory keeps its modes
        readable_as_umask(
            [out_dir / p.relative_to(weights_dir) for p in weights_dir.rglob("*")] + ([] if before else [out_dir])
        )
        if mode is not None:
            out_dir.chmod(mode)  # copytree gave it the checkpoint's
        return out_dir
    if not is_sharded(path):
        raise FileNotFoundError(
            f"{path} is not a checkpoint directory (no model/ or shards/); give runs/<name>/checkpoints/step_NNNNNN"
        )
    config = AutoConfig.from_pretrained(path / "model_meta", trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    state = {"model": model.state_dict()}  # the keys the trainer saved its shards under
    parallel.load_shards(state, path / "shards")
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
    model.to(dtype)  # the dtype the model was given in; training kept float32 masters
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(path / "model_meta", trust_remote_code=trust_remote_code).save_pretrained(out_dir)
    readable_as_umask([p for p in _tree(out_dir) if p not in before or p.name.endswith(".safetensors")])  # ours
    return out_dir


def _export_lora(
    path: Path, out_dir: Path, before: set, *, adapter: bool, base: Path | None, trust_remote_code: bool
) -> Path:
    """The merged model of a LoRA checkpoint, or (sharded) its adapters gathered from the shards."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    adapter_dir = path / lora.ADAPTER_DIR
    base = Path(base or lora.read_adapter_config(adapter_dir).get("base_model_name_or_path") or "").expanduser()
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} holds LoRA adapters on the base model {str(base)!r}, which is not a model "
            "directory here; give the base with --base DIR"
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model = lora.rebuild(model, adapter_dir)
    if is_sharded(path):
        trained = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
        parallel.load_shards({"model": trained}, path / "shards")  # in place: the keys the trainer saved under
    else:
        lora.load_adapter(model, adapter_dir)
    tokenizer_dir = path / "model_meta" if is_sharded(path) else adapter_dir
    if adapter:
        lora.save_adapter(model, out_dir)
    else:
        merged = model.merge_and_unload()  # in float32: each W + scale * B A rounded once, below
        config = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
        dtype = (
            config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
        )
        merged.to(dtype).save_pretrained(out_dir)  # the base's own dtype
    AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code).save_pretrained(out_dir)
    readable_as_umask([p for p in _tree(out_dir) if p not in before or p.name.endswith(".safetensors")])  # ours
    return out_dir


def refuse_links(path: Path) -> None:
    """A checkpoint holds only regular files (save_pretrained and torch.distributed.checkpoint write no
    links). A link in one from elsewhere could point at any file of this machine (~/.ssh/id_rsa), whose
    content an export would copy into a model directory meant for sharing."""
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = Path(root) / name
            if p.is_symlink():
                raise CheckpointError(
                    f"{p} is a symbolic link (to {os.readlink(p)}); a checkpoint holds only regular "
                    "files: replace the link with the file it should be, or remove it"
                )


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
        whole = parallel.read_shards(Path(path) / "shards")
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


def one_process_state(policy, path: Path, policy_state: dict) -> tuple[dict, dict]:
    """A one-process checkpoint's weights (float32, by parameter name; the float32 masters where the model
    directory holds them rounded) and its AdamW state by parameter name (``Policy.optimizer_state_by_name``)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if policy.adapted:
        weights = lora.saved_adapters_by_name(policy.model, path / lora.ADAPTER_DIR)
    else:
        saved = AutoModelForCausalLM.from_pretrained(
            path / "model", dtype=torch.float32, trust_remote_code=policy.model_cfg.trust_remote_code
        )
        weights = dict(saved.state_dict())
        del saved
    names = policy.trained_names()
    for name, master in zip(names, policy_state.get("master_weights") or []):
        weights[name] = master.float()
    # a tied weight is one parameter under several names: each takes the value of the first (the master's)
    first: dict[int, str] = {}
    for name, p in policy.model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        if name in weights and first[id(p)] in weights:
            weights[name] = weights[first[id(p)]]
    return weights, policy.optimizer_state_by_name(policy_state["optimizer"])


def load_policy_weights(policy, path: Path) -> None:
    """A checkpoint's weights into ``policy`` at its world size's own format: the HF model alone (or its LoRA
    adapters), or under FSDP this rank's shards of the model (or the adapters) and the optimizer."""
    check_kind(path, policy.model_cfg.lora)
    shards = policy.sharded_state()
    if shards is not None:
        policy.load_sharded_state(load_shards(path, shards))
    elif policy.adapted:
        lora.load_adapter(policy.model, Path(path) / lora.ADAPTER_DIR)
    else:
        load_model_weights(policy.model, path, trust_remote_code=policy.model_cfg.trust_remote_code)


def _refuse_sharded(path: Path) -> None:
    if is_sharded(path):
        raise CheckpointError(
            f"checkpoint {path} is sharded (written by several ranks) and holds no model directory: "
            f"a run resumes it at any world size; to use its weights elsewhere, turn it into one "
            f"with `dapo export {path} OUT_DIR`"
        )


def load_model_weights(model, path: Path, *, trust_remote_code: bool = False) -> None:
    """Copy the HF-format weights saved in ``path/model`` into an already built model."""
    from transformers import AutoModelForCausalLM

    _refuse_sharded(path)

    saved = AutoModelForCausalLM.from_pretrained(
        Path(path) / "model", dtype=next(model.parameters()).dtype, trust_remote_code=trust_remote_code
    )
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")


# ---- manifests: a checkpoint verified before it is trusted ------------------------------------------
CHUNK = 8 << 20  # bytes read at a time while checksumming


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(path: Path) -> list[str]:
    """Every regular file under ``path`` but the manifest, as sorted relative POSIX paths."""
    return sorted(p.relative_to(path).as_posix() for p in Path(path).rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(path: Path) -> Path:
    """Record every file of the checkpoint directory ``path`` (size, CRC-32: a truncation, zeroed blocks,
    flipped bits) in its manifest.json, written whole under a temporary name and renamed."""
    path = Path(path)
    files = {name: {"bytes": (path / name).stat().st_size, "crc32": _crc32(path / name)} for name in _files(path)}
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": 1, "checksum": "crc32", "files": files}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path / MANIFEST)
    return path / MANIFEST


def verify(path: Path) -> str | None:
    """What differs between checkpoint ``path`` and its manifest, in a few words naming the file (the first
    difference found), or None when every file is as written. A checkpoint without a manifest (written before
    manifests existed) raises Unverified."""
    path = Path(path)
    if not (path / MANIFEST).exists():
        raise Unverified(f"checkpoint {path} has no {MANIFEST} (written before checkpoints had one)")
    try:
        listed = json.loads((path / MANIFEST).read_text())["files"]
        assert isinstance(listed, dict)
    except Exception as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__})"
    for name, want in sorted(listed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing ({want['bytes']} bytes in the manifest)"
        size = file.stat().st_size
        if size != want["bytes"]:
            return f"{name} is {size} bytes, the manifest says {want['bytes']}"
        crc = _crc32(file)
        if crc != want["crc32"]:
            return f"{name} has CRC-32 {crc}, the manifest says {want['crc32']} (same size: its content changed)"
    extra = [name for name in _files(path) if name not in listed]
    if extra:
        return f"{extra[0]} is not in the manifest" + (f" (and {len(extra) - 1} more files)" if len(extra) > 1 else "")
    return None


class Unverified(Exception):
    """A checkpoint without a manifest: it cannot be checked, and is trusted as before."""


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
            return (
                None,
                lines,
                (
                    f"checkpoint {path} is damaged: {why}; run.resume_damaged=refuse, so the run stops: look at it, "
                    f"then remove it (or set run.resume_damaged=skip) to resume from the checkpoint before it"
                ),
            )
        aside = _aside(path)
        os.rename(path, aside)
        lines.append(f"checkpoint {path} is damaged: {why}; moved aside to {aside.name}, not deleted")
    return None, lines, None


def _aside(path: Path) -> Path:
    aside = path.with_name(DAMAGED_PREFIX + path.name)
    for k in range(1, 1000):
        if not aside.exists():
            break
        aside = path.with_name(f"{DAMAGED_PREFIX}{path.name}-{k}")
    return aside


def _fsync_tree(path: Path) -> None:
    """Every file's data and every directory's entries (the names of what was written) to the disk."""
    for p in _tree(path):
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
