"""What `make gpu-check` checks and the report it writes (scripts/gpu_check.py runs the items; this reads their
results back into runs/gpu_check/gpu_report.md)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import gpu_check_real

ROOT = Path(__file__).resolve().parents[1]
GPU_TEST_FILES = ["tests/test_gpu.py", "tests/test_gpu_paths.py", "tests/test_gpu_teacher.py"]  # the items' tests
# item: (what it checks, pytest selection in GPU_TEST_FILES, time limit in seconds)
ITEMS = {
    "a": (
        "one update in float32 and bf16, and under FSDP2 on 1 rank (nccl) with bf16 mixed precision, "
        "cpu_offload, activation checkpointing, against the CPU float32 update",
        "one_update_in_one_process or fsdp2_one_rank or two_steps_on_gpu",
        240,
    ),
    "b": (
        "shared prompt prefix vs unshared: eager, SDPA math / memory-efficient / flash; log-probs and gradients",
        "shared_prompt_prefix",
        120,
    ),
    "c": ("HeadLogProbs vs full logits, float32 and bf16, across CUDA_HEAD_CHUNK_ROWS chunks", "head_log_probs", 60),
    "d": ("fused AdamW vs torch's reference AdamW", "fused_adamw", 60),
    "e": ("LoRA: only adapters change; the merged export gives the trainer's logits", "lora_trains", 120),
    "f": ("checkpoint at step 1, hard stop, resume: final weights vs an uninterrupted run", "hard_stop", 240),
    "g": ("perf/peak_cuda_<phase>_gb vs torch.cuda.max_memory_allocated", "phase_peaks or training_run_logs", 180),
    "i": (
        "GSPO and CISPO (algo.objective): one update in float32 and bf16 against the CPU float32 one",
        "each_objective",
        120,
    ),
    "m": (
        "the rollout process (rollout.max_staleness): its tokens and log-probs vs the in-process engine's",
        "rollout_process",
        120,
    ),
    "n": (
        "a rollout rank (rollout.ranks=1, torchrun, 2 ranks on the device) vs the rollout process: samples, weights",
        "rollout_rank_on_the_device",
        240,
    ),
    "o": (
        "the teacher pass of on-policy distillation (teacher.path), float32 and bf16, vs its CPU float32 log-probs; "
        "teacher.signal=full's KL head vs full logits",
        "teacher_pass_on_the_device",
        120,
    ),
    "u": (
        "the HF engine's decode loop (shared prefill, ended rows leaving the batch) vs generate: the same tokens",
        "decode_loop_samples",
        120,
    ),
    "v": (
        "algo.old_logp_from_update: the first update's old log-probs from its forward vs a pass over every row",
        "old_logp_from_update_on_the_device",
        120,
    ),
    "t": (
        "train.kernels: torch.compile per decoder layer, Liger Kernel, both; float32 and bf16 against the CPU update",
        "faster_kernels",
        240,
    ),
}
OTHER_GPU_TESTS = ["tests/test_parallel.py", "tests/test_vllm.py"]
DEMO_RISE_POINTS = 15.0


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


# the demo runs of part demo: (item, state key, what the row says)
DEMO_ROWS = (
    ("h", "demo", "held-out accuracy +15 points"),
    ("k", "demo_tools", "with the Python tool (configs/demo_tools.yaml): held-out accuracy +15 points"),
    ("l", "demo_async", "with rollout.max_staleness=1 (docs/async.md): held-out accuracy +15 points"),
    (
        "s",
        "demo_screening",
        "with algo.screen_samples=4 (screening): held-out accuracy +15 points, prompts screened out",
    ),
)


def demo_line(item: str, demo: dict | None, what: str) -> str:
    """The report's row of a demo run (items h, k, l and s)."""
    if demo is None:
        return f"| {item} | `dapo demo model.device=cuda`: {what} | NOT RUN | | |"
    if "rise" not in demo:
        verdict = "FAIL (no result line)" if demo["exit"] is not None else "FAIL (time-out)"
    elif not demo["cuda"]:
        shortened = " (shortened)" if demo["shortened"] else ""
        rose = "rose" if demo["rise"] >= DEMO_RISE_POINTS else "did not rise"
        verdict = f"CPU run{shortened}: {rose} {demo['rise']} points"
    else:
        verdict = "PASS" if demo["rise"] >= DEMO_RISE_POINTS else f"FAIL (rose {demo['rise']} points)"
    detail = (
        f"{demo['metric']} {demo['before']}% -> {demo['after']}% after step {demo['steps']}, "
        f"wall time {demo['wall_s']} s"
        if "rise" in demo
        else ""
    )
    if demo.get("generation"):
        detail += f"; {demo['generation']}"
    return f"| {item} | `{demo['command']}`: {what} | {verdict} | {detail} | {demo['seconds']} |"


