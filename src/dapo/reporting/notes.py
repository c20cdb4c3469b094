"""What a training run says about itself as it goes, beside its metrics: a step with nothing to learn from (and,
after a few in a row, what to change), optimizer updates skipped for a non-finite loss (and the stop after too many
in a row), the engine sampling from other weights than the trainer's, and stale samples drawn far from the
trained policy. Each is said once, or when it matters, on the run's console and in train.log."""

from __future__ import annotations

from collections import deque

from dapo.checkpoint.files import latest_checkpoint
from dapo.collect.stats import CollectStats
from dapo.config import Config

NO_SIGNAL_STREAK = 3  # steps in a row without an informative group before the run says what to change


class NonFiniteError(RuntimeError):
    """Too many optimizer updates in a row with a non-finite loss or gradient norm."""


class RunNotes:
    """The run's notes, said through ``logger`` (a ``RunLogger``); the state they keep between steps."""

    def __init__(self, cfg: Config, logger):
        self.cfg, self.logger = cfg, logger
        self.no_signal = 0  # steps in a row without an informative group
        self.engine_gap_said = False  # the engine-vs-trainer gap has been reported (once a run)
        self.drift = DriftGuard()  # stale samples: the policy's movement (once a run)

    def collected(self, batch, stats, step: int) -> None:
        """Say so when a step had nothing to learn from, and what to change after a few in a row."""
        self.no_signal = 0 if batch is not None else self.no_signal + 1
        if batch is None:
            self.logger.info(f"step {step}: no informative group was generated; nothing to train on")
        if self.no_signal == NO_SIGNAL_STREAK:
            r = self.cfg.rollout
            self.logger.warn(
                no_signal_advice(
                    self.no_signal, stats, group_size=r.group_size, max_response_tokens=r.max_response_tokens
                )
            )

    def updated(self, step: int, *, updates: int, skipped: int, in_a_row: int) -> None:
        """Say so when the step skipped optimizer updates for a non-finite loss or gradient norm (the weights and
        AdamW state stayed as they were)."""
        if skipped:
            limit = self.cfg.run.max_nonfinite_in_a_row
            self.logger.warn(
                f"step {step}: {skipped} of {updates} optimizer updates skipped, their loss or gradient "
                "norm not finite (weights and AdamW state left as they were; actor/nonfinite_updates); "
                f"{in_a_row} in a row" + (f", the run stops at {limit}" if limit else "")
            )

    def stop_if_nonfinite(self, step: int, *, in_a_row: int) -> None:
        """Stop after ``run.max_nonfinite_in_a_row`` skipped updates in a row, saying what to check."""
        limit = self.cfg.run.max_nonfinite_in_a_row
        if limit and in_a_row >= limit:
            last_checkpoint = latest_checkpoint(self.cfg.run_dir)
            raise NonFiniteError(
                f"step {step}: {in_a_row} optimizer updates in a row had a non-finite loss or gradient norm "
                f"(run.max_nonfinite_in_a_row={limit}), so the run stops; check the learning rate (train.lr="
                f"{self.cfg.train.lr:g}), model.dtype={self.cfg.model.dtype} (overflow in low precision), a reward "
                "function returning inf or nan, and the weights of the last checkpoint"
                + (f" ({last_checkpoint})" if last_checkpoint else "")
                + " for nan"
            )

    def engine_gap(self, metrics: dict, step: int) -> None:
        """Say once when the engine samples from other weights than the trainer's (``engine_gap_warning``), and once
        when stale samples were drawn from a policy far from the trained one (``DriftGuard``).
        Only where the engine's log-probs are of the full distribution: top-p and top-k renormalise them."""
        r = self.cfg.rollout
        if line := self.drift.observe(metrics, step=step, lr=self.cfg.train.lr, max_staleness=r.max_staleness):
            self.logger.warn(line)  # sampled by older weights: how far the policy moved since
        if self.engine_gap_said or r.top_p < 1.0 or r.top_k is not None or metrics.get("async/staleness_max"):
            return  # sampled by older weights (rollout.max_staleness): the gap is the staleness, not a fault
        if line := engine_gap_warning(metrics, dtype=self.cfg.model.dtype, step=step):
            self.logger.warn(line)
            self.engine_gap_said = True


