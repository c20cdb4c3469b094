"""What a long run meets: a hung rank (the step watchdog), a non-finite loss, a rollout engine that fails
mid-generation (a Ray worker that dies mid-step: tests/test_ray.py). Each says so in one line, and nothing earlier
is lost.

The 2-rank parts run this file as a torchrun worker (``python -m torch.distributed.run ... this file``).
"""

import contextlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import small_config  # noqa: E402
from dapo import checkpoint  # noqa: E402
from dapo.checkpoint import files as checkpoint_files  # noqa: E402
from dapo.config import ConfigError, load_config  # noqa: E402
from dapo.reporting.run_log import read_metrics
from dapo.runtime import watchdog

# limits small enough for a test: a phase that ran once is late past max(3 s, 4 x its slowest run); a
# first run (model loading, the first generation) has a minute; the process ends at twice the limit
QUICK_WATCHDOG = [
    "run.watchdog_floor_s=3",
    "run.watchdog_factor=4",
    "run.watchdog_first_s=60",
    "run.watchdog_exit_factor=2",
]
LATE = re.compile(
    r"^watchdog: rank (\d) is late in (\S+)(, waiting for the other ranks in [^:]+)?: ([\d.]+) s, its limit "
    r"([\d.]+) s \((.*)\); every thread's stack is in (\S+); the process ends at ([\d.]+) s "
    r"\(run.watchdog_exit_factor=2\)$"
)


