"""Preempted, nothing lost: SIGTERM (or SIGUSR1, SIGINT) at a chosen moment of step 2 (in generation, in
grading, in the old log-probs, in the update, during a checkpoint write; asynchronous checkpoints on and off)
leaves a checkpoint of the last completed step, and the resumed run ends with the weights and AdamW state of an
uninterrupted run, bit for bit. The moment is made deterministic by having the run signal itself from a hook at
that phase; benchmarks/preempt_sweep.py sends SIGTERM at random moments instead. With 2 gloo ranks: a signal to
one rank stops both, and they write one checkpoint together; a signal to the torchrun launcher reaches both ranks,
and the resumed run is bit-identical too. (A signal to the driver of ``dapo launch-ray``, forwarded to the ranks on
two Ray nodes: tests/test_ray.py.)"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SMALL_OVERRIDES, small_config  # noqa: E402
from dapo import checkpoint  # noqa: E402
from dapo.checkpoint import files as checkpoint_files
from dapo.checkpoint import preemption
from dapo.checkpoint import shards as checkpoint_shards
from dapo.runtime import parallel

STEPS = ["train.total_steps=3", "run.save_every=null"]
LINE = re.compile(
    r"stopped by (SIG\w+) at step (\d+) \((.*?)\): checkpoint (\S+) (written|already there), ([\d.]+) s after the "
    r"signal; start the run again to resume \(exit code 75\)"
)


def final_state(run_dir: Path) -> dict:
    """The last checkpoint's weights and AdamW state."""
    from safetensors.torch import load_file

    step = checkpoint.latest_checkpoint(run_dir)
    state = checkpoint.load_trainer_state(step)["policy"]["optimizer"]["state"]
    moments = {f"{k}.{m}": v[m] for k, v in state.items() for m in ("exp_avg", "exp_avg_sq")}
    return {
        **load_file(str(step / "model" / "model.safetensors")),
        **moments,
        "step": torch.as_tensor(state[0]["step"]).clone(),
    }


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    from dapo.training import train

    root = tmp_path_factory.mktemp("uninterrupted")
    train(small_config(root, tiny_model_dir, *STEPS))
    return final_state(root / "t")


def signal_at(monkeypatch, where: str, call: int, sig=signal.SIGTERM, times: int = 1) -> None:
    """Have the run send itself ``sig`` (``times`` times in a row) at the ``call``-th entry into ``where`` (the hook
    then goes on as usual)."""
    from dapo.checkpoint import save as checkpoint_save
    from dapo.collect import scoring
    from dapo.model.policy import Policy
    from dapo.rollout import hf

    owner, name = {
        "generate": (hf.HFRolloutEngine, "generate"),
        "reward": (scoring.Scorer, "__call__"),
        "old_logprob": (Policy, "compute_logprobs"),
        "update": (Policy, "update"),
        "checkpoint": (checkpoint_save, "_complete"),  # inside the write, before the rename (a background one too)
    }[where]
    real, calls = getattr(owner, name), {"n": 0}

    def hooked(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            for _ in range(times):
                os.kill(os.getpid(), sig)  # the handler runs before os.kill returns to Python code
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, hooked)


SLOW = pytest.mark.slow  # the same paths as the unmarked cases beside them (an abandoned phase, a finished one)
CASES = [  # where, async checkpoints, extra settings, the step the checkpoint is of, what the line says
    ("generate", False, [], 1, "in generate, abandoned"),
    pytest.param("reward", True, [], 1, "in reward, abandoned", marks=SLOW),
    pytest.param("old_logprob", False, [], 1, "in old_logprob, abandoned", marks=SLOW),
    ("update", True, [], 2, "in update, finished"),
    pytest.param("checkpoint", False, ["run.save_every=2"], 2, "in checkpoint, finished", marks=SLOW),
    ("checkpoint", True, ["run.save_every=2"], 2, None),  # the write is in a thread: the loop is wherever it is
]


