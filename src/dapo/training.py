"""The DAPO training loop, top to bottom (``train_step`` is one step of the paper's Algorithm 1):

  collect              generate G responses per prompt, grade (+1/-1), add the soft overlong
                       penalty, drop groups whose accuracies are all equal, repeat until P prompts
                       (the run's collector: in process, or ahead of the trainer; dapo.collect)
  advantages           overlong filtering (optional), then (R - mean_G) / (std_G + eps) per response
  old log-probs        under the policy that sampled, computed before the update (algo.old_logp_source: or
                       vLLM's)
  update               P / mini_batch_prompts optimizer updates of the token-mean clipped surrogate
                       (the loss built from dapo.algorithm; Policy only runs it)
  weight push          the new weights to the rollout engine, and to the collector
  evaluation, checkpoint, metrics

Launched by torchrun or `dapo launch-ray` (WORLD_SIZE > 1) the same loop runs on every rank with
FSDP: each rank samples a share of the prompts, rank 0 grades them for everyone, every rank then
holds the same batch and computes log-probs and gradients for its share of the rows (dapo.runtime.parallel).
The loop's ``Run`` is named here alone: every component it holds was built by ``run_setup`` from what it needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from dapo import checkpoint, run_setup
from dapo.algorithm.batch import RolloutBatch
from dapo.algorithm.step import (
    assign_advantages,
    make_loss_fn,
    old_logprobs,
    takes_old_logp_from_update,
    teacher_in_loss,
    teacher_term,
)
from dapo.checkpoint import preemption
from dapo.checkpoint.saver import Saver
from dapo.checkpoint.writer import CheckpointWriter
from dapo.collect.base import Collector, StepBatch
from dapo.config import Config, load_config
from dapo.evaluation import HeldOut
from dapo.model import lora
from dapo.model.loading import pick_device
from dapo.model.policy import BaseReference, Policy, ReferenceModel
from dapo.model.teacher import TeacherModel
from dapo.reporting.metrics import sample_records, step_metrics
from dapo.reporting.notes import NonFiniteError, RunNotes
from dapo.reporting.run_log import RunLogger
from dapo.runtime import parallel, watchdog
from dapo.runtime.libraries import raised_outside, rank_log_path
from dapo.runtime.memory import PhaseMemory
from dapo.runtime.step_phases import StepPhases, Timer

__all__ = ["NonFiniteError", "Run", "RunInputs", "StepError", "checked_step", "start", "train", "train_step"]


class StepError(RuntimeError):
    """A step that failed inside a library (the rollout engine, a CUDA call): one line saying where, and how to
    resume."""


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
    engine: object  # the rollout engine the run evaluates with (and, collecting in process, samples with)
    collector: Collector
    loss_fn: Callable
    evaluate: HeldOut
    saver: Saver
    logger: RunLogger
    notes: RunNotes
    memory: PhaseMemory
    step: int = 0  # training steps done
    signals: preemption.Signals | None = None  # SIGTERM, SIGUSR1, SIGINT: a checkpoint on the way out
    teacher: TeacherModel | None = None  # on-policy distillation's frozen teacher (teacher.coef > 0)

    def boundary(self, where: str) -> None:
        """Stop here when a rank has had SIGTERM, SIGUSR1 or SIGINT (dapo.checkpoint.preemption)."""
        if self.signals is not None:
            self.signals.check(where, self.step)


def start(cfg: Config, stack: contextlib.ExitStack, console=None, inputs: RunInputs | None = None) -> Run:
    """Build the run: ranks, policy, rollout engine, data, grading pool, collector, logger; resume if asked."""
    d = run_setup.setup_ranks_and_run_dir(cfg, stack)
    with watchdog.phase("start"):  # models, engine, grading workers, resume: a hang here is named too
        return _build(cfg, stack, d, console, inputs or RunInputs())


def _build(cfg: Config, stack: contextlib.ExitStack, d: parallel.Dist, console, inputs: RunInputs) -> Run:
    """The run's components, one setup step each (run_setup.py), in the order they need one another."""
    # the data and reward.function first: a bad file or function stops the run before any model loads
    train_sets = run_setup.setup_train_sets(cfg, inputs.train_examples)
    eval_sets = run_setup.setup_eval_sets(cfg, inputs.eval_sets)
    reward_fn = run_setup.setup_reward_fn(cfg, inputs.reward_fn, train_sets)
    device = d.device if d.sharded else pick_device(cfg.model.device)
    policy, reference = run_setup.setup_policy(cfg, d, device)
    teacher = run_setup.setup_teacher(cfg, d, device, policy)  # a teacher that cannot load stops the run here
    cfg, capped = run_setup.setup_prompt_limit(cfg, policy, teacher)  # cfg: prompts within the models' contexts
    cfg, engine = run_setup.setup_engine(cfg, d, policy, inputs.tool_env)  # cfg: with the backend "auto" chose
    encode, prompts, eval_sets, overlong = run_setup.setup_data(cfg, policy.tokenizer, train_sets, eval_sets)
    auto = run_setup.auto_grader(cfg, train_sets, eval_sets)  # reward.grader=auto, with what the rows chose
    graders = run_setup.graders_of(cfg, train_sets, eval_sets, auto)
    pool, grader = run_setup.setup_rewards(cfg, d, stack, reward_fn, graders)
    collector = run_setup.setup_collection(
        cfg, d, stack, engine, prompts, encode, pool, grader, tokenizer=policy.tokenizer, device=device,
        tool_env=inputs.tool_env, auto=auto,
    )  # fmt: skip
    saver = Saver(cfg, d, policy, collector, CheckpointWriter(asynchronous=cfg.run.async_checkpoint and not d.sharded))
    memory = PhaseMemory(cuda=device.type == "cuda")
    stack.callback(memory.close)
    step, passed_over, resumed = run_setup.setup_resume(cfg, d, policy, engine, collector)
    logger = run_setup.setup_loggers(cfg, d, stack, console, start_step=step, saver=saver)
    for line in run_setup.data_lines(cfg, train_sets, eval_sets, reward_fn):  # which grader, and why
        logger.info(line)
    for line in filter(None, [capped, *overlong]):  # the prompt limit, and the prompts past it
        logger.info(line)
    if policy.adapted:
        logger.info(lora.summary(policy.model))
    for line in passed_over:  # checkpoints found damaged (moved aside), or not verifiable (written without a manifest)
        logger.warn(line)
    if resumed is not None:
        logger.info(resumed)
    return Run(
        cfg, d, policy, reference, engine, collector,
        loss_fn=make_loss_fn(cfg.algo, cfg.rollout.max_response_tokens),
        evaluate=HeldOut(cfg, engine, encode, eval_sets, pool, grader or auto, policy.tokenizer),
        saver=saver, logger=logger, notes=RunNotes(cfg, logger), memory=memory, step=step, teacher=teacher,
    )  # fmt: skip


