"""Ray placement for training across machines: one worker process per GPU (or per CPU slot), each
running the same ``train()`` as one rank of an FSDP job.

    dapo launch-ray configs/dapo_qwen2.5_32b.yaml model.path=/models/Qwen2.5-32B --nodes 16 --gpus-per-node 8

The driver connects to a running Ray cluster (``ray start`` on every node), reserves one bundle
per rank in a placement group ({"GPU": 1, "CPU": k}, packed node by node), starts one actor per
bundle and tells each its RANK, WORLD_SIZE, LOCAL_RANK and the address of rank 0, which then
becomes the torch.distributed rendezvous (nccl on GPUs, gloo on CPU). Every rank samples a share
of the prompts with its own engine on its own GPU and rank 0 grades (see training.py); Ray only
places and starts the processes. Before any rank trains, the driver prints which node holds which
ranks and checks that every rank sees rank 0's run directory (one filesystem for the checkpoint's
shards), stopping in one line naming the node that does not.

SIGTERM, SIGUSR1 or SIGINT to the driver (a scheduler preempting the job, Ctrl-C) is sent on to every rank's
process, on whichever node it runs, by a small actor pinned to that node: the ranks stop together as a run does on
a signal (``dapo.checkpoint.preemption``), writing one checkpoint, and the driver exits with rank 0's line and
exit code 75.

Whoever can reach a Ray cluster's ports without its token runs code on every node, so the driver
joins only a cluster that refuses requests without a token (``--insecure`` to override), and a
cluster it starts itself (``--address local``) uses a token that lives in this run's environment
only. See docs/security.md.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dapo.config import ConfigError


@dataclass
class Placement:
    nodes: int = 1  # machines
    workers_per_node: int = 8  # ranks per machine
    gpus_per_worker: float = 1.0  # 0: CPU-only workers (gloo), as in the tests
    # CPU slots reserved per rank (tokenising, grading on rank 0); the CLI: 1 for CPU workers
    cpus_per_worker: float = 4.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node


def _worker_class():
    import ray

    @ray.remote
    class TrainWorker:
        """One rank: sets the torch.distributed environment, then runs the ordinary training loop."""

        def __init__(self):
            self.store_socket = None

        def address(self) -> tuple[str, str, int]:
            return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid()

        def see_run_dir(self, run_dir: str, marker: str, text: str | None = None) -> tuple[str, str | None]:
            """This rank's view of the run directory: its absolute path here (a relative run.dir resolves against
            the working directory of this node's Ray, where `ray start` ran) and the text of the file ``marker`` in
            it, None where there is none. With ``text`` (rank 0) the file is written first."""
            path = Path(run_dir).absolute()
            if text is not None:
                path.mkdir(parents=True, exist_ok=True)
                (path / marker).write_text(text)
            try:
                return str(path), (path / marker).read_text()
            except OSError:
                return str(path), None

        def forget(self, run_dir: str, marker: str) -> None:
            (Path(run_dir) / marker).unlink(missing_ok=True)

        def listen(self, host: str) -> int:
            """Rank 0: bind the rendezvous port on this node's address and keep the socket, which the
            store then takes over (``dapo.runtime.parallel``): no moment in which another process could take the
            port."""
            import socket

            family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
            self.store_socket = socket.create_server((host, 0), family=family)
            return self.store_socket.getsockname()[1]

        def train(self, train_fn, config_yaml: str, env: dict) -> dict:
            import yaml

            from dapo.checkpoint import preemption
            from dapo.config import config_from_dict

            preemption.PROCESS_ENDS_WITH_RUN = True  # the actor's process serves this run only
            os.environ.update(env)
            if self.store_socket is not None:
                os.environ["DAPO_STORE_FD"] = str(self.store_socket.detach())
            return train_fn(config_from_dict(yaml.safe_load(config_yaml)))

    return TrainWorker


def token_for_this_run(*, insecure: bool = False) -> None:
    """Token authentication for a cluster started by this process, with a token that lives only in
    its environment (and its children's). Left to itself Ray would write one to ~/.ray/auth_token,
    readable by every user (mode 644), and leave it there."""
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode.lower() != "token":
        if insecure:
            return
        raise ConfigError(
            f"launch-ray --address local: RAY_AUTH_MODE={mode} starts a cluster on which anyone who "
            "reaches its ports runs code; unset it (the run then uses a token of its own) or pass --insecure"
        )
    os.environ["RAY_AUTH_MODE"] = "token"
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def require_token_auth(gcs_address: str) -> None:
    """Stop unless the cluster refuses a request that carries no token. Asked of the cluster itself
    (its GCS), since this driver holding a token says nothing about whether the cluster checks it."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=30
            )
        except grpc.RpcError:
            return  # refused without a token (or it speaks TLS only): not open to whoever reaches the port
    raise ConfigError(
        f"launch-ray: the Ray cluster at {gcs_address} answers requests that carry no token, so anyone "
        "who reaches its ports runs code on its nodes; start every node with RAY_AUTH_MODE=token and "
        "one token (RAY_AUTH_TOKEN_PATH) everywhere, see docs/security.md; or pass --insecure"
    )


