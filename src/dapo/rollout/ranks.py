"""Rollout ranks (``rollout.ranks`` = r, with ``rollout.max_staleness`` > 0): under torchrun or ``dapo launch-ray``
the last r ranks of the job only generate, each on its own device with a full copy of the weights (HF ``generate``
or vLLM); the first WORLD_SIZE - r ranks train with FSDP among themselves.

Trainer rank 0 drives them. Its collecting thread (``dapo.collect.ahead``) runs each step's collection, dynamic
sampling and grading included, with ``RankEngines`` as its engine: each generation round is split into r
contiguous shares of the prompts, one per rollout rank, each sampled with a seed of its own (as the training ranks
of a synchronous run split theirs, ``ShardedRollout``), and the answers are put back in prompt order. Rank 0 then
hands each step's batch to the other training ranks.

Each rollout rank listens on its node's address (the one that reaches MASTER_ADDR), says where in the job's store
with a key of its own, and serves the same two channels as the rollout process beside a single trainer
(``dapo.rollout.remote``): requests, and numbered weights versions received by a thread while a request is being
generated. A rollout rank loads the version a request names between requests, never during one. Over a network the
tensors cross as pickled bytes, not shared memory; the training ranks gather the weights (FSDP) and rank 0 sends
them to each rollout rank over TCP, which for a large model costs seconds a step (NCCL is not used for the push).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import socket
import sys
import threading
from collections.abc import Iterable
from dataclasses import replace
from multiprocessing.connection import Client, Listener

import torch

from dapo.rollout.base import Generation, SamplingParams, Sleepless, concat_generations
from dapo.rollout.remote import START_TIMEOUT_S, RemoteEngineError, pack, payload_of


class Channel:
    """A connection's ``send``/``recv``/``poll`` with plain pickles: torch.multiprocessing's reductions (a tensor
    as a handle to shared memory) mean nothing on another machine."""

    def __init__(self, conn):
        self.conn = conn

    def send(self, obj) -> None:
        self.conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout: float | None = None) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


def _key(index: int) -> str:
    return f"rollout-rank/{index}"


def _reachable_host(master: str) -> str:
    """This node's address on the route to MASTER_ADDR: where trainer rank 0, which serves (or reaches) the store
    there, can reach this rank."""
    try:
        family = socket.getaddrinfo(master, 0, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # a datagram socket sends nothing on connect: this only picks the route
            return s.getsockname()[0]
    except OSError:
        return master


def serve(cfg, build, *, max_model_len: int, env: dict | None = None) -> None:
    """A rollout rank's whole life: listen, say where, build the engine (``build``, as ``RemoteEngine`` takes it),
    answer trainer rank 0 until it stops."""
    from dapo.model.loading import load_tokenizer
    from dapo.rollout import remote
    from dapo.runtime import parallel

    env = os.environ if env is None else env
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    index = rank - (size - cfg.rollout.ranks)
    device = str(parallel.rank_device(cfg.model.device, env))
    store = parallel.job_store(env)
    authkey = os.urandom(32)  # the store is the job's trust boundary (docs/security.md); this keeps strays out
    listener = Listener((_reachable_host(env["MASTER_ADDR"]), 0), authkey=authkey)
    host, port = listener.address[:2]
    store.set(_key(index), json.dumps({"host": host, "port": port, "authkey": authkey.hex()}))
    requests, weights = Channel(listener.accept()), Channel(listener.accept())  # in the order rank 0 connects
    listener.close()
    m = cfg.model
    tokenizer = load_tokenizer(m.path, revision=m.revision, trust_remote_code=m.trust_remote_code)
    threads = cfg.rollout.engine_threads or torch.get_num_threads()
    remote.serve(requests, weights, build, cfg.rollout, cfg.model, tokenizer, max_model_len, threads, device)
    requests.close()
    weights.close()
    if "TORCHELASTIC_RUN_ID" in env:  # a torchrun worker: its process has nothing left to do
        # end as the rollout process (a multiprocessing child) does, without the interpreter's teardown, in which a
        # rollout rank aborted now and then ("terminate called without an active exception": a C++ thread of
        # torch's still joinable); a Ray worker returns instead, its actor living on until the job ends
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class RankEngines(Sleepless):
    """Trainer rank 0's engine when the rollout runs on rollout ranks: ``generate`` splits the prompts among them
    and puts their answers back in order; ``update_weights`` sends each the numbered version."""

    def __init__(self, num_ranks: int, env: dict | None = None):
        from dapo.runtime import parallel

        store = parallel.job_store(env)
        self.version = 0
        self._lock, self._weights_lock = threading.Lock(), threading.Lock()
        self._requests: list[Channel] = []
        self._weights: list[Channel] = []
        for i in range(num_ranks):  # the store's get waits for the key: for the rank to be up and listening
            where = json.loads(store.get(_key(i)))
            authkey = bytes.fromhex(where["authkey"])
            self._requests.append(Channel(Client((where["host"], where["port"]), authkey=authkey)))
            self._weights.append(Channel(Client((where["host"], where["port"]), authkey=authkey)))
        backends = {self._answer(i, self._requests[i], START_TIMEOUT_S, "starting") for i in range(num_ranks)}
        self.backend = backends.pop() if len(backends) == 1 else "mixed"

    def use_version(self, version: int) -> None:
        self.version = version

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generation:
        w = len(self._requests)
        shares = [(len(prompt_ids) * r // w, len(prompt_ids) * (r + 1) // w) for r in range(w)]
        with self._lock:
            for r, (lo, hi) in enumerate(shares):  # all sent first: the ranks generate at the same time
                if hi > lo:  # each rank its own seed: shares must not repeat each other's samples
                    share = replace(params, seed=params.seed * w + r)
                    self._requests[r].send(("generate", self.version, prompt_ids[lo:hi], share))
            parts = [
                self._answer(r, self._requests[r], None, "generating") for r, (lo, hi) in enumerate(shares) if hi > lo
            ]
        return concat_generations(parts)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> None:
        """Every rollout rank gets weights ``version``; each loads it when a request first names it."""
        packed = pack(named_tensors)
        with self._weights_lock:
            for channel in self._weights:
                channel.send((version, packed))
            for r, channel in enumerate(self._weights):
                self._answer(r, channel, None, "receiving weights")

    @staticmethod
    def _answer(rank_index: int, channel: Channel, timeout: float | None, doing: str):
        try:
            if timeout is not None and not channel.poll(timeout):
                raise RemoteEngineError(f"rollout rank {rank_index} did not answer in {timeout:.0f} s while {doing}")
            answer = channel.recv()
        except (EOFError, OSError) as err:
            raise RemoteEngineError(
                f"rollout rank {rank_index} closed its connection while {doing} ({type(err).__name__}); its own "
                "log says why"
            ) from err
        return payload_of(answer, f"rollout rank {rank_index}", doing)

    def close(self) -> None:
        """Tell every rollout rank to stop (each ends its process's run); a rank in the middle of a request is not
        waited for: the run is ending."""
        if self._lock.acquire(timeout=1.0):
            try:
                for channel in self._requests:
                    with contextlib.suppress(OSError):
                        channel.send(("stop",))
            finally:
                self._lock.release()
        for channel in self._requests + self._weights:
            channel.close()
