"""What the checkpoint manifest (size and CRC-32 of every file) adds to a save, and what verifying costs,
on the real model's checkpoint.

    python benchmarks/manifest_cost.py [--runs 3]     # make smollm2 first

The state the real-model preset (configs/smollm2_135m.yaml) saves: SmolLM2-135M-Instruct in float32 with its
AdamW state after one optimizer step (1.6 GB), saved synchronously. Per run: the whole save (manifest
included), the manifest's part of it (reading every file back, from the page cache, and checksumming), and a
verify of the written checkpoint (what resume, `dapo export` and `dapo eval --run` do first); medians printed,
with the CPU seconds of the saves beside their wall seconds. The saves are measured for load (benchmarks/runs.py's
Meter, the process's torch threads its own jobs): where they saw more, the manifest's share of a save is not
printed, and a line says why.

What it is for: pricing the manifest that resuming checks (docs/reliability.md), so that a change to how checkpoints
are written or verified shows what it adds to every save.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from checkpoint_cost import MODEL, ROOT
from dapo import checkpoint
from dapo.checkpoint import files as checkpoint_files
from dapo.checkpoint import save as checkpoint_save
from dapo.config import load_config
from dapo.model.policy import Policy
from runs import Meter, withheld


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if not (MODEL / "config.json").exists():
        raise SystemExit(f"needs {MODEL}: run `make smollm2` once")
    cfg = load_config(ROOT / "configs/smollm2_135m.yaml", [f"model.path={MODEL}", "model.device=cpu"])
    policy = Policy(cfg.model, cfg.train, temperature=cfg.rollout.temperature, device=torch.device("cpu"))
    for p in policy.master or policy.model.parameters():  # one AdamW step: its moments exist, as in training
        p.grad = torch.randn_like(p) * 1e-3
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    spent: list[float] = []
    real = checkpoint_files.write_manifest

    def timed(path):
        t0 = time.perf_counter()
        out = real(path)
        spent.append(time.perf_counter() - t0)
        return out

    checkpoint_save.write_manifest = timed  # where save_checkpoint calls it from
    rows, meters = [], []
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:  # the disk training runs write to
        for step in range(1, args.runs + 1):
            t0 = time.perf_counter()
            meters.append(Meter(own_jobs=torch.get_num_threads()))  # the threads that built the state
            with meters[-1]:
                path = checkpoint.save_checkpoint(
                    Path(tmp),
                    step,
                    model=policy.model,
                    tokenizer=policy.tokenizer,
                    trainer_state={"policy": policy.trainer_state()},
                    config_yaml="run: {}\n",
                    keep=2,
                )
            save = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert checkpoint_files.verify(path) is None
            verify = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            rows.append((save, spent[-1], verify))
            print(
                f"run {step}: {size / 2**30:.2f} GiB, save {save:.2f} s of which the manifest {spent[-1]:.2f} s "
                f"({share(spent[-1] / save, [meters[-1]])}); verify {verify:.2f} s",
                flush=True,
            )
    save, manifest, verify = (statistics.median(r[i] for r in rows) for i in range(3))
    print(
        f"median of {args.runs}: save {save:.2f} s, manifest {manifest:.2f} s ({share(manifest / save, meters)} of the "
        f"save), verify {verify:.2f} s; load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs"
    )
    cpu, wall = sum(m.cpu_s for m in meters), sum(m.wall_s for m in meters)
    print(f"the {args.runs} saves: {cpu:.1f} CPU s, {wall:.1f} wall s")
    reason = withheld([m.load.summary() for m in meters], "share")
    if reason:
        print(reason)


def share(fraction: float, meters: list[Meter]) -> str:
    """``fraction`` as a percentage, or "-" where a save behind it saw more load than its own job."""
    return "-" if withheld([m.load.summary() for m in meters], "share") else f"{100 * fraction:.1f}%"


if __name__ == "__main__":
    main()
