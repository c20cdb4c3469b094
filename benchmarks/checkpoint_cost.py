"""What a checkpoint costs the training loop on the real model: synchronous against asynchronous saves.

    python benchmarks/checkpoint_cost.py [--runs 3] [--step-s 45]     # make smollm2 first

The state the real-model preset (configs/smollm2_135m.yaml) saves each time: SmolLM2-135M-Instruct in
float32 with its AdamW state after one optimizer step (1.6 GB in all), the tokenizer, the trainer
state. Each run saves once synchronously (run.async_checkpoint=false: the loop waits for the whole
write) and once asynchronously (true: the loop waits only for the small state's copy; the weights
and AdamW moments are written from live memory by a background thread, and the loop's next update
waits for that write, which by then has overlapped generation and old log-probs), the order
alternating run by run. Printed per mode, the median over runs of:
  blocked   wall seconds the loop waits inside save_checkpoint;
  write     wall seconds until the checkpoint is whole on disk (fsync and rename included);
  write CPU the CPU seconds the background thread spends (what it takes from the loop's cores while
            it overlaps the next step: with 2 cores, about half of it shows up as a slower step).
The share of a step is blocked / --step-s (the preset's wall seconds per step, measured by
benchmarks/vs_trl.py --real and scaling.py) and, for the asynchronous mode, (blocked + write CPU /
cores) / --step-s as the upper bound of what it takes from the loop. Each mode's saves are measured for load
(benchmarks/runs.py's Meter: wall and CPU seconds of the process and its threads, its torch threads its own
jobs); a mode whose saves saw more load than that gets no share, and a line says why.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dapo import checkpoint
from dapo.checkpoint import writer as checkpoint_writer
from dapo.config import load_config
from dapo.model.policy import Policy
from runs import Meter, withheld  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path("~/.cache/dapo/models/SmolLM2-135M-Instruct").expanduser()


def thread_cpu_s(thread: threading.Thread | None) -> float:
    """CPU seconds a running or finished thread has used (Linux: /proc/self/task/<tid>/stat)."""
    if thread is None or thread.native_id is None:
        return 0.0
    try:
        fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return float("nan")
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def save_once(policy: Policy, run_dir: Path, step: int, asynchronous: bool) -> dict:
    writer = checkpoint_writer.CheckpointWriter(asynchronous=asynchronous)
    writer.tokenizer_files(policy.tokenizer)  # made once per run in training, not per save
    cpu_box: dict = {}
    start = writer.start

    def watched_start(target, write):  # the background thread's own CPU time, read just before it ends
        def measured():
            write()
            cpu_box["cpu"] = thread_cpu_s(threading.current_thread())

        start(target, measured)

    writer.start = watched_start
    t0, c0 = time.perf_counter(), time.process_time()
    checkpoint.save_checkpoint(
        run_dir,
        step,
        model=policy.model,
        tokenizer=policy.tokenizer,
        trainer_state={"policy": policy.trainer_state(), "step_note": step},
        config_yaml="run: {}\n",
        keep=2,
        writer=writer,
    )
    blocked, blocked_cpu = time.perf_counter() - t0, time.process_time() - c0
    writer.wait()
    whole = time.perf_counter() - t0
    write_cpu = cpu_box.get("cpu", blocked_cpu)
    return {"blocked": blocked, "blocked_cpu": blocked_cpu, "write": whole, "write_cpu": write_cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--step-s", type=float, default=45.0, help="the preset's wall seconds per step, for the share")
    args = ap.parse_args()
    if not (MODEL / "config.json").exists():
        raise SystemExit(f"needs {MODEL}: run `make smollm2` once")
    cfg = load_config(ROOT / "configs/smollm2_135m.yaml", [f"model.path={MODEL}", "model.device=cpu"])
    policy = Policy(cfg.model, cfg.train, temperature=cfg.rollout.temperature, device=torch.device("cpu"))
    for p in policy.master or policy.model.parameters():  # one AdamW step: its moments exist, as in training
        p.grad = torch.randn_like(p) * 1e-3
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    size = sum(t.numel() * t.element_size() for t in policy.model.state_dict().values())
    size += sum(
        t.numel() * t.element_size()
        for s in policy.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
        f"state saved: {size / 2**30:.2f} GiB (weights + AdamW); load average {os.getloadavg()[0]:.2f}"
    )
    res: dict[str, list[dict]] = {"sync": [], "async": []}
    # own jobs: the process's torch threads, which built the state just before (the load average lags a minute)
    meters = {mode: Meter(own_jobs=torch.get_num_threads()) for mode in res}
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:  # the disk training runs write to
        step = 0
        for run in range(args.runs):
            for mode in ("sync", "async") if run % 2 == 0 else ("async", "sync"):
                step += 1
                with meters[mode]:
                    r = save_once(policy, Path(tmp), step, mode == "async")
                res[mode].append(r)
                print(
                    f"run {run + 1} {mode:5s} blocked {r['blocked']:.2f} s ({r['blocked_cpu']:.2f} CPU s), whole on "
                    f"disk after {r['write']:.2f} s, write CPU {r['write_cpu']:.2f} s",
                    flush=True,
                )
    cores = min(2, os.cpu_count() or 1)
    print(f"\nmedian of {args.runs} runs; share of a {args.step_s:.0f} s step")
    for mode, rs in res.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        reason = withheld([meters[mode].load.summary()], "share of a step", unit="modes")
        share = "-" if reason else f"{100 * med['blocked'] / args.step_s:4.1f}%"
        line = (
            f"{mode:5s} blocked {med['blocked']:6.2f} s ({share} of a step), "
            f"whole after {med['write']:5.2f} s, write CPU {med['write_cpu']:5.2f} s"
        )
        if mode == "async" and not reason:
            bound = med["blocked"] + med["write_cpu"] / cores
            line += f"; with the write's CPU taken from the step: <= {100 * bound / args.step_s:.1f}%"
        print(line + f"; saves: {meters[mode].cpu_s:.1f} CPU s, {meters[mode].wall_s:.1f} wall s")
        if reason:
            print(f"  {reason}")


if __name__ == "__main__":
    main()