# ---- the watchdog alone --------------------------------------------------------------------------
def wait_for(cond, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "the watchdog never spoke"
        time.sleep(0.02)


def stuck_in_generation(release: threading.Event):  # a name to find in the dumped stacks
    release.wait()


def test_a_late_phase_gets_one_line_the_stacks_and_then_the_exit(tmp_path):
    phases = watchdog.PHASES
    phases.slowest.clear()
    exits, lines = [], []

    class Console:
        def write(self, text):
            lines.append(text)

        def flush(self):
            pass

    log = tmp_path / "train.log"
    dog = watchdog.Watchdog(
        rank=3,
        log_path=log,
        factor=4.0,
        floor_s=0.2,
        first_s=30.0,
        exit_factor=2.0,
        console=Console(),
        exit=exits.append,
    ).start()
    release = threading.Event()
    try:
        with watchdog.phase("generate"):
            pass  # a first run (fast): the history
        assert "generate" in phases.slowest and not dog.lines
        with watchdog.phase("generate"):  # the second run hangs
            wait_for(lambda: dog.lines)
            late = dog.lines[0]
            assert not exits  # a late phase is said before the process ends
            helper = threading.Thread(target=stuck_in_generation, args=(release,), name="helper")
            helper.start()
            wait_for(lambda: exits)
    finally:
        release.set()
        dog.stop()
    found = LATE.match(late)
    assert found, late
    rank, path, _, elapsed, limit, why, where, exit_at = found.groups()
    # the floor: 4 x a run of microseconds is far below 0.2 s
    assert (rank, path, float(limit), why, where) == (
        "3",
        "generate",
        0.2,
        "the floor run.watchdog_floor_s=0.2",
        str(log),
    )
    assert 0.2 <= float(elapsed) < 0.2 + 0.5 and float(exit_at) == 0.4  # seen within a tick (0.05 s here)
    assert exits == [124] and len(dog.lines) == 2
    assert (
        dog.lines[1].startswith("watchdog: rank 3 stopped after ")
        and " in generate, past 2 x its limit; exit code 124" in dog.lines[1]
    )
    text = log.read_text()
    # twice every thread's stack: when late (the helper not started yet) and at the exit (the helper stuck)
    assert text.count("dapo.runtime.watchdog: rank 3 late in generate after") == 1
    assert text.count("dapo.runtime.watchdog: rank 3 ends in generate after") == 1
    assert "in stuck_in_generation" in text.split("ends in generate")[1]
    assert "test_a_late_phase_gets_one_line_the_stacks_and_then_the_exit" in text  # the main thread, inside the phase
    assert "".join(lines).count("\n") == 2  # the two lines, nothing else on the console


HOLDS_THE_LOCK = """
import sys, time
from pathlib import Path
from dapo.runtime import watchdog
with watchdog.phase("update"):
    pass
dog = watchdog.Watchdog(rank=0, log_path=Path(sys.argv[1]), factor=1.0, floor_s=1.0, first_s=60.0, exit_factor=2.0,
                        backstop=True).start()
with watchdog.phase("update"):
    time.sleep(0.5)  # the watchdog thread runs a few ticks, arming faulthandler's timer
    sum(range(10**13))  # C code that never lets go of the interpreter lock: the watchdog thread runs no more
"""


def test_a_rank_that_holds_the_interpreter_lock_is_still_ended_with_its_stack(tmp_path):
    """The watchdog thread needs the interpreter lock; faulthandler's timer, re-armed at every tick a little
    past the exit due (here 2 s + 10 ticks + 2 s), does not, and ends the process with the stacks in the log."""
    import subprocess

    from test_parallel import REPO, env_for_children

    log = tmp_path / "train.log"
    out = subprocess.run(
        [sys.executable, "-c", HOLDS_THE_LOCK, str(log)],
        cwd=REPO,
        env=env_for_children(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr[-2000:]  # faulthandler's exit
    text = log.read_text()
    assert "Timeout (0:00:0" in text and 'File "<string>", line 11 in <module>' in text, text
    assert "watchdog:" not in out.stderr  # the thread that would have said it never ran again


def test_limits_follow_the_runs_own_history():
    phases = watchdog.Phases()
    dog = watchdog.Watchdog(
        rank=0, log_path=Path("x"), factor=5.0, floor_s=10.0, first_s=100.0, exit_factor=3.0, phases=phases
    )
    assert dog.limit("update") == (100.0, "its first run, run.watchdog_first_s=100")
    phases.slowest["update"] = 1.0
    assert dog.limit("update") == (10.0, "the floor run.watchdog_floor_s=10")
    phases.slowest["update"] = 4.0
    assert dog.limit("update") == (20.0, "5 x its slowest completed run, 4.0 s")


def test_phases_nest_and_a_failure_names_the_innermost():
    with pytest.raises(KeyError):
        with watchdog.phase("outer"):
            with watchdog.phase("inner"):
                raise KeyError("x")
    assert watchdog.failed_in() == "outer > inner"
    with watchdog.phase("outer"):
        with watchdog.waiting("barrier"):
            assert watchdog.PHASES.here().stack[-1].waiting == "barrier"
    assert "outer > inner" not in watchdog.PHASES.slowest  # a failed run is no history


def test_the_steps_blocks_reach_each_hook_and_the_watchdog_under_its_own_names():
    from dapo.runtime.step_phases import StepPhases, Timer

    watchdog.PHASES.slowest.clear()
    seen, timer = [], Timer()

    @contextlib.contextmanager
    def recorder(name):
        seen.append(("enter", name))
        try:
            yield
        finally:
            seen.append(("exit", name))

    phase = StepPhases(memory=recorder, timer=timer, watchdog=watchdog.step_phase)
    with phase("step"):
        with phase("collect"), watchdog.phase("generate"):
            pass
        with phase("checkpoint", watchdog="checkpoint_wait"):
            assert watchdog.PHASES.here().stack[-1].path == "checkpoint_wait"  # the step itself is not watched
        with phase("checkpoint"):
            pass
    assert set(watchdog.PHASES.slowest) == {"generate", "checkpoint_wait", "checkpoint"}
    assert set(timer.seconds) == {"step", "collect", "checkpoint"}  # the wait is timed as checkpoint
    assert seen[:2] == [("enter", "step"), ("enter", "collect")] and seen[-1] == ("exit", "step")
    with pytest.raises(KeyError), phase("update"):
        raise KeyError("x")
    assert watchdog.failed_in() == "update" and ("exit", "update") in seen and "update" in timer.seconds


@pytest.mark.parametrize(
    "override,message",
    [
        ("run.watchdog_factor=0.5", "run.watchdog_factor=0.5: must be >= 1"),
        (
            "run.watchdog_floor_s=0",
            "run.watchdog_floor_s=0.0: must be > 0 seconds; switch the watchdog off with run.watchdog=false",
        ),
        ("run.watchdog_exit_factor=1", "run.watchdog_exit_factor=1.0: must be > 1"),
        ("run.max_nonfinite_in_a_row=0", "run.max_nonfinite_in_a_row=0: must be > 0, or null"),
    ],
)
def test_watchdog_settings_are_checked(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/demo.yaml", [override])
    assert load_config("configs/demo.yaml", ["run.watchdog=false"]).run.watchdog is False


# ---- a normal run --------------------------------------------------------------------------------
def test_a_normal_run_says_nothing_and_the_watchdog_saw_every_phase(tiny_model_dir, tmp_path, capsys):
    from dapo.training import train

    # a floor of 20 s: the phases of this run take well under a second, but 4 other jobs share the 2 cores
    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        *QUICK_WATCHDOG,
        "run.watchdog_floor_s=20",
        "train.total_steps=3",
        "eval.before_train=true",
    )
    train(cfg)
    out = capsys.readouterr()
    assert "watchdog" not in out.out + out.err
    assert "dapo.runtime.watchdog" not in (tmp_path / "t" / "train.log").read_text()
    assert set(watchdog.PHASES.slowest) == {
        "start",
        "eval",
        "generate",
        "reward",
        "old_logprob",
        "checkpoint_wait",
        "checkpoint",
        "update",
        "weight_sync",
    }


# ---- 2 ranks, one of them hung ---------------------------------------------------------------------
def hang_worker(where: str, model_dir: str, run_dir: str) -> None:
    """Run under torchrun: 3 training steps, with step 2's generation asleep on rank 1 (``generate``) or
    its grading on rank 0 never returning (``reward``: a call the pool's per-response time limit does not reach)."""

    from dapo.rewards import pool
    from dapo.rollout import hf
    from dapo.training import train

    rank, calls = int(os.environ["RANK"]), {"n": 0}
    if where == "generate" and rank == 1:
        real = hf.HFRolloutEngine.generate

        def generate(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                time.sleep(3600)  # the rank that hangs
            return real(self, *args, **kwargs)

        hf.HFRolloutEngine.generate = generate
    if where == "reward" and rank == 0:
        real_execute = pool.RewardPool._run

        def execute(self, *args):
            calls["n"] += 1
            if calls["n"] == 2:
                threading.Event().wait()  # never returns
            return real_execute(self, *args)

        pool.RewardPool._run = execute
    train(small_config(run_dir, model_dir, *QUICK_WATCHDOG, "train.total_steps=3", "run.save_every=1"))


@pytest.mark.parametrize("where,hung_rank", [("generate", 1), ("reward", 0)])
def test_a_hung_rank_is_named_with_its_stacks_and_the_job_ends(tiny_model_dir, tmp_path, where, hung_rank):
    from test_parallel import torchrun

    t0 = time.perf_counter()
    out = torchrun(__file__, "hang", where, tiny_model_dir, tmp_path, check=False, timeout=240)
    seconds = time.perf_counter() - t0
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("watchdog: ")]
    print(
        f"\n{where} hung on rank {hung_rank}: torchrun ended after {seconds:.1f} s (exit {out.returncode}); "
        + "\n".join(lines)
    )
    assert out.returncode != 0
    late = {int(m.group(1)): m for m in map(LATE.match, lines) if m}
    assert hung_rank in late, (lines, out.stderr[-3000:])
    hung = late[hung_rank]
    assert hung.group(2) == where and hung.group(3) is None  # the hung rank is in the phase, not waiting
    assert (
        float(hung.group(5)) <= float(hung.group(4)) <= float(hung.group(5)) + 1.0
    )  # said within a tick or so (0.3 s)
    # the phase ran once at step 1: its limit is the floor or 4 x that run, never the first run's minute
    assert float(hung.group(5)) < 60 and "its first run" not in hung.group(6)
    if 1 - hung_rank in late:  # the other rank waits for it and says so
        assert late[1 - hung_rank].group(3) is not None
    log = tmp_path / "t" / ("train.log" if hung_rank == 0 else f"train.rank{hung_rank}.log")
    assert hung.group(7) == str(log)
    stacks = log.read_text().split(f"dapo.runtime.watchdog: rank {hung_rank} late in {where}")[1]
    assert "Current thread" in stacks or "Thread 0x" in stacks
    assert ("in generate" if where == "generate" else "in execute") in stacks  # the hook that hangs, by name
    assert any(
        line.startswith(f"watchdog: rank {hung_rank} stopped after")
        or line.startswith(f"watchdog: rank {1 - hung_rank} stopped after")
        for line in lines
    )
    # step 1 is whole: its checkpoint and its row
    assert [p.name for p in checkpoint_files.list_checkpoints(tmp_path / "t")] == ["step_000001"]
    rows = [json.loads(r) for r in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines() if r.strip()]
    assert [r["step"] for r in rows] == [1]


# ---- a non-finite loss -----------------------------------------------------------------------------
def poison_updates(monkeypatch, steps):
    """The loss is nan in every optimizer update of the given training steps (Policy.update calls, 1-based)."""
    from dapo import training
    from dapo.model.policy import Policy

    state = {"call": 0}
    real_update, real_make = Policy.update, training.make_loss_fn

    def update(self, *args, **kwargs):
        state["call"] += 1
        return real_update(self, *args, **kwargs)

    def make_loss_fn(*args, **kwargs):
        loss_fn = real_make(*args, **kwargs)

        def poisoned(*a, **k):
            loss, stats = loss_fn(*a, **k)
            return (loss * float("nan"), stats) if state["call"] in steps else (loss, stats)

        return poisoned

    monkeypatch.setattr(Policy, "update", update)
    monkeypatch.setattr(training, "make_loss_fn", make_loss_fn)


def rows_of(run_dir: Path) -> list[dict]:
    """The run's metrics rows; [] before the first."""
    return read_metrics(run_dir)  # a row still being written is left out: the ray test polls a running run


def test_a_nonfinite_loss_skips_the_update_and_leaves_weights_and_adamw_state(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    from safetensors.torch import load_file

    from dapo.training import train

    poison_updates(monkeypatch, steps={2})
    train(small_config(tmp_path, tiny_model_dir, "train.total_steps=3", "run.save_every=1", "run.keep_checkpoints=3"))
    out = " ".join(capsys.readouterr().out.split())  # the console wraps its lines at its width
    said = (
        "step 2: 2 of 2 optimizer updates skipped, their loss or gradient norm not finite (weights and AdamW state "
        "left as they were; actor/nonfinite_updates); 2 in a row, the run stops at 5"
    )
    assert out.count(said) == 1 and out.count("optimizer updates skipped") == 1, out
    rows = rows_of(tmp_path / "t")
    assert [(r["step"], r["actor/nonfinite_updates"], r["actor/skipped_updates"]) for r in rows] == [
        (1, 0, 0),
        (2, 2, 2),
        (3, 0, 2),
    ]
    ckpt = {p.name: p for p in checkpoint_files.list_checkpoints(tmp_path / "t")}
    weights = {k: load_file(p / "model" / "model.safetensors") for k, p in ckpt.items()}
    adamw = {k: checkpoint.load_trainer_state(p)["policy"]["optimizer"]["state"] for k, p in ckpt.items()}
    one, two, three = (f"step_00000{i}" for i in (1, 2, 3))
    assert all(torch.equal(weights[one][k], weights[two][k]) for k in weights[one])  # step 2 changed nothing
    assert any(not torch.equal(weights[two][k], weights[three][k]) for k in weights[two])  # step 3 trained
    for i, state in adamw[two].items():
        assert all(torch.equal(v, adamw[one][i][k]) for k, v in state.items()), i  # moments and AdamW's step count
    assert float(adamw[one][0]["step"]) == 2 and float(adamw[three][0]["step"]) == 4


def test_nonfinite_updates_in_a_row_stop_the_run_in_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from conftest import SMALL_OVERRIDES
    from dapo import cli

    poison_updates(monkeypatch, steps={2, 3, 4})
    code = cli.main(
        [
            "train",
            "configs/demo.yaml",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path}",
            *SMALL_OVERRIDES,
            "train.total_steps=4",
            "run.save_every=1",
            "run.max_nonfinite_in_a_row=3",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: step 3: 4 optimizer updates in a row had a non-finite loss or gradient norm "
        f"(run.max_nonfinite_in_a_row=3), so the run stops; check the learning rate (train.lr=0.001), "
        f"model.dtype=float32 (overflow in low precision), a reward function returning inf or nan, and "
        f"the weights of the last checkpoint ({tmp_path}/t/checkpoints/step_000003) for nan"
    ]
    assert [(r["step"], r["actor/nonfinite_updates"]) for r in rows_of(tmp_path / "t")] == [(1, 0), (2, 2), (3, 2)]
    assert [p.name for p in checkpoint_files.list_checkpoints(tmp_path / "t")] == [
        "step_000002",
        "step_000003",
    ]  # keep 2
    # the streak is saved with the checkpoint and read back: started again, the run goes on counting from 4
    from conftest import make_policy, small_config

    saved = checkpoint.load_trainer_state(tmp_path / "t" / "checkpoints" / "step_000003")["policy"]
    assert (saved["skipped_updates"], saved["nonfinite_in_a_row"]) == (4, 4)
    policy = make_policy(small_config(tmp_path / "again", tiny_model_dir))
    policy.load_trainer_state({**saved, "optimizer": policy.optimizer.state_dict()})
    assert (policy.skipped_updates, policy.nonfinite_in_a_row) == (4, 4)


# ---- the rollout engine fails mid-generation --------------------------------------------------------
def test_a_rollout_engine_failing_mid_generation_stops_in_one_line_and_the_run_resumes(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    from conftest import SMALL_OVERRIDES
    from dapo import cli
    from dapo.rollout import hf

    real, calls = hf.HFRolloutEngine.generate, {"n": 0}

    def generate(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # step 2's generation
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered\nCompile with "
                "`TORCH_USE_CUDA_DSA` to enable device-side assertions."
            )
        return real(self, *args, **kwargs)

    monkeypatch.setattr(hf.HFRolloutEngine, "generate", generate)
    args = [
        "train",
        "configs/demo.yaml",
        f"model.path={tiny_model_dir}",
        f"run.dir={tmp_path}",
        *SMALL_OVERRIDES,
        "train.total_steps=3",
        "run.save_every=1",
    ]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    run = tmp_path / "t"
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: step 2 failed in generate on rank 0: RuntimeError: CUDA error: an illegal memory access "
        f"was encountered Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions. (the "
        f"traceback is in {run}/train.log); start the run again to resume from "
        f"{run}/checkpoints/step_000001"
    ], err[-3000:]
    assert "Traceback" not in err
    log = (run / "train.log").read_text()
    assert "step 2 failed in generate; the traceback:" in log and "in generate\n    raise RuntimeError" in log
    assert [p.name for p in checkpoint_files.list_checkpoints(run)] == ["step_000001"] and [
        r["step"] for r in rows_of(run)
    ] == [1]
    monkeypatch.setattr(hf.HFRolloutEngine, "generate", real)  # the engine works again
    assert cli.main(args) == 0
    out = capsys.readouterr().out.replace("\n", "")  # the console wraps the path at its width
    assert f"resumed from {run}/checkpoints/step_000001 (step 1)" in out
    assert [r["step"] for r in rows_of(run)] == [1, 2, 3]


if __name__ == "__main__":  # the torchrun worker
    mode, *rest = sys.argv[1:]
    {"hang": hang_worker}[mode](*rest)