def item_status(result: dict | None) -> tuple[str, str]:
    """(verdict, detail) of one item's pytest run."""
    if result is None:
        return "NOT RUN", ""
    cases = result["cases"]
    if result["exit"] is None:
        return "FAIL (time-out)", f"stopped after {result['seconds']} s"
    count = lambda dev, st: sum(1 for c in cases if c["device"] == dev and c["status"] == st)  # noqa: E731
    detail = ", ".join(
        f"{dev}: {count(dev, 'passed')} passed, {count(dev, 'failed')} failed, {count(dev, 'skipped')} skipped"
        for dev in ("cuda", "cpu", "other")
        if any(c["device"] == dev for c in cases)
    )
    if any(c["status"] == "failed" for c in cases) or (result["exit"] not in (0, 5) and not cases):
        return "FAIL", detail
    if count("cuda", "passed") and not count("cuda", "skipped"):
        return "PASS", detail
    if count("cuda", "passed"):
        return "PASS (some CUDA cases skipped)", detail
    return "SKIPPED on CUDA (cpu twins only)" if count("cpu", "passed") else "SKIPPED", detail


def write_report(state: dict, paths: list[Path]) -> str:
    """The whole report from the accumulated state, written to each of ``paths``; returns its text."""
    tests = state.get("tests", {})
    lines = header_lines(state) + item_lines(state, tests) + figure_lines(tests) + bench_lines(state.get("bench"))
    lines += failure_lines(state, tests)
    lines += [
        "",
        "Not verifiable on one lent GPU without network: vLLM on GPU (its wheel is pinned to another torch and "
        "too large to carry), NCCL across several GPUs, Ray across machines.",
    ]
    text = "\n".join(lines) + "\n"
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return text


def header_lines(state: dict) -> list[str]:
    """The commit, the device (or plainly: none) and the versions found; which wheels went in."""
    env = (state.get("install") or {}).get("env") or {}
    lines = ["# dapo gpu-check report", "", f"written {now()}, commit {git_commit()}", ""]
    if env.get("device"):
        lines.append(
            f"**device: {env['device']}** ({env['devices']} visible, {env['memory_gib']} GiB, compute capability "
            f"{env['capability']})"
        )
    else:
        lines.append(
            "**device: none: no CUDA device was visible.** This run checked the script on a CPU "
            "(--allow-cpu): every CUDA case is skipped, no figure below is a GPU figure."
        )
    lines += [
        "",
        f"python {env.get('python')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, "
        f"NCCL {env.get('nccl')}, transformers {env.get('transformers')}, peft {env.get('peft')}, "
        f"math-verify {env.get('math_verify')}, pytest {env.get('pytest')}; TF32 matmul {env.get('tf32_matmul')}",
        "",
    ]
    inst = state.get("install")
    if inst:
        lines += [
            f"wheels from .whl ({inst['how']}): " + (", ".join(inst["installed"]) or "none"),
            "kept the machine's: " + (", ".join(inst["kept"]) or "none"),
            "",
        ]
    return lines


