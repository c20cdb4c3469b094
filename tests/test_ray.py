"""Ray: a 2-rank run placed on a private local cluster trains and checkpoints; a cluster without auth is refused;
on a cluster of two Ray nodes on this machine the ranks land on both, a run directory the nodes do not share is
refused at start, SIGTERM to the driver reaches the rank on each node and stops the job at one checkpoint (exit
code 75), a node lost mid-run ends the job in one line, and after either the same command resumes, bit for bit."""

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SMALL_OVERRIDES  # noqa: E402
from dapo import checkpoint  # noqa: E402
from dapo.checkpoint import files as checkpoint_files
from dapo.checkpoint import preemption
from dapo.checkpoint import weights as checkpoint_weights
from test_parallel import REPO, env_for_children  # noqa: E402
from test_reliability import QUICK_WATCHDOG, rows_of  # noqa: E402


# ---- Ray ------------------------------------------------------------------------------------------
def private_ray_env(home, ray_tmp: str) -> dict:
    """The environment of a job on a private local Ray cluster: its own HOME and temp dir, no usage reports, and
    no RAY_AUTH_* of the caller's (launch-ray starts the cluster with a token of its own)."""
    env = env_for_children(HOME=str(home), RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    return {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}


# ---- launch-ray's refusals before any cluster starts -------------------------------------------------
# Here, not in test_cli.py: Ray finds a cluster by the processes running on the machine, so a test that expects no
# cluster must not run beside the tests below that start one (each file runs whole in one pytest worker)
def launch_ray_refused(tmp_path, *args: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """`dapo launch-ray configs/demo.yaml ARGS` with a private Ray environment (``private_ray_env``, no DAPO_VERBOSE)
    and a temp dir of its own, removed after."""
    ray_tmp = tempfile.mkdtemp(prefix="dray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    environ = {k: v for k, v in private_ray_env(tmp_path, ray_tmp).items() if k != "DAPO_VERBOSE"}
    try:
        return subprocess.run(
            [sys.executable, "-m", "dapo.cli", "launch-ray", "configs/demo.yaml", *args],
            cwd=REPO, env={**environ, **env}, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_launch_ray_without_a_cluster_says_how_to_start_one(tmp_path):
    pytest.importorskip("ray")
    out = launch_ray_refused(tmp_path, "--cpu-workers-per-node", "1", timeout=120, RAY_ADDRESS="")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert "no Ray cluster is running" in out.stderr and "ray start --head" in out.stderr
    assert "--address local" in out.stderr


def test_launch_ray_local_refuses_a_placement_the_machine_cannot_hold(tmp_path):
    """Checked against the private cluster's resources before any worker starts (Ray would wait forever)."""
    pytest.importorskip("ray")
    placement = ["--address", "local", "--num-cpus", "2", "--cpu-workers-per-node", "2", "--cpus-per-worker", "4"]
    out = launch_ray_refused(tmp_path, f"run.dir={tmp_path / 'runs'}", *placement, timeout=200)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert "needs 2 worker(s) x 4 CPUs = 8 CPUs, the Ray cluster has 2" in out.stderr
    assert "--cpus-per-worker (to 1 or less)" in out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)  # about a minute on a loaded 2-core machine, nearly 3 on a slower one
def test_ray_two_cpu_workers_grade_with_the_configs_reward_function_train_a_step_and_checkpoint(
    tiny_model_dir, tmp_path
):
    """launch-ray on a private local cluster, 2 CPU workers on its one node: reward.function reaches the Ray ranks in
    their config (rank 0 imports the file and its grading workers grade with it, in training and in the evaluation
    at the end), a step trains and the checkpoint holds one shard per rank; no token file is written. One step: the
    two-node test trains several, resumed."""
    pytest.importorskip("ray")
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "my_rewards.py").write_text("def quarter(response, ground_truth):\n    return 0.25, True\n")
    spec = f"{tmp_path / 'my_rewards.py'}:quarter"
    ray_tmp = tempfile.mkdtemp(prefix="dray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    real_token = Path.home() / ".ray" / "auth_token"
    token_before = real_token.read_bytes() if real_token.exists() else None
    # no RAY_AUTH_* given: launch-ray starts the private cluster with token authentication and a
    # token that lives in its environment only, so Ray writes no token file (it would be 0644 in
    # ~/.ray); HOME and RAY_TMPDIR keep everything else under temporary directories
    env = private_ray_env(home, ray_tmp)
    cmd = [
        sys.executable,
        "-m",
        "dapo.cli",
        "launch-ray",
        "configs/demo.yaml",
        f"model.path={tiny_model_dir}",
        f"run.dir={tmp_path / 'runs'}",
        *SMALL_OVERRIDES,
        "train.total_steps=1",
        "algo.soft_overlong_punishment=false",
        f"reward.function={spec}",
        "--address",
        "local",
        "--num-cpus",
        "2",
        "--cpu-workers-per-node",
        "2",
        "--cpus-per-worker",
        "1",
    ]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    seconds = time.perf_counter() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    print(f"\nRay, 2 CPU workers, 1 step: {seconds:.1f} s including cluster start")
    run = tmp_path / "runs" / "t"
    ckpt = checkpoint.latest_checkpoint(run)
    assert ckpt is not None and ckpt.name == "step_000001" and checkpoint_weights.is_sharded(ckpt)
    assert len(list((ckpt / "shards").glob("*.distcp"))) == 2  # one file per rank
    assert f"data: built-in arith task, grader: your reward function (reward.function={spec})" in out.stdout
    # the private cluster starts its workers at the driver's niceness (Ray's own default, 15, would warn)
    assert "niceness" not in out.stdout + out.stderr
    rows = rows_of(run)
    assert [r["step"] for r in rows] == [1]
    assert all(r["rollout/acc_mean"] == 1.0 and r["reward/score_mean"] == 0.25 for r in rows)
    assert rows[-1]["eval/arith/avg@2"] == 1.0
    assert not (home / ".ray" / "auth_token").exists()
    assert (real_token.read_bytes() if real_token.exists() else None) == token_before


RAY_HEAD = """
import sys, ray
ray.init(num_cpus=1, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes stdin
"""


def test_launch_ray_refuses_to_start_a_cluster_without_auth(tmp_path):
    pytest.importorskip("ray")
    env = env_for_children(HOME=str(tmp_path), RAY_AUTH_MODE="disabled")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo.cli",
            "launch-ray",
            "configs/demo.yaml",
            "--address",
            "local",
            "--cpu-workers-per-node",
            "2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert "RAY_AUTH_MODE=disabled starts a cluster on which anyone who reaches its ports runs code" in out.stderr
    assert "--insecure" in out.stderr


@pytest.mark.slow
def test_launch_ray_refuses_to_join_a_cluster_without_auth(tiny_model_dir, tmp_path):
    """A cluster started without RAY_AUTH_MODE=token answers anyone; the driver notices, even though
    it holds a token itself, and stops before placing anything."""
    pytest.importorskip("ray")
    ray_tmp = tempfile.mkdtemp(prefix="dray", dir="/tmp")
    env = private_ray_env(tmp_path, ray_tmp)
    head = subprocess.Popen(
        [sys.executable, "-c", RAY_HEAD],
        env={**env, "RAY_AUTH_MODE": "disabled"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        gcs_address = head.stdout.readline().strip()
        driver_env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": hashlib.sha256(os.urandom(16)).hexdigest()}
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "dapo.cli",
                "launch-ray",
                "configs/demo.yaml",
                f"model.path={tiny_model_dir}",
                f"run.dir={tmp_path / 'runs'}",
                "--address",
                gcs_address,
                "--cpu-workers-per-node",
                "1",
                "--cpus-per-worker",
                "1",
            ],
            cwd=REPO,
            env=driver_env,
            capture_output=True,
            text=True,
            timeout=200,
        )
    finally:
        head.communicate(input="", timeout=60)  # the head's driver shuts its cluster down
        shutil.rmtree(ray_tmp, ignore_errors=True)
    refusals = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(refusals) == 1, out.stderr[-3000:]
    assert f"the Ray cluster at {gcs_address} answers requests that carry no token" in refusals[0]
    assert "--insecure" in refusals[0]
    assert not (tmp_path / "runs").exists()


# ---- two Ray nodes on one machine ---------------------------------------------------------------------------
# A Ray cluster of two nodes, as Ray's own tests make one: the head on 127.0.0.2 and a second node on 127.0.0.3
# (Linux routes all of 127/8 to loopback), one CPU slot each. Each node's Ray starts in a directory of its own, as
# `ray start` on two machines would, so its workers resolve a relative path there. On stdin, "kill" ends every
# process of the second node at once (a machine lost) and "add" starts it again.
TWO_NODES = """
import os, sys
from ray.cluster_utils import Cluster

dir_a, dir_b = sys.argv[1:3]
os.chdir(dir_a)
head = {"node_ip_address": "127.0.0.2", "num_cpus": 1, "include_dashboard": False}
cluster = Cluster(initialize_head=True, head_node_args=head)

def second_node():
    os.chdir(dir_b)
    return cluster.add_node(node_ip_address="127.0.0.3", num_cpus=1)

node = second_node()
print(cluster.address, flush=True)
for line in sys.stdin:
    if line.strip() == "kill":
        cluster.remove_node(node, allow_graceful=False)
    else:
        node = second_node()
    print(line.strip(), "done", flush=True)
cluster.shutdown()
"""
STEPS = 4  # the run's length: a stop after step 1 or 2 leaves the relaunch a step before the node is lost and one after
PLACED = re.compile(r"^launch-ray: node (127\.0\.0\.[23]) (\w{8}): rank (\d) \(pid (\d+)\)$", re.M)


def test_ranks_below_normal_priority_are_named_at_start_with_the_fix():
    from dapo.cluster import niceness_warning

    assert niceness_warning([0, 0, 0]) is None
    assert niceness_warning([15, 0, 15]) == (
        "launch-ray: warning: 2 of 3 ranks run at niceness 15 (Ray's default for its workers is 15): beside other "
        "work on their machines they get a small share of the CPU; start each node's Ray with RAY_worker_niceness=0 "
        "in its environment (RAY_worker_niceness=0 ray start ...)"
    )


DRIVER_IMPORTS = """
import sys
import dapo.cluster
from dapo import cli

def launch(cfg, placement, train_fn, **kw):  # what the driver runs once the ranks are placed, in place of Ray
    import dapo.cluster.watch, dapo.runtime.libraries, dapo.runtime.starting
    print(train_fn.__module__, train_fn.__name__, placement.world_size)

dapo.cluster.launch = launch
cli.main(["launch-ray", "configs/demo.yaml", "--address", "local", "--cpu-workers-per-node", "2"])
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_the_launch_ray_driver_imports_neither_torch_nor_transformers():
    """The driver places the ranks and waits for them: the training loop, torch and transformers load on the ranks
    (``cli.train_on_rank``), not on the head node (4 CPU seconds and 220 MB less there, measured)."""
    out = subprocess.run(
        [sys.executable, "-c", DRIVER_IMPORTS], cwd=REPO, env=env_for_children(), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["dapo.cli train_on_rank 2", "[]"]


def test_the_start_lines_say_which_node_holds_which_ranks():
    from dapo.cluster import placement_lines

    where = [("10.0.0.1", "a1" * 28, 11), ("10.0.0.1", "a1" * 28, 12), ("10.0.0.2", "b2" * 28, 21)]  # rank order
    assert placement_lines(where) == [
        "launch-ray: node 10.0.0.1 a1a1a1a1: rank 0 (pid 11), rank 1 (pid 12)",
        "launch-ray: node 10.0.0.2 b2b2b2b2: rank 2 (pid 21)",
    ]


@contextlib.contextmanager
def two_nodes(root: Path, env: dict):
    """The two-node cluster, started in ``root``/a and ``root``/b; yields its address and a function that tells
    it "kill" or "add"."""
    for d in ("a", "b"):
        (root / d).mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", TWO_NODES, str(root / "a"), str(root / "b")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def tell(what: str) -> None:
        proc.stdin.write(what + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == f"{what} done"

    try:
        yield proc.stdout.readline().strip(), tell
    finally:
        try:
            proc.communicate(timeout=60)  # stdin closed: the cluster shuts down
        except subprocess.TimeoutExpired:
            proc.kill()


def placed(stdout: str) -> dict[int, str]:
    """Which node address holds each rank, from the driver's start-up lines."""
    return {int(m.group(3)): m.group(1) for m in PLACED.finditer(stdout)}


def errors_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def launch_killing_the_second_node(
    cmd: list[str], env: dict, run: Path, tell, last: Path
) -> tuple[subprocess.CompletedProcess, float]:
    """``cmd``, resuming from checkpoint ``last``, with every process of the second node killed once the first step
    after it is logged (its row comes after a collective of both ranks). Returns the driver's result and its
    seconds after the kill."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any(r["step"] > checkpoint.step_of(last) for r in rows_of(run)) and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        tell("kill")
        t0 = time.perf_counter()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.perf_counter() - t0


def pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` waits for delivery to process ``pid`` (its SigPnd and ShdPnd masks in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (sig - 1) & 1 for mask in masks)


def launch_with_sigterm(cmd: list[str], env: dict, run: Path, logs: Path) -> tuple[subprocess.CompletedProcess, list]:
    """``cmd`` with SIGTERM to the driver once step 1's row is written. The ranks' processes are frozen (SIGSTOP) from
    then until the signal the driver sends on is pending in each of them: so the test sees it reach the rank on each
    node, and no rank runs on (to the end of the run) while the signal travels, however fast or loaded the machine.
    Returns the driver's result and the addresses of the nodes whose rank the signal reached."""
    from test_preemption import wait_for_rows

    # files, not pipes: nothing reads the driver's output while the ranks are frozen, and a full pipe would stall it
    with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err)
    frozen, reached, t0 = [], [], time.monotonic()
    try:
        wait_for_rows(proc, run, timeout=400)
        ranks = [(m.group(1), int(m.group(4))) for m in PLACED.finditer((logs / "stdout").read_text())]
        for _, pid in ranks:
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while not all(pending(pid, signal.SIGTERM) for _, pid in ranks) and time.monotonic() < t0 + 200:
            time.sleep(0.05)
        reached = sorted(ip for ip, pid in ranks if pending(pid, signal.SIGTERM))
        print(f"\nSIGTERM pending in the ranks on {reached} {time.monotonic() - t0:.1f} s after it was sent")
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        try:
            proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
    print(f"the driver exited {time.monotonic() - t0:.1f} s after the signal")
    out, err = ((logs / name).read_text() for name in ("stdout", "stderr"))
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), reached


def check_stopped_by_sigterm(stopped: subprocess.CompletedProcess, reached: list, run: Path) -> None:
    """The driver exited 75 with rank 0's line alone, the checkpoint it names the run's only one (of a step before
    the last, so that the relaunch trains), the signal having reached the rank on each node."""
    from test_preemption import LINE

    lines = [x for x in (stopped.stdout + stopped.stderr).splitlines() if "stopped by" in x]
    print(f"SIGTERM to the driver reached the ranks on {reached}: exit {stopped.returncode}, {lines}")
    assert stopped.returncode == preemption.EXIT_CODE and len(lines) == 1, stopped.stderr[-4000:]
    assert reached == ["127.0.0.2", "127.0.0.3"]
    m = LINE.fullmatch(lines[0])
    assert m and m.group(1) == "SIGTERM" and 1 <= int(m.group(2)) < 3 and m.group(5) == "written", lines[0]
    assert [checkpoint.step_of(p) for p in checkpoint_files.list_checkpoints(run)] == [int(m.group(2))]
    assert m.group(4) == str(checkpoint.latest_checkpoint(run))
    assert "Traceback" not in stopped.stderr and "died mid-run" not in stopped.stderr


def check_refused(refused: subprocess.CompletedProcess, root: Path) -> None:
    """A relative run.dir, which each node resolves in its own directory: refused at start in one line naming the
    node, the rank and both paths, the ranks having been placed on both nodes."""
    errors, where = errors_of(refused.stderr), placed(refused.stdout)
    print(f"\n{refused.stdout}{errors}")
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-4000:]
    assert sorted(where.values()) == ["127.0.0.2", "127.0.0.3"]
    theirs = root / "ab"[where[1] == "127.0.0.3"] / "runs" / "t"  # the path on rank 1's node
    assert re.fullmatch(
        rf"error: launch-ray: node {where[1]} \w{{8}} \(rank 1\) does not share the run directory: rank 0 "
        rf"\(node {where[0]} \w{{8}}\) wrote a file into \S+ that rank 1 does not find in {theirs}; .*",
        errors[0],
    ), errors[0]


