"""The DAPO training loop, top to bottom (``train_step`` is one step of the paper's Algorithm 1):

  collect              generate G responses per prompt, grade (+1/-1), add the soft overlong
                       penalty, drop groups whose accuracies are all equal, repeat until P prompts
                       (dynamic_sampling.BatchCollector)
  advantages           overlong filtering (optional), then (R - mean_G) / (std_G + eps) per response
  old log-probs        under the policy that sampled, recomputed before the update (algo.old_logp: or
                       vLLM's)
  update               P / mini_batch_prompts optimizer updates of the token-mean clipped surrogate
                       (the loss built here from algo.py; Policy only runs it)
  weight push          the new weights to the rollout engine
  evaluation, checkpoint, metrics

Launched by torchrun or `dapo launch-ray` (WORLD_SIZE > 1) the same loop runs on every rank with
FSDP: each rank samples a share of the prompts, rank 0 grades them for everyone, every rank then
holds the same batch and computes log-probs and gradients for its share of the rows (parallel.py).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dapo import checkpoint, lora, parallel, preemption, run_setup, watchdog
from dapo.async_rollout import AsyncRollout
from dapo.batch import RolloutBatch
from dapo.config import Config, ConfigError, dump_yaml, load_config
from dapo.data import PromptSampler, render_prompt
from dapo.dynamic_sampling import (
    BatchCollector,
    CollectStats,
    next_keep_rate,
    round_seeds,
)
from dapo.evaluation import evaluate, sampling_settings
from dapo.library_logging import raised_outside, rank_log_path
from dapo.log import RunLogger
from dapo.memory import PhaseMemory
from dapo.metrics import (
    DriftGuard,
    engine_gap_warning,
    no_signal_advice,
    sample_records,
    sampling_metrics,
    step_metrics,
)
from dapo.models import pick_device
from dapo.phases import assign_advantages, make_loss_fn, old_logprobs
from dapo.policy import BaseReference, Policy, ReferenceModel
from dapo.rollout import SamplingParams
from dapo.screening import screen_metrics

NO_SIGNAL_STREAK = 3  # steps in a row without an informative group before the run says what to change


class StepError(RuntimeError):
    """A step that failed inside a library (the rollout engine, a CUDA call): one line saying where, and how to
    resume."""


class NonFiniteError(RuntimeError):
    """Too many optimizer updates in a row with a non-finite loss or gradient norm."""


@dataclass
class TrainState:
    """What the loop carries from step to step, besides the policy and the prompt sampler."""

    step: int = 0  # training steps done
    gen_rounds: int = 0  # generation rounds done (several per step with dynamic sampling)
    keep_rate: float = 1.0  # running estimate of the share of groups dynamic sampling keeps
    buffer: list[RolloutBatch] = field(default_factory=list)  # surplus kept groups, used first next step

    def observe(self, cstats: CollectStats) -> None:
        self.gen_rounds += cstats.rounds
        self.keep_rate = next_keep_rate(self.keep_rate, cstats)

    def round_seed(self, base_seed: int):
        """The sampling seed of this step's k-th generation round: distinct across the whole run."""
        return round_seeds(base_seed, self.gen_rounds)

    def state_dict(self) -> dict:
        return {**vars(self), "buffer": [b.state() for b in self.buffer]}

    @classmethod
    def from_state_dict(cls, state: dict) -> TrainState:
        counters = {k: state[k] for k in ("step", "gen_rounds", "keep_rate")}  # (a checkpoint holds more)
        return cls(**counters, buffer=[RolloutBatch.from_state(s) for s in state["buffer"]])


