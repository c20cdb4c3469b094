"""Data-parallel training with FSDP2: the only module that touches torch.distributed's process groups (the
sharded checkpoints' files are ``dapo.checkpoint.shards``'s).

One process per device. ``init`` reads the launcher's environment (torchrun, or the Ray workers in
``dapo.cluster``: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); with WORLD_SIZE unset or 1
nothing is initialised and every helper here is the identity, so the single-process path is the
plain PyTorch one.

Under FSDP every rank samples a share of the prompts with its own full copy of the weights, the
generations are gathered so that every rank holds the whole rollout batch (rank 0 grades it and
broadcasts the grades), and each rank trains on a share of each mini-batch's rows balanced by
token count. The loss of every rank is
divided by the valid tokens of the whole mini-batch (one all-reduce), so gradients are *summed*
over ranks, never averaged: the objective is the same for any number of ranks.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from dapo.config import ConfigError
from dapo.runtime.watchdog import waiting


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


def backend_for(use_cuda: bool) -> str:
    """The process group's backends: gloo on CPU; on GPUs nccl, with gloo beside it for the collectives
    on CPU tensors (train.cpu_offload keeps shards in CPU memory, and gathering them for a weight push
    or an export is a collective on CPU tensors, which nccl cannot run)."""
    return "cpu:gloo,cuda:nccl" if use_cuda else "gloo"


def init(device_name: str = "auto", env: dict | None = None, rollout_ranks: int = 0) -> Dist:
    """Join the process group the launcher set up (nccl on GPUs, gloo on CPU); Dist() when alone.

    ``rollout_ranks`` = r (rollout.ranks): the last r ranks of the job only generate (``dapo.rollout.ranks``) and
    stay out of this group: the training group is the first WORLD_SIZE - r ranks, met through a prefix of the
    job's store."""
    env = os.environ if env is None else env
    job_size = int(env.get("WORLD_SIZE", "1"))
    check_rollout_split(rollout_ranks, job_size)
    world_size = job_size - rollout_ranks
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if job_size <= 1:
        return Dist(device=torch.device("cuda" if use_cuda else "cpu"))
    rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", "0"))
    device = rank_device(device_name, env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:  # one trainer beside rollout ranks: no training group; the job's store meets the rollout
        job_store(env)
        return Dist(device=device)
    if not dist.is_initialized():
        # ranks wait for the slowest generation and for grading; which rank hangs, and where, the step watchdog
        # (``watchdog``) says sooner, from each phase's own history
        store = _rendezvous_store(env, rank, job_size, STORE_TIMEOUT) if not rollout_ranks else job_store(env)
        if rollout_ranks:
            store = dist.PrefixStore("dapo-train/", store)
        dist.init_process_group(
            backend_for(use_cuda), rank=rank, world_size=world_size, timeout=STORE_TIMEOUT, store=store
        )
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def rank_device(device_name: str, env: dict) -> torch.device:
    """The device of a rank of a job: its LOCAL_RANK's GPU (torchrun shows a process every GPU of its node; a Ray
    worker sees only its own, index 0), or the CPU."""
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("model.device=cuda but no CUDA device is visible; use model.device=cpu (gloo)")
    if not use_cuda:
        return torch.device("cpu")
    return torch.device("cuda", int(env.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


STORE_TIMEOUT = timedelta(hours=1)
_JOB_STORE: list = []  # the job's store, made once (rank 0's serves it for the process's life)


def check_rollout_split(rollout_ranks: int, job_size: int) -> None:
    """One line for a split of the job's ranks that leaves no rank to train, or asks for rollout ranks alone."""
    if rollout_ranks and job_size <= rollout_ranks:
        raise ConfigError(
            f"rollout.ranks={rollout_ranks}: the job has {job_size} rank{'s' * (job_size > 1)} (WORLD_SIZE), which "
            f"leaves none to train; launch at least {rollout_ranks + 1} (torchrun --nproc_per_node, launch-ray "
            "--num-workers) or lower rollout.ranks"
        )


def is_rollout_rank(rollout_ranks: int, env: dict | None = None) -> bool:
    """This process is one of the job's last ``rollout_ranks`` ranks (rollout.ranks): it generates, and trains not."""
    env = os.environ if env is None else env
    job_size = int(env.get("WORLD_SIZE", "1"))
    check_rollout_split(rollout_ranks, job_size)
    return rollout_ranks > 0 and int(env.get("RANK", "0")) >= job_size - rollout_ranks


def job_store(env: dict | None = None):
    """The store every rank of the job reaches (torchrun's agent's, or the one rank 0 serves), under a prefix of
    this attempt: the training group meets in it, and rollout ranks publish where they listen."""
    if not _JOB_STORE:
        env = os.environ if env is None else env
        rank, size = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        store = _rendezvous_store(env, rank, size, STORE_TIMEOUT)
        if store is None:  # torchrun's agent serves it
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=STORE_TIMEOUT)
        _JOB_STORE.append(dist.PrefixStore(f"dapo/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store))
    return _JOB_STORE[0]


def _rendezvous_store(env, rank: int, world_size: int, timeout: timedelta):
    """The TCPStore the ranks meet at: rank 0 serves it on MASTER_ADDR only (torch's own listens on
    every interface), the others connect to it. None where torchrun's agent already runs one.

    The store has no authentication and ranks exchange pickles through it and the process group, so
    every node of a job must trust the others (docs/security.md).
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    import socket

    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    if rank != 0:  # every rank passes its store (a store on rank 0 alone and env:// elsewhere never meet)
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    fd = env.get("DAPO_STORE_FD")  # bound by the launcher (dapo.cluster) and kept open: no race for the port
    if fd is None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        fd = socket.create_server((host, port), family=family).detach()  # the store owns it from here
    os.set_blocking(int(fd), False)  # its event loop accepts until EAGAIN: on a blocking socket it hangs at exit
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=int(fd)
    )


def shutdown(d: Dist, *, clean: bool = True) -> None:
    """Leave the process group; ``clean``: every rank got here without an error (else no barrier: a
    rank still inside a collective would never meet it)."""
    if not (d.sharded and dist.is_initialized()):
        return
    # gloo's worker threads outlive destroy_process_group (the model's DTensors keep the group alive until
    # the interpreter exits) and drop a finished collective's tensors themselves, which takes the GIL:
    # if that happens once the interpreter is finalizing, the thread is killed and the process aborts
    # ("terminate called without an active exception"), about one exit in fifty. So on a clean exit every
    # rank first waits for all its collectives (the barrier), then lets the workers finish, GIL released.
    if clean:
        dist.barrier()
        time.sleep(0.05)
    vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_groups is not None:  # in-process vLLM engines made subgroups of this world; they go first
        vllm_groups.cleanup_dist_env_and_memory()  # (and it destroys the world group too)
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- sharding ------------------------------------------------------------------------------------
def wrap(
    module: nn.Module, layers: list[nn.Module], d: Dist, *, compute_dtype: torch.dtype, cpu_offload: bool = False
) -> nn.Module:
    """Shard ``module`` in place with FSDP2: each of ``layers`` is one unit, the rest is the root.

    Parameters stay float32 (the master copy, and so the AdamW state); forward and backward run
    in ``compute_dtype``; gradients are reduced in float32 and summed across ranks.
    """
    if not d.sharded:
        if cpu_offload:
            raise ConfigError(
                "train.cpu_offload=true: FSDP does the offloading, across several ranks (torchrun "
                "--nproc-per-node N ... or dapo launch-ray); a single process would offload nothing: "
                "set train.cpu_offload=false, or train LoRA adapters (model.lora.rank) to fit one GPU"
            )
        return module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(d.device.type, (d.world_size,))
    kwargs = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)}
    if cpu_offload:
        if d.device.type != "cuda":
            raise ConfigError(
                "train.cpu_offload=true: offloading moves shards between GPU and CPU memory; "
                "it needs CUDA devices (set train.cpu_offload=false on CPU)"
            )
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    module.float()  # after sharding: a rank never holds a full float32 copy
    for m in module.modules():
        if isinstance(m, FSDPModule):
            # each rank's loss is already divided by the global token count: sum, do not average
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum
    return module


def full_tensors(named_params):
    """(name, full tensor) one parameter at a time; a DTensor (FSDP2 shard) is gathered with
    ``full_tensor()``, a collective, so every rank must iterate to the end in the same order."""
    for name, p in named_params:
        yield name, (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach())


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Total gradient norm over every rank's shard (a plain tensor), gradients clipped in place."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# ---- collectives ---------------------------------------------------------------------------------
def all_reduce(t: torch.Tensor, d: Dist, op: str = "sum") -> torch.Tensor:
    """A reduced copy of ``t`` (same device and dtype) over every rank; ``t`` itself when alone."""
    if not d.sharded:
        return t
    x = t.detach().to(d.device, torch.float64 if t.dtype == torch.float64 else torch.float32).clone()
    dist.all_reduce(x, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return x.to(t.device, t.dtype)


def all_gather(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """Every rank's ``t`` stacked in rank order, (world_size, *t.shape), on ``t``'s device; ``t[None]``
    when alone. One collective for values that are reduced in different ways (sums beside a max)."""
    if not d.sharded:
        return t[None]
    x = t.detach().to(d.device).contiguous()
    parts = [torch.empty_like(x) for _ in range(d.world_size)]
    dist.all_gather(parts, x)
    return torch.stack(parts).to(t.device)


def broadcast_object(obj, d: Dist, src: int = 0):
    """Rank ``src``'s object on every rank (pickled; for rollout batches and small state)."""
    if not d.sharded:
        return obj
    box = [obj if d.rank == src else None]
    with waiting(f"broadcast_object from rank {src}"):  # rank 0's grades: the others wait for its grading
        dist.broadcast_object_list(box, src=src, device=d.device if d.device.type == "cuda" else None)
    return box[0]


def all_gather_object(obj, d: Dist) -> list:
    """Every rank's ``obj``, in rank order, on every rank (pickled)."""
    if not d.sharded:
        return [obj]
    out = [None] * d.world_size
    with waiting("all_gather_object"):  # every rank's samples: the fastest waits for the slowest generation
        dist.all_gather_object(out, obj)
    return out


class OnMain:
    """Method calls on ``obj`` run on rank 0 only and every rank gets rank 0's result: for work done
    once whose result must be identical everywhere (grading, where a time limit may strike)."""

    def __init__(self, obj, d: Dist):
        self._obj, self._d = obj, d

    @property
    def local(self):
        """The object itself, for calls rank 0 makes alone (its collecting thread beside rollout ranks)."""
        return self._obj

    def __getattr__(self, name):
        def call(*args, **kwargs):
            result = getattr(self._obj, name)(*args, **kwargs) if self._d.is_main else None
            return broadcast_object(result, self._d)

        return call


def barrier(d: Dist) -> None:
    if d.sharded:
        with waiting("barrier"):
            dist.barrier()


# ---- data partition ------------------------------------------------------------------------------
def balanced_partition(costs: list[int], num_parts: int) -> list[list[int]]:
    """Split indices into ``num_parts`` lists with near-equal total cost (longest first, to the lightest).

    Deterministic, so every rank computes the same partition without talking to the others; each
    part keeps its indices in ascending order.
    """
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        k = min(range(num_parts), key=lambda k: (loads[k], len(parts[k]), k))
        parts[k].append(i)
        loads[k] += costs[i]
    return [sorted(p) for p in parts]


def rank_share(rows: list[int], costs: list[int], d: Dist) -> list[int]:
    """This rank's rows of a mini-batch, balanced by ``costs`` (tokens per row)."""
    if not d.sharded:
        return rows
    return [rows[i] for i in balanced_partition(costs, d.world_size)[d.rank]]


def same_count(items: list, d: Dist) -> list:
    """``items`` padded with None to the longest list on any rank: sharded forwards and backwards are
    collectives, so every rank must run as many of them (a None is a pass with nothing to learn)."""
    if not d.sharded:
        return items
    longest = int(all_reduce(torch.tensor(float(len(items))), d, op="max"))
    return items + [None] * (longest - len(items))


def sharded_state(model: nn.Module, optimizer, *, trainable_only: bool = False) -> dict:
    """Model and optimizer state as DTensor shards keyed by parameter name (for torch.distributed.checkpoint);
    ``trainable_only``: the frozen parameters left out (LoRA: the adapters alone, not the base)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if trainable_only:  # a tied weight is in the state dict under each of its names, and only one is dropped
        trained = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trained}
    return {"model": model_sd, "optim": optim_sd}


def load_sharded_state(
    model: nn.Module, optimizer, state: dict, *, trainable_only: bool = False, full: bool = False
) -> None:
    """``state`` as ``sharded_state`` made it into the model and optimizer. With ``trainable_only`` the frozen
    parameters are not in it and keep their values (every key that is in it was filled by the shards' load).

    ``full``: ``state`` holds whole tensors keyed by parameter name (a one-process checkpoint's weights and
    AdamW state), and every rank keeps its shard of each (torch's ``set_state_dict`` slices them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only, full_state_dict=full)
    if state["optim"] is None:  # an optimizer that has not stepped yet: nothing of it to load
        set_model_state_dict(model, state["model"], options=options)
        return
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