def train_step(run: Run, step: int) -> tuple[dict, RolloutBatch | None]:
    """One training step, phase by phase; returns its metrics and the batch it trained on."""
    cfg, policy, collector = run.cfg, run.policy, run.collector
    timer = Timer()
    phase = StepPhases(memory=run.memory.phase, timer=timer, watchdog=watchdog.step_phase)  # timed, measured, watched
    with phase("step"):
        # generation and grading, every round (perf/time_generate_s, _reward_s)
        with run.logger.warnings_of(step), phase("collect"):
            taken = collector.take(step)
        run.boundary("collect")
        metrics, batch = dict(taken.metrics), taken.batch
        run.notes.collected(batch, taken.stats, step)
        if batch is not None:
            metrics |= _update(run, taken, step, phase, timer.seconds)
            run.notes.engine_gap(metrics, step)  # the engine's log-probs against the trainer's; stale samples' drift
        else:  # nothing trained: the same weights are this step's version (a collector ahead waits on it)
            with phase("weight_sync"):
                collector.publish(step, policy.named_weights(), held_over=taken.held_over)
        if step == cfg.train.total_steps or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0):
            with phase("eval"):
                metrics |= _evaluate(run, step)
        run.step = step
        with phase("checkpoint"):  # the time the loop waits: with run.async_checkpoint, copying the small state
            if step == cfg.train.total_steps or (cfg.run.save_every and step % cfg.run.save_every == 0):
                metrics |= run.saver.wait()  # the previous save's background write (perf/checkpoint_write_s)
                run.saver.save(step)
    times = {f"perf/time_{k}_s": v for k, v in timer.seconds.items()}
    cpu_times = {f"perf/cpu_{k}_s": v for k, v in timer.cpu_seconds.items()}
    return metrics | times | cpu_times | run.memory.take(), batch