def check_ended_at_once(killed: subprocess.CompletedProcess, seconds: float, run: Path, last: Path) -> None:
    """The second node lost mid-run: the job ended within seconds, in one line naming the rank and node lost and the
    checkpoint to resume from."""
    errors = errors_of(killed.stderr)
    lost = next(rank for rank, ip in placed(killed.stdout).items() if ip == "127.0.0.3")
    print(f"{killed.stdout}{errors} ({seconds:.1f} s after the kill)")
    # 3-6 s when measured, on an idle machine and a loaded one: the bound tells "at once" from a timeout's end
    assert killed.returncode == 2 and len(errors) == 1 and seconds < 60, killed.stderr[-4000:]
    assert f"resumed from {last}" in console_of(killed.stdout).replace("\n", "")
    assert checkpoint.latest_checkpoint(run) == last
    assert re.fullmatch(
        rf"error: launch-ray: the worker of rank {lost} \(pid \d+ on node 127\.0\.0\.3 \w{{8}}\) died mid-run "
        rf"\(\w+: .*\); the job is stopped; launch it again to resume from {last}",
        errors[0],
    ), errors[0]
    assert [r["step"] for r in rows_of(run)][-1] < STEPS  # it stopped mid-run


def console_of(stdout: str) -> str:
    """The driver's output without the prefix Ray puts before each line of a rank's."""
    return re.sub(r"(\x1b\[\d+m)?\(TrainWorker pid=\d+\)(\x1b\[0m)? ?", "", stdout)


