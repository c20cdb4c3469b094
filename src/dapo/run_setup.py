"""The setup steps of a training run (``training.start``), each building one component from the config and the
components built before it: the ranks, the run directory, the policy, the rollout engine, the data, the grading
pool, the collector, the checkpoint to resume from, the loggers. None of them sees the loop's ``Run``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random

import torch

from dapo import checkpoint
from dapo.checkpoint.saver import Saver
from dapo.collect.base import CollectionState, Collector
from dapo.collect.collector import build_collector
from dapo.collect.dynamic_sampling import DynamicSampling
from dapo.collect.scoring import Scorer
from dapo.config import Config, ConfigError, dump_yaml
from dapo.data.files import DataRead
from dapo.data.prompt_order import PromptOrder
from dapo.data.prompts import fit_prompts, make_encoder, model_context, prompt_limit
from dapo.data.train_sets import load_train_sets, read_settings
from dapo.evaluation import held_out_set, load_benchmark
from dapo.model.policy import BaseReference, Policy, ReferenceModel
from dapo.model.teacher import TeacherModel
from dapo.reporting.run_log import RunLogger
from dapo.reporting.trackers import check_installed, open_trackers, run_status
from dapo.rewards.reward_fn import grader_name
from dapo.rewards.setup import grading_function, grading_pool
from dapo.rewards.sources import DataSet, auto_graders, grading_line, row_graders
from dapo.rewards.sources import graders_of as graders_of_sets
from dapo.rollout import SamplingParams, build
from dapo.runtime import parallel, threads, watchdog
from dapo.runtime.libraries import setup_library_logging


def setup_ranks_and_run_dir(cfg: Config, stack: contextlib.ExitStack) -> parallel.Dist:
    """Seed Python's and torch's generators and join the ranks (a world of one without torchrun or Ray); then the
    run directory (an earlier run moved aside with run.overwrite), the libraries' log lines in its train.log, and
    the watchdog that names a hung phase there."""
    check_installed(cfg.run.loggers)  # before anything is built
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    threads.fit_torch_threads()  # no more threads than the CPUs this process may use
    d = parallel.init(cfg.model.device, rollout_ranks=cfg.rollout.ranks)  # torchrun, Ray: FSDP over the ranks
    checkpoint.prepare_run_dir(cfg.run_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite, dist=d)
    log_path = setup_library_logging(cfg.run_dir, cfg.run.log_level, rank=d.rank)  # vLLM, Ray, transformers: train.log
    watchdog.PHASES.slowest.clear()  # a new run, a new history (a process may run several)
    dog = watchdog.start(cfg.run, rank=d.rank, log_path=log_path)
    if dog is not None:
        stack.callback(dog.stop)
    return d


def setup_policy(
    cfg: Config, d: parallel.Dist, device: torch.device
) -> tuple[Policy, ReferenceModel | BaseReference | None]:
    """The policy, and the reference model when algo.kl_coef > 0 (None without a KL term)."""
    r = cfg.rollout
    train_seq_tokens = cfg.data.max_prompt_tokens + r.max_response_tokens  # the longest sequence a training pass sees
    model_kw = {"device": device, "temperature": r.temperature, "max_seq_tokens": train_seq_tokens}
    policy = Policy(cfg.model, cfg.train, d, **model_kw)
    reference = None
    if cfg.algo.kl_coef > 0:  # with LoRA the base is the policy with its adapters off: no second copy
        reference = policy.base_reference() if policy.adapted else ReferenceModel(cfg.model, cfg.train, d, **model_kw)
    return policy, reference


def setup_teacher(cfg: Config, d: parallel.Dist, device: torch.device, policy: Policy) -> TeacherModel | None:
    """The frozen teacher when teacher.coef > 0 (None without one), on the trainer's ranks (sharded as the policy
    is), its log-probs at the sampling temperature over the policy's micro-batch layout; a teacher whose tokenizer
    is not the policy's is refused."""
    if cfg.teacher.coef == 0:
        return None
    r = cfg.rollout
    teacher = TeacherModel(
        cfg.teacher, cfg.model, cfg.train, d,
        student_tokenizer=policy.tokenizer, device=device, temperature=r.temperature,
        max_seq_tokens=cfg.data.max_prompt_tokens + r.max_response_tokens,
    )  # fmt: skip
    if cfg.teacher.signal == "full" and teacher.packed != policy.packed:  # it runs on the student's micro-batches
        raise ConfigError(
            f"teacher.signal=full: teacher.path={cfg.teacher.path} {'packs' if teacher.packed else 'cannot pack'} "
            f"sequences (its attention kernels) and model.path={cfg.model.path} "
            f"{'does' if policy.packed else 'does not'}; set train.pack_sequences=false, or teacher.signal=sampled"
        )
    return teacher


