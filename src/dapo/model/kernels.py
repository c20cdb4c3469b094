"""Faster kernels for the trainer's forward and backward passes (``train.kernels``), each computing what the eager
model computes, to its dtype's rounding:

- ``compile``: ``torch.compile`` on each decoder layer, as torchtune compiles per layer: one layer's graph is
  compiled once and reused by every layer, so compile time does not grow with depth, and the layers' elementwise
  work (norms, activations, rotary embedding, residual adds, casts) is fused into few kernels. Shapes are dynamic
  (micro-batches differ in rows and length), so a new shape does not recompile.
- ``liger``: Liger Kernel's fused RMSNorm, SwiGLU and RoPE (Triton, CUDA only), on the model types it covers. Its
  fused linear cross-entropy is not used: dapo computes the sampled tokens' log-probs itself (``logprobs``).

Applied by ``Policy._prepare`` before LoRA adapters and FSDP, so the compiled layer includes the adapters' matmuls.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: the ModuleList with one entry per hidden layer."""
    count = getattr(lm.config, "num_hidden_layers", None)
    for module in lm.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"no list of {count} decoder layers found in {type(lm).__name__}")


def compile_decoder_layers(lm: nn.Module) -> int:
    """Compile every decoder layer in place (``nn.Module.compile``); returns how many."""
    layers = decoder_layers(lm)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def apply_liger(lm: nn.Module, device: torch.device) -> str:
    """Liger Kernel's RMSNorm, SwiGLU and RoPE on ``lm``; returns the model type. Raises ValueError with the fix
    where they cannot run: no CUDA, the library missing, a model type it does not cover."""
    if device.type != "cuda":
        raise ValueError(f"its Triton kernels run on CUDA only, and the trainer runs on {device.type}")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        raise ValueError(f"Liger Kernel is not installed ({err}): pip install liger-kernel") from None
    model_type = getattr(lm.config, "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ValueError(f"it has no kernels for model type {model_type!r}")
    # the fused cross-entropy variants replace the LM head's forward: dapo reads the head's logits itself
    wanted = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False}
    wanted["fused_linear_cross_entropy"] = False
    takes = inspect.signature(apply).parameters
    apply(model=lm, **{k: v for k, v in wanted.items() if k in takes})
    return model_type