@pytest.mark.parametrize("where,asynchronous,extra,saved,said", CASES)
def test_a_signal_checkpoints_the_last_completed_step_and_the_resume_is_bit_identical(
    uninterrupted, tiny_model_dir, tmp_path, monkeypatch, where, asynchronous, extra, saved, said
):
    from dapo.training import train

    cfg = small_config(tmp_path, tiny_model_dir, *STEPS, f"run.async_checkpoint={str(asynchronous).lower()}", *extra)
    signal_at(monkeypatch, where, 2 if where != "checkpoint" else 1)  # step 2 (the first save is step 2's)
    t0 = time.perf_counter()
    with pytest.raises(preemption.Stopped) as stopped:
        train(cfg)
    seconds = time.perf_counter() - t0
    line = str(stopped.value)
    print(f"\n{where} (async {asynchronous}): {line}")
    m = LINE.fullmatch(line)
    assert m and m.group(1) == "SIGTERM" and int(m.group(2)) == saved, line
    assert said is None or m.group(3) == said
    assert [checkpoint.step_of(p) for p in checkpoint_files.list_checkpoints(cfg.run_dir)] == [saved]
    assert m.group(4) == str(checkpoint.latest_checkpoint(cfg.run_dir))
    assert checkpoint_files.verify(checkpoint.latest_checkpoint(cfg.run_dir)) is None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or not callable(signal.getsignal(signal.SIGTERM))
    monkeypatch.undo()
    train(cfg)  # started again: resumes and finishes
    resumed = final_state(cfg.run_dir)
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed), "the resumed run's weights differ"
    print(f"  stopped {seconds:.1f} s into the run; resumed to bit-identical weights and AdamW state")


def wait_for_rows(proc: subprocess.Popen, run_dir: Path, rows: int = 1, timeout: float = 240) -> None:
    """Until the run's ``metrics.jsonl`` has ``rows`` rows (the run still going)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().count("\n") >= rows):
        assert time.monotonic() < deadline and proc.poll() is None, "the run ended before its first row"
        time.sleep(0.1)


def test_a_repeat_of_the_signal_within_seconds_is_the_same_stop(tiny_model_dir, tmp_path, monkeypatch):
    """Slurm signals every process of a job step and torchrun forwards the SIGTERM it got too: a rank gets it
    twice within milliseconds. That is one stop with its checkpoint, not a second signal's exit at once."""
    from dapo.training import train

    cfg = small_config(tmp_path, tiny_model_dir, *STEPS)
    signal_at(monkeypatch, "update", 2, times=2)
    with pytest.raises(preemption.Stopped) as stopped:
        train(cfg)
    m = LINE.fullmatch(str(stopped.value))
    assert m and m.group(2) == "2" and m.group(3) == "in update, finished", str(stopped.value)
    assert [checkpoint.step_of(p) for p in checkpoint_files.list_checkpoints(cfg.run_dir)] == [2]


