"""Training-phase FLOP/s (6 x parameters x tokens / time) as a fraction of what torch.mm reaches here.

    python benchmarks/mfu.py [--updates 5] [--threads 1] [--config configs/demo.yaml] [key=value ...]
    python benchmarks/mfu.py --real [--updates 3] [key=value ...]

--real: the real-model preset (configs/smollm2_135m.yaml, SmolLM2-135M-Instruct from the local cache)
on a synthetic rollout batch of the preset's shape (see ``mfu_real.synthetic_batch``), with torch's default
thread count (what training uses); it reports old log-probs and update separately, wall and CPU
time, and ends with ``update MFU: NN%``. Tokens there are the real tokens the decoder must run:
with the preset's shared prompt prefix a prompt counts once per micro-batch it is in, not once per
response. The demo mode is described next.

One demo rollout batch (32 prompts x G=8 from assets/arith-base, graded by the arith grader) is
generated once; then each iteration runs the training phase of a step on it exactly as the loop
does: old log-probs (forward, with entropy) and Policy.update (the configured optimizer updates,
forward + backward + AdamW). Tokens are the real prompt + response tokens through the forward
(padding not counted). Achieved FLOP/s: 6 N tokens / update time, and 8 N tokens / (old log-prob +
update time) for the whole phase. The reference is measured in the same run, alternating with the
training iterations: torch.mm at the model's own matmul shapes, (tokens per micro-batch x hidden)
times each weight matrix (q, k, v, o, gate, up, down, LM head), combined as the FLOP-weighted rate
those matmuls would run at; torch.mm of a 1024^3 square is printed for scale. A profile of one
update says where the rest of the time goes. Printed: medians over iterations (the first dropped).
Times are the process's CPU time (one torch thread by default), summed over threads with --threads > 1, which is
consistent between the training phase and the matmul reference; wall times are printed beside them. Both the
training phases and the torch.mm reference are measured for load (benchmarks/runs.py's Meter, the torch threads
its own jobs): where either saw more, a busy machine may have bent the ratio, and MFU is not printed (a line says
why). The --real mode does the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from dapo.algorithm.batch import RolloutBatch
from dapo.algorithm.step import make_loss_fn
from dapo.config import load_config
from dapo.data import arith
from dapo.data.prompts import make_encoder
from dapo.model.policy import Policy
from dapo.rewards import grade
from dapo.rollout.base import SamplingParams
from dapo.rollout.hf import HFRolloutEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mfu_matmul import mm_rate, model_shapes, reference_rate  # noqa: E402
from mfu_real import graded_batch, real_main  # noqa: E402
from runs import Meter, withheld  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MATMUL_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)


def rollout_batch(policy: Policy, cfg) -> RolloutBatch:
    r = cfg.rollout
    examples = arith.make_examples("train", cfg.train.prompts_per_step, seed=0, difficulty=cfg.data.task_difficulty)
    encode = make_encoder(policy.tokenizer, cfg.data.max_prompt_tokens)
    engine = HFRolloutEngine(policy.model, policy.tokenizer)
    gen = engine.generate(
        [encode(ex) for ex in examples],
        SamplingParams(
            n=r.group_size,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_response_tokens,
        ),
    )
    rows = [ex for ex in examples for _ in range(r.group_size)]
    acc = torch.tensor([float(grade(t, ex.ground_truth, "arith").acc) for t, ex in zip(gen.texts, rows)])
    return graded_batch(rows, r.group_size, gen.prompt_ids, gen.response_ids, gen.truncated, gen.texts, acc)


def micro_batch_rows(cfg, batch: RolloutBatch, tokens: int) -> int:
    """Real tokens in one training micro-batch: the shape the model's matmuls see."""
    per_update = tokens * cfg.train.mini_batch_prompts // cfg.train.prompts_per_step
    budget = getattr(cfg.train, "max_tokens_per_micro_batch", 0)
    if budget:
        return min(budget, per_update)
    return min(per_update, cfg.train.micro_batch_size * tokens // len(batch))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct with its preset, synthetic batch")
    parser.add_argument(
        "--updates", type=int, default=None, help="timed training phases (demo 5 after a warm-up; real 3)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (demo 1; real: torch's default)")
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"), help="demo mode only")
    parser.add_argument(
        "--head-chunk",
        type=int,
        default=None,
        help="response rows per LM-head chunk (default: the trainer's, dapo.model.logprobs.head_chunk_rows)",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    return parser.parse_args()


def time_demo_phases(updates: int, policy: Policy, batch: RolloutBatch, loss_fn, m: int, shapes, meters) -> tuple:
    """``updates`` training phases after one warm-up, each after timing torch.mm at the model's shapes:
    the medians of old log-probs and update (CPU, then wall) and of the torch.mm reference; ``meters`` ("train",
    "mm") measure the timed ones."""
    t_old, t_update, ref = [], [], []
    for it in range(updates + 1):
        with meters["mm"] if it else Meter():  # the warm-up is not measured
            rate = reference_rate(m, shapes)
        with meters["train"] if it else Meter():
            t0, w0 = time.process_time(), time.perf_counter()
            batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True)
            t1, w1 = time.process_time(), time.perf_counter()
            policy.update(batch, loss_fn)
            t2, w2 = time.process_time(), time.perf_counter()
        if it == 0:
            continue  # warm-up: first-call allocations, optimizer state
        t_old.append((t1 - t0, w1 - w0))
        t_update.append((t2 - t1, w2 - w1))
        ref.append(rate)
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    return med(t_old, 0), med(t_update, 0), statistics.median(ref), med(t_old, 1), med(t_update, 1)


def update_profile(policy: Policy, batch: RolloutBatch, loss_fn) -> list[str]:
    """One update under torch.profiler: the matmuls' share of CPU self time and the top ops, as printed lines."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        policy.update(batch, loss_fn)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_self = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    lines = [f"profile of one update: matmuls {matmul / total_self:.0%} of CPU self time; top ops:"]
    for e in top:
        lines.append(
            f"  {e.key:48s} {e.self_cpu_time_total / 1e3:8.1f} ms  "
            f"{e.self_cpu_time_total / total_self:5.1%}  x{e.count}"
        )
    return lines


def main() -> None:
    args = parse_args()
    if args.head_chunk:  # measuring only: the trainer picks its chunk by vocabulary and device
        import functools

        from dapo.model import logprobs

        logprobs.token_logprobs = functools.partial(logprobs.token_logprobs, chunk_tokens=args.head_chunk)
    if args.real:
        args.updates = args.updates or 3
        real_main(args)
        return
    args.updates = args.updates or 5
    args.threads = args.threads or 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(args.config, [f"model.path={ROOT / 'assets/arith-base'}", "model.device=cpu", *args.overrides])
    policy = Policy(cfg.model, cfg.train, temperature=cfg.rollout.temperature, device=torch.device("cpu"))
    loss_fn = make_loss_fn(cfg.algo, cfg.rollout.max_response_tokens)
    batch = rollout_batch(policy, cfg)
    n_params = sum(p.numel() for p in policy.model.parameters())
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    m = micro_batch_rows(cfg, batch, tokens)
    meters = {"train": Meter(args.threads), "mm": Meter(args.threads)}
    shapes = model_shapes(policy.model.config)
    old, upd, mm, old_wall, upd_wall = time_demo_phases(args.updates, policy, batch, loss_fn, m, shapes, meters)
    with meters["mm"]:
        square = mm_rate(1024, 1024, 1024)
    profile_lines = update_profile(policy, batch, loss_fn)

    updates = cfg.train.prompts_per_step // cfg.train.mini_batch_prompts * cfg.train.ppo_epochs
    achieved = 6 * n_params * tokens * cfg.train.ppo_epochs / upd
    phase = (2 + 6 * cfg.train.ppo_epochs) * n_params * tokens / (old + upd)
    print(
        f"torch {torch.__version__}, {args.threads} threads, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"model {n_params:,} parameters (hidden {policy.model.config.hidden_size}, vocab "
        f"{policy.model.config.vocab_size}); batch {len(batch)} responses, {tokens:,} tokens, {updates} updates, "
        f"~{m:,} tokens per micro-batch"
    )
    print(
        f"old log-probs {old:.3f} s, update {upd:.3f} s (median of {args.updates}); wall {old_wall:.3f} s, "
        f"{upd_wall:.3f} s"
    )
    print(f"achieved, update (6N tokens / time):              {achieved / 1e9:8.2f} GFLOP/s")
    print(f"achieved, training phase (8N tokens / time):      {phase / 1e9:8.2f} GFLOP/s")
    print(f"torch.mm at the model's shapes ({m} rows):        {mm / 1e9:8.2f} GFLOP/s")
    print(f"torch.mm 1024x1024x1024:                          {square / 1e9:8.2f} GFLOP/s")
    for name, meter in meters.items():
        print(f"{name:5s} timed: {meter.cpu_s:.2f} CPU s, {meter.wall_s:.2f} wall s ({meter.load.describe()})")
    reason = withheld([meter.load.summary() for meter in meters.values()], "MFU", unit="measurements")
    print(
        f"MFU update: {reason}"
        if reason
        else f"MFU update: {achieved / mm:.1%} of the model-shape matmul rate ({achieved / square:.1%} of the "
        f"square's); training phase: {phase / mm:.1%}"
    )
    for line in profile_lines:
        print(line)


if __name__ == "__main__":
    main()