class Timer:
    """``with timer("update"): ...`` adds the block's wall time to ``timer.seconds["update"]``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


class StepPhases:
    """The step's blocks: ``with phase("update"): ...`` enters each hook's own context for the block, ``hook(name)``,
    in the order given (the memory recorder, the timer, the watchdog). A block may go by another name for one hook:
    ``phase("checkpoint", watchdog="checkpoint_wait")``."""

    def __init__(self, **hooks: Callable[[str], contextlib.AbstractContextManager]):
        self.hooks = hooks

    @contextlib.contextmanager
    def __call__(self, name: str, **renamed: str):
        with contextlib.ExitStack() as stack:
            for key, hook in self.hooks.items():
                stack.enter_context(hook(renamed.get(key, name)))
            yield


@dataclass
class RunInputs:
    """What a Python caller (dapo.api) hands a run besides its config; None: what the config names.
    A run started with them resumes with the same ones (config.yaml cannot name them)."""

    train_examples: list | None = None  # instead of data.train_files or the built-in task
    eval_sets: list | None = None  # (Benchmark, examples) pairs instead of eval.benchmarks
    reward_fn: Callable | None = None  # grades every response, in the grading pool, instead of reward.grader
    tool_env: object | None = None  # a dapo.tools.Environment: multi-turn rollouts with the caller's own tool


@dataclass
class Run:
    """Everything one training run holds, built once by ``start``."""

    cfg: Config
    dist: parallel.Dist
    policy: Policy
    reference: ReferenceModel | BaseReference | None
    engine: object
    encode: object
    sampler: PromptSampler
    collector: BatchCollector
    pool: object
    loss_fn: object
    eval_sets: list
    state: TrainState
    logger: RunLogger
    writer: checkpoint.CheckpointWriter = field(default_factory=lambda: checkpoint.CheckpointWriter(asynchronous=False))
    grader: str | None = None  # every row's grader (a caller's reward function); None: reward.grader
    no_signal: int = 0  # steps in a row without an informative group
    engine_gap_said: bool = False  # the engine-vs-trainer gap has been reported (once a run)
    drift: DriftGuard = field(default_factory=DriftGuard)  # stale samples: the policy's movement (once a run)
    memory: PhaseMemory | None = None  # each phase's peak memory (perf/peak_*_gb)
    signals: preemption.Signals | None = None  # SIGTERM, SIGUSR1, SIGINT: a checkpoint on the way out
    rollout_ahead: AsyncRollout | None = None  # rollout.max_staleness > 0: the engine collects the next steps
    resumed_async: dict | None = None  # the checkpoint's collection ahead (rollout.max_staleness > 0)

    def evaluate(self, step: int) -> dict:
        """The held-out metrics; every sampled response goes to samples/step_NNNNNN.<benchmark>.responses.jsonl."""
        e, out = self.cfg.eval, {}
        tokenizer = self.policy.tokenizer
        for bench, examples in self.eval_sets:
            sampling = SamplingParams(**sampling_settings(bench, self.cfg, in_training=True), seed=e.seed)
            res = evaluate(
                self.engine,
                self.encode,
                examples,
                self.pool,
                sampling,
                name=bench.name,
                grader=self.grader or self.cfg.reward.grader,
                render=lambda ex: render_prompt(ex, tokenizer),
            )
            self.logger.write_eval_responses(step, res)
            out.update(res.metrics())
        return out

    def small_state(self) -> dict:
        """The trainer state a step changes before its update (sampler, counters, held-over groups, RNG), copied."""
        sampler = {} if self.rollout_ahead is not None else self.sampler.state_dict()  # the collection's: in save
        state = {"sampler": sampler, **self.state.state_dict(), "rng": checkpoint.rng_state()}
        return copy.deepcopy(state)

    def save(self, small: dict | None = None) -> None:
        """Checkpoint the run as it is, or (``small``, from ``small_state``) as it was before an abandoned step."""
        cfg, policy, d = self.cfg, self.policy, self.dist
        if self.rollout_ahead is not None:  # the sampler is the collection's, ahead of the trainer: as it is saved
            small = small or self.state.state_dict()
            ahead = self.rollout_ahead.checkpoint_state(small["step"])
            small = {**small, "sampler": ahead["state"]["sampler"], "async": ahead}
        small = small or {"sampler": self.sampler.state_dict(), **self.state.state_dict()}
        trainer_state = {"policy": policy.trainer_state(), **small, "world_size": d.world_size}
        checkpoint.save_checkpoint(
            cfg.run_dir,
            small["step"],
            model=policy.model,
            tokenizer=policy.tokenizer,
            trainer_state=trainer_state,
            config_yaml=dump_yaml(cfg),
            keep=cfg.run.keep_checkpoints,
            shards=policy.sharded_state(),
            dist=d,
            writer=self.writer,
        )

    def finish_saves(self) -> dict:
        """Wait for the checkpoint being written (raising its error); the last write's duration, if new."""
        self.writer.wait()
        write_s = self.writer.take_write_s()
        return {} if write_s is None else {"perf/checkpoint_write_s": write_s}

    def resume(self, path) -> int | None:
        """Continue from checkpoint ``path``, written at this world size or another; returns the number of
        ranks that wrote it (None: not recorded, an older checkpoint).

        Across world sizes the run goes on as it would have: the prompt stream is one seeded order for the
        whole run (every rank draws the same prompts and the engines split them), the held-over groups,
        step, generation-round count, keep-rate estimate and RNG are global, and AdamW's moments and step
        count are resharded with the weights (``checkpoint.load_policy``). The responses are redrawn: each
        rollout engine samples its share of the prompts with a seed of its own (``ShardedRollout``)."""
        saved = checkpoint.load_trainer_state(path)
        checkpoint.load_policy(self.policy, path, saved.get("policy"))
        # an engine with its own copy starts from the checkpoint
        self.engine.update_weights(self.policy.named_weights())
        self.sampler.load_state_dict(saved["sampler"])
        self.state = TrainState.from_state_dict(saved)
        checkpoint.set_rng_state(saved["rng"])
        self.resumed_async = saved.get("async")
        if self.resumed_async is not None and self.resumed_async["in_flight"] and self.rollout_ahead is None:
            raise ConfigError(
                f"the checkpoint holds batches collected ahead at rollout.max_staleness="
                f"{self.resumed_async['max_staleness']}; resume with that setting"
            )
        return saved.get("world_size")

    def boundary(self, where: str) -> None:
        """Stop here when a rank has had SIGTERM, SIGUSR1 or SIGINT (preemption.py)."""
        if self.signals is not None:
            self.signals.check(self, where)

    def note_engine_gap(self, metrics: dict, step: int) -> None:
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

    def note_nonfinite(self, step: int) -> None:
        """Say so when the step skipped optimizer updates for a non-finite loss or gradient norm (the weights and
        AdamW state stayed as they were)."""
        updates, skipped = self.policy.last_updates
        if skipped:
            limit = self.cfg.run.max_nonfinite_in_a_row
            self.logger.warn(
                f"step {step}: {skipped} of {updates} optimizer updates skipped, their loss or gradient "
                "norm not finite (weights and AdamW state left as they were; actor/nonfinite_updates); "
                f"{self.policy.nonfinite_in_a_row} in a row" + (f", the run stops at {limit}" if limit else "")
            )

    def stop_if_nonfinite(self, step: int) -> None:
        """Stop after ``run.max_nonfinite_in_a_row`` skipped updates in a row, saying what to check."""
        limit, streak = self.cfg.run.max_nonfinite_in_a_row, self.policy.nonfinite_in_a_row
        if limit and streak >= limit:
            last = checkpoint.latest_checkpoint(self.cfg.run_dir)
            raise NonFiniteError(
                f"step {step}: {streak} optimizer updates in a row had a non-finite loss or gradient norm "
                f"(run.max_nonfinite_in_a_row={limit}), so the run stops; check the learning rate (train.lr="
                f"{self.cfg.train.lr:g}), model.dtype={self.cfg.model.dtype} (overflow in low precision), a reward "
                "function returning inf or nan, and the weights of the last checkpoint"
                + (f" ({last})" if last else "")
                + " for nan"
            )

    def note_signal(self, batch: RolloutBatch | None, cstats: CollectStats, step: int) -> None:
        """Say so when a step had nothing to learn from, and what to change after a few in a row."""
        self.no_signal = 0 if batch is not None else self.no_signal + 1
        if batch is None:
            self.logger.info(f"step {step}: no informative group was generated; nothing to train on")
        if self.no_signal == NO_SIGNAL_STREAK:
            r = self.cfg.rollout
            self.logger.warn(
                no_signal_advice(
                    self.no_signal, cstats, group_size=r.group_size, max_response_tokens=r.max_response_tokens
                )
            )


