"""A causal LM's log-probs of response tokens: the log-prob pass over one micro-batch (the decoder,
then the LM head at response positions only, chunked), and ``LogProbModel``, which splits a rollout
batch into micro-batches (``dapo.model.micro_batch``), shares the rows out over FSDP ranks and runs the pass.

The policy and the reference model (``dapo.model.policy``) are LogProbModels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dapo.algorithm.batch import RolloutBatch
from dapo.config import ConfigError
from dapo.model.loading import DTYPES, decoder_layers, decoder_of, load_model_and_tokenizer
from dapo.model.logits import LogitTransform, UnsupportedModel, find_logit_transform, padding_problem
from dapo.model.micro_batch import MicroBatch, make_micro_batch, micro_batch_rows, prompt_of_rows
from dapo.model.prefix import prompt_then_responses, unsupported
from dapo.runtime import parallel

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dapo.config import ModelConfig, TrainConfig


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
    ``transform``: what the model's forward does to the head's output (``dapo.model.logits``); a soft cap's
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
            # (c, V), turned in place into d loss / d (h W^T)
            coef = _chunk_logits(h[rows], weight, ctx.temperature, transform, tanh)
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


class HeadReverseKL(torch.autograd.Function):
    """KL(student || teacher) over the whole vocabulary at each row, the student's distribution being the LM head
    over ``h`` (at the sampling temperature, after ``transform``) and the teacher's given as (n, V) log-probs;
    ``chunk`` rows at a time, keeping no logits for backward (each chunk's are recomputed there, as in
    ``HeadLogProbs``). The gradient with respect to the student's logits z of row i is
    p_i * (log p_i - log q_i - KL_i) / temperature; the teacher's log-probs get none."""

    @staticmethod
    def forward(ctx, h, weight, teacher_logp, temperature: float, chunk: int, transform: LogitTransform):
        kl = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        for t0 in range(0, h.shape[0], chunk):
            rows = slice(t0, t0 + chunk)
            logp = _chunk_logits(h[rows], weight, temperature, transform).log_softmax(-1)  # (c, V)
            kl[rows] = (logp.exp() * (logp - teacher_logp[rows])).sum(-1)
        ctx.save_for_backward(h, weight, teacher_logp, kl)
        ctx.temperature, ctx.chunk, ctx.transform = temperature, chunk, transform
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        h, weight, teacher_logp, kl = ctx.saved_tensors
        need_h, need_weight = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        transform = ctx.transform
        for t0 in range(0, h.shape[0], ctx.chunk):
            rows = slice(t0, t0 + ctx.chunk)
            tanh = []
            logp = _chunk_logits(h[rows], weight, ctx.temperature, transform, tanh).log_softmax(-1)  # (c, V)
            # d KL / d logits, times the chain factor from the head's output to the tempered logits
            g = grad_kl[rows, None] * (transform.scale / ctx.temperature)
            coef = logp.exp() * (logp - teacher_logp[rows] - kl[rows, None]) * g
            if tanh:  # a soft cap's derivative, as in HeadLogProbs
                coef = coef * (1 - tanh[0].square())
            coef = coef.to(weight.dtype)
            if need_h:
                grad_h[rows] = coef @ weight
            if need_weight:
                grad_weight.addmm_(coef.t().float(), h[rows].float())
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_h, grad_weight, None, None, None, None


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
        self,
        mb: MicroBatch,
        *,
        temperature: float,
        with_entropy: bool = False,
        chunk_tokens: int | None = None,
        full_logp: bool = False,
        teacher_logp: torch.Tensor | None = None,
    ):
        """(B, T) log-probs of the sampled tokens and (B, T) entropies (None without ``with_entropy``). With
        ``full_logp``: instead, the (n, V) log-probs of every vocabulary entry at the n response positions, in
        ``mb.token_index`` order (no gradient). With ``teacher_logp`` (those of a teacher, over the same
        micro-batch): also the (B, T) reverse KL from this model's distribution to the teacher's at each position."""
        if mb.shared is None:
            hidden = self.decoder(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids
            ).last_hidden_state.flatten(0, 1)  # (R * L, H)
        else:
            hidden = prompt_then_responses(self.decoder, mb.shared)  # (prompt and response positions, H)
        h = hidden[mb.token_index]  # (n, H)
        chunk_tokens = chunk_tokens or head_chunk_rows(self.head.weight.shape[0], h.device)
        if full_logp:
            return self._full_logp(h, temperature, chunk_tokens)
        if teacher_logp is not None:
            logp, ent = self._sampled_logp(mb, h, temperature, with_entropy, chunk_tokens)
            return logp, ent, self._scatter(mb, self._reverse_kl(h, teacher_logp, temperature, chunk_tokens))
        return self._sampled_logp(mb, h, temperature, with_entropy, chunk_tokens)

    @torch.no_grad()
    def _full_logp(self, h: torch.Tensor, temperature: float, chunk_tokens: int) -> torch.Tensor:
        chunks = [
            _chunk_logits(h[t0 : t0 + chunk_tokens], self.head.weight, temperature, self.transform).log_softmax(-1)
            if self.fused_head
            else (self.transform(self.head(h[t0 : t0 + chunk_tokens]).float()) / temperature).log_softmax(-1)
            for t0 in range(0, h.shape[0], chunk_tokens)
        ]
        return torch.cat(chunks) if chunks else h.new_zeros(0, self.head.weight.shape[0], dtype=torch.float32)

    def _reverse_kl(self, h: torch.Tensor, teacher_logp: torch.Tensor, temperature: float, chunk_tokens: int):
        """(n,) KL(this model || teacher) at each response position, with its gradient."""
        if self.fused_head:
            return HeadReverseKL.apply(h, self.head.weight, teacher_logp, temperature, chunk_tokens, self.transform)

        def chunk_kl(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            logp = (self.transform(self.head(x).float()) / temperature).log_softmax(-1)
            return (logp.exp() * (logp - q)).sum(-1)

        parts = [
            torch.utils.checkpoint.checkpoint(
                chunk_kl, h[t0 : t0 + chunk_tokens], teacher_logp[t0 : t0 + chunk_tokens], use_reentrant=False
            )
            for t0 in range(0, h.shape[0], chunk_tokens)
        ]
        return torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)

    def _sampled_logp(self, mb: MicroBatch, h: torch.Tensor, temperature: float, with_entropy: bool, chunk_tokens: int):
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
    """What ``lm``'s forward does after its LM head (``dapo.model.logits``), found once per model. Raises
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
    model, mb: MicroBatch, *, temperature: float, with_entropy: bool = False, chunk_tokens: int | None = None, **kw
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
    return logprob_pass(mb, temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens, **kw)


def uses_varlen_attention(model) -> bool:
    """Whether packed sequences avoid padding compute: flash-attention kernels take them without a mask."""
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash_attention")


class LogProbModel:
    """A causal LM's log-probs of a rollout batch's response tokens: rows split into micro-batches by
    the token budget (packed where the attention kernels allow, or each distinct prompt once with
    ``train.share_prompt_prefix``), and under FSDP each rank computing its share of the rows with the
    sharded log-prob pass. Loaded from ``model_cfg``: under FSDP each rank loads the weights on CPU and keeps
    only its shard on the device; a subclass readies the model first (``_prepare``)."""

    path_key = "model.path"  # the setting that named the model, as its errors say it

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
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        self.dist = dist or parallel.Dist(device=device or torch.device("cpu"))
        self.device = self.dist.device if device is None else device
        lm, self.tokenizer = load_model_and_tokenizer(
            model_cfg.path,
            model_cfg.dtype,
            "cpu" if self.dist.sharded else self.device,
            revision=model_cfg.revision,
            trust_remote_code=model_cfg.trust_remote_code,
            keep_dropout=model_cfg.keep_dropout,
        )
        self.model = lm = self._prepare(lm)
        self.pad_id = self.tokenizer.pad_token_id
        self.temperature = temperature  # log-probs are of the distribution that sampled: at its temperature
        self.share_prompts = train_cfg.share_prompt_prefix
        if self.share_prompts and (why := unsupported(lm, max_seq_tokens)):
            raise ConfigError(
                f"train.share_prompt_prefix=true: {model_cfg.path} has {why}; set train.share_prompt_prefix=false"
            )
        # the probes of the model's forward run its layers eagerly (train.kernels=[compile] compiles them for the
        # training passes' shapes and modes, not for two tiny probes in eval mode)
        with torch.compiler.set_stance("force_eager"):
            self._check_forward(lm, model_cfg)
        self.logprob_pass = self._sharded_logprob_pass(lm)

    def _check_forward(self, lm, model_cfg) -> None:
        """A ConfigError where the model's forward would not give the log-probs its engines sample: logits past the
        LM head and a scale or cap, or padding that reaches the real tokens."""
        try:
            logit_transform(lm)  # found before sharding, on the whole head
        except UnsupportedModel as err:
            raise ConfigError(
                f"{self.path_key}={model_cfg.path}: {err}; its log-probs would not be those the engines "
                "sample, so it cannot be trained exactly"
            ) from None
        if why := padding_problem(lm):
            raise ConfigError(
                f"{self.path_key}={model_cfg.path}: {why}; the trainer's micro-batches would not give its own "
                "log-probs, so it cannot be trained exactly"
            )

    def _prepare(self, lm):
        """The loaded model, made ready for its use (trained or frozen) before its log-prob pass is built."""
        return lm

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

    # ---- rows: per optimizer update, per rank, per micro-batch ----------------------------
    def mini_batch_rows(self, batch: RolloutBatch) -> list[list[int]]:
        """The rows of each optimizer update of one pass over ``batch``, in order: whole groups,
        ``train.mini_batch_prompts`` of them per update."""
        g, per_update = batch.group_size, max(1, self.train_cfg.mini_batch_prompts)
        groups = list(range(batch.num_groups))
        return [
            [i * g + j for i in groups[s : s + per_update] for j in range(g)] for s in range(0, len(groups), per_update)
        ]

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

    @property
    def packed(self) -> bool:
        mode = self.train_cfg.pack_sequences
        return mode == "true" or (mode == "auto" and uses_varlen_attention(self.model))

    @property
    def _layout(self) -> dict[str, bool]:
        """How micro-batches are laid out: the same settings plan them and build them."""
        # split_responses: FSDP gathers every layer's shard at each decoder call, so ranks must make the same
        # calls: one response pass per micro-batch, whatever widths each rank's rows have
        return {"packed": self.packed, "share_prompts": self.share_prompts, "split_responses": not self.dist.sharded}

    def micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        """``rows`` split by the token budget; returns lists of batch row indices."""
        t = self.train_cfg
        return micro_batch_rows(batch, rows, t.max_tokens_per_micro_batch, max_rows=t.micro_batch_size, **self._layout)

    def _make_micro_batch(self, batch: RolloutBatch, rows: list[int]) -> MicroBatch:
        return make_micro_batch(batch, rows, self.pad_id, self.device, **self._layout)

    # ---- log-probs ------------------------------------------------------------------------
    def micro_batch_logprobs(self, batch: RolloutBatch, rows: list[int], *, with_entropy: bool = False):
        """(B, T) log-probs of ``rows``' response tokens in one forward pass, T their longest response, and
        their entropy (None without ``with_entropy``)."""
        mb = self._make_micro_batch(batch, rows)
        return token_logprobs(self.logprob_pass, mb, temperature=self.temperature, with_entropy=with_entropy)

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, *, with_entropy: bool = False, skip: Sequence[int] = ()):
        """(N, T) log-probs of the sampled tokens (and entropy) under this model; 0 on the rows in ``skip``."""
        was_training = self.model.training
        self.model.train(False)
        T = batch.max_response_len
        logp = torch.zeros(len(batch), T)
        entropy = torch.zeros(len(batch), T) if with_entropy else None
        rows = list(range(len(batch)))
        if self.dist.sharded:  # the rows this rank trains on; the others' come with the all-reduce below
            rows = [i for update_rows in self.mini_batch_rows(batch) for i in self._rank_rows(batch, update_rows)]
        if skip:
            skipped = set(skip)
            rows = [i for i in rows if i not in skipped]
        for micro in parallel.same_count(self.micro_batches(batch, rows), self.dist):
            # None: a pass only to join the collectives
            lp, ent = self.micro_batch_logprobs(batch, micro or [0], with_entropy=with_entropy)
            if micro is None:
                continue
            logp[micro, : lp.shape[1]] = lp.float().cpu()
            if with_entropy:
                entropy[micro, : lp.shape[1]] = ent.float().cpu()
        self.model.train(was_training)
        if self.dist.sharded:  # every row was filled by exactly one rank
            logp = parallel.all_reduce(logp, self.dist)
            entropy = parallel.all_reduce(entropy, self.dist) if with_entropy else None
        return logp, entropy