def _update(run: Run, taken: StepBatch, step: int, phase: StepPhases, seconds: dict[str, float]) -> dict:
    """Advantages, old log-probs, the update and the weight push of a step with a batch; their metrics (``seconds``:
    the step's phases timed so far)."""
    cfg, policy, engine, batch = run.cfg, run.policy, run.engine, taken.batch
    assign_advantages(batch, cfg.algo, cfg.rollout.group_size, filter_void_turns=cfg.tools.filter_void_turns)
    engine.sleep()  # a colocated engine frees its memory for the trainer; no-op for hf
    with phase("old_logprob"):
        old = old_logprobs(
            batch,
            policy,
            cfg.algo,
            reference=run.reference,
            held_over=taken.held_over,
            from_update=takes_old_logp_from_update(cfg),
        )
    distilled, full_teacher = {}, run.teacher if cfg.teacher.signal == "full" else None
    if run.teacher is not None and full_teacher is None:  # on-policy distillation: a term in every token's advantage
        with phase("teacher_logprob"):
            distilled = teacher_term(batch, run.teacher, cfg.teacher)
    elif full_teacher is not None:
        teacher_in_loss(batch, cfg.teacher)
    run.boundary("old_logprob")  # the last point a stop abandons the step: past it the update is finished
    # an asynchronous save writes the weights and AdamW state from live memory (for the watchdog a phase of its
    # own: a wait of nothing must not set the limit of the save itself)
    with phase("checkpoint", watchdog="checkpoint_wait"):
        run.saver.writer.wait()
    with phase("update"):
        update = policy.update(
            batch,
            run.loss_fn,
            with_entropy=old.entropy_from_update,
            teacher=full_teacher,
            teacher_coef=cfg.teacher.coef,
            old_logp_rows=old.from_update,
        )
    updates, skipped = policy.last_updates
    run.notes.updated(step, updates=updates, skipped=skipped, in_a_row=policy.nonfinite_in_a_row)
    with phase("weight_sync"):
        engine.wake()
        engine.update_weights(policy.named_weights())
        run.collector.publish(step, policy.named_weights(), held_over=old.held_over)
    metrics = (
        old.metrics
        | distilled
        | step_metrics(
            batch,
            taken.stats,
            update,
            seconds,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            max_response_tokens=cfg.rollout.max_response_tokens,
            old_logprob_tokens=old.tokens_computed,
            engine_vs_trainer=cfg.algo.old_logp_source != "engine",
        )
    )
    return metrics


def _evaluate(run: Run, step: int) -> dict:
    """The held-out metrics; every sampled response goes to samples/step_NNNNNN.<benchmark>.responses.jsonl."""
    out = {}
    for result in run.evaluate():
        run.logger.write_eval_responses(step, result)
        out.update(result.metrics())
    return out


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
        from dapo.rollout.build import serve_rollout_rank

        serve_rollout_rank(cfg)
        return {}
    with contextlib.ExitStack() as stack:
        run = start(cfg, stack, console, inputs)
        grace_s = cfg.run.preempt_grace_s  # from here a signal stops the run with a checkpoint
        run.signals = stack.enter_context(preemption.on_signals(run.saver, grace_s=grace_s, dist=run.dist))
        last: dict = {}
        if run.step == 0 and cfg.eval.before_train:
            with watchdog.phase("eval"):
                metrics = _evaluate(run, 0)
            last = run.logger.log(0, metrics)
            run.logger.held_out(0, last)
        for step in range(run.step + 1, cfg.train.total_steps + 1):
            run.boundary("step")
            metrics, batch = checked_step(run, step)
            last = run.logger.log(step, metrics)
            run.logger.step_line(step, cfg.train.total_steps, last)
            run.logger.held_out(step, last)
            if batch is not None:
                run.logger.write_samples(step, sample_records(batch, run.policy.tokenizer, cfg.run.samples_per_step))
            # after its row and samples are written: the skipped updates are counted there
            run.notes.stop_if_nonfinite(step, in_a_row=run.policy.nonfinite_in_a_row)
        with watchdog.phase("checkpoint"):
            # the last checkpoint is whole on disk before train returns (train.log has how long it took)
            run.saver.wait()
        run.logger.log_run_files(title=cfg.run.name)
    return last


# one run in its own process, as the ablation runner starts them: python -m dapo.training PRESET [key=value ...]
if __name__ == "__main__":
    from dapo.runtime import starting

    try:
        with starting.stop_while_starting():  # a stop while the model loads: as in `dapo train`
            train(load_config(sys.argv[1], sys.argv[2:]))
    except preemption.Stopped as stopped:  # as `dapo train`: the stop line alone (rank 0's), exit code 75
        if stopped.main:
            print(stopped, file=sys.stderr, flush=True)
        sys.exit(stopped.exit_code)
    except starting.StoppedStarting as stop:
        if os.environ.get("RANK", "0") == "0":
            print(stop.line, file=sys.stderr, flush=True)
        sys.exit(starting.EXIT_CODE)