def check_fits(p: Placement, nodes: list[dict], *, local: bool = False) -> None:
    """Stop, saying what to change, when the cluster (``nodes``: each alive node's resources) can never
    hold the placement; Ray itself would wait forever for the resources."""
    asked = {"CPU": p.world_size * p.cpus_per_worker, "GPU": p.world_size * p.gpus_per_worker}
    have = {k: sum(n.get(k, 0.0) for n in nodes) for k in asked}
    per = {"CPU": p.cpus_per_worker, "GPU": p.gpus_per_worker}
    biggest = {k: max((n.get(k, 0.0) for n in nodes), default=0.0) for k in asked}
    ranks = f"{p.nodes} node(s) x {p.workers_per_node} worker(s)" if p.nodes > 1 else f"{p.world_size} worker(s)"
    for k, flag in (("CPU", "--cpus-per-worker"), ("GPU", "--gpus-per-node")):
        if asked[k] <= have[k] and per[k] <= biggest[k]:
            continue
        need = f"{ranks} x {per[k]:g} {k}s = {asked[k]:g} {k}s"
        if k == "GPU":
            fix = (
                "use fewer GPU workers (--gpus-per-node, --nodes), or CPU workers (--cpu-workers-per-node N) "
                "where the cluster has no GPU"
            )
        else:
            fit = max(have[k] // max(p.world_size, 1), 0)
            fix = f"lower {flag} (to {fit:g} or less)" if fit >= 1 else "use fewer workers"
            fix += (
                ", or give the private cluster more slots with --num-cpus" if local else ", or add nodes to the cluster"
            )
        raise ConfigError(
            f"launch-ray: the placement needs {need}, the Ray cluster has {have[k]:g} "
            f"(at most {biggest[k]:g} on one node); {fix}"
        )


def launch(
    cfg, placement: Placement, train_fn, *, address: str = "auto", ray_init: dict | None = None, insecure: bool = False
) -> dict:
    """Run ``train_fn(cfg)`` (``dapo.training.train``, passed in so this module stays below the loop) on
    ``placement.world_size`` Ray workers; returns rank 0's last logged row.
    ``insecure`` joins (or starts) a cluster without token authentication."""
    if address == "local":
        token_for_this_run(insecure=insecure)  # before Ray is imported: it reads RAY_AUTH_MODE once, then
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from dapo.config import dump_yaml

    if not ray.is_initialized():
        join_cluster(address, ray_init)
    p = placement
    try:
        if not insecure:
            require_token_auth(ray.get_runtime_context().gcs_address)
        check_fits(p, [n["Resources"] for n in ray.nodes() if n.get("Alive")], local=address == "local")
    except ConfigError:
        ray.shutdown()
        raise
    bundle = {"CPU": p.cpus_per_worker, **({"GPU": p.gpus_per_worker} if p.gpus_per_worker else {})}
    # PACK fills a node before the next, so consecutive ranks share a machine (and its NVLink)
    pg = placement_group([dict(bundle) for _ in range(p.world_size)], strategy="PACK")
    ray.get(pg.ready(), timeout=600)
    try:
        actors, where = start_ranks(pg, p)
        for line in placement_lines(where):
            print(line, flush=True)
        run_dir = check_shared_run_dir(actors, where, cfg.run_dir)
        print(f"launch-ray: run directory {run_dir}, the same for all {len(actors)} ranks", flush=True)
        master_addr = where[0][0]
        master_port = ray.get(actors[0].listen.remote(master_addr))
        local_counts: dict[str, int] = {}
        runs = []
        for rank, (actor, (_, node, _)) in enumerate(zip(actors, where)):
            local_rank = local_counts.get(node, 0)
            local_counts[node] = local_rank + 1
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(p.world_size),
                "LOCAL_RANK": str(local_rank),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
            }
            runs.append(actor.train.remote(train_fn, dump_yaml(cfg), env))
        workers = [f"rank {rank} (pid {pid} on {node_name(ip, node)})" for rank, (ip, node, pid) in enumerate(where)]
        forward = Forwarder([(node, pid) for _, node, pid in where], cfg.run.preempt_grace_s)
        try:
            with forward.installed():
                return wait_for_ranks(runs, workers, run_dir, actors, forward)[0]
        finally:
            forward.close()
    finally:
        remove_placement_group(pg)


