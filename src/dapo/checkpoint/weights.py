"""A checkpoint's weights read back in the form they were written (``dapo.checkpoint``'s docstring shows the layouts):
full weights or LoRA adapters, one process's files or FSDP shards. Into a model or a policy at that form (a run
resuming at another world size: ``checkpoint.load_policy``), or as one Hugging Face model directory (``dapo export``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from dapo.checkpoint import shards as shard_files
from dapo.model import lora
from dapo.runtime.files import CheckpointError, readable_as_umask, tree


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
    shard_files.load_shards(shards, Path(path) / "shards")
    return shards


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


def load_model_weights(model, path: Path, *, trust_remote_code: bool = False) -> None:
    """Copy the HF-format weights saved in ``path/model`` into an already built model."""
    from transformers import AutoModelForCausalLM

    if is_sharded(path):
        raise CheckpointError(
            f"checkpoint {path} is sharded (written by several ranks) and holds no model directory: "
            f"a run resumes it at any world size; to use its weights elsewhere, turn it into one "
            f"with `dapo export {path} OUT_DIR`"
        )
    saved = AutoModelForCausalLM.from_pretrained(
        Path(path) / "model", dtype=next(model.parameters()).dtype, trust_remote_code=trust_remote_code
    )
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")


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
    before = set(tree(out_dir)) if out_dir.exists() else set()
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
    shard_files.load_shards(state, path / "shards")
    model.to(_config_dtype(config))  # the dtype the model was given in; training kept float32 masters
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(path / "model_meta", trust_remote_code=trust_remote_code).save_pretrained(out_dir)
    readable_as_umask([p for p in tree(out_dir) if p not in before or p.name.endswith(".safetensors")])  # ours
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
        shard_files.load_shards({"model": trained}, path / "shards")  # in place: the keys the trainer saved under
    else:
        lora.load_adapter(model, adapter_dir)
    tokenizer_dir = path / "model_meta" if is_sharded(path) else adapter_dir
    if adapter:
        lora.save_adapter(model, out_dir)
    else:
        merged = model.merge_and_unload()  # in float32: each W + scale * B A rounded once, below
        config = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
        merged.to(_config_dtype(config)).save_pretrained(out_dir)  # the base's own dtype
    AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code).save_pretrained(out_dir)
    readable_as_umask([p for p in tree(out_dir) if p not in before or p.name.endswith(".safetensors")])  # ours
    return out_dir


def _config_dtype(config) -> torch.dtype:
    """The dtype a model's config names (a torch.dtype or its name; float32 when it names none)."""
    return config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))


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
