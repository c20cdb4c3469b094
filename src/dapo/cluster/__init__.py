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

from dapo.cluster.launch import Placement, check_fits, launch, niceness_warning, placement_lines

__all__ = ["Placement", "check_fits", "launch", "niceness_warning", "placement_lines"]