def start(cfg: Config, stack: contextlib.ExitStack, console=None, inputs: RunInputs | None = None) -> Run:
    """Build the run: ranks, policy, rollout engine, data, grading pool, logger; resume if asked."""
    d = run_setup.setup_ranks_and_run_dir(cfg, stack)
    with watchdog.phase("start"):  # models, engine, grading workers, resume: a hang here is named too
        return _build(cfg, stack, d, console, inputs or RunInputs())


def _build(cfg: Config, stack: contextlib.ExitStack, d: parallel.Dist, console, inputs: RunInputs) -> Run:
    """The run's components, one setup step each (run_setup.py), in the order they need one another."""
    device = d.device if d.sharded else pick_device(cfg.model.device)
    policy, reference = run_setup.setup_policy(cfg, d, device)
    cfg, engine = run_setup.setup_engine(cfg, d, policy, inputs.tool_env)  # cfg: with the backend "auto" chose
    encode, sampler = run_setup.setup_data(cfg, policy.tokenizer, inputs.train_examples)
    eval_sets = run_setup.setup_eval_sets(cfg, inputs.eval_sets)
    pool, grader = run_setup.setup_rewards(cfg, d, stack, inputs.reward_fn)
    collector, rollout_ahead = run_setup.setup_collection(
        cfg, d, stack, engine, sampler, encode, pool, grader, policy=policy, device=device, tool_env=inputs.tool_env
    )
    run = Run(
        cfg,
        d,
        policy,
        reference,
        engine,
        encode,
        sampler,
        collector,
        pool,
        make_loss_fn(cfg.algo, cfg.rollout.max_response_tokens),
        eval_sets,
        TrainState(),
        RunLogger(None, total_steps=cfg.train.total_steps),  # writes nothing; rank 0's is made once resumed
        checkpoint.CheckpointWriter(asynchronous=cfg.run.async_checkpoint and not d.sharded),
        grader=grader,
        memory=PhaseMemory(cuda=device.type == "cuda"),
        rollout_ahead=rollout_ahead,
    )
    stack.callback(run.memory.close)
    passed_over, resumed = run_setup.setup_resume(run)
    run_setup.setup_loggers(run, stack, console)
    if policy.adapted:
        run.logger.info(lora.summary(policy.model))
    for line in passed_over:  # checkpoints found damaged (moved aside), or not verifiable (written without a manifest)
        run.logger.warn(line)
    if resumed is not None:
        run.logger.info(resumed)
    return run