def no_signal_advice(streak: int, cstats: CollectStats, *, group_size: int, max_response_tokens: int) -> str:
    """One line for a run whose groups keep coming back all right or all wrong."""
    wrong = cstats.groups_all_wrong / max(cstats.prompts_generated, 1)
    right = cstats.groups_all_correct / max(cstats.prompts_generated, 1)
    if wrong >= right:
        fix = (
            f"the data is too hard for this model: use easier problems, a larger group (rollout.group_size="
            f"{group_size}) or longer responses (rollout.max_response_tokens={max_response_tokens})"
        )
    else:
        fix = "the data is too easy for this model: use harder problems"
    return (
        f"no informative group for {streak} steps in a row: {100 * wrong:.0f}% of groups all wrong, "
        f"{100 * right:.0f}% all right; {fix}"
    )


ENGINE_GAP_LIMIT = {"float32": 1e-3, "bfloat16": 0.1}


def engine_gap_warning(metrics: dict, *, dtype: str, step: int) -> str | None:
    """One line when the rollout engine's log-probs are further from the trainer's than ``dtype`` explains
    (``ENGINE_GAP_LIMIT``): the sign of weights that did not reach the engine. None otherwise."""
    gap = metrics.get("rollout/logprob_abs_diff_mean")
    limit = ENGINE_GAP_LIMIT.get(dtype)
    if gap is None or limit is None or float(gap) <= limit:
        return None
    return (
        f"step {step}: the rollout engine's log-probs are {float(gap):.3g} nats per token from the trainer's "
        f"(a {dtype} run stays under {limit:g}): the engine is probably not sampling from the trained weights; "
        "check train.log for a weight push that failed or was skipped, or weights lost across the engine's "
        "sleep and wake (rollout/logprob_abs_diff_mean follows the gap)"
    )


# where staleness started to cost accuracy on the demo (docs/async.md, benchmarks/async_rollout.py --lrs, 5 paired
# seeds): the settings of lr and k past either level lost 4 to 20 points of held-out accuracy at equal steps (5 to
# 20 of train accuracy), those within both 2 or fewer
DRIFT_KL_LEVEL = 0.005  # async/policy_kl, nats a token
DRIFT_ESS_LEVEL = 0.985  # rollout/is_ess
DRIFT_WINDOW = 5  # steps averaged, so one step's noise does not warn


class DriftGuard:
    """Says once when training on stale samples moves the policy past the level that cost accuracy: the mean of
    ``async/policy_kl`` or ``rollout/is_ess`` over the last DRIFT_WINDOW steps that trained on stale samples."""

    def __init__(self) -> None:
        self.recent: deque[tuple[float, float]] = deque(maxlen=DRIFT_WINDOW)
        self.said = False

    def observe(self, metrics: dict, *, step: int, lr: float, max_staleness: int) -> str | None:
        if self.said or not metrics.get("async/staleness_max") or "async/policy_kl" not in metrics:
            return None
        self.recent.append((float(metrics["async/policy_kl"]), float(metrics["rollout/is_ess"])))
        if len(self.recent) < DRIFT_WINDOW:
            return None
        kl = sum(k for k, _ in self.recent) / DRIFT_WINDOW
        ess = sum(e for _, e in self.recent) / DRIFT_WINDOW
        if kl <= DRIFT_KL_LEVEL and ess >= DRIFT_ESS_LEVEL:
            return None
        self.said = True
        return (
            f"step {step}: the policy moves far between sampling and training: async/policy_kl {kl:.3g} nats a token "
            f"and rollout/is_ess {ess:.3f} over the last {DRIFT_WINDOW} steps (past {DRIFT_KL_LEVEL:g} or under "
            f"{DRIFT_ESS_LEVEL:g}, the demo lost 4 to 20 points of accuracy at equal steps: docs/async.md); lower "
            f"train.lr (now {lr:g}) or rollout.max_staleness (now {max_staleness})"
        )
