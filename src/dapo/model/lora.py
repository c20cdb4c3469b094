"""LoRA adapters (``model.lora``) with peft: adding them, the merged weights, and their files.

With ``model.lora.rank`` set, the policy is the base model under peft LoRA adapters on the decoder
layers' linear modules: every base weight is frozen, only the adapters train, go into the optimizer
and into checkpoints. The rollout engine samples from the merged model: the ``hf`` engine is the
live peft model itself, vLLM receives ``merged_weights`` (W + scale * B A per adapted layer, under the
base model's own parameter names) through the ordinary weight push.

A LoRA checkpoint keeps the adapter in peft's format in ``adapter/`` (``adapter_config.json``, which
also marks the checkpoint as LoRA, and ``adapter_model.safetensors``); under FSDP the adapter
weights are in ``shards/`` and ``adapter/`` holds the config alone. The base is read again from
``model.path`` on resume, and from ``base_model_name_or_path`` of the adapter config on export.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from dapo.config import ConfigError
from dapo.runtime import parallel
from dapo.runtime.files import CheckpointError

if TYPE_CHECKING:
    from dapo.config import LoraConfig

ADAPTER = "default"  # peft's name for a model's one adapter
ADAPTER_DIR = "adapter"  # inside a checkpoint
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def is_adapted(model) -> bool:
    """Whether ``model`` is a peft model (peft is imported only by runs that use it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's linear modules by name, its LM head excluded (it stays frozen, and tied to the embeddings)."""
    head = model.get_output_embeddings()
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def add_adapters(model, cfg: LoraConfig, *, seed: int):
    """``model`` (a transformers causal LM) under fresh LoRA adapters as ``cfg`` says: a peft model whose
    adapters alone require gradients. The adapters start at B = 0, so the model computes what it did;
    A is drawn from ``seed`` alone, so every FSDP rank (and every run with the seed) starts from the same.
    A target name that matches none of its linear layers is a ConfigError naming them."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    linear = linear_layers(model)
    # peft's rule for a list of names: a module whose name is the target or ends with "." + target
    unmatched = [t for t in cfg.target_modules if not any(n == t or n.endswith("." + t) for n in linear)]
    if unmatched:
        names = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ConfigError(
            f"model.lora.target_modules: {', '.join(unmatched)} match no linear layer of "
            f"{model.name_or_path or type(model).__name__}; its linear layers (the LM head excluded) "
            f"are {', '.join(names)}, e.g. model.lora.target_modules=[{','.join(names[:2])}]"
        )
    head = next(name for name, m in model.named_modules() if m is model.get_output_embeddings())
    peft_cfg = PeftLoraConfig(
        task_type="CAUSAL_LM",
        r=cfg.rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        exclude_modules=[head],
    )
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):  # the caller's random streams go on as if nothing was drawn
        torch.manual_seed(seed)
        return get_peft_model(model, peft_cfg, adapter_name=ADAPTER)


def summary(model) -> str:
    """One line: the adapters' rank and how many parameters train beside the frozen ones."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    cfg = model.peft_config[ADAPTER]
    return (
        f"LoRA rank {cfg.r} (alpha {cfg.lora_alpha:g}) on {', '.join(sorted(cfg.target_modules))}: "
        f"{trained:,} trained parameters, {frozen:,} frozen"
    )


def merged_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight of the model the adapters make, under the base model's parameter
    names: an adapted layer's weight is W + peft's delta (scale * B A), computed aside, so the model
    itself is never merged. Under FSDP every tensor is gathered in turn (a collective: every rank must
    iterate to the end), as ``parallel.full_tensors`` does."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}

    def named():
        for name, p in base.named_parameters():
            owner, _, leaf = name.rpartition(".")
            if ".lora_" in name:  # the adapters themselves: inside the merged weights
                continue
            layer_name = owner.removesuffix(".base_layer")
            if owner.endswith(".base_layer") and layer_name in adapted:
                if leaf == "weight":  # summed in float32 and rounded once to the base's dtype
                    with torch.no_grad():
                        p = (p.float() + adapted[layer_name].get_delta_weight(ADAPTER).float()).to(p.dtype)
                name = f"{layer_name}.{leaf}"
            yield name, p

    return parallel.full_tensors(named())


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter weights as peft saves them (names without the adapter's name); the live tensors."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER)


def save_adapter(model, directory: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """peft's adapter format in ``directory``: ``adapter_config.json`` and, unless ``weights`` is empty (the
    FSDP case, weights in shards), ``adapter_model.safetensors`` (``weights``: None = the model's own now)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    peft_cfg = model.peft_config[ADAPTER]
    inference_mode = peft_cfg.inference_mode
    peft_cfg.inference_mode = True  # as peft writes it: loaded for use, not for training
    try:
        peft_cfg.save_pretrained(str(directory))
    finally:
        peft_cfg.inference_mode = inference_mode
    weights = adapter_state(model) if weights is None else weights
    if weights:
        save_file(
            {k: v.detach().contiguous() for k, v in weights.items()},
            str(directory / WEIGHTS_FILE),
            metadata={"format": "pt"},
        )


def read_adapter_config(directory: Path) -> dict:
    file = Path(directory) / CONFIG_FILE
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{file} is unreadable ({type(err).__name__}); the checkpoint is incomplete or "
            "damaged: delete its step directory or use another"
        ) from None


def check_settings(directory: Path, cfg: LoraConfig) -> None:
    """The adapter saved in ``directory`` has the shape and scale ``cfg`` asks for; else a CheckpointError
    naming the setting."""
    saved = read_adapter_config(directory)
    ours = {
        "rank": (saved.get("r"), cfg.rank),
        "alpha": (saved.get("lora_alpha"), cfg.lora_alpha),
        "dropout": (saved.get("lora_dropout"), cfg.dropout),
        "target_modules": (sorted(saved.get("target_modules") or []), sorted(cfg.target_modules)),
    }
    for key, (was, now) in ours.items():
        if was != now:
            raise CheckpointError(
                f"checkpoint {Path(directory).parent} holds a LoRA adapter with model.lora.{key}="
                f"{was}, this run asks for {now}: set model.lora.{key} as it was saved to resume it, "
                "or start a new run (another run.name)"
            )


def load_adapter(model, directory: Path) -> None:
    """The adapter weights saved in ``directory`` into ``model``'s adapters (every one of them, nothing else)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(directory) / WEIGHTS_FILE
    if not file.is_file():
        raise CheckpointError(
            f"{file} is missing; the checkpoint is incomplete: delete its step directory or use another"
        )
    weights = load_file(str(file))
    expected = adapter_state(model)
    if set(weights) != set(expected):
        raise CheckpointError(
            f"{file} does not fit this model's adapters (missing {sorted(set(expected) - set(weights))[:3]}, "
            f"unexpected {sorted(set(weights) - set(expected))[:3]}); resume with the model.path it was trained on"
        )
    set_peft_model_state_dict(model, weights, adapter_name=ADAPTER)


def saved_adapters_by_name(model, directory: Path) -> dict[str, torch.Tensor]:
    """The adapter weights saved in ``directory`` (one process) keyed by ``model``'s own parameter names, which
    include the adapter's name that peft's file leaves out: the form they take to FSDP ranks."""
    from safetensors.torch import load_file

    file = Path(directory) / WEIGHTS_FILE
    if not file.is_file():
        raise CheckpointError(
            f"{file} is missing; the checkpoint is incomplete: delete its step directory or use another"
        )
    weights = load_file(str(file))
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    out = {name: weights.get(name.replace(f".{ADAPTER}", "")) for name in trained}  # peft's renaming on save
    missing = [name for name, w in out.items() if w is None]
    if missing or len(weights) != len(out):
        raise CheckpointError(
            f"{file} does not fit this model's adapters ({len(weights)} saved, {len(out)} here; "
            f"missing {missing[:3]}); resume with the model.path it was trained on"
        )
    return out


def rebuild(base_model, directory: Path):
    """``base_model`` under adapters of the shape saved in ``directory`` (weights not loaded), as in training."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig.from_pretrained(str(directory))
    peft_cfg.inference_mode = False  # the same trainable parameters, so the same names in the shards
    peft_cfg.base_model_name_or_path = base_model.name_or_path  # the base used now (export --base)
    return get_peft_model(base_model, peft_cfg, adapter_name=ADAPTER)