def train_step(run: Run, step: int) -> tuple[dict, RolloutBatch | None]:
    """One training step, phase by phase; returns its metrics and the batch it trained on."""
    cfg, state, policy, engine = run.cfg, run.state, run.policy, run.engine
    timer = Timer()
    memory = {"memory": run.memory.phase} if run.memory is not None else {}
    phase = StepPhases(**memory, timer=timer, watchdog=watchdog.step_phase)  # each block timed, measured, watched
    with phase("step"):
        # generation and grading, every round (perf/time_generate_s, _reward_s)
        with run.logger.warnings_of(step), phase("collect"):
            if run.rollout_ahead is not None:  # collected ahead, while the trainer updated (rollout.max_staleness)
                batch, cstats, ahead = run.rollout_ahead.take(step)
            else:
                batch, cstats, ahead = run.collector.collect(
                    cfg.train.prompts_per_step,
                    state.buffer,
                    round_seed=state.round_seed(cfg.rollout.seed),
                    keep_rate_estimate=state.keep_rate if cfg.algo.adaptive_oversample else 1.0,
                ) + ({},)
        run.boundary("collect")
        state.observe(cstats)
        metrics = ahead | sampling_metrics(cstats, buffer_groups=len(state.buffer), gen_rounds_total=state.gen_rounds)
        if cfg.algo.screen_samples:
            metrics |= screen_metrics(
                cstats.screen, group_size=cfg.rollout.group_size, screen_samples=cfg.algo.screen_samples
            )
        run.note_signal(batch, cstats, step)
        if batch is not None:
            assign_advantages(batch, cfg.algo, cfg.rollout.group_size, filter_void_turns=cfg.tools.filter_void_turns)
            engine.sleep()  # a colocated engine frees its memory for the trainer; no-op for hf
            with phase("old_logprob"):
                old = old_logprobs(batch, run)
            run.boundary("old_logprob")  # the last point a stop abandons the step: past it the update is finished
            # an asynchronous save writes the weights and AdamW state from live memory (for the watchdog a phase of
            # its own: a wait of nothing must not set the limit of the save itself)
            with phase("checkpoint", watchdog="checkpoint_wait"):
                run.writer.wait()
            with phase("update"):
                update = policy.update(batch, run.loss_fn, with_entropy=old.entropy_from_update)
            run.note_nonfinite(step)
            with phase("weight_sync"):
                engine.wake()
                engine.update_weights(policy.named_weights())
                if run.rollout_ahead is not None:
                    run.rollout_ahead.publish(step, policy.named_weights())
            metrics |= old.metrics | step_metrics(
                batch,
                cstats,
                update,
                timer.seconds,
                max_prompt_tokens=cfg.data.max_prompt_tokens,
                max_response_tokens=cfg.rollout.max_response_tokens,
                old_logprob_tokens=old.tokens_computed,
                engine_vs_trainer=cfg.algo.old_logp != "engine",
            )
            run.note_engine_gap(metrics, step)
        elif run.rollout_ahead is not None:  # nothing trained: version t is version t - 1's weights, and is waited on
            with phase("weight_sync"):
                run.rollout_ahead.publish(step, policy.named_weights())
        if step == cfg.train.total_steps or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0):
            with phase("eval"):
                metrics |= run.evaluate(step)
        state.step = step
        with phase("checkpoint"):  # the time the loop waits: with run.async_checkpoint, copying the small state
            if step == cfg.train.total_steps or (cfg.run.save_every and step % cfg.run.save_every == 0):
                metrics |= run.finish_saves()  # the previous save's background write (perf/checkpoint_write_s)
                run.save()
    peaks = run.memory.take() if run.memory is not None else {}
    return metrics | {f"perf/time_{k}_s": v for k, v in timer.seconds.items()} | peaks, batch