def start_ranks(pg, p: Placement) -> tuple[list, list[tuple[str, str, int]]]:
    """One TrainWorker per bundle of ``pg``; returns the actors in rank order and where each runs (node address,
    node id, pid). Ranks go in node order, rank 0's node first, so LOCAL_RANK counts the ranks of one machine."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    worker = _worker_class()
    actors = [
        worker.options(
            num_cpus=p.cpus_per_worker,
            num_gpus=p.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote()
        for i in range(p.world_size)
    ]
    where = ray.get([a.address.remote() for a in actors])
    order = sorted(range(len(actors)), key=lambda i: (where[i][1] != where[0][1], where[i][1], i))
    return [actors[i] for i in order], [where[i] for i in order]


def node_name(ip: str, node_id: str) -> str:
    """A node as the console names it: its address, and the head of its Ray id (two nodes can share an address)."""
    return f"node {ip} {node_id[:8]}"


def placement_lines(where: list[tuple[str, str, int]]) -> list[str]:
    """The start-up lines saying where each rank runs, one line per node (``where``: in rank order)."""
    ranks: dict[tuple[str, str], list[str]] = {}
    for rank, (ip, node, pid) in enumerate(where):
        ranks.setdefault((ip, node), []).append(f"rank {rank} (pid {pid})")
    return [f"launch-ray: {node_name(ip, node)}: {', '.join(held)}" for (ip, node), held in ranks.items()]


def check_shared_run_dir(actors: list, where: list[tuple[str, str, int]], run_dir) -> Path:
    """Rank 0's run directory as an absolute path (a relative run.dir is resolved on rank 0's node, not where the
    driver runs). Stops in one line, before any rank trains, unless every rank sees it: each rank writes
    its own shard of a checkpoint, so a node that writes elsewhere (its own disk, a relative run.dir taken from
    another working directory) would leave checkpoints no launch can resume from. Rank 0 writes a file of a new,
    random name (no node can have it cached: a network filesystem looks it up at its server) and every rank looks
    for it at its own path of the run directory; rank 0 then removes it."""
    import ray

    marker, text = f".dapo-shared-{secrets.token_hex(8)}", secrets.token_hex(16)
    try:
        home, _ = ray.get(actors[0].see_run_dir.remote(str(run_dir), marker, text))
    except OSError as err:
        raise ConfigError(
            f"launch-ray: rank 0 on {node_name(*where[0][:2])} cannot write its run directory {run_dir} "
            f"({type(getattr(err, 'cause', err)).__name__}: {getattr(err, 'cause', err)})"
        ) from None
    try:
        seen = ray.get([a.see_run_dir.remote(str(run_dir), marker) for a in actors])
    finally:
        ray.get(actors[0].forget.remote(home, marker))
    for rank, ((path, got), (ip, node, _)) in enumerate(zip(seen, where)):
        if got != text:
            raise ConfigError(
                f"launch-ray: {node_name(ip, node)} (rank {rank}) does not share the run directory: rank 0 "
                f"({node_name(*where[0][:2])}) wrote a file into {home} that rank {rank} does not find in {path}; "
                "give run.dir as an absolute path on a filesystem every node mounts (a relative one is taken "
                "from the directory each node's `ray start` ran in)"
            )
    return Path(home)


def join_cluster(address: str, ray_init: dict | None) -> None:
    """Connect to the Ray cluster at ``address`` ("local": start a private one), or stop with one line saying why
    not and what to do."""
    import ray

    try:
        from dapo.runtime.libraries import verbose

        quiet = {} if verbose() else {"logging_level": "warning"}  # Ray's INFO lines on the driver's console
        ray.init(address=None if address == "local" else address, **{**quiet, **(ray_init or {})})
    except (ray.exceptions.AuthenticationError, ConnectionError) as err:  # a token cluster refuses one without
        why = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else type(err).__name__
        if "Could not find any running Ray instance" in str(err):
            raise ConfigError(
                f"launch-ray: no Ray cluster is running at --address {address}; start one with "
                "`ray start --head` (token authentication: docs/security.md), or try on this "
                "machine alone with --address local"
            ) from None
        raise ConfigError(
            f"launch-ray: cannot join the Ray cluster at {address} ({why}); with token authentication "
            "export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=<the cluster's token file> first "
            "(docs/security.md)"
        ) from None


def _signaller_class():
    import ray

    @ray.remote(num_cpus=0)
    class Signaller:
        """On a node that holds ranks: sends a signal to their processes (one already gone is passed over)."""

        def send(self, pids: list[int], signum: int) -> None:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    return Signaller


class Forwarder:
    """The driver's SIGTERM, SIGUSR1 and SIGINT, sent on to every rank's process by a small actor on each node
    that holds ranks (pinned there, no CPU asked), started with the ranks so that the signal is on its way in
    milliseconds: a driver can signal no process on another machine, and the rank's own actor cannot take the
    call (an actor that answers calls beside its training would train off the main thread, where Python runs no
    signal handler). Each signal the driver gets is forwarded once (a second one, as for a single run, ends the
    ranks at once)."""

    MARGIN_S = 15.0  # past run.preempt_grace_s the ranks exit by themselves; this much later the driver stops

    def __init__(self, ranks: list[tuple[str, int]], grace_s: float):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.grace_s = grace_s
        self.nodes: dict[str, list[int]] = {}  # node id: the pids of its ranks
        for node, pid in ranks:
            self.nodes.setdefault(node, []).append(pid)
        signaller = _signaller_class()
        self.signallers = {
            node: signaller.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            for node in self.nodes
        }
        self.pending: list[int] = []
        self.signum: int | None = None
        self.t0: float | None = None
        self.sent: list = []  # the calls' references, kept until the job ends

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"

    @contextlib.contextmanager
    def installed(self):
        from dapo.checkpoint.preemption import SIGNALS

        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach the main thread only: a caller's thread leaves them to the main one
            return
        old = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.pending.append(signum)  # forwarded from the wait loop: no Ray call inside a signal handler
        if self.signum is None:
            self.signum, self.t0 = signum, time.monotonic()

    def forward(self) -> None:
        while self.pending:
            signum = self.pending.pop(0)
            for node, pids in self.nodes.items():
                self.sent.append(self.signallers[node].send.remote(pids, signum))

    def close(self) -> None:
        import ray

        for actor in self.signallers.values():
            ray.kill(actor)

    def overdue(self) -> bool:
        return self.t0 is not None and time.monotonic() - self.t0 > self.grace_s + self.MARGIN_S

    def stopped(self, why: str, run_dir):
        """The driver's line when the ranks did not all stop with theirs."""
        from dapo.checkpoint import latest_checkpoint
        from dapo.checkpoint.preemption import EXIT_CODE, Stopped

        last = latest_checkpoint(run_dir)
        return Stopped(
            f"stopped by {self.name}: {why}; launch it again to resume from "
            + (str(last) if last else "the start (no checkpoint yet)")
            + f" (exit code {EXIT_CODE})"
        )


