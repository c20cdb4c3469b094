"""Ray placement for training across machines: one worker process per GPU (or per CPU slot), each
running the same ``train()`` as one rank of an FSDP job.

    dapo launch-ray configs/dapo_qwen2.5_32b.yaml model.path=/models/Qwen2.5-32B --nodes 16 --gpus-per-node 8

The driver connects to a running Ray cluster (``ray start`` on every node), reserves one bundle
per rank in a placement group ({"GPU": 1, "CPU": k}, packed node by node), starts one actor per
bundle and tells each its RANK, WORLD_SIZE, LOCAL_RANK and the address of rank 0, which then
becomes the torch.distributed rendezvous (nccl on GPUs, gloo on CPU). Every rank samples a share
of the prompts with its own engine on its own GPU and rank 0 grades (see train.py); Ray only
places and starts the processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class Placement:
    nodes: int = 1  # machines
    workers_per_node: int = 8  # ranks per machine
    gpus_per_worker: float = 1.0  # 0: CPU-only workers (gloo), as in the tests
    cpus_per_worker: float = 4.0  # CPU slots reserved per rank (tokenising, grading on rank 0)

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node


def _worker_class():
    import ray

    @ray.remote
    class TrainWorker:
        """One rank: sets the torch.distributed environment, then runs the ordinary training loop."""

        def address(self) -> tuple[str, int, str]:
            import socket

            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            return ray.util.get_node_ip_address(), port, ray.get_runtime_context().get_node_id()

        def train(self, config_yaml: str, env: dict) -> dict:
            import yaml

            from dapo.config import config_from_dict
            from dapo.train import train

            os.environ.update(env)
            return train(config_from_dict(yaml.safe_load(config_yaml)))

    return TrainWorker


def launch(cfg, placement: Placement, *, address: str = "auto", ray_init: dict | None = None) -> dict:
    """Run ``cfg`` on ``placement.world_size`` Ray workers; returns rank 0's last logged row."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from dapo.config import dump_yaml

    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, **(ray_init or {}))
    p = placement
    bundle = {"CPU": p.cpus_per_worker, **({"GPU": p.gpus_per_worker} if p.gpus_per_worker else {})}
    # PACK fills a node before the next, so consecutive ranks share a machine (and its NVLink)
    pg = placement_group([dict(bundle) for _ in range(p.world_size)], strategy="PACK")
    ray.get(pg.ready(), timeout=600)
    try:
        worker = _worker_class()
        actors = [worker.options(num_cpus=p.cpus_per_worker, num_gpus=p.gpus_per_worker,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
                  .remote() for i in range(p.world_size)]
        where = ray.get([a.address.remote() for a in actors])
        # ranks in node order, so LOCAL_RANK counts the ranks of one machine
        order = sorted(range(len(actors)), key=lambda i: (where[i][2] != where[0][2], where[i][2], i))
        master_addr, master_port, _ = where[order[0]]
        local_counts: dict[str, int] = {}
        runs = []
        for rank, i in enumerate(order):
            node = where[i][2]
            local_rank = local_counts.get(node, 0)
            local_counts[node] = local_rank + 1
            env = {"RANK": str(rank), "WORLD_SIZE": str(p.world_size), "LOCAL_RANK": str(local_rank),
                   "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
            runs.append(actors[i].train.remote(dump_yaml(cfg), env))
        return ray.get(runs)[0]
    finally:
        remove_placement_group(pg)
