"""The typed record that moves a step's rollouts through it, instead of a string-keyed dict
(``dapo.model.micro_batch`` splits a ``RolloutBatch`` into the micro-batches of the forward passes)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property

import torch


@dataclass
class RolloutBatch:
    """N = P * G sampled responses in prompt-major order, plus what the step computes for them.

    Token ids are kept as per-row lists so batches from different generation rounds concatenate
    without re-padding; tensors are padded per micro-batch, to that micro-batch's longest row.
    """

    group_size: int
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # includes the EOS token when the response stopped by itself
    truncated: torch.Tensor  # (N,) bool: hit max_response_tokens without stopping
    texts: list[str]  # decoded responses, for grading and for reading
    example_uids: list[str]
    ground_truths: list[str]
    acc: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # (N,) float 0/1: raw correctness
    reward: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # (N,) shaped reward
    # (N,) <= 0: the soft overlong part of it
    overlong_penalty: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    preds: list[str] = field(default_factory=list)
    # per token, as the rollout engine sampled it (vllm); empty if not reported
    rollout_logp: list[list[float]] = field(default_factory=list)
    # per response token 1 where a tool wrote it (multi-turn rows): context the model reads, never trained on,
    # so it is 0 in response_mask; empty when no row called a tool
    tool_mask: list[list[int]] = field(default_factory=list)
    # per row: a turn neither called the tool nor answered (tools.filter_void_turns masks such rows); empty when
    # no row called a tool
    void_turn: list[bool] = field(default_factory=list)
    # per row: grading gave up on it (reward.ungraded=leave_out), so its reward says nothing: it sets no group
    # baseline and is not trained on; empty when every row was graded
    ungraded: list[bool] = field(default_factory=list)
    # per token, for groups held over in the surplus buffer: their old_logp, taken under the weights that sampled
    # them when they were held over (None for a row sampled this step, whose old_logp is computed with the step's)
    held_over_old_logp: list[list[float] | None] = field(default_factory=list)
    # per row: the weights version that sampled it (rollout.max_staleness > 0: the policy after that many updates);
    # empty in the synchronous loop, where every row is sampled by the weights it trains
    policy_version: list[int] = field(default_factory=list)
    trainable: torch.Tensor | None = None  # (N,) bool: False rows are masked out (overlong filtering)
    adv: torch.Tensor | None = None  # (N,)
    old_logp: torch.Tensor | None = None  # (N, T) under the policy before this step's updates
    ref_logp: torch.Tensor | None = None  # (N, T) under the initial policy (KL baselines only)
    entropy: torch.Tensor | None = None  # (N, T)
    # (N, T) truncated importance-sampling weights (with algo.rollout_is_cap set)
    is_weights: torch.Tensor | None = None

    @classmethod
    def of_responses(
        cls,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        *,
        group_size: int,
        truncated: torch.Tensor | None = None,
        texts: list[str] | None = None,
        example_uids: list[str] | None = None,
        ground_truths: list[str] | None = None,
        reward: torch.Tensor | None = None,
        **fields,
    ) -> RolloutBatch:
        """A batch of these rows; what is not given is filled as for rows nobody graded: none truncated, empty
        texts, one example and ground truth for all. ``reward`` (N,), given without ``acc``, grades them as the
        +1/-1 rule does: ``acc`` = reward > 0 and no overlong penalty. Any other field by name."""
        n = len(response_ids)
        if reward is not None and "acc" not in fields:
            fields |= {"acc": (reward > 0).float(), "overlong_penalty": torch.zeros(n)}
        return cls(
            group_size=group_size,
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            truncated=torch.zeros(n, dtype=torch.bool) if truncated is None else truncated,
            texts=[""] * n if texts is None else texts,
            example_uids=["x"] * n if example_uids is None else example_uids,
            ground_truths=["0"] * n if ground_truths is None else ground_truths,
            **({} if reward is None else {"reward": reward}),
            **fields,
        )

    @classmethod
    def from_generation(cls, gen, *, group_size: int, **fields) -> RolloutBatch:
        """The rows of a rollout engine's ``Generation``: its token ids, truncation, texts, and the engine's
        log-probs and tool masks where it reported them; the rest as ``of_responses`` takes it."""
        return cls.of_responses(
            gen.prompt_ids,
            gen.response_ids,
            group_size=group_size,
            truncated=gen.truncated,
            texts=gen.texts,
            rollout_logp=gen.logprobs or [],
            tool_mask=gen.tool_mask or [],
            **fields,
        )

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    @cached_property
    def response_lengths(self) -> torch.Tensor:
        # computed once: every micro-batch of the update slices it (token ids never change after sampling)
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.long)  # (N,)

    @property
    def max_response_len(self) -> int:
        return max((len(r) for r in self.response_ids), default=0)

    def response_mask(self, rows: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
        """(n, width) float mask: 1 on response tokens that are trained on."""
        mask = self.written_mask(rows, width)
        if self.trainable is not None:
            keep = self.trainable if rows is None else self.trainable[rows]
            mask = mask * keep[:, None].float()
        return mask

    def written_mask(self, rows: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
        """(n, width) float mask: 1 on the response tokens the model wrote (not padding, not a tool's output)."""
        lengths = self.response_lengths if rows is None else self.response_lengths[rows]
        width = int(lengths.max()) if width is None else width
        mask = (torch.arange(width)[None, :] < lengths[:, None]).float()  # (n, width)
        if self.tool_mask:
            picked = self.tool_mask if rows is None else [self.tool_mask[i] for i in rows.tolist()]
            for i, tool in enumerate(picked):
                if any(tool):
                    mask[i, : len(tool)] *= 1.0 - torch.tensor(tool[:width], dtype=mask.dtype)
        return mask

    def select_rows(self, rows: list[int]) -> RolloutBatch:
        index = torch.tensor(rows, dtype=torch.long)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "group_size":
                out[f.name] = value
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in rows] if value else []
            elif isinstance(value, torch.Tensor):
                out[f.name] = value[index] if value.numel() else value
            else:
                out[f.name] = None
        return RolloutBatch(**out)

    def select_groups(self, groups: list[int]) -> RolloutBatch:
        g = self.group_size
        return self.select_rows([i * g + j for i in groups for j in range(g)])

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        batches = [b for b in batches if len(b)]
        if not batches:
            raise ValueError("nothing to concatenate")
        out = {}
        for f in fields(RolloutBatch):
            values = [getattr(b, f.name) for b in batches]
            if f.name == "group_size":
                out[f.name] = values[0]
            elif f.name in ("rollout_logp", "policy_version") and not all(values):
                out[f.name] = []  # rows without them would misalign the rest
            elif f.name in FILL_ROWS:  # a batch without them beside one with: its rows filled in
                fill = FILL_ROWS[f.name]
                out[f.name] = [x for b, v in zip(batches, values) for x in (v or fill(b))] if any(values) else []
            elif isinstance(values[0], list):
                out[f.name] = [x for v in values for x in v]
            elif isinstance(values[0], torch.Tensor) and f.name not in PER_STEP:
                out[f.name] = torch.cat(values)
            else:
                out[f.name] = None  # per-token tensors are recomputed for the combined batch
        return RolloutBatch(**out)

    def state(self) -> dict:
        """Plain types and tensors only, for torch.save(weights_only=True) in checkpoints."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PER_STEP}

    @staticmethod
    def from_state(state: dict) -> RolloutBatch:
        state = dict(state)
        for old, new in RENAMED_FIELDS.items():  # checkpoints written before a field was named for what it holds
            if old in state:
                state[new] = state.pop(old)
        return RolloutBatch(**state)

    def padded_logp(self, per_row: list[list[float] | None], width: int) -> torch.Tensor:
        """Per-row token log-probs as an (N, width) tensor, 0 past each row's end (and on a None row)."""
        out = torch.zeros(len(self), width)
        for i, lp in enumerate(per_row):
            if lp:
                out[i, : len(lp)] = torch.tensor(lp[:width])
        return out

    def old_logp_with_held_over(self, recomputed: torch.Tensor) -> torch.Tensor:
        """old_logp (N, T): ``recomputed`` (under the current weights, which sampled this step's rows),
        except on rows held over from an earlier step, whose old policy is the weights that sampled
        them: the clip must bound the step from that policy (PPO's trust region), not from a ratio
        restarted at 1."""
        if not any(lp is not None for lp in self.held_over_old_logp):
            return recomputed
        stale = torch.tensor([lp is not None for lp in self.held_over_old_logp])  # (N,)
        held = self.padded_logp(self.held_over_old_logp, recomputed.shape[1])  # (N, T)
        return torch.where(stale[:, None], held, recomputed)


# old name -> new, as checkpoints written before hold them; read until release 0.3
RENAMED_FIELDS = {"overlong": "overlong_penalty", "behaviour_logp": "held_over_old_logp"}
PER_STEP = ("old_logp", "ref_logp", "entropy", "is_weights")  # computed for the step's whole batch, never carried over
# per-row lists a batch may leave empty, and what its rows hold in a concatenation with a batch that has them
FILL_ROWS = {
    "tool_mask": lambda b: [[0] * len(r) for r in b.response_ids],  # rows of a batch without tools: no tool token
    "void_turn": lambda b: [False] * len(b),
    "ungraded": lambda b: [False] * len(b),
    "held_over_old_logp": lambda b: [None] * len(b),  # sampled by the weights being trained: none held over
}
