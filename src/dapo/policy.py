"""The policy: a Hugging Face causal LM, its optimizer, log-probs and the clipped-surrogate update.

Nothing here decides anything about the algorithm: the loss comes from ``dapo.algo``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dapo import algo, parallel
from dapo.batch import RolloutBatch, pad_rows, plan_micro_batches
from dapo.models import DTYPES, load_model_and_tokenizer


@dataclass
class MicroBatch:
    """One forward pass: rows right-padded to the longest (R = B), or packed into one row (R = 1).

    Only response positions reach the LM head: ``token_index`` picks, for each response token, the
    flat position in (R * L) whose hidden state predicts it, and ``out_index`` where it goes in (B, T).
    """

    input_ids: torch.Tensor  # (R, L)
    attention_mask: torch.Tensor | None  # (R, L) when padded; None when packed
    position_ids: torch.Tensor | None  # (R, L) restarting at 0 for each packed sequence; None when padded
    token_index: torch.Tensor  # (n,) flat index into R * L of the position that predicts each response token
    targets: torch.Tensor  # (n,) the response tokens
    out_index: torch.Tensor  # (n,) flat index into B * T
    num_rows: int  # B
    width: int  # T: the longest response in this micro-batch

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass computes, padding included."""
        return self.input_ids.numel()


def make_micro_batch(batch: RolloutBatch, rows: list[int], pad_id: int, device, *, packed: bool = False) -> MicroBatch:
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
    return MicroBatch(input_ids.to(device), attention_mask, None if position_ids is None else position_ids.to(device),
                      as_long(token_index), as_long(targets), as_long(out_index), len(rows), width)


def _head_logp(head, h: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = head(h).float() / temperature  # (n, V): float32 for this chunk only
    log_z = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - log_z, logits, log_z


class ResponseLogProbs(nn.Module):
    """The log-prob pass over response tokens as one module (the decoder and the LM head of ``lm``).

    Under FSDP this module is the root of the sharding, so the decoder and the head run inside one
    forward and their parameters are gathered and their gradients reduced like any other layer's.
    """

    def __init__(self, lm):
        super().__init__()
        self.decoder = lm.get_decoder()
        self.head = lm.get_output_embeddings()

    def forward(self, mb: MicroBatch, *, temperature: float, with_entropy: bool = False, chunk_tokens: int = 1024):
        hidden = self.decoder(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                              position_ids=mb.position_ids).last_hidden_state  # (R, L, H)
        h = hidden.reshape(-1, hidden.shape[-1])[mb.token_index]  # (n, H)
        logps, entropies = [], []
        for t0 in range(0, h.shape[0], chunk_tokens):
            h_c, y_c = h[t0 : t0 + chunk_tokens], mb.targets[t0 : t0 + chunk_tokens]
            if torch.is_grad_enabled():
                logp = torch.utils.checkpoint.checkpoint(
                    lambda x, y: _head_logp(self.head, x, y, temperature)[0], h_c, y_c, use_reentrant=False)
                logps.append(logp)
                continue
            logp, logits, log_z = _head_logp(self.head, h_c, y_c, temperature)
            logps.append(logp)
            if with_entropy:
                entropies.append(log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1))
        # scattered straight into (B, T): a view of a flat buffer as the output would make FSDP warn
        # that an in-place op on it could skip its pre-backward hook
        out_at = torch.unravel_index(mb.out_index, (mb.num_rows, mb.width))
        flat = torch.cat(logps)  # (n,)
        logp = flat.new_zeros(mb.num_rows, mb.width).index_put(out_at, flat)
        entropy = None
        if with_entropy:
            if torch.is_grad_enabled():
                raise ValueError("entropy is computed without gradients; call under torch.no_grad()")
            ent = torch.cat(entropies)
            entropy = ent.new_zeros(mb.num_rows, mb.width).index_put(out_at, ent)
        return logp, entropy