def setup_engine(cfg: Config, d: parallel.Dist, policy: Policy, tool_env) -> tuple[Config, object]:
    """The rollout engine, and the config with the backend it runs (rollout.backend=auto resolved)."""
    # the saved config says which engine ran ("auto" resolved)
    r = dataclasses.replace(cfg.rollout, backend=build.resolve_backend(cfg.rollout.backend))
    cfg = dataclasses.replace(cfg, rollout=r)
    engine = build.training_engine(cfg, policy, d, tool_env=tool_env)
    if cfg.algo.old_logp_source == "engine" and engine.backend != "vllm":
        raise ConfigError(
            f"algo.old_logp_source=engine: rollout.backend=auto chose {engine.backend}, which reports no "
            "log-probs (vLLM is not installed); use algo.old_logp_source=recompute"
        )
    return cfg, engine


def setup_train_sets(cfg: Config, train_examples: list | None) -> list[DataSet]:
    """The training problems, set by set as the run's start lines name them: ``train_examples`` (given in Python:
    a list of Examples, or a ``DataRead`` of them), else each file of data.train_files, or the built-in task."""
    d = cfg.data
    if train_examples is not None:
        if isinstance(train_examples, DataRead):
            return [DataSet.of("data given to dapo.train", train_examples, d.template)]
        return [DataSet("data given to dapo.train", train_examples, d.template)]
    return [
        DataSet.of("data", read, None) if path is None else DataSet.of(f"data {path}", read, d.template)
        for path, read in load_train_sets(d)
    ]


def setup_reward_fn(cfg: Config, reward_fn, train_sets: list[DataSet]):
    """What grades every response instead of reward.grader: the caller's ``reward_fn``, or reward.function's
    function, imported and tried on one response (built by every rank, before the model: a bad one stops the
    run at once), or None."""
    probe_truth = train_sets[0].examples[0].ground_truth if train_sets and train_sets[0].examples else "1"
    return grading_function(cfg, reward_fn, probe_truth=probe_truth)


def setup_prompt_limit(cfg: Config, policy: Policy, teacher: TeacherModel | None = None) -> tuple[Config, str | None]:
    """The config with data.max_prompt_tokens at most the model's context less the longest response the run asks
    for (training or held-out), and at most the teacher's less a training response (it scores every trained
    sequence whole); the line saying it was capped (None: it fits)."""
    r, e = cfg.rollout, cfg.eval
    budget, key = max(
        (r.max_response_tokens, "rollout.max_response_tokens"), (e.max_response_tokens or 0, "eval.max_response_tokens")
    )
    context = model_context(policy.model.config)
    limit, line = prompt_limit(cfg.data.max_prompt_tokens, context, budget, key)
    if teacher is not None:
        try:
            by_teacher = prompt_limit(
                cfg.data.max_prompt_tokens, model_context(teacher.model.config), r.max_response_tokens,
                "rollout.max_response_tokens",
            )  # fmt: skip
        except ConfigError as err:
            raise ConfigError(f"teacher.path={cfg.teacher.path}: {err}") from None
        if by_teacher[0] < limit:
            limit, line = by_teacher[0], f"teacher.path={cfg.teacher.path}: {by_teacher[1]}"
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_tokens=limit)), line


def setup_data(
    cfg: Config, tokenizer, train_sets: list[DataSet], eval_sets: list
) -> tuple[object, PromptOrder, list, list[str]]:
    """The prompt encoder, the order in which the training problems (``setup_train_sets``) are drawn, the held-out
    sets, and the lines counting each set's prompts over data.max_prompt_tokens (dropped with
    data.overlong_prompts=drop)."""
    encode = make_encoder(tokenizer, cfg.data.max_prompt_tokens)
    rule, lines, prompts, kept_eval = cfg.data.overlong_prompts, [], [], []
    for data in train_sets:
        examples, line = fit_prompts(data.label, list(data.examples), encode, rule)
        prompts += examples
        lines += [line] if line else []
    for bench, examples in eval_sets:
        examples, line = fit_prompts(held_out_set(bench, examples, cfg.data.template).label, examples, encode, rule)
        kept_eval.append((bench, examples))
        lines += [line] if line else []
    return encode, PromptOrder(prompts, seed=cfg.data.seed), kept_eval, lines