@pytest.mark.parametrize(
    "times,entry",
    [(2, ["dapo.cli", "train"]), (1, ["dapo.training"])],
    ids=["twice", "module"],
)
def test_dapo_train_stops_on_sigterm_in_one_line_with_exit_code_75(tiny_model_dir, tmp_path, times, entry):
    """From outside, as a scheduler would: SIGTERM once step 1's row is written, wherever step 2 then is. Once,
    through ``python -m dapo.training``, the entry `dapo ablate` and the benchmarks start runs with. Twice, through
    `dapo train`: a second SIGTERM 0.1 s after the first, as when Slurm signals every process of the job and a
    launcher forwards its own: the same stop as the first alone, not a second one (which would exit at once
    without the checkpoint)."""
    from test_parallel import REPO, env_for_children

    cmd = [sys.executable, "-m", *entry, "configs/demo.yaml", *SMALL_OVERRIDES]
    cmd += [f"model.path={tiny_model_dir}", f"run.dir={tmp_path}", "train.total_steps=50", "run.save_every=null"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env_for_children(COLUMNS="500"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_rows(proc, tmp_path / "t")
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    if times == 2:
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    seconds = time.perf_counter() - t0
    lines = [x for x in err.splitlines() if x.startswith("stopped by")]
    print(f"\nexit {proc.returncode} {seconds:.1f} s after SIGTERM: {lines}")
    assert proc.returncode == preemption.EXIT_CODE, err[-3000:]
    assert len(lines) == 1 and LINE.fullmatch(lines[0]), err[-3000:]
    step = int(LINE.fullmatch(lines[0]).group(2))
    assert step >= 1 and [checkpoint.step_of(p) for p in checkpoint_files.list_checkpoints(tmp_path / "t")] == [step]
    assert "Traceback" not in err


# ---- 2 gloo ranks ------------------------------------------------------------------------------------
def ranks_worker(model_dir: str, root: str) -> None:
    """Under torchrun (2 ranks, one process group for every run here): the uninterrupted run; the same run with
    SIGUSR1 to rank 1 alone in its second generation; that run started again. Each rank writes what it saw."""
    from dapo.rollout import hf
    from dapo.training import train

    root, rank = Path(root), int(os.environ["RANK"])
    leave = parallel.shutdown
    parallel.shutdown = lambda d, clean=True: None  # one process group for all the runs here
    train(small_config(root / "ref", model_dir, *STEPS))
    real, calls = hf.HFRolloutEngine.generate, {"n": 0}

    def generate(self, *args, **kwargs):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real(self, *args, **kwargs)

    hf.HFRolloutEngine.generate = generate
    try:
        train(small_config(root / "stopped", model_dir, *STEPS))
        line = "not stopped"
    except preemption.Stopped as stop:
        line = str(stop)
    hf.HFRolloutEngine.generate = real
    (root / f"line.{rank}.txt").write_text(line)
    train(small_config(root / "stopped", model_dir, *STEPS))
    leave(parallel.init("cpu"))


def test_a_signal_to_one_of_two_ranks_stops_both_at_one_checkpoint(tiny_model_dir, tmp_path):

    _torchrun(tiny_model_dir, tmp_path)
    lines = [(tmp_path / f"line.{r}.txt").read_text() for r in (0, 1)]
    print("\n" + "\n".join(lines))
    for line in lines:
        m = LINE.fullmatch(line)
        assert m and m.group(1) == "SIGUSR1" and m.group(2) == "1", line
    assert "in generate" in lines[1]  # where it landed, on the rank it was sent to
    # the resumed run reached the uninterrupted run's weights (and AdamW state), through the shards

    a = checkpoint_shards.read_shards(checkpoint.latest_checkpoint(tmp_path / "ref" / "t") / "shards")
    b = checkpoint_shards.read_shards(checkpoint.latest_checkpoint(tmp_path / "stopped" / "t") / "shards")
    assert checkpoint.step_of(checkpoint.latest_checkpoint(tmp_path / "stopped" / "t")) == 3
    flat_a, flat_b = _flat(a), _flat(b)
    assert flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a)


def _flat(tree, prefix="") -> dict:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}.{key}").items()}
    return {}


