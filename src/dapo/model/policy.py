"""The policy and the reference model: Hugging Face causal LMs loaded for training, AdamW over float32
masters, the update, and the trainer's state.

Both are ``dapo.model.logprobs.LogProbModel``s: the update takes its micro-batches and their log-prob pass
(``micro_batch_logprobs``) and adds the loss, the backward and the optimizer step. Nothing here
decides anything about the algorithm: the loss arrives as a function (``LossFn``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from dapo.algorithm.batch import RolloutBatch
from dapo.config import ConfigError
from dapo.model import kernels, lora
from dapo.model.logprobs import LogProbModel, token_logprobs
from dapo.model.micro_batch import MicroBatch
from dapo.model.update_stats import Stat, StatTotals, over_updates
from dapo.runtime import parallel
from dapo.runtime.files import CheckpointError

if TYPE_CHECKING:
    from dapo.config import ModelConfig, TrainConfig


def _grad_into(master: torch.Tensor):
    """A hook that moves a low-precision parameter's fresh gradient into its float32 master's."""

    def hook(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.float()
        else:  # one kernel that widens and adds, where .float() then add_ is a copy and an add (GPU profile)
            master.grad.add_(p.grad)
        p.grad = None  # the bf16 gradient is not kept: the next backward starts it from zero

    return hook


class LossFn(Protocol):
    """The loss ``Policy.update`` minimises, called once per micro-batch (B rows, T its longest response):

      logp        (B, T) log-probs of the response tokens under the weights being trained (with gradient)
      old_logp    (B, T) under the weights that sampled them
      adv         (B,)   advantages, or (B, T) per token (a teacher's term added: dapo.algorithm.advantages)
      mask        (B, T) 1 on the tokens trained on
      num_tokens, num_seqs   valid tokens and sequences of the whole mini-batch (every micro-batch, every
                  rank): dividing by these makes the micro-batch losses add up to the mini-batch's
      is_weights  (B, T) per-token loss weights, or None
      ref_logp    (B, T) under the reference model, or None when the batch has none

    It returns the loss and its statistics by name (``dapo.algorithm.losses.Stat``: a value and how it combines over
    micro-batches and ranks), the same names at every call; each becomes a metric of the step
    (``actor/<name>``). ``dapo.algorithm.losses.actor_loss`` gives pg_loss, kl_loss with a KL term, and its surrogate's.
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


class FullTeacher(Protocol):
    """teacher.signal=full's teacher (``dapo.model.teacher.TeacherModel``): the (n, V) log-probs of every vocabulary
    entry at the n response positions of one of the student's micro-batches, without gradient."""

    def full_logprobs(self, mb: MicroBatch) -> torch.Tensor: ...


def _old_logp_from_forward(
    batch: RolloutBatch, idx: torch.Tensor, at: torch.Tensor, logp: torch.Tensor, ent: torch.Tensor
) -> None:
    """The old log-probs and entropy of a micro-batch's rows ``idx[at]`` from the update's forward before its
    optimizer step (``logp``, ``ent``: (B, T) over ``idx``): the weights the log-prob pass would have used, so the
    ratio is exactly 1 where the pass's would be 1 to float rounding."""
    width = logp.shape[1]
    batch.old_logp[idx[at], :width] = logp.detach()[at.to(logp.device)].float().cpu()
    batch.entropy[idx[at], :width] = ent.detach()[at.to(ent.device)].float().cpu()


class ReferenceModel(LogProbModel):
    """The initial weights, frozen: log-probs under pi_ref for a KL penalty (GRPO's; DAPO has none)."""

    def _prepare(self, lm):
        return lm.requires_grad_(False).train(False)

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

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, dist: parallel.Dist | None = None, **load):
        """``load``: ``temperature``, ``device`` and ``max_seq_tokens``, as ``LogProbModel`` takes them."""
        self.adapted = model_cfg.lora.enabled
        super().__init__(model_cfg, train_cfg, dist, **load)
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

    def _prepare(self, lm):
        if self.model_cfg.gradient_checkpointing:
            lm.gradient_checkpointing_enable()
        lm.config.use_cache = False  # training forward passes never need the KV cache
        if "liger" in self.train_cfg.kernels:
            try:
                kernels.apply_liger(lm, self.device)
            except ValueError as err:
                raise ConfigError(f"train.kernels=[liger]: {err}; or leave liger out of train.kernels") from None
        if self.adapted:  # the base frozen, LoRA adapters trained; the model is the peft model from here on
            lm = lora.add_adapters(lm, self.model_cfg.lora, seed=self.train_cfg.seed)
        if "compile" in self.train_cfg.kernels:  # after the adapters: each compiled layer includes them
            kernels.compile_decoder_layers(lm)
        return lm

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
    def update(
        self,
        batch: RolloutBatch,
        loss_fn: LossFn,
        *,
        with_entropy: bool = False,
        teacher: FullTeacher | None = None,
        teacher_coef: float = 0.0,
        old_logp_rows: Sequence[int] = (),
    ) -> dict[str, torch.Tensor]:
        """Several optimizer updates over one rollout batch (mini-batches of whole groups,
        ``mini_batch_rows``), each minimising ``loss_fn`` summed over its micro-batches.

        ``loss_fn`` gets the whole mini-batch's token and sequence counts, so splitting it into
        micro-batches (or over ranks) leaves the gradient unchanged. Returns its statistics and the
        gradient norm over the updates (``over_updates``), the learning rate and the skipped updates.
        ``with_entropy``: each row's entropy from the first forward over it goes into ``batch.entropy``
        (algo.old_logp_source=engine runs no log-prob pass that would give it). ``teacher``: teacher.signal=full's,
        whose exact KL(student || teacher) at each trained token is added to the loss, ``teacher_coef`` x its token
        mean over the mini-batch (the statistic ``teacher/reverse_kl_mean``). ``old_logp_rows``: rows of the first
        update (algo.old_logp_from_update) whose old log-probs and entropy its own forward gives, written into
        ``batch.old_logp`` and ``batch.entropy`` (the log-prob pass skipped them).
        """
        self.model.train()
        entropy = torch.zeros(len(batch), batch.max_response_len) if with_entropy else None  # this rank's rows
        per_update, skipped_before = [], self.skipped_updates
        kl_term = (teacher, teacher_coef) if teacher is not None else None
        for epoch in range(self.train_cfg.ppo_epochs):
            for k, rows in enumerate(self.mini_batch_rows(batch)):
                rows = self._rank_rows(batch, rows)
                from_forward = frozenset(old_logp_rows) if epoch == k == 0 else frozenset()  # no step taken yet
                per_update.append(
                    self._mini_batch_update(
                        batch, rows, loss_fn, entropy if epoch == 0 else None, kl_term, from_forward
                    )
                )
        if entropy is not None:  # every row was filled by exactly one rank
            batch.entropy = parallel.all_reduce(entropy, self.dist)
        if old_logp_rows and self.dist.sharded:  # each rank wrote its own share of them
            at = torch.tensor(sorted(old_logp_rows))
            batch.old_logp[at] = parallel.all_reduce(batch.old_logp[at], self.dist)
            batch.entropy[at] = parallel.all_reduce(batch.entropy[at], self.dist)
        out = over_updates(per_update)
        out["lr"] = torch.tensor(self.optimizer.param_groups[0]["lr"])  # the rate these updates took, not the next
        self.scheduler.step()
        out["skipped_updates"] = torch.tensor(float(self.skipped_updates))
        out["nonfinite_updates"] = torch.tensor(float(self.skipped_updates - skipped_before))  # this step's
        self.last_updates = (len(per_update), self.skipped_updates - skipped_before)
        return out

    def _mini_batch_update(
        self,
        batch: RolloutBatch,
        rows: list[int],
        loss_fn: LossFn,
        entropy: torch.Tensor | None,
        kl_term: tuple[FullTeacher, float] | None = None,
        from_forward: frozenset[int] = frozenset(),
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
            totals.add(self._micro_batch_backward(batch, micro, loss_fn, counts, entropy, kl_term, from_forward))
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
        self,
        batch: RolloutBatch,
        micro: list[int] | None,
        loss_fn: LossFn,
        counts: dict,
        entropy: torch.Tensor | None,
        kl_term: tuple[FullTeacher, float] | None = None,
        from_forward: frozenset[int] = frozenset(),
    ) -> dict[str, Stat]:
        """Forward and backward over one micro-batch (None: a pass only to join the ranks' collectives);
        returns the loss's statistics and the loss itself, as "loss". The rows in ``from_forward`` take this
        forward's log-probs as their old ones (``update``'s ``old_logp_rows``)."""
        rows = micro or [0]
        idx = torch.tensor(rows)
        width = max(len(batch.response_ids[i]) for i in rows)
        mask = batch.response_mask(idx, width=width) * (micro is not None)  # (B, T)
        if mask.sum() == 0 and not self.dist.sharded:  # every row filtered out (overlong filtering)
            return {}
        own_old = [k for k, i in enumerate(rows) if i in from_forward] if micro is not None else []
        with_entropy = micro is not None and (entropy is not None or bool(own_old))
        if kl_term is None:
            logp, ent = self.micro_batch_logprobs(batch, rows, with_entropy=with_entropy)
        else:  # the teacher over the same micro-batch, then the student's log-probs and its KL to the teacher
            mb = self._make_micro_batch(batch, rows)
            teacher_logp = kl_term[0].full_logprobs(mb)  # (n, V)
            logp, ent, kl = token_logprobs(
                self.logprob_pass,
                mb,
                temperature=self.temperature,
                with_entropy=with_entropy,
                teacher_logp=teacher_logp,
            )
        if entropy is not None and micro is not None:
            entropy[idx, :width] = ent.float().cpu()  # (B, T)
        if own_old:
            _old_logp_from_forward(batch, idx, torch.tensor(own_old), logp, ent)
        on_device = lambda x: None if x is None else x[idx, :width].to(self.device)  # noqa: E731
        adv = batch.adv[idx] if batch.adv.dim() == 1 else batch.adv[idx, :width]  # (B,), or (B, T) with a teacher
        loss, stats = loss_fn(
            logp,
            on_device(batch.old_logp),
            adv.to(self.device),
            mask.to(self.device),
            **counts,
            is_weights=on_device(batch.is_weights),
            ref_logp=on_device(batch.ref_logp),
        )
        if kl_term is not None:  # its token mean over the mini-batch, as token-mean's policy loss
            on_tokens = kl * mask.to(self.device)
            loss = loss + kl_term[1] * on_tokens.sum() / counts["num_tokens"]
            tokens = mask.sum().to(self.device)
            stats["teacher/reverse_kl_mean"] = (on_tokens.sum().detach() / tokens.clamp(min=1), tokens.float(), "mean")
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
            raise CheckpointError(
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
            raise CheckpointError(
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
            raise CheckpointError(
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
        # checkpoints written before it was saved have none: read as 0 until release 0.3
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))


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
