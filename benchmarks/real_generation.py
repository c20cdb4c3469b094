"""Generation on the real model: the training run's vLLM engine against bare vLLM and HF generate.

    python benchmarks/real_generation.py [--runs 3] [--prompts 16]      # make smollm2 first

Workload: one generation round of configs/smollm2_135m.yaml: --prompts word problems (their chat
prompts, as training encodes them) x G=8 samples, temperature 0.7, at most 96 new tokens.
Three sides, each in its own process, alternating run by run after one warm-up round:
  ours   the VLLMRolloutEngine a training run builds (the preset's KV cache and whole-prompt prefill),
         called as the loop calls it: after a weight push, with the cut at EOS, truncation flags,
         decoded texts and per-token log-probs it returns;
  bare   vllm.LLM on the same model directory and prompts, as a user would write it (float32, the
         same KV cache size, sampling settings and seeds), returning its RequestOutputs; vLLM's
         default runs the engine core in a second process, which on 2 cores competes with the
         worker for them;
  bare-inproc  the same with VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine core in the calling
         process, as the training engine runs it): the like-for-like baseline for the overhead;
  hf     the HFRolloutEngine (transformers generate with its KV cache).
Printed: response tokens/s (median over runs; wall time, and CPU time of the side's process and
its children: vLLM's engine-core and worker processes), ours against bare-inproc (the overhead),
bare and hf, and per round the cost of what the loop adds around generation: the
weight push of the 135M model (update_weights) and sleep/wake (no-ops for vLLM on CPU, timed anyway).
Each side's generation is measured for load (benchmarks/runs.py's Meter, the machine's cores its own jobs): a
ratio between sides is printed only where no run behind it saw more load than that; otherwise a line says why.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from runs import Meter, describe, withheld  # noqa: E402

MODEL = Path("~/.cache/dapo/models/SmolLM2-135M-Instruct").expanduser()
G, MAX_NEW, TEMPERATURE, KV_GIB = 8, 96, 0.7, 0.5


def prompts(tokenizer, k: int) -> list[list[int]]:
    from dapo.data.files import load_examples
    from dapo.data.prompts import make_encoder

    encode = make_encoder(tokenizer, 256)
    return [encode(ex) for ex in load_examples(ROOT / "data/word_problems/train.jsonl", template="raw")[:k]]


def timed(fn):
    """``fn()``, its wall seconds, the CPU seconds of this process and its descendants (vLLM's engine core and
    worker), and the load meanwhile (``Load.summary()``)."""
    meter = Meter(own_jobs=os.cpu_count() or 1)
    with meter:
        out = fn()
    return out, meter.wall_s, meter.cpu_s, meter.load.summary()


def side_ours(args) -> dict:
    from dapo.config import RolloutConfig
    from dapo.model.loading import load_model_and_tokenizer
    from dapo.rollout import SamplingParams
    from dapo.rollout.build import engine_on

    model, tok = load_model_and_tokenizer(MODEL)
    engine = engine_on(RolloutConfig(backend="vllm", kv_cache_gib=KV_GIB), model, tok, max_model_len=256 + MAX_NEW)
    ids = prompts(tok, args.prompts)
    engine.generate(ids, SamplingParams(n=G, temperature=TEMPERATURE, max_new_tokens=MAX_NEW, seed=999))  # warm-up
    _, push_s, push_cpu, _ = timed(lambda: engine.update_weights(model.named_parameters()))
    _, sleep_s, _, _ = timed(lambda: (engine.sleep(), engine.wake()))
    gen, wall, cpu, load = timed(
        lambda: engine.generate(
            ids, SamplingParams(n=G, temperature=TEMPERATURE, max_new_tokens=MAX_NEW, seed=args.seed)
        )
    )
    return {
        "tokens": gen.num_tokens,
        "wall": wall,
        "cpu": cpu,
        "load": load,
        "push_s": push_s,
        "push_cpu": push_cpu,
        "sleep_wake_s": sleep_s,
    }


def side_bare(args) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(MODEL)
    # the settings vLLM needs on a CPU for seeded sampling (see rollout/vllm.py), nothing of the trainer's
    llm = LLM(
        model=str(MODEL),
        dtype="float32",
        seed=0,
        max_model_len=256 + MAX_NEW,
        kv_cache_memory_bytes=int(KV_GIB * 2**30),
        enable_chunked_prefill=False,
        max_num_batched_tokens=8192,
        long_prefill_token_threshold=0,
        enforce_eager=True,
        generation_config="vllm",
    )
    ids = prompts(tok, args.prompts)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in ids]

    def run(seed):
        params = [
            SamplingParams(n=G, temperature=TEMPERATURE, top_p=1.0, max_tokens=MAX_NEW, seed=seed * 10_007 + i)
            for i in range(len(reqs))
        ]
        return llm.generate(reqs, params, use_tqdm=False)

    run(999)
    outs, wall, cpu, load = timed(lambda: run(args.seed))
    return {"tokens": sum(len(c.token_ids) for o in outs for c in o.outputs), "wall": wall, "cpu": cpu, "load": load}


def side_hf(args) -> dict:
    from dapo.model.loading import load_model_and_tokenizer
    from dapo.rollout.base import SamplingParams
    from dapo.rollout.hf import HFRolloutEngine

    model, tok = load_model_and_tokenizer(MODEL)
    engine = HFRolloutEngine(model, tok)
    ids = prompts(tok, args.prompts)
    engine.generate(ids[:2], SamplingParams(n=G, temperature=TEMPERATURE, max_new_tokens=8, seed=999))
    gen, wall, cpu, load = timed(
        lambda: engine.generate(
            ids, SamplingParams(n=G, temperature=TEMPERATURE, max_new_tokens=MAX_NEW, seed=args.seed)
        )
    )
    return {"tokens": gen.num_tokens, "wall": wall, "cpu": cpu, "load": load}


def side_bare_inproc(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return side_bare(args)


SIDES = {"ours": side_ours, "bare": side_bare, "bare-inproc": side_bare_inproc, "hf": side_hf}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--sides", default="ours,bare-inproc,bare,hf")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        Path(args.json).write_text(json.dumps(SIDES[args.side](args)))
        return
    if not (MODEL / "config.json").exists():
        sys.exit(f"needs {MODEL}: run `make smollm2` once")
    sides = args.sides.split(",")
    res: dict[str, list[dict]] = {s: [] for s in sides}
    for run in range(args.runs):
        for side in sides if run % 2 == 0 else sides[::-1]:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [
                    sys.executable,
                    __file__,
                    "--side",
                    side,
                    "--json",
                    f.name,
                    "--prompts",
                    str(args.prompts),
                    "--seed",
                    str(run),
                ]
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}
                )
                if proc.returncode:
                    sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
                r = json.loads(Path(f.name).read_text())
            res[side].append(r)
            print(
                f"run {run + 1} {side:11s} {r['tokens']} tokens, {r['tokens'] / r['wall']:.0f} tokens/s wall, "
                f"{r['tokens'] / r['cpu']:.0f} per CPU s ({r['wall']:.1f} wall s, {r['cpu']:.1f} CPU s)"
                + (f"; weight push {r['push_s']:.2f} s" if "push_s" in r else "")
                + f"  ({'' if r['load']['clean'] else 'shared the machine: '}{describe(r['load'])})",
                flush=True,
            )
    rate = {s: statistics.median(r["tokens"] / r["wall"] for r in rs) for s, rs in res.items()}
    cpu_rate = {s: statistics.median(r["tokens"] / r["cpu"] for r in rs) for s, rs in res.items()}
    print(
        f"\n{args.prompts} prompts x G={G}, <= {MAX_NEW} tokens, temperature {TEMPERATURE}; median of {args.runs} runs"
    )
    for s in sides:
        print(f"{s:11s} {rate[s]:7.0f} tokens/s wall  {cpu_rate[s]:7.0f} tokens per CPU s")

    def loads(*names):
        return [r["load"] for name in names for r in res[name]]

    for bare in ("bare-inproc", "bare"):
        if "ours" in rate and bare in rate:
            reason = withheld(loads("ours", bare), "overhead")
            print(
                f"ours vs {bare} vLLM: "
                + (
                    reason
                    or f"{100 * (rate[bare] / rate['ours'] - 1):+.1f}% overhead (wall), "
                    f"{100 * (cpu_rate[bare] / cpu_rate['ours'] - 1):+.1f}% (CPU)"
                )
            )
    if "ours" in rate and "hf" in rate:
        reason = withheld(loads("ours", "hf"), "ratio")
        print("ours vs HF generate: " + (reason or f"{rate['ours'] / rate['hf']:.2f}x"))
    if "ours" in res:
        push = statistics.median(r["push_s"] for r in res["ours"])
        sleep = statistics.median(r["sleep_wake_s"] for r in res["ours"])
        print(f"weight push (135M, float32): {push:.2f} s per step; sleep + wake: {sleep * 1000:.1f} ms")


if __name__ == "__main__":
    main()
