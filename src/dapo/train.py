"""The DAPO training loop, top to bottom. One training step:

  collect_batch        generate G responses per prompt, grade (+1/-1), add the soft overlong
                       penalty, drop groups whose accuracies are all equal, repeat until P prompts
  overlong filtering   truncated responses masked out of the loss (optional)
  group_advantages     (R - mean_G) / (std_G + eps), one value per response
  old log-probs        under the policy that sampled, recomputed before the update
  policy.update        P / mini_batch_prompts optimizer updates, token-mean clipped surrogate
  update_weights       the new weights to the rollout engine
  metrics, evaluation, checkpoint

Launched by torchrun or `dapo launch-ray` (WORLD_SIZE > 1) the same loop runs on every rank with
FSDP: each rank samples a share of the prompts, rank 0 grades them for everyone, every rank then
holds the same batch and computes log-probs and gradients for its share of the rows (parallel.py).
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.markup import escape

from dapo import algo, checkpoint, parallel
from dapo.batch import RolloutBatch
from dapo.config import Config, ConfigError, dump_yaml
from dapo.dynamic_sampling import CollectStats, Scorer, collect_batch, record_behaviour_logp
from dapo.log import NullLogger, RunLogger, setup_library_logging
from dapo.policy import DTYPES, Policy, load_model_and_tokenizer, pick_device
from dapo.rollout import SamplingParams, ShardedRollout, make_rollout, resolve_backend


@dataclass
class TrainState:
    step: int = 0  # training steps done
    gen_rounds: int = 0  # generation rounds done (several per step with dynamic sampling)
    keep_rate: float = 1.0  # running estimate of the share of groups dynamic sampling keeps
    buffer: list[RolloutBatch] = field(default_factory=list)  # surplus kept groups, used first next step


def load_train_examples(cfg: Config):
    from dapo.data import load_examples

    if cfg.data.train_files:
        examples = []
        for path in cfg.data.train_files:
            examples += load_examples(path, template=cfg.data.template, max_row_chars=cfg.data.max_row_chars)
        return examples
    if cfg.data.task != "arith":
        raise ValueError(f"data.task={cfg.data.task!r}: the built-in task is arith; or give data.train_files")
    from dapo.tasks import arith

    return arith.make_examples("train", cfg.data.task_train_size, seed=cfg.data.seed, difficulty=cfg.data.task_difficulty)


def make_encoder(tokenizer, max_prompt_tokens: int):
    from dapo.data import render_prompt

    # No token spans more characters than the vocabulary's longest entry, so the kept tokens lie within
    # this many characters of the end (with a margin for the word cut in two): a prompt of megabytes
    # is cut before it is tokenised, which would otherwise take the whole text's time and memory.
    max_chars = (max_prompt_tokens + 16) * max(map(len, tokenizer.get_vocab()), default=1)
    cache: dict = {}

    def encode(example) -> list[int]:
        if example not in cache:  # examples are frozen and hashable; templates render once each
            text = render_prompt(example, tokenizer)[-max_chars:]
            ids = tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None))["input_ids"]
            cache[example] = ids[-max_prompt_tokens:]  # cut from the left: the question's end matters most
        return cache[example]

    return encode


def make_engine(cfg: Config, policy: Policy, d: parallel.Dist):
    """The rollout engine. Alone it shares the policy's model. Under FSDP every rank holds a full
    copy in model.dtype (rows finish at different lengths, so generating with the sharded model
    would make the ranks wait on each other) and samples its share of the prompts; with vLLM and
    rollout.tensor_parallel_size = k, each group of k ranks holds one copy, split over them."""
    # the longest sequence the run asks for: vLLM sizes its KV cache and scheduler for this, not the model's context
    max_model_len = cfg.data.max_prompt_tokens + max(cfg.rollout.max_response_tokens, cfg.eval.max_response_tokens)
    if not d.sharded:
        return make_rollout(cfg.rollout, policy.model, policy.tokenizer, max_model_len=max_model_len)
    k = cfg.rollout.tensor_parallel_size if cfg.rollout.backend == "vllm" else 1
    if d.world_size % k:
        raise ConfigError(f"rollout.tensor_parallel_size={k} does not divide the {d.world_size} trainer ranks; "
                          "pick a divisor (one vLLM engine per group of that many ranks)")
    trust = cfg.model.trust_remote_code
    if cfg.rollout.backend == "vllm":
        model = weightless_model(cfg.model.path, cfg.model.dtype, trust_remote_code=trust)
    else:
        model, _ = load_model_and_tokenizer(cfg.model.path, cfg.model.dtype, d.device, trust_remote_code=trust)
    return ShardedRollout(make_rollout(cfg.rollout, model, policy.tokenizer, max_model_len=max_model_len), d,
                          tensor_parallel_size=k)


def weightless_model(path, dtype: str, *, trust_remote_code: bool = False):
    """The model on the meta device: vLLM reads the checkpoint itself and needs only its directory,
    dtype and generation config (a full copy here would cost every GPU the whole model)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path).expanduser()
    with torch.device("meta"):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    if (Path(path) / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


@contextlib.contextmanager
def grading_pool(cfg: Config, d: parallel.Dist):
    """The grading workers. Under FSDP only rank 0 has them: it grades every rank's samples, once,
    and every rank receives the same grades."""
    from dapo.rewards import RewardPool

    if not d.is_main:
        yield parallel.OnMain(None, d)
        return
    with RewardPool(num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s) as pool:
        yield parallel.OnMain(pool, d) if d.sharded else pool


def sampling_metrics(cstats: CollectStats, buffer_size: int) -> dict:
    """What generation produced this step, trained on or not."""
    return {
        "reward/timeouts": cstats.timeouts,
        "rollout/acc_mean": cstats.acc_sum / max(cstats.samples_generated, 1),
        "sampling/gen_rounds": cstats.rounds,
        "sampling/prompts_generated": cstats.prompts_generated,
        "sampling/prompts_kept": cstats.groups_kept,
        "sampling/prompts_dropped": cstats.groups_dropped,
        "sampling/prompts_from_buffer": cstats.groups_from_buffer,
        "sampling/all_correct_frac": cstats.groups_all_correct / max(cstats.prompts_generated, 1),
        "sampling/all_wrong_frac": cstats.groups_all_wrong / max(cstats.prompts_generated, 1),
        "sampling/samples_generated": cstats.samples_generated,
        "sampling/dropped_gen_time_frac": cstats.seconds_dropped / max(cstats.seconds_generate, 1e-9),
        "sampling/buffer_groups": buffer_size,
        "sampling/cap_hit": float(cstats.cap_hit),
        "perf/time_generate_s": cstats.seconds_generate,
        "perf/time_reward_s": cstats.seconds_reward,
        "perf/gen_tokens_per_s": cstats.tokens_generated / max(cstats.seconds_generate, 1e-9),
        "perf/reward_samples_per_s": cstats.samples_generated / max(cstats.seconds_reward, 1e-9),
    }


def step_metrics(batch: RolloutBatch, cstats: CollectStats, update: dict, times: dict, *,
                 max_prompt_tokens: int = 0, max_response_tokens: int = 0) -> dict:
    """What the update trained on and how it went."""
    lengths = batch.response_lengths.float()  # (N,)
    prompt_lengths = torch.tensor([len(p) for p in batch.prompt_ids], dtype=torch.float32)  # (N,)
    mask = batch.response_mask()
    samples_trained = len(batch)
    adv_tokens = batch.adv.repeat_interleave(batch.response_lengths)  # every response token, as verl's data metrics
    m = {
        "reward/score_mean": batch.reward.mean(),
        "reward/score_max": batch.reward.max(),
        "reward/score_min": batch.reward.min(),
        "reward/acc_mean": batch.acc.mean(),
        "reward/overlong_penalty_mean": batch.overlong.mean(),
        "rollout/response_length_mean": lengths.mean(),
        "rollout/response_length_max": lengths.max(),
        "rollout/response_length_min": lengths.min(),
        "rollout/response_length_clip_frac": (lengths == max_response_tokens).float().mean(),  # at the limit, EOS or not
        "rollout/prompt_length_mean": prompt_lengths.mean(),
        "rollout/prompt_length_max": prompt_lengths.max(),
        "rollout/prompt_length_min": prompt_lengths.min(),
        "rollout/prompt_length_clip_frac": (prompt_lengths == max_prompt_tokens).float().mean(),  # cut from the left
        "rollout/truncated_frac": batch.truncated.float().mean(),
        "actor/entropy": (batch.entropy[:, : mask.shape[1]] * mask).sum() / mask.sum().clamp(min=1),
        "actor/adv_abs_mean": batch.adv.abs().mean(),
        "actor/adv_token_mean": adv_tokens.mean(),
        "actor/adv_token_max": adv_tokens.max(),
        "actor/adv_token_min": adv_tokens.min(),
        "sampling/samples_per_trained_sample": cstats.samples_generated / max(samples_trained, 1),
        "sampling/tokens_per_trained_token": cstats.tokens_generated / max(float(mask.sum()), 1.0),
        "perf/train_tokens_per_s": float(mask.sum()) / max(times["update"], 1e-9),
        "perf/old_logprob_tokens_per_s": float(lengths.sum()) / max(times["old_logprob"], 1e-9),
    }
    if batch.rollout_logp:  # the engine's log-probs of its own samples vs the trainer's: numerics (and buffer staleness)
        T = batch.old_logp.shape[1]
        rollout_logp = batch.padded_logp(batch.rollout_logp, T)  # (N, T)
        diff = (rollout_logp - batch.old_logp).abs()[torch.arange(T)[None, :] < batch.response_lengths[:, None]]
        m["rollout/logprob_abs_diff_mean"], m["rollout/logprob_abs_diff_max"] = diff.mean(), diff.max()
    m.update({f"perf/time_{k}_s": v for k, v in times.items()})
    m.update({f"actor/{k}": v for k, v in update.items()})
    return m


def importance_weights(batch: RolloutBatch, cap: float) -> dict:
    """Truncated importance sampling on the engine's log-probs (algo.truncated_is_weights): sets
    ``batch.is_weights`` and returns its statistics; nothing when ``cap`` is 0 (off, the reference)."""
    if cap <= 0:
        return {}
    if not batch.rollout_logp:
        raise ValueError("algo.rollout_is_cap > 0 needs the rollout engine's log-probs; this batch has none")
    T = batch.old_logp.shape[1]
    batch.is_weights, stats = algo.truncated_is_weights(
        batch.old_logp, batch.padded_logp(batch.rollout_logp, T), batch.response_mask(width=T), cap=cap)  # (N, T)
    return {f"rollout/{k}": v for k, v in stats.items()}


NO_SIGNAL_STREAK = 3  # steps in a row without an informative group before the run says what to change


def no_signal_advice(streak: int, cstats: CollectStats, cfg: Config) -> str:
    """One line for a run whose groups keep coming back all right or all wrong."""
    wrong = cstats.groups_all_wrong / max(cstats.prompts_generated, 1)
    right = cstats.groups_all_correct / max(cstats.prompts_generated, 1)
    if wrong >= right:
        fix = (f"the data is too hard for this model: use easier problems, a larger group (rollout.group_size="
               f"{cfg.rollout.group_size}) or longer responses (rollout.max_response_tokens={cfg.rollout.max_response_tokens})")
    else:
        fix = "the data is too easy for this model: use harder problems"
    return (f"no informative group for {streak} steps in a row: {100 * wrong:.0f}% of groups all wrong, "
            f"{100 * right:.0f}% all right; {fix}")


def train(cfg: Config, *, console=None) -> dict:
    """Run (or resume) training; returns the last logged row with eval/* before and after."""
    run_dir = cfg.run_dir
    cfg.rollout.backend = resolve_backend(cfg.rollout.backend)  # the saved config says which one ran
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    d = parallel.init(cfg.model.device)  # WORLD_SIZE > 1 (torchrun, Ray): FSDP over the ranks
    checkpoint.prepare_run_dir(run_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite, dist=d)
    setup_library_logging(run_dir, cfg.run.log_level, rank=d.rank)  # vLLM, Ray, transformers: train.log
    policy = Policy(cfg, d.device if d.sharded else pick_device(cfg.model.device), d)
    engine = make_engine(cfg, policy, d)
    encode = make_encoder(policy.tokenizer, cfg.data.max_prompt_tokens)
    from dapo.data import PromptSampler
    from dapo.evaluate import evaluate, load_benchmark

    sampler = PromptSampler(load_train_examples(cfg), seed=cfg.data.seed)
    eval_sets = [load_benchmark(b, template=cfg.data.template, num_problems=cfg.eval.num_problems,
                                max_row_chars=cfg.data.max_row_chars) for b in cfg.eval.benchmarks]
    state = TrainState()
    resume_from = checkpoint.latest_checkpoint(run_dir) if cfg.run.resume else None
    if resume_from is not None:
        saved = checkpoint.load_trainer_state(resume_from)
        checkpoint.load_policy_weights(policy, resume_from)
        engine.update_weights(policy.named_weights())  # an engine with its own copy starts from the checkpoint
        policy.load_trainer_state(saved["policy"])
        sampler.load_state_dict(saved["sampler"])
        state = TrainState(step=saved["step"], gen_rounds=saved["gen_rounds"], keep_rate=saved["keep_rate"],
                           buffer=[RolloutBatch.from_state(s) for s in saved["buffer"]])
        checkpoint.set_rng_state(saved["rng"])
    logger = NullLogger()
    if d.is_main:
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
        logger = RunLogger(run_dir, total_steps=cfg.train.total_steps, start_step=state.step,
                           tensorboard=cfg.run.tensorboard, progress=cfg.run.progress, console=console)
    if resume_from is not None:
        logger.info(f"resumed from {resume_from} (step {state.step})")

    r, a = cfg.rollout, cfg.algo
    sampling = SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_response_tokens)
    with grading_pool(cfg, d) as pool:
        scorer = Scorer(pool, grader=cfg.reward.grader, algo_cfg=a, max_response_tokens=r.max_response_tokens)

        def run_eval() -> dict:
            e, out = cfg.eval, {}
            for bench, examples in eval_sets:
                res = evaluate(engine, encode, examples, pool, name=bench.name, n=e.n, temperature=e.temperature,
                               top_p=e.top_p, max_new_tokens=e.max_response_tokens or r.max_response_tokens,
                               seed=e.seed, grader=cfg.reward.grader)
                out.update(res.metrics())
            return out

        def save(step: int) -> None:
            trainer_state = {"policy": policy.trainer_state(), "sampler": sampler.state_dict(),
                             "buffer": [b.state() for b in state.buffer], "gen_rounds": state.gen_rounds,
                             "keep_rate": state.keep_rate}
            checkpoint.save_checkpoint(run_dir, step, model=policy.model, tokenizer=policy.tokenizer,
                                       trainer_state=trainer_state, config_yaml=dump_yaml(cfg),
                                       keep=cfg.run.keep_checkpoints, shards=policy.sharded_state(), dist=d)

        def train_on(batch: RolloutBatch, cstats: CollectStats) -> dict:
            if a.overlong_filtering:
                batch.trainable = ~batch.truncated  # sec. 3.4: truncated answers carry no learning signal
            in_baseline = None if a.truncated_in_group_stats else ~batch.truncated  # the paper masks only the loss
            batch.adv = algo.group_advantages(batch.reward, r.group_size, scale_by_std=a.scale_adv_by_std,
                                              in_baseline=in_baseline)  # (N,)
            engine.sleep()  # a colocated engine frees its memory for the trainer; no-op for hf
            t0 = time.perf_counter()
            if state.buffer:  # held-over groups keep the log-probs of the weights that sampled them (still loaded)
                record_behaviour_logp(state.buffer, policy.compute_logprobs, source=a.buffer_logp)
            batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True)  # (N, T)
            batch.old_logp = batch.behaviour_old_logp(batch.old_logp)  # held-over groups: the weights that sampled them
            is_stats = importance_weights(batch, a.rollout_is_cap)  # engine vs trainer sampling; off unless cap > 0
            if policy.ref_model is not None:
                batch.ref_logp, _ = policy.compute_logprobs(batch, model=policy.ref_model)  # (N, T)
            t1 = time.perf_counter()
            update = policy.update(batch)
            t2 = time.perf_counter()
            engine.wake()
            engine.update_weights(policy.named_weights())
            times = {"old_logprob": t1 - t0, "update": t2 - t1, "weight_sync": time.perf_counter() - t2}
            return {**step_metrics(batch, cstats, update, times, max_prompt_tokens=cfg.data.max_prompt_tokens,
                                   max_response_tokens=r.max_response_tokens), **is_stats}

        last: dict = {}
        no_signal = 0  # steps in a row without an informative group
        if state.step == 0 and cfg.eval.before_train:
            last = logger.log(0, run_eval())
            logger.info("before training: " + ", ".join(f"{k} {v:.3f}" for k, v in last.items() if "avg@" in k))

        for step in range(state.step + 1, cfg.train.total_steps + 1):
            t_step = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                batch, cstats = collect_batch(
                    engine=engine, sampler=sampler, scorer=scorer, encode=encode, buffer=state.buffer,
                    num_prompts=cfg.train.prompts_per_step, sampling=sampling, algo_cfg=a,
                    round_seed=lambda k, base=state.gen_rounds: r.seed * 1_000_003 + base + k,
                    keep_rate_estimate=state.keep_rate if a.adaptive_oversample else 1.0,
                    max_buffer_groups=a.buffer_max_groups,
                )
            for w in caught:
                logger.info(f"[yellow]warning (step {step}): {escape(str(w.message))}[/]")
            state.gen_rounds += cstats.rounds
            if cstats.keep_rates:
                state.keep_rate = 0.7 * state.keep_rate + 0.3 * (sum(cstats.keep_rates) / len(cstats.keep_rates))
            metrics = sampling_metrics(cstats, len(state.buffer))
            metrics["sampling/gen_rounds_total"] = state.gen_rounds
            if batch is None:  # every group all right or all wrong: nothing to learn from, but the step still counts
                no_signal += 1
                logger.info(f"step {step}: no informative group was generated; nothing to train on")
                if no_signal == NO_SIGNAL_STREAK:
                    logger.info(f"[yellow]{escape(no_signal_advice(no_signal, cstats, cfg))}[/]")
            else:
                no_signal = 0
                metrics.update(train_on(batch, cstats))
            t3 = time.perf_counter()
            if step == cfg.train.total_steps or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0):
                metrics.update(run_eval())
                metrics["perf/time_eval_s"] = time.perf_counter() - t3
            t4 = time.perf_counter()
            state.step = step
            if (cfg.run.save_every and step % cfg.run.save_every == 0) or step == cfg.train.total_steps:
                save(step)
            metrics["perf/time_checkpoint_s"] = time.perf_counter() - t4
            metrics["perf/time_step_s"] = time.perf_counter() - t_step
            last = logger.log(step, metrics)
            logger.step_line(step, cfg.train.total_steps, last)
            if batch is not None:
                logger.write_samples(step, sample_records(batch, policy.tokenizer, cfg.run.samples_per_step))
    logger.close()
    parallel.shutdown(d)
    return last


def sample_records(batch: RolloutBatch, tokenizer, k: int) -> list[dict]:
    rows = list(range(0, len(batch), max(1, len(batch) // max(k, 1))))[:k]
    return [{
        "prompt": tokenizer.decode(batch.prompt_ids[i], skip_special_tokens=True), "response": batch.texts[i],
        "reward": float(batch.reward[i]), "acc": float(batch.acc[i]), "pred": batch.preds[i] if batch.preds else "",
        "ground_truth": batch.ground_truths[i], "length": len(batch.response_ids[i]), "truncated": bool(batch.truncated[i]),
    } for i in rows]


def read_metrics(run_dir: Path) -> list[dict]:
    import json

    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
