"""What ranks share before they train: the partition of rows by tokens, the prompts each tensor-parallel group
samples, the refusal of a tensor-parallel size that does not divide the ranks, and the rendezvous store, which
listens on the master address only (2 ranks started as processes of their own, without torchrun)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import small_config  # noqa: E402
from dapo.rollout import SamplingParams  # noqa: E402
from dapo.runtime import parallel  # noqa: E402
from test_parallel import REPO, env_for_children  # noqa: E402


# ---- pure helpers --------------------------------------------------------------------------------
def test_balanced_partition_by_tokens():
    costs = [10, 1, 7, 3, 3, 4]
    parts = parallel.balanced_partition(costs, 2)
    assert sorted(i for p in parts for i in p) == list(range(6))  # every row exactly once
    assert sorted(sum(costs[i] for i in p) for p in parts) == [14, 14]  # 10+4 | 7+3+3+1
    assert parallel.balanced_partition([5], 2) == [[0], []]
    alone = parallel.Dist()
    assert parallel.rank_share([4, 5, 6], [1, 1, 1], alone) == [4, 5, 6]
    assert parallel.same_count([[1], [2]], alone) == [[1], [2]]
    assert float(parallel.all_reduce(torch.tensor(3.0), alone)) == 3.0


def test_tensor_parallel_size_must_divide_the_ranks(tmp_path, tiny_model_dir):
    from conftest import training_engine
    from dapo.config import ConfigError

    cfg = small_config(tmp_path, tiny_model_dir, "rollout.backend=vllm", "rollout.tensor_parallel_size=2")
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=2 does not divide the 3 trainer ranks"):
        training_engine(cfg, None, parallel.Dist(rank=0, world_size=3))  # checked before vLLM or any model loads


def test_sharded_rollout_gives_each_tensor_parallel_group_one_share(monkeypatch):
    """4 ranks, engines of 2: ranks 0-1 pass prompts 0-1 with seed 2*3+0, ranks 2-3 prompts 2-3 with
    seed 2*3+1; only an engine's first rank sends its samples, so the gather has one copy per engine."""
    from dapo.rollout import Generation, ShardedRollout

    calls, sent = [], []

    class Echo:  # one response per prompt: [prompt token, seed]
        def generate(self, prompt_ids, params):
            calls.append((prompt_ids, params.seed))
            return Generation(
                prompt_ids=prompt_ids,
                response_ids=[p + [params.seed] for p in prompt_ids],
                truncated=torch.zeros(len(prompt_ids), dtype=torch.bool),
                texts=[""] * len(prompt_ids),
            )

    class Sent(Exception):
        pass

    def record(obj, d):
        sent.append(obj)
        raise Sent

    prompts = [[0], [1], [2], [3]]
    monkeypatch.setattr(parallel, "all_gather_object", record)
    for rank in range(4):
        with pytest.raises(Sent):
            ShardedRollout(Echo(), parallel.Dist(rank=rank, world_size=4), 2).generate(prompts, SamplingParams(seed=3))
    assert calls == [([[0], [1]], 6), ([[0], [1]], 6), ([[2], [3]], 7), ([[2], [3]], 7)]
    assert [g.response_ids if g else None for g in sent] == [[[0, 6], [1, 6]], None, [[2, 7], [3, 7]], None]
    monkeypatch.setattr(parallel, "all_gather_object", lambda obj, d: sent)
    gen = ShardedRollout(Echo(), parallel.Dist(rank=3, world_size=4), 2).generate(prompts, SamplingParams(seed=3))
    assert gen.response_ids == [[0, 6], [1, 6], [2, 7], [3, 7]] and gen.prompt_ids == prompts


# ---- the rendezvous store -------------------------------------------------------------------------
STORE_WORKER = """
import json, os, torch
from dapo.runtime import parallel
d = parallel.init("cpu")
total = parallel.all_reduce(torch.tensor(float(d.rank + 1)), d)
port, listening = int(os.environ["MASTER_PORT"]), []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # local address (hex), state 0A = LISTEN
    for row in open(table).read().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            listening.append(local.rsplit(":", 1)[0])
print(json.dumps({"rank": d.rank, "total": float(total), "listening": listening}))
parallel.shutdown(d)
"""


@pytest.mark.parametrize("launcher_socket", [False, True])
def test_rank_0_store_listens_on_the_master_address_only(launcher_socket):
    """torch's own store listens on every interface; here it binds MASTER_ADDR, on a socket the
    launcher bound and handed over (as dapo.cluster does, so no other process can take the port
    between choosing and listening), or on MASTER_PORT itself."""
    import json
    import socket

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    env = env_for_children(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    if not launcher_socket:
        sock.close()  # rank 0 binds MASTER_PORT itself
    rank0_extra = {"DAPO_STORE_FD": str(sock.fileno())} if launcher_socket else {}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STORE_WORKER],
            env={**env, "RANK": str(rank), **(rank0_extra if rank == 0 else {})},
            pass_fds=(sock.fileno(),) if launcher_socket and rank == 0 else (),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    if launcher_socket:
        sock.close()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    rank0, rank1 = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert rank0["total"] == rank1["total"] == 3.0
    assert rank0["listening"] == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or ::