def checked_step(run: Run, step: int) -> tuple[dict, RolloutBatch | None]:
    """``train_step``; a failure from inside a library becomes one line (StepError) naming the step, the phase
    and the checkpoint a new start resumes from, with the traceback in train.log."""
    watchdog.PHASES.here().failed_in = None
    try:
        return train_step(run, step)
    except Exception as err:
        if not raised_outside(err):
            raise
        where = watchdog.failed_in() or "the step"
        log = logging.getLogger("dapo.training")
        log.info("step %d failed in %s; the traceback:", step, where, exc_info=err)  # train.log only (INFO)
        last = checkpoint.latest_checkpoint(run.cfg.run_dir)
        why = " ".join(str(err).split())[:300] or "no message"
        raise StepError(
            f"step {step} failed in {where} on rank {run.dist.rank}: {type(err).__name__}: {why} (the "
            f"traceback is in {rank_log_path(run.cfg.run_dir, run.dist.rank)}); start the run again to resume from "
            + (str(last) if last else "the start (no checkpoint yet)")
        ) from err


def train(cfg: Config, *, console=None, inputs: RunInputs | None = None) -> dict:
    """Run (or resume) training; returns the last logged row (with eval/* before and after). On a rollout rank
    (rollout.ranks) it serves generation to trainer rank 0 until the run ends, and returns {}."""
    if parallel.is_rollout_rank(cfg.rollout.ranks):
        from dapo.rollout.ranks import serve

        serve(cfg)
        return {}
    with contextlib.ExitStack() as stack:
        run = start(cfg, stack, console, inputs)
        stack.enter_context(preemption.on_signals(run))  # from here a signal stops the run with a checkpoint
        last: dict = {}
        if run.state.step == 0 and cfg.eval.before_train:
            with watchdog.phase("eval"):
                metrics = run.evaluate(0)
            last = run.logger.log(0, metrics)
            run.logger.held_out(0, last)
        for step in range(run.state.step + 1, cfg.train.total_steps + 1):
            run.boundary("step")
            metrics, batch = checked_step(run, step)
            last = run.logger.log(step, metrics)
            run.logger.step_line(step, cfg.train.total_steps, last)
            run.logger.held_out(step, last)
            if batch is not None:
                run.logger.write_samples(step, sample_records(batch, run.policy.tokenizer, cfg.run.samples_per_step))
            run.stop_if_nonfinite(step)  # after its row and samples are written: the skipped updates are counted there
        with watchdog.phase("checkpoint"):
            # the last checkpoint is whole on disk before train returns (train.log has how long it took)
            run.finish_saves()
        run.logger.log_run_files(title=cfg.run.name)
    return last


# one run in its own process, as the ablation runner starts them: python -m dapo.training PRESET [key=value ...]
if __name__ == "__main__":
    try:
        train(load_config(sys.argv[1], sys.argv[2:]))
    except preemption.Stopped as stopped:  # as `dapo train`: the stop line alone (rank 0's), exit code 75
        if stopped.main:
            print(stopped, file=sys.stderr, flush=True)
        sys.exit(stopped.exit_code)