def item_lines(state: dict, tests: dict) -> list[str]:
    """One row per item of GPU_TEST_FILES, per demo run and for item r."""
    lines = ["| item | what | result | cases | seconds |", "|---|---|---|---|---|"]
    for item, (what, _, _) in ITEMS.items():
        verdict, detail = item_status(tests.get(item))
        lines.append(f"| {item} | {what} | {verdict} | {detail} | {(tests.get(item) or {}).get('seconds', '')} |")
    verdict, detail = item_status(tests.get("gpu-marked"))
    lines.append(
        f"| other | tests marked gpu in {', '.join(OTHER_GPU_TESTS)} | {verdict} | {detail} | "
        f"{(tests.get('gpu-marked') or {}).get('seconds', '')} |"
    )
    lines += [demo_line(item, state.get(key), what) for item, key, what in DEMO_ROWS]
    return lines + [
        "",
        "| item | what | result | figures |",
        "|---|---|---|---|",
        gpu_check_real.report_line(state.get("real")),
    ]


def figure_lines(tests: dict) -> list[str]:
    """Each test's measured differences beside its tolerance, and why cases were skipped."""
    lines = ["", "## Measured differences (tests/test_gpu*.py, each beside the tolerance its test states)", ""]
    for item in [*ITEMS, "gpu-marked"]:
        lines += [f"- `{fig}`" for fig in (tests.get(item) or {}).get("figures", [])]
    skipped = sorted({c["message"] for r in tests.values() for c in r["cases"] if c["status"] == "skipped"})
    return lines + (["", "Skip reasons: " + "; ".join(skipped)] if skipped else [])


def bench_lines(bench: dict | None) -> list[str]:
    """benchmarks/gpu.py's rows, its profile, and the parts not yet measured with the command that measures them."""
    lines = ["", "## Benchmarks (benchmarks/gpu.py)", ""]
    if bench is None:
        return lines + ["not run"]
    if bench.get("smoke"):
        lines += [
            "**smoke run (no CUDA device): tiny shapes, the script checked, no figure here is a measurement**",
            "",
        ]
    rows = bench.get("rows", {})
    lines += bench.get("header", []) + [row for part in bench.get("all_parts", rows) for row in rows.get(part, [])]
    if bench.get("failed"):
        lines += ["", "failed parts: " + "; ".join(f"{k}: {v[:300]}" for k, v in bench["failed"].items())]
    prof = (bench.get("results") or {}).get("profile")
    if prof:
        lines += ["", "profile, top kernels/ops of one 1.5B-shape update:"]
        lines += [f"    {s:8.3f} s  {k}" for k, s in prof["top"]]
    if bench["exit"] is None:
        lines.append(f"(stopped after {bench['seconds']} s)")
    left = [part for part in bench.get("all_parts", []) if part not in bench.get("done", [])]
    if left:
        lines += [
            "",
            f"not measured yet: {', '.join(left)}; measure them (the rows above stay) with "
            f"`make gpu-check GPU_CHECK_PARTS=bench GPU_CHECK_BENCH_PARTS={','.join(left)}`",
        ]
    return lines


def failure_lines(state: dict, tests: dict) -> list[str]:
    """The last lines of output of every item, demo and benchmark that failed."""
    failures = [(k, r["tail"]) for k, r in tests.items() if r.get("tail")]
    failures += [(key, state[key]["tail"]) for _, key, _ in DEMO_ROWS if (state.get(key) or {}).get("tail")]
    bench = state.get("bench")
    failures += [("bench", bench["tail"])] if bench and bench.get("tail") else []
    if not failures:
        return []
    lines = ["", "## Output of what failed (last lines)"]
    for name, tail in failures:
        lines += ["", f"### {name}", "```", tail[-3000:], "```"]
    return lines


def git_commit() -> str:
    """The commit checked. A lent machine gets a copy of the working tree without .git, so the command
    there names it: GPU_CHECK_COMMIT=$(git rev-parse --short HEAD), filled in here when the command is written."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "?"
        )
    except OSError:
        return "?"