class WorkerLostError(RuntimeError):
    """A rank's Ray worker process died mid-run; the message names it and where the run resumes."""


# after one rank fails, how long the others are given to show that a worker died first (a rank whose peer
# died fails in its next collective, which can be before Ray has reported the death)
LOST_WORKER_GRACE_S = 30.0


POLL_S = 0.2  # how often the driver looks for a signal to forward while it waits for the ranks


def wait_for_ranks(runs: list, workers: list[str], run_dir, actors: list, forward: Forwarder | None = None) -> list:
    """Every rank's result. When a rank's worker process dies (killed, out of memory, its node lost) the job
    stops at once with one line naming it, instead of the other ranks waiting in their collectives; the
    other ranks are then ended too, so that a new launch starts clean and resumes. A signal to the driver is
    forwarded to every rank (``forward``); the ranks that stop for it raise ``preemption.Stopped``, and rank 0's
    line is the driver's."""
    import ray
    from ray.exceptions import RayActorError

    from dapo.checkpoint import latest_checkpoint
    from dapo.checkpoint.preemption import Stopped

    pending, failed, stops = list(runs), None, {}
    while pending:
        if forward is not None:
            forward.forward()
        wait = (POLL_S if forward is not None else None) if failed is None else LOST_WORKER_GRACE_S
        done, pending = ray.wait(pending, num_returns=1, timeout=wait)
        if not done:
            if failed is None:  # only polling
                if forward is not None and forward.overdue():
                    for actor in actors:
                        ray.kill(actor)
                    raise forward.stopped(
                        f"the ranks did not stop within run.preempt_grace_s={forward.grace_s:g} s and "
                        f"{forward.MARGIN_S:g} s more; they were ended without a new checkpoint",
                        run_dir,
                    )
                continue
            break  # the grace ran out: no worker was lost, the first failure stands
        try:
            ray.get(done[0])
        except RayActorError as err:  # the actor's process is gone
            for actor in actors:
                ray.kill(actor)
            if forward is not None and forward.signum is not None:  # it ended itself: past the grace, a 2nd signal
                raise forward.stopped(
                    f"the worker of {workers[runs.index(done[0])]} exited before a checkpoint was written (past "
                    f"run.preempt_grace_s={forward.grace_s:g} s, at a second signal, or still starting)",
                    run_dir,
                ) from None
            last = latest_checkpoint(run_dir)
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            why = first.split(". ")[0][:200]  # Ray's first sentence; the rest says what it may or may not have done
            raise WorkerLostError(
                f"launch-ray: the worker of {workers[runs.index(done[0])]} died mid-run ({type(err).__name__}: {why}); "
                "the job is stopped; launch it again to resume from "
                + (str(last) if last else "the start (no checkpoint yet)")
            ) from None
        except Exception as err:  # a rank's own error: wait a little for a lost worker that caused it
            cause = getattr(err, "cause", err)  # ray.get raises a rank's exception wrapped in a RayTaskError
            if isinstance(cause, Stopped):
                stops[runs.index(done[0])] = cause
            failed = failed or err
    if failed is not None:
        for actor in actors:
            ray.kill(actor)
        if stops and isinstance(getattr(failed, "cause", failed), Stopped):
            raise Stopped(str(stops[min(stops)])) from None  # rank 0's line (every rank's is the same)
        raise failed
    return ray.get(runs)
