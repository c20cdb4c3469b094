"""The driver of ``dapo launch-ray``: the placement, the cluster it joins or starts, the ranks it starts and the
checks before they train (see the package's docstring)."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from dapo.cluster.watch import Forwarder, wait_for_ranks
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

        def niceness(self) -> int:
            return os.nice(0)

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
        # Ray starts its workers (the ranks) at niceness 15 unless told otherwise: beside other busy processes such
        # a rank gets a few percent of a core (a two-rank test run went from 3 to past 18 minutes)
        os.environ.setdefault("RAY_worker_niceness", "0")
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
        if warning := niceness_warning(ray.get([a.niceness.remote() for a in actors])):
            print(warning, flush=True)
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


def niceness_warning(nices: list[int]) -> str | None:
    """The start-up line when ranks run below normal priority, at a niceness above 0 (``nices``: each rank's
    niceness), None when none does. A cluster's Ray starts its workers at niceness 15 unless its environment says
    otherwise, and such a rank, beside other busy processes on its machine, gets a small share of the CPU."""
    low = [n for n in nices if n > 0]
    if not low:
        return None
    return (
        f"launch-ray: warning: {len(low)} of {len(nices)} ranks run at niceness {max(low)} (Ray's default for its "
        "workers is 15): beside other work on their machines they get a small share of the CPU; start each node's "
        "Ray with RAY_worker_niceness=0 in its environment (RAY_worker_niceness=0 ray start ...)"
    )


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
