"""The torch.mm reference of benchmarks/mfu.py: the rate float32 torch.mm reaches here at a model's own matmul
shapes, timed in the process's CPU time like the training phase it is compared with."""

from __future__ import annotations

import statistics
import time

import torch


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


def shapes_rate(shapes) -> float:
    """FLOP-weighted torch.mm rate over (m, k, n, count): total FLOPs / total time at measured speeds."""
    rates = {(m, k, n): mm_rate(m, k, n) for m, k, n, _ in shapes}
    flops = [(2 * m * k * n * cnt, (m, k, n)) for m, k, n, cnt in shapes]
    return sum(f for f, _ in flops) / sum(f / rates[s] for f, s in flops)