def check_resumed(resumed: subprocess.CompletedProcess, run: Path, last: Path) -> None:
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    console = console_of(resumed.stdout)
    print(console[console.index("launch-ray: node") :])
    assert f"resumed from {last}" in console.replace("\n", "")
    assert sorted(placed(resumed.stdout).values()) == ["127.0.0.2", "127.0.0.3"]
    assert checkpoint.step_of(checkpoint.latest_checkpoint(run)) == STEPS


# a reward function of the user's, from a file: right when the response has an even number of characters, scored
# +-0.5, so that neither the training rewards nor the held-out verdicts can come from the built-in grader
USER_REWARD = """
def even_length(response, ground_truth):
    right = len(response) % 2 == 0
    return (0.5 if right else -0.5), right
"""


def check_the_users_reward_function(run: Path, stdout: str, spec: str) -> None:
    """rank 0 imported reward.function, and its grading workers scored every training sample and judged every
    held-out response with it."""
    assert f"grader: your reward function (reward.function={spec})" in stdout
    rows = [r for r in rows_of(run) if "reward/score_mean" in r]
    assert rows and all(abs(r["reward/score_mean"] - (r["rollout/acc_mean"] - 0.5)) < 1e-9 for r in rows)
    held_out = [json.loads(line) for line in next((run / "samples").glob("*.arith.responses.jsonl")).open()]
    assert held_out and all(r["correct"] == (len(r["response"]) % 2 == 0) for r in held_out)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # about 5 minutes on a loaded 2-core machine: five launches and a cluster start
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nodes on 127.0.0.2 and .3: all of 127/8 is loopback")
def test_two_ray_nodes_place_ranks_on_both_refuse_an_unshared_run_dir_and_resume_after_sigterm_and_a_lost_node(
    tiny_model_dir, tmp_path
):
    """launch-ray on a cluster of two Ray nodes: a relative run.dir (another directory on each node) is refused at
    start in one line naming the node; with a shared one the ranks land on both nodes and say so, and the ranks grade
    with the reward function their config names (a file of the user's). SIGTERM to the driver reaches the rank on
    each node (through the small actor the driver starts there): the ranks stop at one checkpoint of their last
    completed step and the driver exits 75 with rank 0's line. The same command again resumes; the second node's
    processes killed after its first step end the job at once, in one line naming node and rank. Launched once more
    (the node back) it resumes from that checkpoint and ends with the metrics, weights and AdamW state of an
    uninterrupted run, bit for bit."""
    pytest.importorskip("ray")
    sys.path.insert(0, str(REPO / "scripts"))
    from same_runs import compare
    from test_preemption import same_shards

    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "my_rewards.py").write_text(USER_REWARD)
    spec = f"{tmp_path / 'my_rewards.py'}:even_length"
    ray_tmp = tempfile.mkdtemp(prefix="dray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**private_ray_env(home, ray_tmp), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(32).hex()}
    env["COLUMNS"] = "500"  # the driver's stop line unwrapped
    # the nodes' Ray started as docs/scaling.md says for a shared machine: at Ray's default niceness of 15 the ranks,
    # beside the suite's other busy processes, got a few percent of a core and this test ran past 18 minutes
    env["RAY_worker_niceness"] = "0"
    ref, run = (tmp_path / d / "t" for d in ("ref", "runs"))
    t0 = time.perf_counter()
    try:
        with two_nodes(tmp_path, env) as (address, tell):
            laps = {"cluster start": time.perf_counter()}
            flags = ["--address", address, "--nodes", "2", "--cpu-workers-per-node", "1", "--cpus-per-worker", "1"]
            cmd = [sys.executable, "-m", "dapo.cli", "launch-ray", "configs/demo.yaml", f"model.path={tiny_model_dir}"]
            cmd += [*SMALL_OVERRIDES, f"train.total_steps={STEPS}", f"reward.function={spec}",
                    "algo.soft_overlong_punishment=false", "eval.benchmarks=[arith]"]  # fmt: skip
            # a checkpoint at the end only, so that the stop writes its own and the lost node's run has that one to
            # resume from; a grace no loaded machine runs out of (the run's default watchdog: the test freezes the
            # ranks)
            stopping = [f"run.dir={run.parent}", "run.save_every=null", "run.preempt_grace_s=120"]

            def launch(*overrides) -> subprocess.CompletedProcess:
                argv = [*cmd, *overrides, *flags]
                return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)

            check_refused(launch("run.save_every=1", *QUICK_WATCHDOG, "run.dir=runs"), tmp_path)  # resolved per node
            laps["refusal"] = time.perf_counter()

            uninterrupted = launch(f"run.dir={ref.parent}")
            laps["uninterrupted run"] = time.perf_counter()
            assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]
            assert sorted(placed(uninterrupted.stdout).values()) == ["127.0.0.2", "127.0.0.3"]
            assert f"launch-ray: run directory {ref}, the same for all 2 ranks\n" in uninterrupted.stdout
            check_the_users_reward_function(ref, uninterrupted.stdout, spec)

            stopped = launch_with_sigterm([*cmd, *stopping, *flags], env, run, tmp_path)
            laps["SIGTERM"] = time.perf_counter()
            check_stopped_by_sigterm(*stopped, run)
            last = checkpoint.latest_checkpoint(run)

            # the same command again: it resumes, and loses the second node after its first step
            killed, seconds = launch_killing_the_second_node([*cmd, *stopping, *flags], env, run, tell, last)
            laps["relaunched, node lost"] = time.perf_counter()
            check_ended_at_once(killed, seconds, run, last)
            tell("add")  # the node back: the same command resumes from the last checkpoint
            check_resumed(launch(*stopping), run, last)
            laps["node back, resumed"] = time.perf_counter()
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    ends = [t0, *laps.values()]
    print(", ".join(f"{k} {b - a:.1f} s" for k, a, b in zip(laps, ends, ends[1:])))
    print(f"two nodes: {time.perf_counter() - t0:.1f} s in all (load average {os.getloadavg()[0]:.1f})")
    assert compare(ref, run, set()) == []  # every logged value but the clock readings, row by row
    assert same_shards(ref, run)  # the last checkpoint's weights and AdamW state, bit for bit
