"""The policy and the reference model: Hugging Face causal LMs, their log-probs, and the update.

Nothing here decides anything about the algorithm: the loss arrives as a function (``LossFn``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from dapo import lora, parallel
from dapo.batch import RolloutBatch, pad_rows, plan_micro_batches, plan_shared_prompt_micro_batches, response_passes
from dapo.logits import LogitTransform, UnsupportedModel, find_logit_transform, padding_problem
from dapo.models import DTYPES, decoder_layers, decoder_of, load_model_and_tokenizer
from dapo.prefix import (
    SharedPrompts,
    fed_widths,
    prompt_of_rows,
    prompt_then_responses,
    shared_prompt_passes,
    unsupported,
)

if TYPE_CHECKING:
    from dapo.config import ModelConfig, TrainConfig


@dataclass
class MicroBatch:
    """One forward pass: rows right-padded to the longest (R = B), or packed into one row (R = 1), or
    (``shared``) the distinct prompts once and the responses after them.

    Only response positions reach the LM head: ``token_index`` picks, for each response token, the
    flat position in (R * L) whose hidden state predicts it (with ``shared``: in the prompt pass's
    positions, then the response passes'), and ``out_index`` where it goes in (B, T).
    """

    input_ids: torch.Tensor | None  # (R, L); None with shared prompts
    attention_mask: torch.Tensor | None  # (R, L) when padded; None when packed
    position_ids: torch.Tensor | None  # (R, L) restarting at 0 for each packed sequence; None when padded
    token_index: torch.Tensor  # (n,) flat index into R * L of the position that predicts each response token
    targets: torch.Tensor  # (n,) the response tokens
    out_index: torch.Tensor  # (n,) flat index into B * T
    num_rows: int  # B
    width: int  # T: the longest response in this micro-batch
    shared: SharedPrompts | None = None  # the prompt pass and response passes (train.share_prompt_prefix)

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass computes, padding included."""
        return self.input_ids.numel() if self.shared is None else self.shared.num_tokens


def make_micro_batch(
    batch: RolloutBatch,
    rows: list[int],
    pad_id: int,
    device,
    *,
    packed: bool = False,
    share_prompts: bool = False,
    split_responses: bool = True,
) -> MicroBatch:
    """The forward pass over ``rows``; ``share_prompts``: each distinct prompt once, the responses in
    passes of similar width (one pass without ``split_responses``)."""
    if share_prompts:
        return _shared_prompt_micro_batch(batch, rows, pad_id, device, split_responses)
    seqs = [batch.prompt_ids[i] + batch.response_ids[i] for i in rows]
    width = max(len(batch.response_ids[i]) for i in rows)
    token_index, targets, out_index = [], [], []
    offset = 0
    row_len = max(len(s) for s in seqs)
    for b, i in enumerate(rows):
        p, r = len(batch.prompt_ids[i]), len(batch.response_ids[i])
        base = offset if packed else b * row_len
        token_index += range(base + p - 1, base + p + r - 1)  # position p + t - 1 predicts response token t
        out_index += range(b * width, b * width + r)
        targets += batch.response_ids[i]
        offset += len(seqs[b])
    if packed:
        input_ids = torch.tensor([[t for s in seqs for t in s]], dtype=torch.long)  # (1, sum of lengths)
        position_ids = torch.cat([torch.arange(len(s)) for s in seqs])[None, :]
        attention_mask = None
    else:
        input_ids = pad_rows(seqs, pad_id)  # (B, L)
        lengths = torch.tensor([len(s) for s in seqs])
        attention_mask = (torch.arange(row_len)[None, :] < lengths[:, None]).long().to(device)
        position_ids = None
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return MicroBatch(
        input_ids.to(device),
        attention_mask,
        None if position_ids is None else position_ids.to(device),
        as_long(token_index),
        as_long(targets),
        as_long(out_index),
        len(rows),
        width,
    )


def _shared_prompt_micro_batch(batch: RolloutBatch, rows: list[int], pad_id: int, device, split: bool) -> MicroBatch:
    responses = [batch.response_ids[i] for i in rows]
    shared, token_index = shared_prompt_passes(
        [batch.prompt_ids[i] for i in rows],
        responses,
        response_passes(fed_widths(responses), split=split),
        pad_id,
        device,
    )
    width = max(len(batch.response_ids[i]) for i in rows)
    out_index = [t for b, i in enumerate(rows) for t in range(b * width, b * width + len(batch.response_ids[i]))]
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return MicroBatch(
        None,
        None,
        None,
        as_long(token_index),
        as_long([t for i in rows for t in batch.response_ids[i]]),
        as_long(out_index),
        len(rows),
        width,
        shared,
    )


def _head_logp(head, h: torch.Tensor, targets: torch.Tensor, temperature: float, transform: LogitTransform):
    logits = transform(head(h).float()) / temperature  # (n, V): float32 for this chunk only, the model's own logits
    log_z = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - log_z, logits, log_z


# CPU head chunks keep float32 logits under glibc's mmap threshold, free in time (benchmarks/RESULTS.md, HeadLogProbs)
CPU_HEAD_CHUNK_BYTES = 24 * 2**20
MIN_HEAD_CHUNK_ROWS = 64  # below this the head's matmuls slow down
CUDA_HEAD_CHUNK_ROWS = 1024  # CUDA's caching allocator reuses blocks: a chunk as large as a matmul likes


def head_chunk_rows(vocab_size: int, device: torch.device) -> int:
    if device.type == "cuda":
        return CUDA_HEAD_CHUNK_ROWS
    return max(MIN_HEAD_CHUNK_ROWS, CPU_HEAD_CHUNK_BYTES // (4 * vocab_size))


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, temperature: float, transform: LogitTransform, tanh_out: list | None = None
) -> torch.Tensor:
    """(rows, V) float32 logits at the sampling temperature: ``transform(head(h).float()) / temperature``.
    With soft-capping and ``tanh_out``, the tanh values (before the cap's multiplication) are appended to it."""
    z = (h @ weight.t()).float()
    if transform.softcap is None:
        return z.div_(temperature / transform.scale)
    u = z.mul_(transform.scale / transform.softcap).tanh_()
    if tanh_out is None:
        return u.mul_(transform.softcap / temperature)
    tanh_out.append(u)
    return u * (transform.softcap / temperature)


class HeadLogProbs(torch.autograd.Function):
    """The LM head (a bias-free linear layer) and each target token's log-prob under it, ``chunk``
    rows at a time, without keeping any logits for backward.

    Backward recomputes a chunk's logits and turns that one buffer, in place, into the gradient
    (one-hot - softmax) x grad / temperature; the head weight's gradient is one accumulation over the
    chunks. The same arithmetic as checkpointing each chunk of ``_head_logp``, where autograd makes a
    fresh (rows, V) tensor for the division, the log-sum-exp, the gather and each of their gradients,
    and a fresh (V, H) weight gradient per chunk. ``with_entropy``: also each row's entropy (no gradient).
    ``transform``: what the model's forward does to the head's output (``dapo.logits``); a soft cap's
    backward keeps a second (rows, V) buffer, its tanh values.
    """

    @staticmethod
    def forward(
        ctx,
        h,
        weight,
        targets,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        transform: LogitTransform = LogitTransform(),
    ):
        n = h.shape[0]  # h: (n, H), weight: (V, H), targets: (n,)
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        log_z = torch.empty_like(logp)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=h.device)
        for t0 in range(0, n, chunk):
            rows = slice(t0, t0 + chunk)
            logits = _chunk_logits(h[rows], weight, temperature, transform)  # (c, V)
            log_z[rows] = torch.logsumexp(logits, dim=-1)
            logp[rows] = logits.gather(-1, targets[rows, None]).squeeze(-1) - log_z[rows]
            if with_entropy:
                entropy[rows] = _entropy(logits, log_z[rows])
        ctx.save_for_backward(h, weight, targets, log_z)
        ctx.temperature, ctx.chunk, ctx.transform = temperature, chunk, transform
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        h, weight, targets, log_z = ctx.saved_tensors
        need_h, need_weight = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h) if need_h else None
        # the weight's gradient accumulates in place, in float32 (a fresh (V, H) product per chunk would
        # be page-faulted in anew each time on the CPU); a lower-precision weight's chunk products go
        # through one reused buffer of its dtype
        grad_weight = None
        part = None if weight.dtype == torch.float32 or not need_weight else torch.empty_like(weight)
        transform = ctx.transform
        for t0 in range(0, h.shape[0], ctx.chunk):
            rows = slice(t0, t0 + ctx.chunk)
            g = grad_logp[rows] * (transform.scale / ctx.temperature)  # (c,): d logits / d (h W^T) without a cap
            tanh = []
            coef = _chunk_logits(
                h[rows], weight, ctx.temperature, transform, tanh
            )  # (c, V), turned in place into d loss / d (h W^T)
            coef.sub_(log_z[rows, None]).exp_().mul_(-g[:, None])  # -softmax x g
            coef[torch.arange(coef.shape[0], device=coef.device), targets[rows]] += g  # + one-hot x g
            if tanh:  # the cap's own derivative: d (cap tanh(s z / cap)) / dz = s (1 - tanh^2)
                coef.mul_(tanh[0].square_().neg_().add_(1))
            coef = coef.to(weight.dtype)
            if need_h:
                grad_h[rows] = coef @ weight
            if need_weight and grad_weight is None:
                grad_weight = (coef.t() @ h[rows]).float()  # (V, H) = (V, c) @ (c, H); float32: no copy
            elif need_weight and part is None:
                grad_weight.addmm_(coef.t(), h[rows])
            elif need_weight:
                grad_weight.add_(torch.mm(coef.t(), h[rows], out=part))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)  # (no copy for float32)
        return grad_h, grad_weight, None, None, None, None, None


