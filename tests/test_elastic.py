"""Elastic resume: a checkpoint written at one world size resumes at another (one process -> 2 ranks,
2 -> 1, 2 -> 3, gloo under torchrun), full weights and LoRA adapters, and the run goes on as the
uninterrupted one does.

What is identical across world sizes: the prompts (one seeded stream for the whole run, which every
rank draws alike), the held-over groups, the step and generation-round counts, the schedule and
AdamW's step count. What differs: the order in which gradients are summed (over ranks, and over a
different split of the rows), so the weights after k steps differ from the uninterrupted run's by
rounding, measured here. A run also redraws its responses at another world size (each rollout engine
samples its share of the prompts with a seed of its own), so to measure the rounding alone the worker
below has every rank sample the whole batch with the one-process seed, as one process does.
"""

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import make_policy, small_config  # noqa: E402
from dapo import checkpoint, cli  # noqa: E402
from dapo.checkpoint import shards as checkpoint_shards
from dapo.checkpoint import weights as checkpoint_weights
from dapo.checkpoint.weights import is_lora  # noqa: E402
from dapo.runtime import parallel
from dapo.runtime.files import CheckpointError
from test_parallel import REPO, env_for_children  # noqa: E402

# dynamic sampling with a buffer: held-over groups (and their behaviour log-probs) cross the world-size change, on
# 12 problems, so prompts recur and the sampler's state is past its first pass
RUN = [
    "train.total_steps=3",
    "run.save_every=1",
    "run.keep_checkpoints=3",
    "algo.dynamic_sampling=true",
    "algo.filter_metric=reward",
    "algo.max_gen_rounds=3",
    "algo.oversample=3.0",
    "algo.held_over_max_groups=8",
    "data.task_train_size=12",
]
LORA = ["model.lora.rank=4", "train.lr=1e-2"]