def data_lines(cfg: Config, train_sets: list[DataSet], eval_sets: list, reward_fn) -> list[str]:
    """One line per training and held-out data set: how its rows were read, its prompt template and its grader,
    and why."""
    custom = None
    if reward_fn is not None:
        spec = cfg.reward.function
        custom = "your reward function" + (f" (reward.function={spec})" if spec is not None else "")
    sets = [*train_sets, *(held_out_set(bench, examples, cfg.data.template) for bench, examples in eval_sets)]
    chosen = row_graders(sets) if cfg.reward.grader == "auto" and reward_fn is None else {}
    return [grading_line(data, grader=cfg.reward.grader, custom=custom, chosen=chosen) for data in sets]


def graders_of(cfg: Config, train_sets: list[DataSet], eval_sets: list, auto: str | dict[str, str]) -> set[str]:
    """The graders the run's training and held-out rows go to (``auto``: ``auto_grader``'s)."""
    held_out = [held_out_set(bench, examples, cfg.data.template) for bench, examples in eval_sets]
    return graders_of_sets([*train_sets, *held_out], auto)


def auto_grader(cfg: Config, train_sets: list[DataSet], eval_sets: list) -> str | dict[str, str]:
    """reward.grader, or for auto the graders the run's rows chose for the data sources whose names say none
    (``dapo.rewards.sources.auto_graders``): what the grading pool is told."""
    if cfg.reward.grader != "auto":
        return cfg.reward.grader
    held_out = [held_out_set(bench, examples, cfg.data.template) for bench, examples in eval_sets]
    return auto_graders([*train_sets, *held_out]) or "auto"


def setup_eval_sets(cfg: Config, eval_sets: list | None) -> list:
    """The (Benchmark, examples) pairs the run evaluates on: ``eval_sets``, or None: eval.benchmarks."""
    if eval_sets is not None:
        return eval_sets
    read_as = {"num_problems": cfg.eval.num_problems, **read_settings(cfg.data)}
    return [load_benchmark(b, **read_as) for b in cfg.eval.benchmarks]


def setup_rewards(
    cfg: Config, d: parallel.Dist, stack: contextlib.ExitStack, reward_fn, graders: set[str]
) -> tuple[object, str | None]:
    """The grading workers, and the grader of every row: for ``reward_fn`` (``setup_reward_fn``'s, run in the
    workers) its name, REWARD_FN or REWARD_FUNCTION; None for reward.grader. ``graders``: those the rows go to
    (``graders_of``). Under FSDP only rank 0 has workers: it grades every rank's samples, once, and every rank
    receives the same grades."""
    grader = grader_name(reward_fn) if reward_fn is not None else None
    if not d.is_main:
        return parallel.OnMain(None, d), grader
    pool = stack.enter_context(grading_pool(cfg, reward_fn, graders=graders))
    return (parallel.OnMain(pool, d) if d.sharded else pool), grader


def setup_collection(
    cfg: Config, d: parallel.Dist, stack, engine, prompts, encode, pool, grader, *, tokenizer, device, tool_env,
    auto=None,
) -> Collector:  # fmt: skip
    """The run's collector (generation, grading, dynamic sampling, screening): in process on ``engine``, or with
    rollout.max_staleness the same collection ahead of the trainer, its engine in a rollout process of its own or
    on rollout ranks (closed with ``stack``). ``grader``: a caller's reward function's name, else ``auto``
    (``auto_grader``'s) or reward.grader grades."""
    r, a = cfg.rollout, cfg.algo
    if cfg.teacher.coef > 0 and not cfg.teacher.reward_advantage:
        # pure distillation: every token's advantage is the teacher's, so a group needs no varied rewards to teach
        a = dataclasses.replace(a, dynamic_sampling=False)
    scorer_of = functools.partial(
        Scorer,
        grader=grader or auto or cfg.reward.grader,
        algo_cfg=a,
        max_response_tokens=r.max_response_tokens,
        reward_from_score=grader is not None,
        leave_out_ungraded=cfg.reward.ungraded == "leave_out",
    )
    sampling = SamplingParams(
        n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_response_tokens
    )

    def dynamic_sampling(on_engine, *, local: bool) -> DynamicSampling:
        # ahead of the trainer, rank 0 grades alone: its own pool, no broadcast
        scorer = scorer_of(pool.local if local and d.sharded else pool)
        return DynamicSampling(
            engine=on_engine, prompts=prompts, scorer=scorer, encode=encode, sampling=sampling, algo=a
        )

    ahead = functools.partial(build.ahead_engines, cfg, tokenizer, device, tool_env=tool_env)
    collector = build_collector(cfg, d, engine, dynamic_sampling, ahead)
    stack.callback(collector.close)
    return collector