def _torchrun(model_dir, root, mode="ranks"):
    from test_parallel import REPO, env_for_children

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, mode]
    out = subprocess.run(
        [*cmd, str(model_dir), str(root)],
        cwd=REPO,
        env=env_for_children(COLUMNS="500"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


# ---- a signal to the launcher -------------------------------------------------------------------------
# with a sharded reference model (the KL term), gradient checkpointing and overlong filtering, so the bit-identical
# resume below covers the state those add to a sharded run's step
LAUNCHED = ["train.total_steps=4", "run.save_every=null", "algo.kl_coef=0.01", "model.gradient_checkpointing=true",
            "algo.overlong_filtering=true"]  # fmt: skip


def resume_worker(model_dir: str, root: str) -> None:
    """Under torchrun (2 ranks): the uninterrupted run, then the stopped run started again (it resumes)."""
    from dapo.training import train

    root = Path(root)
    leave = parallel.shutdown
    parallel.shutdown = lambda d, clean=True: None  # one process group for both runs
    train(small_config(root / "ref", model_dir, *LAUNCHED))
    train(small_config(root / "stopped", model_dir, *LAUNCHED))
    leave(parallel.init("cpu"))


def same_shards(a: Path, b: Path) -> bool:
    """The last checkpoints of two sharded runs hold the same weights and AdamW state, bit for bit."""

    flat_a, flat_b = (_flat(checkpoint_shards.read_shards(checkpoint.latest_checkpoint(r) / "shards")) for r in (a, b))
    return flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a)


def test_sigterm_to_torchrun_stops_both_ranks_at_one_checkpoint_and_the_resume_is_bit_identical(
    tiny_model_dir, tmp_path
):
    """SIGTERM to the torchrun launcher, not a rank (Kubernetes signals the container's first process): torchrun
    sends it on to each rank's process group and waits for them (``--shutdown-timeout``, 30 s) before it kills
    them; the ranks write one checkpoint of their last completed step within that. torchrun itself then exits
    with 1 (its SignalException), not the ranks' 75. Started again from that step's shards, the run ends as an
    uninterrupted one, its sharded reference model (KL), gradient checkpointing and overlong filtering on."""
    from test_parallel import REPO, env_for_children

    run = tmp_path / "stopped" / "t"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dapo.cli"]
    cmd += ["train", "configs/demo.yaml", *SMALL_OVERRIDES, f"model.path={tiny_model_dir}"]
    cmd += [f"run.dir={tmp_path / 'stopped'}", *LAUNCHED]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env_for_children(COLUMNS="500"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_for_rows(proc, run)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    seconds = time.perf_counter() - t0
    lines = [x for x in err.splitlines() if x.startswith("stopped by")]
    forwarded = re.findall(r"Sending process (\d+) closing signal SIGTERM", err)
    print(f"\ntorchrun exit {proc.returncode} {seconds:.1f} s after SIGTERM; forwarded to {forwarded}: {lines}")
    # torchrun's own exit, documented: 1, its SignalException re-raised; at times its interpreter then aborts on the
    # way out ("terminate called without an active exception", a thread of its own still running): -6
    assert proc.returncode in (1, -signal.SIGABRT) and "SignalException" in err, err[-3000:]
    assert len(set(forwarded)) == 2, err[-3000:]  # to both ranks
    assert len(lines) == 1 and LINE.fullmatch(lines[0]), err[-3000:]  # rank 0's line only
    step = int(LINE.fullmatch(lines[0]).group(2))
    assert 1 <= step < 4 and [checkpoint.step_of(p) for p in checkpoint_files.list_checkpoints(run)] == [step]
    assert "exit code 75" in lines[0] and "Unable to shutdown process" not in err  # no rank was killed
    resumed = _torchrun(tiny_model_dir, tmp_path, "resume")
    # a run that started over would end on the same weights: the resume must say it resumed from the stop's step
    assert f"resumed from {run / 'checkpoints' / f'step_{step:06d}'}" in resumed.stdout, resumed.stdout[-3000:]
    assert checkpoint.step_of(checkpoint.latest_checkpoint(run)) == 4
    metrics = [line for line in (tmp_path / "ref" / "t" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(metrics) == 4 and all('"actor/kl_loss"' in m for m in metrics)  # rank 0 alone writes the run's files
    assert same_shards(tmp_path / "ref" / "t", run), "the resumed run's weights differ"


if __name__ == "__main__":
    {"ranks": ranks_worker, "resume": resume_worker}[sys.argv[1]](*sys.argv[2:])


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (the SigCgt mask of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught >> (sig - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_dapo_train_stopped_while_it_starts_exits_75_in_one_line(tiny_model_dir, tmp_path, sig):
    """A scheduler's signal in a run's first seconds (here: as soon as the process handles it, while it imports torch
    and transformers) ends it as a stop mid-training does: exit code 75, one line, nothing left behind."""
    from test_parallel import REPO, env_for_children

    cmd = [sys.executable, "-m", "dapo.cli", "train", "configs/demo.yaml", *SMALL_OVERRIDES]
    cmd += [f"model.path={tiny_model_dir}", f"run.dir={tmp_path}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env_for_children(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not _catches(proc.pid, sig) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == preemption.EXIT_CODE, err[-3000:]
    name = signal.Signals(sig).name
    line = f"stopped by {name} before training began: nothing to save; start the run again (exit code 75)"
    assert err.strip() == line
    assert not (tmp_path / "t").exists()  # a start that failed leaves no run directory