def torchrun(nproc: int, *args, timeout=400):
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        __file__,
        *map(str, args),
    ]
    out = subprocess.run(
        cmd, cwd=REPO, env=env_for_children(COLUMNS="500"), capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def step_dir(run_root: Path, step: int) -> Path:
    return run_root / "t" / "checkpoints" / f"step_{step:06d}"


def start_from(source: Path, run_root: Path) -> None:
    """A run directory whose only checkpoint is ``source``: the run resumes from it."""
    shutil.copytree(source, run_root / "t" / "checkpoints" / source.name)


def weights(step: Path, tmp: Path) -> dict:
    """A checkpoint's weights (its adapters for LoRA) as `dapo export` writes them, from either format."""
    from safetensors.torch import load_file

    run = step.parent.parent.parent.name
    lora = is_lora(step)
    assert cli.main(["export", str(step), str(tmp / f"{run}-{step.name}"), *(["--adapter"] if lora else [])]) == 0
    return load_file(str(tmp / f"{run}-{step.name}" / ("adapter_model.safetensors" if lora else "model.safetensors")))


def adam_steps(step: Path) -> list[float]:
    """AdamW's step count of every trained parameter, from either format."""
    if checkpoint_weights.is_sharded(step):
        state = checkpoint_shards.read_shards(step / "shards")["optim"]["state"]
    else:
        state = checkpoint.load_trainer_state(step)["policy"]["optimizer"]["state"]
    return sorted(float(s["step"]) for s in state.values())


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Uninterrupted one-process runs (full weights, LoRA) and the resumed ones:
    ref step 1 -> 2 ranks (up), up's step 2 -> 1 process (down) and -> 3 ranks (wide)."""
    from dapo.training import train

    root = tmp_path_factory.mktemp("elastic")
    train(small_config(root / "ref", tiny_model_dir, *RUN))
    train(small_config(root / "lora_ref", tiny_model_dir, *RUN, *LORA))
    start_from(step_dir(root / "ref", 1), root / "up")
    start_from(step_dir(root / "lora_ref", 1), root / "lora_up")
    bf16 = bf16_one_process_checkpoint(tiny_model_dir, root / "bf16")
    up = torchrun(2, "train", tiny_model_dir, root, bf16)
    start_from(step_dir(root / "up", 2), root / "down")
    start_from(step_dir(root / "lora_up", 2), root / "lora_down")
    down = [
        train(small_config(root / "down", tiny_model_dir, *RUN)),
        train(small_config(root / "lora_down", tiny_model_dir, *RUN, *LORA)),
    ]
    start_from(step_dir(root / "up", 2), root / "wide")
    wide = torchrun(3, "train_wide", tiny_model_dir, root)
    return root, {"up": up.stdout, "wide": wide.stdout, "down": down}


MATRIX = [
    ("up", "ref", 1, 2),
    ("down", "ref", 2, 1),
    ("wide", "ref", 2, 3),
    ("lora_up", "lora_ref", 1, 2),
    ("lora_down", "lora_ref", 2, 1),
]


@pytest.mark.slow
def test_a_checkpoint_resumes_at_another_world_size_as_the_run_would_have_gone_on(runs, tmp_path):
    root, outs = runs
    lines = []
    for run, ref, before, after in MATRIX:
        resumed_at = 1 if run.endswith("up") else 2
        final, want = step_dir(root / run, 3), step_dir(root / ref, 3)
        assert checkpoint_weights.is_sharded(final) == (after > 1) and is_lora(final) == run.startswith("lora")
        # what is identical: the prompts drawn, the held-over groups, the counters, AdamW's step count
        a, b = checkpoint.load_trainer_state(want), checkpoint.load_trainer_state(final)
        ca, cb = a["collection"], b["collection"]
        assert cb["prompt_order"] == ca["prompt_order"] and cb["gen_rounds"] == ca["gen_rounds"]
        assert b["step"] == a["step"] == 3
        assert ca["prompt_order"]["epoch"] > 0  # 12 problems: the prompts recurred, past the order's first pass
        assert len(cb["held_over"]) == len(ca["held_over"])
        assert b["policy"]["scheduler"] == a["policy"]["scheduler"]
        assert b["world_size"] == after
        assert adam_steps(final) == adam_steps(want) and set(adam_steps(want)) == {6.0}  # 2 updates a step
        # what differs by the order of summation only: the weights after the steps since the resume
        w, w_ref = weights(final, tmp_path), weights(want, tmp_path)
        start = weights(step_dir(root / ref, resumed_at), tmp_path)
        assert w.keys() == w_ref.keys()
        diff = max((w[k].float() - w_ref[k].float()).abs().max().item() for k in w)
        moved = max((w_ref[k].float() - start[k].float()).abs().max().item() for k in w)
        lines.append(
            f"{run:>9}: {before} -> {after} ranks at step {resumed_at}, {3 - resumed_at} steps on: "
            f"max |w - w_uninterrupted| {diff:.2e} (the steps moved weights by up to {moved:.2e})"
        )
        assert diff < 1e-3 * moved, lines[-1]
    print("\n" + "\n".join(lines))
    assert "written by 1 rank, resharded onto 2" in outs["up"]
    assert "written by 2 ranks, resharded onto 3" in outs["wide"]


@pytest.mark.slow
def test_a_full_disk_stops_every_rank_of_a_sharded_save_in_one_line(runs):
    """3 ranks save step 1, then the disk fills: under rank 1's shard of step 2, then under rank 0 just
    before step 3's rename. Every rank stops with the same line, no partial directory is left, step 1
    is whole and loads."""
    root, _ = runs
    ckpts = root / "full_disk" / "checkpoints"
    per_rank = [(root / f"full_disk.{r}.txt").read_text().splitlines() for r in range(3)]
    print("\n" + "\n".join(per_rank[0]))
    assert per_rank[0] == per_rank[1] == per_rank[2] and len(per_rank[0]) == 2
    for line, step in zip(per_rank[0], (2, 3)):
        assert line.startswith(f"writing checkpoint {ckpts / f'step_{step:06d}'} failed (")
        assert f"({'rank 1: ' if step == 2 else ''}OSError: [Errno 28] No space left on device)" in line
        assert line.endswith(
            f"its partial files were removed and starting the run again resumes from "
            f"{ckpts / 'step_000001'}, which is whole: free space on that disk (or fix the cause) first"
        )
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001"]
    assert len(checkpoint_shards.read_shards(ckpts / "step_000001" / "shards")["model"]) > 0


def bf16_one_process_checkpoint(tiny_model_dir: Path, run_dir: Path) -> Path:
    """A one-process bfloat16 checkpoint after one AdamW step: the model directory holds the weights rounded
    to bfloat16, the trainer state their float32 masters."""
    cfg = small_config(run_dir, tiny_model_dir, "model.dtype=bfloat16")
    torch.manual_seed(0)
    policy = make_policy(cfg)
    for m in policy.master:
        m.grad = torch.randn_like(m)
    policy.optimizer.step()
    policy._sync_from_master()
    return checkpoint.save_checkpoint(
        run_dir,
        1,
        model=policy.model,
        tokenizer=policy.tokenizer,
        trainer_state={"policy": policy.trainer_state()},
        config_yaml="",
        keep=1,
    )


@pytest.mark.slow
def test_bfloat16_masters_cross_world_sizes_exactly(runs, tiny_model_dir, tmp_path):
    """One process computing in bfloat16 keeps float32 masters beside its bfloat16 model; FSDP's
    parameters are float32 masters. The masters go across unrounded, both ways."""
    root, _ = runs
    step = root / "bf16" / "checkpoints" / "step_000001"
    saved = checkpoint.load_trainer_state(step)["policy"]
    names = [n for n, _ in make_policy(small_config(tmp_path, tiny_model_dir)).model.named_parameters()]
    # 1 process -> 2 ranks (the worker saved rank 0's gathered weights and moments)
    got = torch.load(root / "bf16_on_2_ranks.pt", weights_only=True)
    for i, name in enumerate(names):
        assert torch.equal(got["weights"][name], saved["master_weights"][i]), name
        assert torch.equal(got["exp_avg"][name], saved["optimizer"]["state"][i]["exp_avg"]), name
    assert not all(torch.equal(m, m.bfloat16().float()) for m in saved["master_weights"])  # not bf16 values
    # 2 ranks (float32) -> 1 process in bfloat16: the masters as saved, the model rounded from them
    shards = checkpoint_shards.read_shards(step_dir(root / "up", 2) / "shards")
    policy = make_policy(small_config(tmp_path, tiny_model_dir, "model.dtype=bfloat16"))
    checkpoint.load_policy(
        policy, step_dir(root / "up", 2), checkpoint.load_trainer_state(step_dir(root / "up", 2))["policy"]
    )
    for (name, p), master in zip(policy.model.named_parameters(), policy.master):
        assert torch.equal(master, shards["model"][name]) and torch.equal(p, master.bfloat16()), name
    for i, name in enumerate(names):
        assert torch.equal(
            policy.optimizer.state_dict()["state"][i]["exp_avg_sq"], shards["optim"]["state"][name]["exp_avg_sq"]
        )
    assert policy.optimizer.param_groups[0]["fused"]  # this run's own AdamW, the saved hyper-parameters


# ---- the torchrun worker ---------------------------------------------------------------------------
def sample_whole_batches() -> None:
    """Every rank samples all of a round's prompts with the round's seed, as one process does (the test's
    way to hold the responses equal across world sizes; a run samples a share per engine)."""
    from dapo.rollout import ShardedRollout

    ShardedRollout.generate = lambda self, prompt_ids, params: self.engine.generate(prompt_ids, params)


def bf16_check(model_dir: str, root: Path, step: Path) -> None:
    """A one-process bfloat16 checkpoint loaded on these ranks: rank 0 saves the gathered weights and moments."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    d = parallel.init("cpu")
    policy = make_policy(small_config(root / "bf16_check", model_dir, "model.dtype=bfloat16"), "cpu", d)
    checkpoint.load_policy(policy, step, checkpoint.load_trainer_state(step)["policy"])
    weights = dict(parallel.full_tensors(policy.model.named_parameters()))
    _, optim = get_state_dict(policy.model, policy.optimizer, options=StateDictOptions(full_state_dict=True))
    if d.is_main:
        torch.save(
            {"weights": weights, "exp_avg": {k: s["exp_avg"] for k, s in optim["state"].items()}},
            root / "bf16_on_2_ranks.pt",
        )


def full_disk_check(model_dir: str, root: Path) -> None:
    """Sharded checkpoints on a full disk: rank 1's shard fails to write (step 2), then rank 0's last
    step before the rename (step 3). Every rank writes the line it stopped with to full_disk.<rank>.txt."""
    import errno
    import os

    from torch.distributed.checkpoint import filesystem

    from dapo.checkpoint import save as checkpoint_save

    d = parallel.init("cpu")
    run_dir = root / "full_disk"
    policy = make_policy(small_config(run_dir, model_dir), "cpu", d)

    def save(step):
        checkpoint.save_checkpoint(
            run_dir,
            step,
            model=policy.model,
            tokenizer=policy.tokenizer,
            keep=2,
            dist=d,
            trainer_state={"policy": policy.trainer_state()},
            config_yaml="",
            shards=policy.sharded_state(),
        )

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    save(1)
    lines = []
    for rank, (where, name) in ((1, (filesystem.FileSystem, "create_stream")), (0, (checkpoint_save, "_complete"))):
        real = getattr(where, name)
        if d.rank == rank:
            setattr(where, name, full)
        try:
            save(2 if rank else 3)
        except CheckpointError as err:
            lines.append(str(err))
        setattr(where, name, real)
    (root / f"full_disk.{d.rank}.txt").write_text("\n".join(lines))


def worker(mode: str, model_dir: str, root: str, *rest) -> None:
    from dapo.training import train

    root = Path(root)
    sample_whole_batches()
    leave = parallel.shutdown
    parallel.shutdown = lambda d, clean=True: None  # one process group for all the runs here (gloo re-joins poorly)
    if mode == "train":
        bf16_check(model_dir, root, Path(rest[0]))
        train(small_config(root / "up", model_dir, *RUN))
        train(small_config(root / "lora_up", model_dir, *RUN, *LORA))
    else:
        train(small_config(root / "wide", model_dir, *RUN))
        full_disk_check(model_dir, root)
    leave(parallel.init("cpu"))


if __name__ == "__main__":
    worker(*sys.argv[1:])