def setup_resume(
    cfg: Config, d: parallel.Dist, policy: Policy, engine, collector: Collector
) -> tuple[int, list[str], str | None]:
    """Continue from the run's newest whole checkpoint when run.resume is on, then start the collector from there
    (or the start); returns the steps done, the lines about the checkpoints passed over, and the line saying where
    it resumed (None: it starts afresh)."""
    resume_from, passed_over = (
        checkpoint.resume_point(cfg.run_dir, refuse_damaged=cfg.run.resume_damaged == "refuse", dist=d)
        if cfg.run.resume
        else (None, [])
    )
    step, resumed = 0, None
    if resume_from is not None:
        step, saved_world_size, earlier = resume(resume_from, policy, engine, collector)
        resharded = (
            f"; written by {saved_world_size} rank{'s' * (saved_world_size > 1)}, resharded onto {d.world_size}"
            if saved_world_size not in (None, d.world_size)
            else ""
        )
        resumed = f"resumed from {resume_from} (step {step}){resharded}"
        if earlier:
            resumed += (
                "; its collection state has the earlier layout (sampler, buffer), read as the prompt order and the "
                "held-over groups (the layout is read until 0.3)"
            )
    collector.start(step, policy.named_weights())  # from the step resumed (its weights are version ``step``)
    return step, passed_over, resumed


def resume(path, policy: Policy, engine, collector: Collector) -> tuple[int, int | None, bool]:
    """Continue from checkpoint ``path``, written at this world size or another; returns the steps it had done, the
    number of ranks that wrote it (None: not recorded, an older checkpoint) and whether its collection state has the
    earlier layout.

    Across world sizes the run goes on as it would have: the prompt stream is one seeded order for the whole run
    (every rank draws the same prompts and the engines split them), the held-over groups, step, generation-round
    count, keep-rate estimate and RNG are global, and AdamW's moments and step count are resharded with the weights
    (``checkpoint.load_policy``). The responses are redrawn: each rollout engine samples its share of the prompts
    with a seed of its own (``ShardedRollout``)."""
    saved = checkpoint.load_trainer_state(path)
    checkpoint.load_policy(policy, path, saved.get("policy"))
    engine.update_weights(policy.named_weights())  # an engine with its own copy starts from the checkpoint
    collector.load_state(CollectionState.from_trainer_state(saved))
    checkpoint.set_rng_state(saved["rng"])
    return saved["step"], saved.get("world_size"), CollectionState.KEY not in saved


def setup_loggers(cfg: Config, d: parallel.Dist, stack: contextlib.ExitStack, console, *, start_step: int,
                  saver: Saver) -> RunLogger:  # fmt: skip
    """Rank 0's config.yaml, logger (metrics.jsonl, TensorBoard, the console's lines) and trackers (W&B, MLflow),
    from step ``start_step``; other ranks get a logger that writes nothing. On ``stack``, what ends the run: the
    last checkpoint write, the logger closed with the run's status, the ranks parted."""
    logger = RunLogger(None, total_steps=cfg.train.total_steps)  # writes nothing
    if d.is_main:
        (cfg.run_dir / "config.yaml").write_text(dump_yaml(cfg))
        logger = RunLogger(
            cfg.run_dir,
            total_steps=cfg.train.total_steps,
            start_step=start_step,
            tensorboard="tensorboard" in cfg.run.loggers,
            progress=cfg.run.progress,
            step_lines="console" in cfg.run.loggers,
            console=console,
        )
    stack.push(lambda kind, err, tb: parallel.shutdown(d, clean=kind is None))
    stack.push(lambda kind, err, tb: logger.close(run_status(kind)))
    stack.callback(saver.writer.wait)  # first of these: a run that stops (an error, Ctrl-C) still completes its write
    if d.is_main:
        logger.trackers = open_trackers(cfg, start_step=start_step, warn=logger.warn, info=logger.info)
    return logger