def token_logprobs(
    model, mb: MicroBatch, *, temperature: float, with_entropy: bool = False, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token, at the sampling temperature: (B, T), and entropy (B, T).

    Only response positions go through the LM head, ``chunk_tokens`` at a time. With gradients on,
    each chunk is checkpointed: backward recomputes its logits instead of keeping them, so float32
    logits for more than one chunk never exist at once, in forward or backward. ``model`` is a
    causal LM or its ``ResponseLogProbs`` (the sharded one under FSDP).
    """
    scorer = model if isinstance(model, ResponseLogProbs) else ResponseLogProbs(model)
    return scorer(mb, temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens)


def uses_varlen_attention(model) -> bool:
    """Whether packed sequences avoid padding compute: flash-attention kernels take them without a mask."""
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash_attention")


def _grad_into(master: torch.Tensor):
    """A hook that moves a low-precision parameter's fresh gradient into its float32 master's."""

    def hook(p: torch.Tensor) -> None:
        g = p.grad.float()
        master.grad = g if master.grad is None else master.grad.add_(g)
        p.grad = None  # the bf16 gradient is not kept: the next backward starts it from zero

    return hook


class Policy:
    def __init__(self, cfg, device: torch.device, dist: parallel.Dist | None = None):
        self.cfg = cfg
        self.device = device
        self.dist = dist or parallel.Dist(device=device)
        # under FSDP each rank loads on CPU and keeps only its shard on the device (see _log_probs_of)
        load_on = "cpu" if self.dist.sharded else device
        self.model, self.tokenizer = load_model_and_tokenizer(cfg.model.path, cfg.model.dtype, load_on,
                                                              trust_remote_code=cfg.model.trust_remote_code)
        if cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.config.use_cache = False  # training forward passes never need the KV cache
        self.scorer = self._log_probs_of(self.model)
        self.pad_id = self.tokenizer.pad_token_id
        self.master = self._master_weights()  # float32 copies in one process below float32; None otherwise
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            self.master or [p for p in self.model.parameters() if p.requires_grad],
            lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
        )
        warmup = t.warmup_steps
        # the schedule advances once per training step (not per optimizer update), like the paper's
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )
        self.ref_model = None
        if cfg.algo.kl_coef > 0:
            self.ref_model, _ = load_model_and_tokenizer(cfg.model.path, cfg.model.dtype, load_on,
                                                         trust_remote_code=cfg.model.trust_remote_code)
            self.ref_model.requires_grad_(False).train(False)
            self.ref_scorer = self._log_probs_of(self.ref_model)
        self.skipped_updates = 0

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
        if self.dist.sharded or DTYPES[self.cfg.model.dtype] == torch.float32:
            return None
        masters = []
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            master = nn.Parameter(p.detach().float().clone())
            p.register_post_accumulate_grad_hook(_grad_into(master))
            masters.append(master)
        return masters

    @torch.no_grad()
    def _sync_from_master(self) -> None:
        if self.master is not None:
            for p, master in zip([p for p in self.model.parameters() if p.requires_grad], self.master):
                p.copy_(master)  # round to the compute dtype

    def _log_probs_of(self, model) -> ResponseLogProbs:
        """The model's log-prob pass; under FSDP sharded across ranks (one unit per decoder layer),
        float32 master weights, forward and backward in model.dtype."""
        scorer = ResponseLogProbs(model)
        return parallel.wrap(scorer, list(scorer.decoder.layers), self.dist, compute_dtype=DTYPES[self.cfg.model.dtype],
                             cpu_offload=self.cfg.train.cpu_offload)

    def _rank_rows(self, batch: RolloutBatch, rows: list[int]) -> list[int]:
        """This rank's share of a mini-batch's rows, balanced by sequence tokens (all of them when alone)."""
        costs = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows]
        return parallel.rank_share(rows, costs, self.dist)

    # ---- micro-batches --------------------------------------------------------------------
    @property
    def packed(self) -> bool:
        mode = self.cfg.train.pack_sequences
        return mode == "true" or (mode == "auto" and uses_varlen_attention(self.model))

    def micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        """``rows`` split by the token budget; returns lists of batch row indices."""
        lengths = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows]
        t = self.cfg.train
        plan = plan_micro_batches(lengths, t.max_tokens_per_micro_batch, packed=self.packed, max_rows=t.micro_batch_size)
        return [[rows[j] for j in chunk] for chunk in plan]

    def _make_micro_batch(self, batch: RolloutBatch, rows: list[int]) -> MicroBatch:
        return make_micro_batch(batch, rows, self.pad_id, self.device, packed=self.packed)

    # ---- log-probs ------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, *, model=None, with_entropy: bool = False):
        """(N, T) log-probs of the sampled tokens (and entropy) under ``model`` (default: the policy)."""
        model = self.model if model is None else model
        scorer = self.scorer if model is self.model else self.ref_scorer if model is self.ref_model else model
        was_training = model.training
        model.train(False)
        T = batch.max_response_len
        logp = torch.zeros(len(batch), T)
        entropy = torch.zeros(len(batch), T) if with_entropy else None
        rows = list(range(len(batch)))
        if self.dist.sharded:  # the rows this rank trains on; the others' come with the all-reduce below
            per_update = self.cfg.train.mini_batch_prompts * batch.group_size
            rows = [i for s in range(0, len(batch), per_update) for i in self._rank_rows(batch, rows[s : s + per_update])]
        for micro in parallel.same_count(self.micro_batches(batch, rows), self.dist):
            mb = self._make_micro_batch(batch, micro or [0])  # None: a pass only to join the collectives
            lp, ent = token_logprobs(scorer, mb, temperature=self.cfg.rollout.temperature, with_entropy=with_entropy)
            if micro is None:
                continue
            logp[micro, : mb.width] = lp.float().cpu()
            if with_entropy:
                entropy[micro, : mb.width] = ent.float().cpu()
        model.train(was_training)
        if self.dist.sharded:  # every row was filled by exactly one rank
            logp = parallel.all_reduce(logp, self.dist)
            entropy = parallel.all_reduce(entropy, self.dist) if with_entropy else None
        return logp, entropy

    # ---- the update -----------------------------------------------------------------------
    def update(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """Several optimizer updates over one rollout batch (mini-batches of whole groups).

        Each mini-batch's loss is normalised by the valid tokens (or samples) of the whole
        mini-batch, so splitting it into micro-batches leaves the gradient unchanged.
        """
        cfg, a = self.cfg.train, self.cfg.algo
        self.model.train()
        g = batch.group_size
        groups = list(range(batch.num_groups))
        per_update = max(1, cfg.mini_batch_prompts)
        totals: dict[str, list[torch.Tensor]] = {}
        for _epoch in range(cfg.ppo_epochs):
            for start in range(0, len(groups), per_update):
                rows = [i * g + j for i in groups[start : start + per_update] for j in range(g)]
                stats = self._mini_batch_update(batch, rows, a)
                for k, v in stats.items():
                    totals.setdefault(k, []).append(v)
        self.scheduler.step()
        out = {k: (torch.stack(v).max() if k.endswith("_max") else torch.stack(v).mean()) for k, v in totals.items()}
        out["lr"] = torch.tensor(self.optimizer.param_groups[0]["lr"])
        out["skipped_updates"] = torch.tensor(float(self.skipped_updates))
        return out

    def _mini_batch_update(self, batch: RolloutBatch, rows: list[int], a) -> dict[str, torch.Tensor]:
        rows = self._rank_rows(batch, rows)
        width = max((len(batch.response_ids[i]) for i in rows), default=0)
        mask_all = batch.response_mask(torch.tensor(rows, dtype=torch.long), width=width)  # (n, T_mb)
        # the divisor counts the whole mini-batch on every rank (DAPO eq. 12 over the step, not the shard)
        num_tokens_cpu = parallel.all_reduce(mask_all.sum(), self.dist)
        num_tokens = num_tokens_cpu.to(self.device)
        num_seqs = parallel.all_reduce((mask_all.sum(-1) > 0).sum(), self.dist).to(self.device)
        sums: dict[str, torch.Tensor] = {}
        up_max = torch.zeros(())
        for micro in parallel.same_count(self.micro_batches(batch, rows), self.dist):
            mb = self._make_micro_batch(batch, micro or [0])  # None: a pass only to join the collectives
            idx = torch.tensor(micro or [0])
            mask_cpu = batch.response_mask(idx, width=mb.width) * (micro is not None)  # (B, T)
            if mask_cpu.sum() == 0 and not self.dist.sharded:  # every row filtered out (overlong filtering)
                continue
            mask = mask_cpu.to(self.device)
            logp, _ = token_logprobs(self.scorer, mb, temperature=self.cfg.rollout.temperature)
            old_logp = batch.old_logp[idx, : mb.width].to(self.device)
            adv = batch.adv[idx].to(self.device)
            is_weights = None if batch.is_weights is None else batch.is_weights[idx, : mb.width].to(self.device)
            loss, stats = algo.policy_loss(
                logp, old_logp, adv, mask,
                eps_low=a.eps_low, eps_high=a.eps_high, loss_agg=a.loss_agg,
                num_tokens=num_tokens, num_seqs=num_seqs,
                norm_length=self.cfg.rollout.max_response_tokens, dual_clip=a.dual_clip, is_weights=is_weights,
            )
            pg_loss = loss.detach()
            if self.ref_model is not None and a.kl_coef > 0:
                ref_logp = batch.ref_logp[idx, : mb.width].to(self.device)
                kl = algo.kl_penalty(logp, ref_logp, a.kl_kind)  # (B, T)
                kl_loss = algo.aggregate(kl, mask, a.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                                         norm_length=self.cfg.rollout.max_response_tokens)
                loss = loss + a.kl_coef * kl_loss
                sums["kl_loss"] = sums.get("kl_loss", 0) + kl_loss.detach().cpu()
            loss.backward()
            weight = mask_cpu.sum() / num_tokens_cpu.clamp(min=1)  # this micro-batch's share of tokens
            sums["pg_loss"] = sums.get("pg_loss", 0) + pg_loss.cpu()
            for k in ("clipfrac_high", "clipfrac_low", "clipfrac_dual", "approx_kl", "token_prob_mean"):
                sums[k] = sums.get(k, 0) + stats[k].cpu() * weight
            up_max = torch.maximum(up_max, stats["up_clipped_prob_max"].cpu())
            sums["_up_sum"] = sums.get("_up_sum", 0) + (stats["up_clipped_prob_mean"] * stats["num_up_clipped"]).cpu()
            sums["_up_n"] = sums.get("_up_n", 0) + stats["num_up_clipped"].cpu()
        if self.dist.sharded:  # per-rank sums of the statistics -> the mini-batch's
            sums = parallel.all_reduce_dict(sums, self.dist)
            up_max = parallel.all_reduce(up_max, self.dist, op="max")
        trained = self.master or self.model.parameters()
        grad_norm = parallel.clip_grad_norm(trained, self.cfg.train.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
            self._sync_from_master()
        else:
            self.skipped_updates += 1  # one bad batch must not poison the weights
        self.optimizer.zero_grad(set_to_none=True)
        out = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in sums.items() if not k.startswith("_")}
        up_n = sums.get("_up_n", torch.zeros(()))
        out["up_clipped_prob_mean"] = torch.as_tensor(sums.get("_up_sum", 0.0)) / torch.as_tensor(up_n).clamp(min=1)
        out["up_clipped_prob_max"] = up_max
        out["grad_norm"] = grad_norm.detach().float().cpu()
        return out

    # ---- state -----------------------------------------------------------------------------
    def named_weights(self):
        """(name, full tensor) per parameter; under FSDP each is gathered in turn, on every rank."""
        return parallel.full_tensors(self.model.named_parameters())

    def trainer_state(self) -> dict:
        state = {"scheduler": self.scheduler.state_dict(), "skipped_updates": self.skipped_updates}
        if not self.dist.sharded:  # under FSDP the optimizer is saved in shards, with the model
            state["optimizer"] = self.optimizer.state_dict()
        if self.master is not None:  # the model directory holds the bf16 weights; the float32 masters go here
            state["master_weights"] = [m.detach().clone() for m in self.master]
        return state

    def sharded_state(self) -> dict | None:
        """Model and optimizer shards for torch.distributed.checkpoint; None in a single process."""
        return parallel.sharded_state(self.model, self.optimizer) if self.dist.sharded else None

    def load_sharded_state(self, state: dict) -> None:
        parallel.load_sharded_state(self.model, self.optimizer, state)

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
