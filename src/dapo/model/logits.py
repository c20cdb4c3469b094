"""What a causal LM's own forward does to its LM head's output, so the trainer's log-probs are of the
distribution the engines sample.

The trainer runs the decoder and the head weight itself (``logprobs.ResponseLogProbs``: only response
positions reach the head, chunk by chunk), never the CausalLM's forward. Some forwards change the
logits after the head: Granite divides them by ``logits_scaling``, Cohere multiplies them by
``logit_scale``, Gemma 2 and 3 soft-cap them (``cap * tanh(z / cap)``), others scale the hidden state
before the head. vLLM and transformers' generate apply these, so the trainer must too.

``find_logit_transform`` reads the transform off the model itself: it runs the CausalLM's forward with
its decoder replaced by a stub that returns chosen hidden states, so only the head and what follows
it run, and fits ``z -> softcap * tanh(scale * z / softcap)`` (or ``scale * z``) to what comes out. A
forward that does something else (a bias added after the head, a different non-linearity) is found
out by the same probe and refused with one line.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# probe rows: enough values (rows x vocabulary) that a fitted scale is exact to float32 rounding
PROBE_ROWS = 32
# the probe's logits spread this much (standard deviation) so that soft-capping and scaling show
PROBE_LOGIT_STD = 8.0
# the largest relative difference between the model's own logits and the fitted transform's that
# passes as rounding: float32 computes both the same way; bf16 and fp16 round the model's logits to
# 8 and 11 significant bits (2^-8 = 3.9e-3, 2^-11 = 4.9e-4) before its transform, and the fit uses them
PROBE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


class UnsupportedModel(ValueError):
    """The model's logits cannot be reproduced by the trainer's head path."""


@dataclass(frozen=True)
class LogitTransform:
    """The map from the LM head's output ``z`` to the model's logits:
    ``softcap * tanh(scale * z / softcap)``, or ``scale * z`` when ``softcap`` is None."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """The logits, with autograd (soft-capping's gradient is tanh's)."""
        if self.softcap is not None:
            return torch.tanh(z * (self.scale / self.softcap)) * self.softcap
        return z if self.scale == 1.0 else z * self.scale

    def describe(self) -> str:
        if self.softcap is not None:
            return f"logits soft-capped at {self.softcap:g}" + ("" if self.scale == 1.0 else f" after x{self.scale:g}")
        return "logits as the head gives them" if self.scale == 1.0 else f"logits x{self.scale:g}"


def _config_numbers(config) -> list[float]:
    """Every positive number in the config and its text sub-config: the scale a forward applies is one of
    these or its inverse (``logits_scaling``, ``logit_scale``, ``lm_head_multiplier``, width ratios...)."""
    values = []
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        for v in vars(cfg).values():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v):
                values.append(float(v))
    return values


def _softcap_of(config) -> float | None:
    """The final soft-capping the config sets as Gemma 2 and 3 spell it (``final_logit_softcapping``); other
    spellings (RecurrentGemma's ``logits_soft_cap``, xLSTM's ``output_logit_soft_cap``) are found by the fit."""
    for cfg in (config, getattr(config, "text_config", None)):
        cap = getattr(cfg, "final_logit_softcapping", None) if cfg is not None else None
        if cap:
            return float(cap)
    return None


def _stub_output(hidden: torch.Tensor):
    """What the stub decoder returns: ``hidden`` as the last hidden state, and None for anything else a
    CausalLM's forward reads off its decoder's output (a mixture of experts' ``router_logits``, GPT-2's
    ``cross_attentions``, a recurrent model's ``cache_params`` or ``state``...)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class AnyOutput(BaseModelOutputWithPast):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return AnyOutput(last_hidden_state=hidden)


@contextmanager
def _decoder_returning(decoder, hidden: torch.Tensor):
    """The decoder's forward replaced by one that returns ``hidden`` as its last hidden state (no layer runs)."""
    calls = []

    def stub(*args, **kwargs):
        calls.append(True)
        return _stub_output(hidden)

    decoder.forward = stub
    try:
        yield calls
    finally:
        del decoder.forward  # the class's forward again


def _unwrapped(lm):
    """The transformers model under a peft wrapper."""
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def probe_logits(lm, hidden: torch.Tensor) -> torch.Tensor:
    """The model's own logits for the last hidden states ``hidden`` (n, H): its CausalLM forward with the
    decoder answering ``hidden``. Raises UnsupportedModel when the forward does not take them."""
    lm = _unwrapped(lm)
    ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
    from dapo.model.loading import decoder_of

    with torch.no_grad(), _decoder_returning(decoder_of(lm), hidden[None]) as calls:
        try:
            logits = lm(input_ids=ids, use_cache=False).logits  # (1, n, V)
        except Exception as err:  # noqa: BLE001 - any failure means the forward does not go through get_decoder()
            raise UnsupportedModel(
                f"its forward does not run the decoder that get_decoder() returns "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            ) from err
    if not calls:
        raise UnsupportedModel("its forward does not run the decoder that get_decoder() returns")
    return logits[0].float()


def find_logit_transform(lm, *, seed: int = 0) -> LogitTransform:
    """The transform ``lm``'s forward applies after its LM head, read off the model (module docstring).

    Raises UnsupportedModel with a clause for an error message when no soft-cap-and-scale transform
    reproduces the model's logits to rounding."""
    base = _unwrapped(lm)
    head = base.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise UnsupportedModel("no LM head (get_output_embeddings() is None)")
    weight = head.weight
    gen = torch.Generator().manual_seed(seed)
    unit = torch.randn(PROBE_ROWS, weight.shape[1], generator=gen)
    with torch.no_grad():
        z_unit = head(unit.to(weight.device, weight.dtype)).float()
        spread = (z_unit - z_unit.mean()).pow(2).mean().sqrt().clamp(min=1e-6)
        hidden = (unit * (PROBE_LOGIT_STD / float(spread))).to(weight.device, weight.dtype)  # (n, H)
        z = head(hidden).float()  # (n, V) what the head gives
    y = probe_logits(base, hidden)  # (n, V) what the model returns
    if y.shape != z.shape:
        raise UnsupportedModel(f"its logits have shape {tuple(y.shape)}, its head gives {tuple(z.shape)}")
    rtol = PROBE_RTOL.get(weight.dtype, 1e-5)
    numbers = _config_numbers(base.config)
    softcap = _softcap_of(base.config)
    if softcap is not None:
        if not bool((y.abs() <= softcap * (1 + rtol)).all()):
            raise UnsupportedModel(
                f"final_logit_softcapping={softcap:g} but its logits reach {float(y.abs().max()):.4g}"
            )
        caps = [softcap]
    else:  # no cap, else a cap the config names otherwise: the smallest of its numbers above every logit that fits
        caps = [None] + sorted(c for c in set(numbers) if c > float(y.abs().max()) * (1 + rtol))
    errors = []
    for cap in caps:
        if cap is not None:
            target = torch.atanh(y / cap) * cap  # scale * z, where the cap's inverse is well conditioned
            keep = y.abs() < 0.9 * cap
            scale = float((target[keep] * z[keep]).sum() / z[keep].pow(2).sum())
        else:
            scale = float((y * z).sum() / z.pow(2).sum())  # least squares: y = scale * z
        for fitted in (_snap(scale, numbers), scale):  # as the config spells it, else as fitted
            transform = LogitTransform(fitted, cap)
            errors.append(float((transform(z) - y).abs().max() / y.abs().max().clamp(min=1e-12)))
            if errors[-1] <= rtol:
                return transform
    raise UnsupportedModel(
        f"its forward computes the logits in a way the trainer cannot reproduce (more than the LM head "
        f"and a scale or soft cap: the best such fit is off by {min(errors):.2g} of the largest logit)"
    )


def _snap(scale: float, numbers: list[float], rtol: float = 1e-3) -> float:
    """The fitted scale as the config spells it (1, a setting, or a setting's inverse) when one is that close."""
    for exact in [1.0] + numbers + [1.0 / v for v in numbers]:
        if abs(scale - exact) <= rtol * abs(exact):
            return exact
    return scale


# the largest logit difference between a sequence alone and the same sequence right-padded beside a longer one,
# relative to the largest logit, that passes as rounding: float32 kernels differ in summation order only; bf16
# rounds every activation to 8 significant bits, and a padded batch may take another attention kernel
PADDING_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def padding_problem(lm) -> str | None:
    """Why the trainer's micro-batches would not give the model's own log-probs, or None. The trainer pads
    rows on the right and lets the attention mask hide the padding; a forward that lets padding reach the
    real tokens, or one autograd cannot differentiate, is found here on two short rows, before any run."""
    lm = _unwrapped(lm)
    weight = next(lm.parameters())
    short, long_ = [3, 4, 5], [6, 7, 8, 9, 10, 11]
    ids = torch.tensor([short + [0] * (len(long_) - len(short)), long_], device=weight.device)
    mask = torch.tensor([[1] * len(short) + [0] * (len(long_) - len(short)), [1] * len(long_)], device=weight.device)
    was_training = lm.training
    lm.train(False)
    try:
        with torch.no_grad():
            alone = lm(input_ids=ids[:1, : len(short)], use_cache=False).logits[0].float()
            padded = lm(input_ids=ids, attention_mask=mask, use_cache=False).logits[0, : len(short)].float()
        trainable = [p for p in lm.parameters() if p.requires_grad][:1]
        if trainable:
            try:
                with torch.enable_grad():
                    out = lm(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().sum()
                    torch.autograd.grad(out, trainable, allow_unused=True)  # into no .grad: only that it runs
            except RuntimeError as err:
                first = str(err).splitlines()[0] if str(err) else ""
                return f"a forward autograd cannot differentiate ({first[:160]})"
    finally:
        lm.train(was_training)
    off = float((alone - padded).abs().max() / alone.abs().max().clamp(min=1e-12))
    if not off <= PADDING_RTOL.get(weight.dtype, 1e-4):
        return (
            f"logits that change with the padding after a sequence ({off:.2g} of the largest logit on a probe): "
            "its forward does not keep the attention mask's padding out of the real tokens"
        )
    return None