class ResponseLogProbs(nn.Module):
    """The log-prob pass over response tokens as one module (the decoder and the LM head of ``lm``, and
    what ``lm``'s own forward does to the head's output, ``transform``).

    Under FSDP this module is the root of the sharding, so the decoder and the head run inside one
    forward and their parameters are gathered and their gradients reduced like any other layer's.
    """

    def __init__(self, lm, transform: LogitTransform | None = None, *, fused_head: bool | None = None):
        super().__init__()
        self.transform = logit_transform(lm) if transform is None else transform
        self.decoder = decoder_of(lm)
        self.head = lm.get_output_embeddings()
        plain = isinstance(self.head, nn.Linear) and self.head.bias is None  # not an adapter-wrapped or biased head
        # HeadLogProbs where the head is a plain weight; the head module checkpointed chunk by chunk otherwise
        self.fused_head = plain if fused_head is None else fused_head and plain

    def forward(
        self, mb: MicroBatch, *, temperature: float, with_entropy: bool = False, chunk_tokens: int | None = None
    ):
        if mb.shared is None:
            hidden = self.decoder(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids
            ).last_hidden_state.flatten(0, 1)  # (R * L, H)
        else:
            hidden = prompt_then_responses(self.decoder, mb.shared)  # (prompt and response positions, H)
        h = hidden[mb.token_index]  # (n, H)
        chunk_tokens = chunk_tokens or head_chunk_rows(self.head.weight.shape[0], h.device)
        if self.fused_head:
            flat, ent = HeadLogProbs.apply(
                h, self.head.weight, mb.targets, temperature, chunk_tokens, with_entropy, self.transform
            )
            return self._scatter(mb, flat), self._scatter(mb, ent) if with_entropy else None
        logps, entropies = [], []
        for t0 in range(0, h.shape[0], chunk_tokens):
            h_c, y_c = h[t0 : t0 + chunk_tokens], mb.targets[t0 : t0 + chunk_tokens]
            if torch.is_grad_enabled():
                head = self._checkpointed_head(temperature, entropies if with_entropy else None)
                logps.append(torch.utils.checkpoint.checkpoint(head, h_c, y_c, use_reentrant=False))
                continue
            logp, logits, log_z = _head_logp(self.head, h_c, y_c, temperature, self.transform)
            logps.append(logp)
            if with_entropy:
                entropies.append(_entropy(logits, log_z))
        return self._scatter(mb, torch.cat(logps)), self._scatter(mb, torch.cat(entropies)) if with_entropy else None

    @staticmethod
    def _scatter(mb: MicroBatch, flat: torch.Tensor) -> torch.Tensor:
        """(n,) per response token -> (B, T). Scattered straight into a fresh tensor: a view of a flat
        buffer as the output would make FSDP warn that an in-place op on it could skip its pre-backward hook."""
        out_at = torch.unravel_index(mb.out_index, (mb.num_rows, mb.width))
        return flat.new_zeros(mb.num_rows, mb.width).index_put(out_at, flat)

    def _checkpointed_head(self, temperature: float, entropies: list | None):
        """One chunk's log-probs for activation checkpointing; with ``entropies``, the first call (the
        forward, not backward's recomputation) also appends the chunk's entropy, detached, from the
        same logits."""

        def head(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logp, logits, log_z = _head_logp(self.head, x, y, temperature, self.transform)
            if entropies is not None and not done:
                with torch.no_grad():
                    entropies.append(_entropy(logits.detach(), log_z.detach()))
                done.append(True)
            return logp

        done: list[bool] = []
        return head


def logit_transform(lm) -> LogitTransform:
    """What ``lm``'s forward does after its LM head (``dapo.logits``), found once per model. Raises
    UnsupportedModel when the trainer cannot reproduce it."""
    found = lm.__dict__.get("_dapo_logit_transform")
    if found is None:
        found = find_logit_transform(lm)
        lm.__dict__["_dapo_logit_transform"] = found
    return found


def _entropy(logits: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
    """Entropy of each row's softmax distribution, from its (n, V) logits and their logsumexp."""
    return log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def token_logprobs(
    model, mb: MicroBatch, *, temperature: float, with_entropy: bool = False, chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token, at the sampling temperature: (B, T), and entropy (B, T).

    Only response positions go through the LM head, ``chunk_tokens`` at a time (default:
    ``head_chunk_rows``). Backward recomputes each chunk's logits instead of keeping them
    (``HeadLogProbs``; a head that is not a plain bias-free linear layer, e.g. an adapter's, is
    checkpointed chunk by chunk instead), so float32 logits for more than one chunk never exist at
    once, in forward or backward. ``model`` is a causal LM or its ``ResponseLogProbs`` (the sharded
    one under FSDP).
    """
    logprob_pass = model if isinstance(model, ResponseLogProbs) else ResponseLogProbs(model)
    return logprob_pass(mb, temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens)


def uses_varlen_attention(model) -> bool:
    """Whether packed sequences avoid padding compute: flash-attention kernels take them without a mask."""
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash_attention")


def _grad_into(master: torch.Tensor):
    """A hook that moves a low-precision parameter's fresh gradient into its float32 master's."""

    def hook(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.float()
        else:  # one kernel that widens and adds, where .float() then add_ is a copy and an add (GPU profile)
            master.grad.add_(p.grad)
        p.grad = None  # the bf16 gradient is not kept: the next backward starts it from zero

    return hook


# dapo.algo.Stat (value, weight, how): the loss brings its statistics, and this module imports no algorithm
Stat = tuple[torch.Tensor, torch.Tensor, str]


class LossFn(Protocol):
    """The loss ``Policy.update`` minimises, called once per micro-batch (B rows, T its longest response):

      logp        (B, T) log-probs of the response tokens under the weights being trained (with gradient)
      old_logp    (B, T) under the weights that sampled them
      adv         (B,)   advantages
      mask        (B, T) 1 on the tokens trained on
      num_tokens, num_seqs   valid tokens and sequences of the whole mini-batch (every micro-batch, every
                  rank): dividing by these makes the micro-batch losses add up to the mini-batch's
      is_weights  (B, T) per-token loss weights, or None
      ref_logp    (B, T) under the reference model, or None when the batch has none

    It returns the loss and its statistics by name (``dapo.algo.Stat``: a value and how it combines over
    micro-batches and ranks), the same names at every call; each becomes a metric of the step
    (``actor/<name>``). ``dapo.algo.actor_loss`` gives pg_loss, kl_loss with a KL term, and policy_loss's.
    The name ``loss`` is the update's own: the loss itself, whose sum skips a non-finite update.
    """

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        *,
        num_tokens: torch.Tensor,
        num_seqs: torch.Tensor,
        is_weights: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, Stat]]: ...


class StatTotals:
    """One optimizer update's statistics (``dapo.algo.Stat``), combined on the device over its micro-batches,
    then over the ranks in one collective: a "mean" weighted by its weights (0 where they add up to 0), a
    "sum" added, a "max" the largest, a "min" the smallest of those with a weight (0 where none has)."""

    def __init__(self) -> None:
        self.totals: dict[str, Stat] = {}  # value: the sum of value x weight ("mean"), the sum, or the max

    def add(self, stats: dict[str, Stat]) -> None:
        for name, (value, weight, how) in stats.items():
            if how == "mean":
                value = value * weight
            elif how == "min":
                value = torch.where(weight > 0, value, torch.full_like(value, float("inf")))
            if (t := self.totals.get(name)) is None:
                self.totals[name] = (value, weight, how)
            else:
                combine = {"max": torch.maximum, "min": torch.minimum}.get(how, torch.add)
                self.totals[name] = (combine(t[0], value), t[1] + weight, how)

    def reduce(self, dist: parallel.Dist) -> dict[str, tuple[torch.Tensor, str]]:
        """Each statistic's value over every rank (whose losses return the same names), on the CPU, and its how."""
        if not self.totals:  # a mini-batch whose rows were all filtered out trained on nothing
            return {}
        names, hows = list(self.totals), [how for _, _, how in self.totals.values()]
        local = torch.stack([torch.stack([v.float(), w.float()]) for v, w, _ in self.totals.values()])  # (K, 2)
        per_rank = parallel.all_gather(local, dist).cpu()  # (ranks, K, 2)
        is_ = {h: torch.tensor([how == h for how in hows]) for h in ("mean", "max", "min")}  # (K,) each
        value = torch.where(is_["max"], per_rank[..., 0].amax(0), per_rank[..., 0].sum(0))  # (K,)
        value = torch.where(is_["min"], per_rank[..., 0].amin(0), value)
        weight = per_rank[..., 1].sum(0)  # (K,)
        value = torch.where(is_["mean"], value / weight.clamp(min=1e-30), value)
        value = torch.where((is_["mean"] | is_["min"]) & (weight <= 0), torch.zeros(()), value)
        return {k: (v, h) for k, v, h in zip(names, value.unbind(), hows)}


def over_updates(per_update: list[dict[str, tuple[torch.Tensor, str]]]) -> dict[str, torch.Tensor]:
    """The step's statistics: each one's mean over the optimizer updates that have it ("max", "min": their
    largest, smallest)."""
    hows = {k: how for stats in per_update for k, (_, how) in stats.items()}
    values = {k: torch.stack([stats[k][0] for stats in per_update if k in stats]) for k in hows}
    reduce = {"max": torch.amax, "min": torch.amin}
    return {k: reduce.get(hows[k], torch.mean)(v) for k, v in values.items()}


class LogProbModel:
    """A causal LM's log-probs of a rollout batch's response tokens: rows split into micro-batches by
    the token budget (packed where the attention kernels allow, or each distinct prompt once with
    ``train.share_prompt_prefix``), and under FSDP each rank computing its share of the rows with the
    sharded log-prob pass."""

    def __init__(
        self,
        lm,
        pad_id: int,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        dist: parallel.Dist,
        *,
        temperature: float,
        device: torch.device,
        max_seq_tokens: int | None = None,
    ):
        self.model = lm
        self.pad_id = pad_id
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        self.dist, self.device = dist, device
        self.temperature = temperature  # log-probs are of the distribution that sampled: at its temperature
        self.share_prompts = train_cfg.share_prompt_prefix
        from dapo.config import ConfigError

        if self.share_prompts and (why := unsupported(lm, max_seq_tokens)):
            raise ConfigError(
                f"train.share_prompt_prefix=true: {model_cfg.path} has {why}; set train.share_prompt_prefix=false"
            )
        try:
            logit_transform(lm)  # found before sharding, on the whole head
        except UnsupportedModel as err:
            raise ConfigError(
                f"model.path={model_cfg.path}: {err}; its log-probs would not be those the engines "
                "sample, so it cannot be trained exactly"
            ) from None
        if why := padding_problem(lm):
            raise ConfigError(
                f"model.path={model_cfg.path}: {why}; the trainer's micro-batches would not give its own "
                "log-probs, so it cannot be trained exactly"
            )
        self.logprob_pass = self._sharded_logprob_pass(lm)

    def _sharded_logprob_pass(self, lm) -> ResponseLogProbs:
        """The model's log-prob pass; under FSDP sharded across ranks (one unit per decoder layer),
        float32 master weights, forward and backward in model.dtype."""
        logprob_pass = ResponseLogProbs(lm, logit_transform(lm))
        return parallel.wrap(
            logprob_pass,
            decoder_layers(logprob_pass.decoder),
            self.dist,
            compute_dtype=DTYPES[self.model_cfg.dtype],
            cpu_offload=self.train_cfg.cpu_offload,
        )

    def _rank_rows(self, batch: RolloutBatch, rows: list[int]) -> list[int]:
        """This rank's share of a mini-batch's rows, balanced by sequence tokens (all of them when alone).
        Sharing prompts, whole prompts go to a rank with their rows, where there are enough of them."""
        costs = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows]
        if not (self.share_prompts and self.dist.sharded):
            return parallel.rank_share(rows, costs, self.dist)
        by_prompt: dict[int, list[int]] = {}
        for i, u in zip(rows, prompt_of_rows([batch.prompt_ids[i] for i in rows])):
            by_prompt.setdefault(u, []).append(i)
        if len(by_prompt) < self.dist.world_size:  # a rank left idle would cost more than a prompt computed twice
            return parallel.rank_share(rows, costs, self.dist)
        groups = list(by_prompt.values())
        group_costs = [len(batch.prompt_ids[g[0]]) + sum(len(batch.response_ids[i]) for i in g) for g in groups]
        return sorted(i for g in parallel.rank_share(groups, group_costs, self.dist) for i in g)

    # ---- micro-batches --------------------------------------------------------------------
    @property
    def packed(self) -> bool:
        mode = self.train_cfg.pack_sequences
        return mode == "true" or (mode == "auto" and uses_varlen_attention(self.model))

    def micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        """``rows`` split by the token budget; returns lists of batch row indices."""
        t = self.train_cfg
        if self.share_prompts:
            prompts = [batch.prompt_ids[i] for i in rows]
            widths = fed_widths([batch.response_ids[i] for i in rows])
            plan = plan_shared_prompt_micro_batches(
                prompt_of_rows(prompts),
                [len(p) for p in prompts],
                widths,
                t.max_tokens_per_micro_batch,
                max_rows=t.micro_batch_size,
                split_responses=self.split_responses,
            )
        else:
            lengths = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows]
            plan = plan_micro_batches(
                lengths, t.max_tokens_per_micro_batch, packed=self.packed, max_rows=t.micro_batch_size
            )
        return [[rows[j] for j in chunk] for chunk in plan]

    @property
    def split_responses(self) -> bool:
        # FSDP gathers every layer's shard at each decoder call, so ranks must make the same calls: one
        # response pass per micro-batch, whatever widths each rank's rows have
        return not self.dist.sharded

    def _make_micro_batch(self, batch: RolloutBatch, rows: list[int]) -> MicroBatch:
        return make_micro_batch(
            batch,
            rows,
            self.pad_id,
            self.device,
            packed=self.packed,
            share_prompts=self.share_prompts,
            split_responses=self.split_responses,
        )

    # ---- log-probs ------------------------------------------------------------------------
    def mini_batch_rows(self, batch: RolloutBatch) -> list[list[int]]:
        """The rows of each optimizer update of one pass over ``batch``, in order: whole groups,
        ``train.mini_batch_prompts`` of them per update."""
        g, per_update = batch.group_size, max(1, self.train_cfg.mini_batch_prompts)
        groups = list(range(batch.num_groups))
        return [
            [i * g + j for i in groups[s : s + per_update] for j in range(g)] for s in range(0, len(groups), per_update)
        ]

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, *, with_entropy: bool = False):
        """(N, T) log-probs of the sampled tokens (and entropy) under this model."""
        was_training = self.model.training
        self.model.train(False)
        T = batch.max_response_len
        logp = torch.zeros(len(batch), T)
        entropy = torch.zeros(len(batch), T) if with_entropy else None
        rows = list(range(len(batch)))
        if self.dist.sharded:  # the rows this rank trains on; the others' come with the all-reduce below
            per_update = self.train_cfg.mini_batch_prompts * batch.group_size
            by_update: dict[int, list[int]] = {}
            for i in rows:
                by_update.setdefault(i // per_update, []).append(i)
            rows = [i for chunk in by_update.values() for i in self._rank_rows(batch, chunk)]
        for micro in parallel.same_count(self.micro_batches(batch, rows), self.dist):
            mb = self._make_micro_batch(batch, micro or [0])  # None: a pass only to join the collectives
            lp, ent = token_logprobs(self.logprob_pass, mb, temperature=self.temperature, with_entropy=with_entropy)
            if micro is None:
                continue
            logp[micro, : mb.width] = lp.float().cpu()
            if with_entropy:
                entropy[micro, : mb.width] = ent.float().cpu()
        self.model.train(was_training)
        if self.dist.sharded:  # every row was filled by exactly one rank
            logp = parallel.all_reduce(logp, self.dist)
            entropy = parallel.all_reduce(entropy, self.dist) if with_entropy else None
        return logp, entropy


def _placement(
    dist: parallel.Dist | None, device: torch.device | None
) -> tuple[parallel.Dist, torch.device, str | torch.device]:
    """The process group, the device computed on, and where the weights are loaded: under FSDP each
    rank loads on CPU and keeps only its shard on the device."""
    dist = dist or parallel.Dist(device=device or torch.device("cpu"))
    device = dist.device if device is None else device
    return dist, device, "cpu" if dist.sharded else device


class ReferenceModel(LogProbModel):
    """The initial weights, frozen: log-probs under pi_ref for a KL penalty (GRPO's; DAPO has none)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        dist: parallel.Dist | None = None,
        *,
        temperature: float,
        device: torch.device | None = None,
        max_seq_tokens: int | None = None,
    ):
        dist, device, load_on = _placement(dist, device)
        lm, tokenizer = load_model_and_tokenizer(
            model_cfg.path,
            model_cfg.dtype,
            load_on,
            trust_remote_code=model_cfg.trust_remote_code,
            keep_dropout=model_cfg.keep_dropout,
        )
        lm.requires_grad_(False).train(False)
        super().__init__(
            lm,
            tokenizer.pad_token_id,
            model_cfg,
            train_cfg,
            dist,
            temperature=temperature,
            device=device,
            max_seq_tokens=max_seq_tokens,
        )

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """(N, T) log-probs of the sampled tokens under the reference weights."""
        return self.compute_logprobs(batch)[0]


# AdamW's settings that say how it computes, not what: a checkpoint from another world size keeps this run's
OPTIMIZER_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


class Policy(LogProbModel):
    """The policy being trained: the model and tokenizer from ``model_cfg``, AdamW and its schedule from
    ``train_cfg``, float32 master weights below float32, sharded with FSDP over ``dist``'s ranks.

    ``update`` runs the optimizer updates of one rollout batch on a loss it is given (``LossFn``);
    ``temperature`` is the sampling temperature, at which every log-prob is computed.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        dist: parallel.Dist | None = None,
        *,
        temperature: float,
        device: torch.device | None = None,
        max_seq_tokens: int | None = None,
    ):
        dist, device, load_on = _placement(dist, device)
        lm, self.tokenizer = load_model_and_tokenizer(
            model_cfg.path,
            model_cfg.dtype,
            load_on,
            trust_remote_code=model_cfg.trust_remote_code,
            keep_dropout=model_cfg.keep_dropout,
        )
        if model_cfg.gradient_checkpointing:
            lm.gradient_checkpointing_enable()
        lm.config.use_cache = False  # training forward passes never need the KV cache
        self.adapted = model_cfg.lora.enabled
        if self.adapted:  # the base frozen, LoRA adapters trained; the model is the peft model from here on
            lm = lora.add_adapters(lm, model_cfg.lora, seed=train_cfg.seed)
        super().__init__(
            lm,
            self.tokenizer.pad_token_id,
            model_cfg,
            train_cfg,
            dist,
            temperature=temperature,
            device=device,
            max_seq_tokens=max_seq_tokens,
        )
        self.master = self._master_weights()  # float32 copies in one process below float32; None otherwise
        t = train_cfg
        params = self.master or [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=t.lr,
            betas=tuple(t.betas),
            weight_decay=t.weight_decay,
            # torch's fused kernel: the same AdamW update to rounding, in one pass over each tensor and
            # its moments, with none of the foreach path's tensor-sized temporaries (sharded DTensors: foreach)
            fused=not self.dist.sharded and all(p.device.type in ("cpu", "cuda") for p in params),
        )
        warmup = t.warmup_steps
        # the schedule advances once per training step (not per optimizer update), like the paper's
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )
        self.skipped_updates = 0  # optimizer updates skipped for a non-finite loss or gradient norm, over the run
        self.nonfinite_in_a_row = 0  # of those, how many came last in a row (0 after a finite update)
        self.last_updates = (0, 0)  # the last ``update`` call's (optimizer updates, of them skipped)

    def _master_weights(self) -> list[nn.Parameter] | None:
        """Float32 master weights for a single process that computes in bfloat16 (or float16).

        bf16 keeps 8 significant bits: a weight of 0.05 moves in steps of 2.4e-4, so AdamW's updates at
        lr 1e-6 would mostly round away if it updated the bf16 weights themselves. As FSDP does
        (parallel.wrap) and as the reference's actor does, the optimizer and its state work on float32
        copies: forward and backward run on the model's bf16 weights (the rollout engine shares them),
        each backward's gradient is added into its float32 copy (so micro-batches accumulate in float32),
        and after every optimizer step the model takes the copies rounded to bf16 (``_sync_from_master``).
        Under FSDP (sharded) the parameters are already float32 masters.
        """
        trained = [p for p in self.model.parameters() if p.requires_grad]
        if self.dist.sharded or all(p.dtype == torch.float32 for p in trained):
            return None  # (peft keeps LoRA adapters in float32 under a bf16 base: they are their own masters)
        masters = []
        for p in trained:
            master = nn.Parameter(p.detach().float().clone())
            p.register_post_accumulate_grad_hook(_grad_into(master))
            masters.append(master)
        return masters

    @torch.no_grad()
    def _sync_from_master(self) -> None:
        if self.master is not None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            torch._foreach_copy_(params, self.master)  # round to the compute dtype, in a few kernels

    # ---- the update -----------------------------------------------------------------------
    def update(self, batch: RolloutBatch, loss_fn: LossFn, *, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Several optimizer updates over one rollout batch (mini-batches of whole groups,
        ``mini_batch_rows``), each minimising ``loss_fn`` summed over its micro-batches.

        ``loss_fn`` gets the whole mini-batch's token and sequence counts, so splitting it into
        micro-batches (or over ranks) leaves the gradient unchanged. Returns its statistics and the
        gradient norm over the updates (``over_updates``), the learning rate and the skipped updates.
        ``with_entropy``: each row's entropy from the first forward over it goes into ``batch.entropy``
        (algo.old_logp=engine runs no log-prob pass that would give it).
        """
        self.model.train()
        entropy = torch.zeros(len(batch), batch.max_response_len) if with_entropy else None  # this rank's rows
        per_update, skipped_before = [], self.skipped_updates
        for epoch in range(self.train_cfg.ppo_epochs):
            for rows in self.mini_batch_rows(batch):
                rows = self._rank_rows(batch, rows)
                per_update.append(self._mini_batch_update(batch, rows, loss_fn, entropy if epoch == 0 else None))
        if entropy is not None:  # every row was filled by exactly one rank
            batch.entropy = parallel.all_reduce(entropy, self.dist)
        self.scheduler.step()
        out = over_updates(per_update)
        out["lr"] = torch.tensor(self.optimizer.param_groups[0]["lr"])
        out["skipped_updates"] = torch.tensor(float(self.skipped_updates))
        out["nonfinite_updates"] = torch.tensor(float(self.skipped_updates - skipped_before))  # this step's
        self.last_updates = (len(per_update), self.skipped_updates - skipped_before)
        return out

    def _mini_batch_update(
        self, batch: RolloutBatch, rows: list[int], loss_fn: LossFn, entropy: torch.Tensor | None
    ) -> dict[str, tuple[torch.Tensor, str]]:
        """One optimizer update over this rank's ``rows``: the loss's statistics and the gradient norm."""
        width = max((len(batch.response_ids[i]) for i in rows), default=0)
        mask = batch.response_mask(torch.tensor(rows, dtype=torch.long), width=width)  # (n, T_mb)
        # the divisors count the whole mini-batch on every rank (DAPO eq. 12 over the step, not the shard)
        counts = {
            "num_tokens": parallel.all_reduce(mask.sum(), self.dist).to(self.device),
            "num_seqs": parallel.all_reduce((mask.sum(-1) > 0).sum(), self.dist).to(self.device),
        }
        totals = StatTotals()
        for micro in parallel.same_count(self.micro_batches(batch, rows), self.dist):
            totals.add(self._micro_batch_backward(batch, micro, loss_fn, counts, entropy))
        stats = totals.reduce(self.dist)
        grad_norm = parallel.clip_grad_norm(self.master or self.model.parameters(), self.train_cfg.grad_clip)
        # the loss summed over every rank: an inf whose gradient is 0 skips too, and every rank skips together
        loss, _ = stats.pop("loss", (torch.zeros(()), "sum"))
        if torch.isfinite(grad_norm) and bool(torch.isfinite(loss)):
            self.optimizer.step()
            self._sync_from_master()
            self.nonfinite_in_a_row = 0
        else:
            self.skipped_updates += 1  # one bad batch must not poison the weights: they and AdamW's state stay
            self.nonfinite_in_a_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {**stats, "grad_norm": (grad_norm.detach().float().cpu(), "mean")}

    def _micro_batch_backward(
        self, batch: RolloutBatch, micro: list[int] | None, loss_fn: LossFn, counts: dict, entropy: torch.Tensor | None
    ) -> dict[str, Stat]:
        """Forward and backward over one micro-batch (None: a pass only to join the ranks' collectives);
        returns the loss's statistics and the loss itself, as "loss"."""
        rows = micro or [0]
        idx = torch.tensor(rows)
        width = max(len(batch.response_ids[i]) for i in rows)
        mask = batch.response_mask(idx, width=width) * (micro is not None)  # (B, T)
        if mask.sum() == 0 and not self.dist.sharded:  # every row filtered out (overlong filtering)
            return {}
        with_entropy = entropy is not None and micro is not None
        mb = self._make_micro_batch(batch, rows)
        logp, ent = token_logprobs(self.logprob_pass, mb, temperature=self.temperature, with_entropy=with_entropy)
        if with_entropy:
            entropy[idx, :width] = ent.float().cpu()  # (B, T)
        on_device = lambda x: None if x is None else x[idx, :width].to(self.device)  # noqa: E731
        loss, stats = loss_fn(
            logp,
            on_device(batch.old_logp),
            batch.adv[idx].to(self.device),
            mask.to(self.device),
            **counts,
            is_weights=on_device(batch.is_weights),
            ref_logp=on_device(batch.ref_logp),
        )
        loss.backward()
        return {**stats, "loss": (loss.detach(), loss.new_ones(()), "sum")}

    # ---- state -----------------------------------------------------------------------------
    def named_weights(self):
        """(name, full tensor) per parameter of the model being trained, under the base model's names; with
        LoRA the adapted layers' weights merged. Under FSDP each is gathered in turn, on every rank."""
        if self.adapted:
            return lora.merged_weights(self.model)
        return parallel.full_tensors(self.model.named_parameters())

    def base_reference(self) -> BaseReference:
        """The reference model of a LoRA run: this policy with its adapters off (see ``BaseReference``)."""
        return BaseReference(self)

    def trainer_state(self) -> dict:
        # the streak too: a run stopped by run.max_nonfinite_in_a_row and started again stops at the next bad update
        state = {
            "scheduler": self.scheduler.state_dict(),
            "skipped_updates": self.skipped_updates,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }
        if not self.dist.sharded:  # under FSDP the optimizer is saved in shards, with the model
            state["optimizer"] = self.optimizer.state_dict()
        if self.master is not None:  # the model directory holds the bf16 weights; the float32 masters go here
            state["master_weights"] = [m.detach() for m in self.master]  # live, as the optimizer's state
        return state

    def sharded_state(self) -> dict | None:
        """Model and optimizer shards for torch.distributed.checkpoint; None in a single process."""
        if not self.dist.sharded:
            return None
        return parallel.sharded_state(self.model, self.optimizer, trainable_only=self.adapted)

    def load_sharded_state(self, state: dict) -> None:
        parallel.load_sharded_state(self.model, self.optimizer, state, trainable_only=self.adapted)

    def trained_names(self) -> list[str]:
        """The names of the parameters AdamW updates, in its order: a one-process optimizer state keys its
        entries by these positions, a sharded one (torch's distributed state dict) by these names."""
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def optimizer_state_by_name(self, state: dict) -> dict:
        """A one-process AdamW state dict (entries by position) keyed by parameter name, as a sharded
        checkpoint keys it: the form in which it goes to another world size."""
        names = self.trained_names()
        positions = {i for g in state["param_groups"] for i in g["params"]}
        if positions != set(range(len(names))):
            raise parallel.CheckpointError(
                f"the checkpoint's AdamW state is for {len(positions)} parameters and this "
                f"model trains {len(names)}: resume it with the model.path and model.lora "
                "settings it was written with"
            )
        return {
            "state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
        }

    def load_full_state(self, weights: dict[str, torch.Tensor], optimizer: dict) -> None:
        """A checkpoint written at another world size: ``weights``, whole float32 tensors by parameter name
        (every parameter, or with LoRA the adapters), and ``optimizer``, AdamW's state keyed by name
        (``optimizer_state_by_name``). Under FSDP each rank keeps its shards; in one process the float32
        masters (below float32) take the weights as they are and the model takes them rounded.

        The saved hyper-parameters (lr, betas, ...) are restored, this run's AdamW implementation kept
        (fused in one process, foreach over shards): both take the same steps up to rounding."""
        names = self.trained_names()
        missing = [n for n in names if n not in weights]
        if missing:
            raise parallel.CheckpointError(
                f"the checkpoint holds no weights for {', '.join(missing[:3])} "
                f"({len(missing)} of {len(names)} trained parameters): resume it with the "
                "model.path and model.lora settings it was written with"
            )
        groups = [
            {**g, **{k: live[k] for k in OPTIMIZER_IMPLEMENTATION if k in live}}
            for g, live in zip(optimizer["param_groups"], self.optimizer.param_groups)
        ]
        if not optimizer["state"]:  # saved before its first update (nothing informative to train on yet)
            for live, saved in zip(self.optimizer.param_groups, groups):
                live.update({k: v for k, v in saved.items() if k != "params"})
        optimizer = {"state": optimizer["state"], "param_groups": groups} if optimizer["state"] else None
        if self.dist.sharded:
            parallel.load_sharded_state(
                self.model,
                self.optimizer,
                {"model": weights, "optim": optimizer},
                trainable_only=self.adapted,
                full=True,
            )
            return
        params = dict(self.model.named_parameters(remove_duplicate=False))  # a tied weight under each of its names
        unknown = [n for n in weights if n not in params]
        if unknown:
            raise parallel.CheckpointError(
                f"the checkpoint holds weights this model does not have ({', '.join(unknown[:3])}"
                "): resume it with the model.path it was written with"
            )
        with torch.no_grad():
            for name in names if self.adapted else weights:  # every weight, or with LoRA the adapters
                params[name].copy_(weights[name])
            for master, name in zip(self.master or [], names):
                master.copy_(weights[name])
        if optimizer is not None:
            position = {name: i for i, name in enumerate(names)}
            self.optimizer.load_state_dict(
                {
                    "state": {position[n]: s for n, s in optimizer["state"].items()},
                    "param_groups": [{**g, "params": [position[n] for n in g["params"]]} for g in groups],
                }
            )

    def load_trainer_state(self, state: dict) -> None:
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.master is not None and "master_weights" in state:
            with torch.no_grad():
                for master, saved in zip(self.master, state["master_weights"]):
                    master.copy_(saved)
            self._sync_from_master()
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_updates = int(state["skipped_updates"])
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))  # (checkpoints written before it was saved)


class BaseReference:
    """The reference model of a LoRA run without a second copy of the weights: the policy's own model with
    its adapters switched off (peft's ``disable_adapter``), which is the base model the run started from
    (the adapters start at B = 0). Under FSDP it runs the policy's sharded pass."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """(N, T) log-probs of the sampled tokens under the base weights."""
        with self.policy.model.disable_adapter():
            return self.policy.compute_logprobs(batch)[0]
