"""Atomic checkpoints: everything a killed run needs to continue exactly where it stopped.

    <run>/checkpoints/step_000020/
        model/              Hugging Face format (config, safetensors, tokenizer): loadable anywhere
        trainer_state.pt    optimizer, scheduler, the collection (prompt order, held-over groups, counters), RNG
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

Each checkpoint ends with ``manifest.json`` (``files``); resuming, ``dapo export`` and ``dapo eval --run``
verify it before they trust one: ``resume_point`` picks the newest that verifies and moves damaged ones aside
(``damaged.step_*``), ``check_whole`` refuses a damaged one.

Any checkpoint resumes at any world size (``load_policy``): one process's on N ranks, N ranks' in one
process or on M ranks, the model and AdamW state resharded by torch.distributed.checkpoint.
A single process can write it in a background thread (``writer``, run.async_checkpoint):
the small trainer state is copied when save_checkpoint is called, the weights and optimizer state
are written from live memory, and the loop waits for the write before its next update changes them.

The modules: ``save`` and ``load`` (a checkpoint, and the point a run resumes from), ``run_dir`` (the run's
directory), ``files`` (where a run's checkpoints are, their manifests), ``shards`` (torch.distributed.checkpoint's
files, read safely), ``weights`` (the weights in the form they were written; ``dapo export``), ``writer`` (the
background write), ``saver`` (what of a training run a checkpoint holds) and ``preemption`` (a checkpoint on the
way out, on SIGTERM, SIGUSR1 or SIGINT).
"""

from dapo.checkpoint.files import latest_checkpoint, step_of
from dapo.checkpoint.load import check_whole, load_policy, load_trainer_state, resume_point
from dapo.checkpoint.run_dir import prepare_run_dir, removed_if_start_fails
from dapo.checkpoint.save import rng_state, save_checkpoint, set_rng_state

__all__ = [
    "check_whole",
    "latest_checkpoint",
    "load_policy",
    "load_trainer_state",
    "prepare_run_dir",
    "removed_if_start_fails",
    "resume_point",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "step_of",
]
