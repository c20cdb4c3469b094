"""Training-phase FLOP/s (6 x parameters x tokens / time) as a fraction of what torch.mm reaches here.

    python benchmarks/mfu.py [--updates 5] [--threads 1] [--config configs/demo.yaml] [key=value ...]

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
Times are the process's CPU time (one torch thread by default), so other processes on a shared
machine barely move the ratio; with --threads > 1 they are summed over threads, which is still
consistent between the training phase and the matmul reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from dapo import algo
from dapo.batch import RolloutBatch
from dapo.config import load_config
from dapo.policy import Policy
from dapo.rewards import grade
from dapo.rollout.base import SamplingParams
from dapo.rollout.hf import HFRolloutEngine
from dapo.tasks import arith
from dapo.data import make_encoder
from dapo.train import make_loss_fn

ROOT = Path(__file__).resolve().parents[1]
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def mm_rate(m: int, k: int, n: int, min_seconds: float = 0.05) -> float:
    """FLOP/s of torch.mm for (m x k) @ (k x n), float32: the median over repeated timings."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    reps = 1
    while True:  # enough repetitions that one timing lasts min_seconds
        t0 = time.process_time()
        for _ in range(reps):
            torch.mm(a, b)
        dt = time.process_time() - t0
        if dt >= min_seconds:
            break
        reps *= 2
    times = []
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(reps):
            torch.mm(a, b)
        times.append((time.process_time() - t0) / reps)
    return 2 * m * k * n / statistics.median(times)


def model_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of every weight matmul of one decoder layer, then the LM head (counted once)."""
    h = config.hidden_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    i = config.intermediate_size
    layer = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    return layer * config.num_hidden_layers + [(h, config.vocab_size)]


def reference_rate(m: int, shapes: list[tuple[int, int]]) -> float:
    """FLOP-weighted rate of the model's matmuls at m rows: total FLOPs / total time at measured speeds."""
    rates = {s: mm_rate(m, *s) for s in set(shapes)}
    flops = [2 * m * k * n for k, n in shapes]
    return sum(flops) / sum(f / rates[s] for f, s in zip(flops, shapes))


def rollout_batch(policy: Policy, cfg) -> RolloutBatch:
    r = cfg.rollout
    examples = arith.make_examples("train", cfg.train.prompts_per_step, seed=0, difficulty=cfg.data.task_difficulty)
    encode = make_encoder(policy.tokenizer, cfg.data.max_prompt_tokens)
    engine = HFRolloutEngine(policy.model, policy.tokenizer)
    gen = engine.generate([encode(ex) for ex in examples], SamplingParams(
        n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_response_tokens))
    rows = [ex for ex in examples for _ in range(r.group_size)]
    acc = torch.tensor([float(grade(t, ex.ground_truth, "arith").acc) for t, ex in zip(gen.texts, rows)])
    batch = RolloutBatch(group_size=r.group_size, prompt_ids=gen.prompt_ids, response_ids=gen.response_ids,
                         truncated=gen.truncated, texts=gen.texts, example_uids=[ex.uid for ex in rows],
                         ground_truths=[ex.ground_truth for ex in rows], acc=acc, reward=acc * 2 - 1,
                         overlong_penalty=torch.zeros_like(acc))
    batch.adv = algo.group_advantages(batch.reward, r.group_size)
    return batch


def micro_batch_rows(cfg, batch: RolloutBatch, tokens: int) -> int:
    """Real tokens in one training micro-batch: the shape the model's matmuls see."""
    per_update = tokens * cfg.train.mini_batch_prompts // cfg.train.prompts_per_step
    budget = getattr(cfg.train, "max_tokens_per_micro_batch", 0)
    if budget:
        return min(budget, per_update)
    return min(per_update, cfg.train.micro_batch_size * tokens // len(batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=5, help="timed training phases (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"))
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(args.config, [f"model.path={ROOT / 'assets/arith-base'}", "model.device=cpu", *args.overrides])
    policy = Policy(cfg.model, cfg.train, temperature=cfg.rollout.temperature, device=torch.device("cpu"))
    loss_fn = make_loss_fn(cfg.algo, cfg.rollout.max_response_tokens)
    batch = rollout_batch(policy, cfg)
    n_params = sum(p.numel() for p in policy.model.parameters())
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    m = micro_batch_rows(cfg, batch, tokens)
    shapes = model_shapes(policy.model.config)

    t_old, t_update, ref = [], [], []
    for it in range(args.updates + 1):
        rate = reference_rate(m, shapes)
        t0 = time.process_time()
        batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True)
        t1 = time.process_time()
        policy.update(batch, loss_fn)
        t2 = time.process_time()
        if it == 0:
            continue  # warm-up: first-call allocations, optimizer state
        t_old.append(t1 - t0)
        t_update.append(t2 - t1)
        ref.append(rate)
    old, upd, mm = statistics.median(t_old), statistics.median(t_update), statistics.median(ref)
    square = mm_rate(1024, 1024, 1024)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        policy.update(batch, loss_fn)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total_self = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]

    updates = cfg.train.prompts_per_step // cfg.train.mini_batch_prompts * cfg.train.ppo_epochs
    achieved = 6 * n_params * tokens * cfg.train.ppo_epochs / upd
    phase = (2 + 6 * cfg.train.ppo_epochs) * n_params * tokens / (old + upd)
    print(f"torch {torch.__version__}, {args.threads} threads, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"model {n_params:,} parameters (hidden {policy.model.config.hidden_size}, vocab "
          f"{policy.model.config.vocab_size}); batch {len(batch)} responses, {tokens:,} tokens, {updates} updates, "
          f"~{m:,} tokens per micro-batch")
    print(f"old log-probs {old:.3f} s, update {upd:.3f} s (median of {args.updates})")
    print(f"achieved, update (6N tokens / time):              {achieved / 1e9:8.2f} GFLOP/s")
    print(f"achieved, training phase (8N tokens / time):      {phase / 1e9:8.2f} GFLOP/s")
    print(f"torch.mm at the model's shapes ({m} rows):        {mm / 1e9:8.2f} GFLOP/s")
    print(f"torch.mm 1024x1024x1024:                          {square / 1e9:8.2f} GFLOP/s")
    print(f"MFU update: {achieved / mm:.1%} of the model-shape matmul rate ({achieved / square:.1%} of the square's); "
          f"training phase: {phase / mm:.1%}")
    print(f"profile of one update: matmuls {matmul / total_self:.0%} of CPU self time; top ops:")
    for e in top:
        print(f"  {e.key:48s} {e.self_cpu_time_total / 1e3:8.1f} ms  {e.self_cpu_time_total / total_self:5.1%}  x{e.count}")


if __name__ == "__main__":
    main()
