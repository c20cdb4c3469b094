"""The GPU figures (update throughput and MFU, peak memory at the paper's length, HF rollout, a preset step),
on randomly initialised models of real shapes, printed as a Markdown table (--json keeps them; a run's figures go
into a results file under benchmarks/results/, from which benchmarks/RESULTS.md is rendered).

    python benchmarks/gpu.py [--parts peak,update,kernels,lora7b,memory,rollout,preset,profile] [--json OUT.json]
    python benchmarks/gpu.py --smoke     # tiny shapes on whatever device there is (CPU here): the script runs

Parts (each prints its rows as it finishes; a part that fails prints why and the others still run):
  peak     the device's bf16 matmul rate: torch.mm of 8192^3 bfloat16, best of 20 timed after a warm-up;
           every MFU below is against it (same run, same device)
  update   Policy.update (forward, backward, AdamW, one optimizer update) on Qwen2.5-0.5B and -1.5B shapes in
           bf16 with float32 masters: 8 prompts x G=8, 256-token prompts, responses of 768-1024 random tokens,
           token budget 8192 per micro-batch, no activation checkpointing. Tokens/s counts real prompt and
           response tokens (no padding); MFU = 6 N tokens / time / peak, N the parameters that multiply
           (the input embedding counts only when it is also the LM head), and beside it the same with
           causal attention's FLOPs (6 x layers x hidden x sequence length per token) added. Median of 3
           after a warm-up update.
  kernels  the update of `update` with train.kernels: compile (torch.compile per decoder layer), liger (Liger
           Kernel's RMSNorm, SwiGLU, RoPE) and both, each against the eager update of the same shape in the same
           run (the warm-up update compiles; the 3 timed ones reuse the graphs)
  lora7b   the Qwen2.5-7B shape, bf16 base frozen, LoRA rank 16 on every linear layer of the decoder, activation
           checkpointing (its activations at this budget would not fit beside the weights otherwise); MFU on
           4 N per token (the frozen base has no weight gradients: forward 2N, backward to the inputs 2N)
  memory   peak allocated GPU memory of one Policy.update on the 1.5B shape, activation checkpointing on, 4
           responses of 20,480 tokens after 512-token prompts (the paper's length), token budgets of 1, 2 and
           4 rows per forward pass; against the device's total memory
  rollout  HFRolloutEngine (transformers generate) on the 0.5B shape in bf16: 32 prompts x G=8, 128-token
           prompts, 512 new tokens (a random model almost never samples EOS, so every row runs to the limit)
  preset   one whole step of configs/smollm2_135m.yaml with rollout.backend=hf on a random model of
           SmolLM2-135M's shape (Llama, hidden 576, 30 layers, 49,152 vocabulary) with SmolLM2's tokenizer
           (tests/assets), dynamic sampling off (a random model is never right, so every group would be
           dropped), no evaluation; the second of two steps is reported (the first warms up)
  profile  where the time of one 1.5B update goes: CUDA kernel time by kind (torch.profiler)

Models are built in memory on the device (no weights are read or written; Policy's loader is handed the
model), so the 7B shape costs seconds, not a 15 GB write and read. Every timed call is measured for the CPU seconds
it took (this process's) and the machine's load meanwhile (benchmarks/runs.py's Meter, one thread driving the GPU
its own job): an MFU or a speed-up is printed only where neither the reference nor the measurement saw more load
than that; otherwise the row says why (its JSON entry keeps the seconds, with the reason under "withheld").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src"))
from gpu_harness import Harness, gib, pct  # noqa: E402
from runs import machine  # noqa: E402

PAPER_RESPONSE = 20480


class Bench(Harness):
    """The parts, each a method part_<name>: it measures, records its figures in self.results and its table
    rows with self.row."""

    def part_peak(self) -> None:
        n = 512 if self.smoke else 8192
        dtype = torch.bfloat16
        a, b = torch.randn(n, n, device=self.device, dtype=dtype), torch.randn(n, n, device=self.device, dtype=dtype)
        for _ in range(3):
            torch.mm(a, b)
        reps = 3 if self.smoke else 20
        meter = self.meter()
        with meter:  # one block: 20 calls of a few milliseconds each are too short to read the load of one by one
            best = min(self.timed(lambda: torch.mm(a, b)) for _ in range(reps))
        self.peak_flops = 2 * n**3 / best
        self.peak_load = meter.load.summary()
        self.results["peak"] = {"bf16_mm_tflops": self.peak_flops / 1e12, "n": n} | meter.record()
        self.row(
            f"bf16 torch.mm {n}^3 (the MFU reference)",
            f"{self.peak_flops / 1e12:.1f} TFLOP/s",
            f"best of {reps}; {meter.cpu_s:.2f} CPU s over {meter.wall_s:.2f} wall s; {meter.load.describe()}",
        )

    def update_rate(self, name: str, overrides: list[str], *, lora: bool = False, flops_per_param: int = 6) -> dict:
        s = self.shape(name)
        model, tok = self.build(name)
        policy, cfg = self.policy(
            model,
            tok,
            [
                "train.prompts_per_step=8",
                "train.mini_batch_prompts=8",
                "rollout.group_size=8",
                "rollout.max_response_tokens=1024",
                "train.max_tokens_per_micro_batch=8192",
                *overrides,
            ],
        )
        from dapo.algorithm.step import make_loss_fn

        loss_fn = make_loss_fn(cfg.algo, cfg.rollout.max_response_tokens)
        resp = (24, 32) if self.smoke else (768, 1024)
        batch = self.batch(8, 8, 16 if self.smoke else 256, resp, s["vocab"])
        self.old_logp(policy, batch)
        tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
        # causal attention per layer and sequence of L tokens: QK^T and PV, 2 FLOPs x L^2/2 x hidden each, in
        # forward (2 L^2 h) and twice that in backward (the inputs' gradients are needed even under a frozen base)
        attn = sum(
            6 * s["layers"] * s["hidden"] * (len(p) + len(r)) ** 2 for p, r in zip(batch.prompt_ids, batch.response_ids)
        )
        n_params = self.matmul_params(policy.model.get_base_model() if lora else policy.model)
        policy.update(batch, loss_fn)  # warm-up: kernels, allocator, AdamW state
        meter = self.meter()
        times = [self.timed(lambda: policy.update(batch, loss_fn), meter) for _ in range(1 if self.smoke else 3)]  # noqa: F821 (called before the del below)
        t = statistics.median(times)
        flops = flops_per_param * n_params * tokens
        reason = self.withheld(self.peak_load, meter.load.summary()) if self.peak_flops else None
        mfu = self.peak_flops and not reason
        out = {
            "tokens_per_s": tokens / t,
            "seconds": t,
            "cpu_s": meter.cpu_s / len(times),  # per update
            "load": meter.load.summary(),
            "tokens": tokens,
            "params": n_params,
            "mfu": flops / t / self.peak_flops if mfu else None,
            "mfu_with_attention": (flops + attn) / t / self.peak_flops if mfu else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None,
        } | ({"withheld": reason} if reason else {})
        del policy, model
        self.free()
        return out

    def part_update(self) -> None:
        for name in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
            r = self.update_rate(name, [])
            self.results[f"update {name}"] = r
            self.row(
                f"update, {name} shape, bf16 + fp32 masters, budget 8192, {r['tokens']:,} tokens",
                f"{r['tokens_per_s']:,.0f} tokens/s, MFU "
                + (r.get("withheld") or f"{pct(r['mfu'])} (with attention {pct(r['mfu_with_attention'])})"),
                f"{r['seconds']:.2f} s per update ({r['cpu_s']:.2f} CPU s), peak {gib(r['peak_gib'])}",
            )

    def part_kernels(self) -> None:
        """train.kernels against the eager update, at the same shapes in the same run (update's rows, or its own);
        the 1.5B shape first: its MFU is the goal, and a lease cut short keeps the rows printed before the cut."""
        variants = {"compile": ["train.kernels=[compile]"], "liger": ["train.kernels=[liger]"]}
        variants["compile + liger"] = ["train.kernels=[compile,liger]"]
        if not self.cuda:
            variants.pop("liger"), variants.pop("compile + liger")  # Liger's kernels are Triton on CUDA
        for name in ("qwen2.5-1.5b", "qwen2.5-0.5b"):
            eager = self.results.get(f"update {name}") or self.update_rate(name, [])
            for variant, overrides in variants.items():
                r = self.update_rate(name, overrides)
                self.results[f"kernels {variant} {name}"] = r
                reason = self.withheld(eager["load"], r["load"], what="speed-up")
                self.row(
                    f"update, {name} shape, train.kernels {variant}",
                    f"{r['tokens_per_s']:,.0f} tokens/s, "
                    + (
                        reason
                        or f"MFU {pct(r['mfu'])} (eager {pct(eager['mfu'])}): {eager['seconds'] / r['seconds']:.2f}x"
                    ),
                    f"{r['seconds']:.2f} s per update ({r['cpu_s']:.2f} CPU s), peak {gib(r['peak_gib'])}",
                )

    def part_lora7b(self) -> None:
        name = "qwen2.5-7b"
        r = self.update_rate(
            name,
            ["model.lora.rank=16", "model.gradient_checkpointing=true", "train.lr=2e-4"],
            lora=True,
            flops_per_param=4,
        )
        self.results[f"update {name} lora"] = r
        self.row(
            f"update, {name} shape, LoRA rank 16, bf16 base, activation checkpointing, {r['tokens']:,} tokens",
            f"{r['tokens_per_s']:,.0f} tokens/s, MFU "
            + (r.get("withheld") or f"{pct(r['mfu'])} on 4N (with attention {pct(r['mfu_with_attention'])})"),
            f"{r['seconds']:.2f} s per update ({r['cpu_s']:.2f} CPU s), peak {gib(r['peak_gib'])}",
        )

    def part_memory(self) -> None:
        name = "qwen2.5-1.5b"
        s = self.shape(name)
        length, prompt = (96, 16) if self.smoke else (PAPER_RESPONSE, 512)
        row_tokens = length + prompt
        total = torch.cuda.get_device_properties(self.device).total_memory / 2**30 if self.cuda else None
        model, tok = self.build(name)
        from dapo.algorithm.step import make_loss_fn

        policy, cfg = self.policy(
            model,
            tok,
            [
                "train.prompts_per_step=1",
                "train.mini_batch_prompts=1",
                "rollout.group_size=4",
                f"rollout.max_response_tokens={length}",
                "model.gradient_checkpointing=true",
                f"data.max_prompt_tokens={prompt}",
            ],
        )
        loss_fn = make_loss_fn(cfg.algo, length)
        warm = self.batch(1, 4, 8, (8, 8), s["vocab"])
        self.old_logp(policy, warm)
        policy.update(warm, loss_fn)  # AdamW state exists, as in a run
        batch = self.batch(1, 4, prompt, (length, length), s["vocab"])
        self.old_logp(policy, batch)
        for rows_per_pass in (1, 2, 4):
            budget = rows_per_pass * row_tokens
            policy.train_cfg.max_tokens_per_micro_batch = budget  # the plan reads it at each update
            self.free()
            try:
                seconds = self.timed(lambda: policy.update(batch, loss_fn))  # noqa: F821 (called before the del below)
                peak = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None
                fits = "" if total is None else (" (fits)" if peak < total else " (does not fit)")
                self.results[f"memory budget {budget}"] = {"peak_gib": peak, "seconds": seconds, "total_gib": total}
                self.results[f"memory budget {budget}"] |= self.last.record()
                self.row(
                    f"peak memory, {name} update, 4 x {length:,}-token responses, checkpointing, budget {budget:,}"
                    f" ({rows_per_pass} row(s) per pass)",
                    f"{gib(peak)} of {gib(total)}{fits}",
                    f"{seconds:.1f} s ({self.last.cpu_s:.1f} CPU s)",
                )
            except torch.cuda.OutOfMemoryError as err:
                self.results[f"memory budget {budget}"] = {"oom": str(err).splitlines()[0]}
                self.row(
                    f"peak memory, {name} update, budget {budget:,}", "out of memory", str(err).splitlines()[0][:80]
                )
        del policy, model
        self.free()

    def part_rollout(self) -> None:
        from dapo.rollout.base import SamplingParams
        from dapo.rollout.hf import HFRolloutEngine

        name = "qwen2.5-0.5b"
        s = self.shape(name)
        model, tok = self.build(name)
        engine = HFRolloutEngine(model, tok)
        prompts, new = (4, 16) if self.smoke else (32, 512)
        gen = torch.Generator().manual_seed(0)
        ids = [
            torch.randint(2, min(s["vocab"], 50000), (16 if self.smoke else 128,), generator=gen).tolist()
            for _ in range(prompts)
        ]
        params = SamplingParams(n=8, temperature=1.0, max_new_tokens=new, seed=0)
        engine.generate(ids[:2], SamplingParams(n=2, max_new_tokens=4))  # warm-up
        out = {}
        seconds = self.timed(lambda: out.setdefault("g", engine.generate(ids, params)))  # noqa: F821 (called before the del below)
        tokens = out["g"].num_tokens
        self.results["rollout hf"] = {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds}
        self.results["rollout hf"] |= self.last.record()
        self.row(
            f"HF generate rollout, {name} shape bf16, {prompts} x 8 rows, {new} new tokens",
            f"{tokens / seconds:,.0f} tokens/s",
            f"{tokens:,} tokens in {seconds:.1f} s ({self.last.cpu_s:.1f} CPU s)",
        )
        del engine, model
        self.free()

    def part_preset(self) -> None:
        from transformers import AutoTokenizer

        from dapo.config import load_config
        from dapo.reporting.run_log import read_metrics
        from dapo.training import train

        tok = AutoTokenizer.from_pretrained(ROOT / "tests" / "assets" / "smollm2-tokenizer")
        model, tok = self.build("smollm2-135m", dtype=torch.float32, tokenizer=tok)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(Path(tmp) / "model")  # the preset loads a directory (540 MB in float32)
            tok.save_pretrained(Path(tmp) / "model")
            del model
            self.free()
            steps = 2
            overrides = [
                f"model.path={Path(tmp) / 'model'}",
                f"model.device={self.device.type}",
                "rollout.backend=hf",
                f"train.total_steps={steps}",
                "algo.dynamic_sampling=false",
                "eval.before_train=false",
                "eval.every_steps=null",
                "eval.benchmarks=[]",
                "run.save_every=null",
                f"run.dir={tmp}",
                "run.name=p",
                "run.progress=false",
                "run.loggers=console",
                "reward.num_workers=2",
            ]
            if self.smoke:
                overrides += [
                    "rollout.max_response_tokens=16",
                    "algo.overlong_buffer_tokens=4",
                    "train.prompts_per_step=2",
                    "train.mini_batch_prompts=1",
                    "rollout.group_size=2",
                ]
            wall = self.timed(lambda: train(load_config(str(ROOT / "configs" / "smollm2_135m.yaml"), overrides)))
            r = read_metrics(Path(tmp) / "p")[-1]
        keys = ("step", "collect", "generate", "old_logprob", "update", "weight_sync", "checkpoint")
        times = {k: r.get(f"perf/time_{k}_s") for k in keys}
        peaks = {k: v for k, v in r.items() if k.startswith("perf/peak_cuda_")}
        self.results["preset smollm2_135m hf"] = {
            "times": times,
            "cpu_times": {k: r.get(f"perf/cpu_{k}_s") for k in keys},
            "peaks_gib": peaks,
            "wall_s": wall,
            "cpu_s": self.last.cpu_s,
            "load": self.last.load.summary(),
            "tokens_per_s": {k: v for k, v in r.items() if "tokens_per_s" in k},
        }
        self.row(
            f"configs/smollm2_135m.yaml step {steps}, rollout.backend=hf, random model of its shape",
            f"{times['step']:.2f} s per step ({r.get('perf/cpu_step_s', float('nan')):.2f} CPU s)",
            ", ".join(f"{k} {v:.2f} s" for k, v in times.items() if v is not None and k != "step")
            + (f"; peak {max(peaks.values()):.2f} GiB" if peaks else ""),
        )

    def part_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        from dapo.algorithm.step import make_loss_fn

        name = "qwen2.5-1.5b"
        s = self.shape(name)
        model, tok = self.build(name)
        policy, cfg = self.policy(
            model,
            tok,
            [
                "train.prompts_per_step=8",
                "train.mini_batch_prompts=8",
                "rollout.group_size=8",
                "train.max_tokens_per_micro_batch=8192",
            ],
        )
        loss_fn = make_loss_fn(cfg.algo, cfg.rollout.max_response_tokens)
        batch = self.batch(8, 8, 16 if self.smoke else 256, (24, 32) if self.smoke else (768, 1024), s["vocab"])
        self.old_logp(policy, batch)
        policy.update(batch, loss_fn)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities) as prof:
            wall = self.timed(lambda: policy.update(batch, loss_fn))  # noqa: F821 (called before the del below)
        attr = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        kinds = {
            "matmul (gemm)": ("gemm", "mm", "matmul", "cutlass", "sm90", "sm80"),
            "attention": ("flash", "fmha", "attention", "efficient"),
            "softmax / logsumexp / cross-entropy": ("softmax", "logsumexp", "log_softmax"),
            "optimizer": ("adam", "multi_tensor", "foreach"),
            "copies / casts": ("copy", "cast", "convert", "to_copy", "cat", "index", "gather", "scatter"),
        }
        by_kind: dict[str, float] = {}
        events = [
            e
            for e in prof.key_averages()
            if getattr(e, attr, 0) > 0 and (not self.cuda or not e.key.startswith("aten::"))
        ]
        for e in events:
            low = e.key.lower()
            kind = next((k for k, keys in kinds.items() if any(x in low for x in keys)), "elementwise / other")
            by_kind[kind] = by_kind.get(kind, 0.0) + getattr(e, attr)
        busy = sum(by_kind.values()) / 1e6
        self.results["profile"] = {
            "wall_s": wall,
            "cpu_s": self.last.cpu_s,
            "busy_s": busy,
            "by_kind_s": {k: v / 1e6 for k, v in by_kind.items()},
            "top": [(e.key[:90], getattr(e, attr) / 1e6) for e in sorted(events, key=lambda e: -getattr(e, attr))[:12]],
        }
        what = "GPU kernel" if self.cuda else "CPU op"
        self.row(
            f"profile of one {name} update",
            f"{wall:.2f} s wall, {busy:.2f} s of {what} time",
            "; ".join(
                f"{k} {v / 1e6 / max(busy, 1e-9):.0%}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
            ),
        )
        for key, secs in self.results["profile"]["top"]:
            print(f"    {secs:8.3f} s  {key}")
        del policy, model
        self.free()


PARTS = ("peak", "update", "kernels", "lora7b", "memory", "rollout", "preset", "profile")


def header(bench: Bench, args) -> list[str]:
    import transformers

    name = torch.cuda.get_device_name(0) if bench.cuda else "CPU (no CUDA device)"
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}"
    command = (
        "python benchmarks/gpu.py"
        + (" --smoke" if args.smoke else "")
        + (f" --parts {args.parts}" if args.parts != ",".join(PARTS) else "")
    )
    lines = [
        f"### {name}: {versions}{' (smoke: tiny shapes, not figures)' if args.smoke else ''}",
        "",
        f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| measurement | figure | detail |",
        "|---|---|---|",
    ]
    for line in lines:
        print(line, flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks that every part runs (CPU is fine)")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of: " + ",".join(PARTS))
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    bench = Bench(args.smoke)
    if not bench.cuda and not args.smoke:
        sys.exit("no CUDA device: the figures are GPU figures (use --smoke to check that the script runs)")
    parts = [p for p in args.parts.split(",") if p]
    if unknown := sorted(set(parts) - set(PARTS)):
        sys.exit(f"--parts: unknown {unknown}; choose from {','.join(PARTS)}")
    lines = header(bench, args)
    if "peak" not in parts and any(p in parts for p in ("update", "lora7b")):
        parts.insert(0, "peak")  # MFU needs it
    failed, done = {}, []

    def save() -> None:  # after every part (``done`` names it then): a run stopped by its time limit keeps its figures
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "header": lines,
                        "rows": bench.rows,
                        "results": bench.results,
                        "failed": failed,
                        "done": done,
                        "all_parts": list(PARTS),
                        "machine": machine(),  # the host CPU; the GPU is the header's
                    },
                    indent=1,
                    default=str,
                )
            )

    bench.on_row = save  # and after every row: a part stopped by the time limit keeps the rows it printed
    for part in parts:
        t0 = time.perf_counter()
        bench.part = part
        try:
            getattr(bench, f"part_{part}")()
        except Exception as err:  # one part's failure (an OOM, an API change) must not hide the others' figures
            failed[part] = f"{type(err).__name__}: {err}"
            bench.row(part, "FAILED", failed[part].splitlines()[0][:200])
            traceback.print_exc()
            bench.free()
        done.append(part)
        save()
        print(f"    ({part}: {time.perf_counter() - t0:.0f} s)", flush=True)
    save()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
