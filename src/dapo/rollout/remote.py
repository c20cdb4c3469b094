"""A rollout engine in a process of its own (``rollout.max_staleness`` > 0): it samples while the trainer updates.

The process holds its own copy of the model (HF ``generate``, or vLLM) and answers ``generate`` requests over a
pipe. Weights come as numbered versions (``update_weights(tensors, version)``): the process keeps each version
until a request names it, and loads it between requests, never during one. Which version a request uses is the
caller's choice (``use_version``), so the weights each response was sampled with follow from the schedule alone,
not from how fast either side ran: two runs of the same config sample the same tokens, and a resumed run the
tokens an uninterrupted one would have.

Tensors cross the pipe through shared memory (torch.multiprocessing), not as pickled bytes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import traceback
from collections.abc import Iterable

import torch
import torch.multiprocessing as mp

from dapo.rollout.base import Generation, SamplingParams, Sleepless

START_TIMEOUT_S = 600.0  # loading the model (and vLLM's start-up) in the new process


class RemoteEngineError(RuntimeError):
    """The rollout process failed; the message carries its traceback's last line and where the rest went."""


def payload_of(answer: tuple, who: str, doing: str):
    """An answer of the rollout side, ("ok", payload) or ("error", what), as its payload or the error raised."""
    kind, payload = answer
    if kind == "error":
        raise RemoteEngineError(f"{who} failed while {doing}: {payload}")
    return payload


class RemoteEngine(Sleepless):
    """``generate`` / ``update_weights`` as an in-process engine's, answered by the rollout process. Requests and
    weights go over two pipes: a push is received (by a thread of the rollout process) while a request is being
    generated, so the trainer never waits on generation to hand over weights."""

    def __init__(
        self, build, rollout_cfg, model_cfg, tokenizer, *, max_model_len: int, threads: int, device: str = "cpu"
    ):
        """``build(rollout_cfg, model_cfg, tokenizer, max_model_len=, device=, logprobs=True)``: the engine the
        process answers with (``dapo.rollout.build.engine_of_its_own``; a module-level function, passed by name)."""
        from dapo.model.directory import model_dir

        # the directory the trainer loaded (a hub model's snapshot, resolved once), not the hub again
        model_cfg = dataclasses.replace(model_cfg, path=str(model_dir(model_cfg.path, model_cfg.revision)))
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._weights, child_weights = ctx.Pipe()
        self.version = 0  # the weights version the next request samples with
        self._lock = threading.Lock()  # one request and its answer at a time
        self._weights_lock = threading.Lock()
        self._proc = ctx.Process(
            target=serve,
            args=(child, child_weights, build, rollout_cfg, model_cfg, tokenizer, max_model_len, threads, device),
            name="dapo-rollout",
            daemon=False,  # it may start processes of its own (vLLM's)
        )
        self._proc.start()
        child.close()
        child_weights.close()
        self.backend = self._receive(self._conn, START_TIMEOUT_S, "starting")

    def use_version(self, version: int) -> None:
        self.version = version

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generation:
        with self._lock:
            self._send(self._conn, ("generate", self.version, prompt_ids, params), "generating")
            return self._receive(self._conn, None, "generating")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0) -> None:
        """Hand the process weights ``version``; it loads them when a request first names that version. The
        tensors are copied here, so the trainer may go on changing its own."""
        with self._weights_lock:
            self._send(self._weights, (version, pack(named_tensors)), "receiving weights")
            self._receive(self._weights, None, "receiving weights")

    def _send(self, conn, message, doing: str) -> None:
        try:
            conn.send(message)
        except OSError as err:  # BrokenPipeError, ConnectionResetError: the other end is gone
            raise RemoteEngineError(self._gone(doing)) from err

    def _receive(self, conn, timeout: float | None, doing: str):
        try:
            while not conn.poll(5.0 if timeout is None else timeout):
                if not self._proc.is_alive():
                    raise RemoteEngineError(self._gone(doing))
                if timeout is not None:
                    raise RemoteEngineError(f"the rollout process (pid {self._proc.pid}) did not answer while {doing}")
            answer = conn.recv()
        except (EOFError, OSError) as err:
            raise RemoteEngineError(self._gone(doing)) from err
        return payload_of(answer, "the rollout process", doing)

    def _gone(self, doing: str) -> str:
        """The line for a rollout process that died: its pid, how it ended, and how the run goes on."""
        self._proc.join(timeout=5.0)  # its pipe closes as it dies; its exit status comes a moment later
        code = self._proc.exitcode
        if code is None:
            how = "closed its pipes"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"died ({code})"
        else:
            how = f"exited with code {code}"
        return (
            f"the rollout process (pid {self._proc.pid}) {how} while {doing}; the run stops here: run the same "
            "command again to resume from its last checkpoint"
        )

    def close(self) -> None:
        """Stop the process: asked to when no request is in flight, killed when one is (the run is ending; what
        it was generating is not needed)."""
        if self._proc.is_alive():
            if self._lock.acquire(timeout=1.0):
                try:
                    self._conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
                finally:
                    self._lock.release()
                self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()
        self._weights.close()


def pack(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict, list]:
    """The tensors copied into one flat CPU buffer per dtype (shared memory passes one file descriptor per buffer,
    not one per tensor: a model's hundreds, times the versions pending, would exhaust the process's limit), and
    where each tensor lies in it."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named_tensors:
        by_dtype.setdefault(t.dtype, []).append((name, t.detach()))
    flat, index = {}, []
    for dtype, items in by_dtype.items():
        flat[dtype] = torch.cat([t.reshape(-1).to("cpu") for _, t in items])
        offset = 0
        for name, t in items:
            index.append((name, dtype, tuple(t.shape), offset))
            offset += t.numel()
    return flat, index


def unpack(packed: tuple[dict, list]) -> list[tuple[str, torch.Tensor]]:
    flat, index = packed
    return [(name, flat[dtype][offset : offset + math.prod(shape)].view(shape)) for name, dtype, shape, offset in index]


class _Versions:
    """The weights versions received and not yet loaded, filled by a thread of the rollout process."""

    def __init__(self, conn):
        self.conn, self.pending, self.cond, self.closed = conn, {}, threading.Condition(), False
        threading.Thread(target=self._receive, name="dapo-weights", daemon=True).start()

    def _receive(self) -> None:
        while True:
            try:
                version, tensors = self.conn.recv()
            except (EOFError, OSError):
                with self.cond:
                    self.closed = True
                    self.cond.notify_all()
                return
            with self.cond:
                self.pending[version] = tensors
                self.cond.notify_all()
            self.conn.send(("ok", None))

    def take(self, version: int) -> tuple[dict, list]:
        """Version ``version``'s tensors, waiting for them; older versions are dropped (versions only go forward)."""
        with self.cond:
            while version not in self.pending:
                if self.closed:
                    raise RuntimeError(f"weights version {version} was asked for but never sent")
                self.cond.wait(1.0)
            tensors = self.pending[version]
            for old in [v for v in self.pending if v <= version]:
                del self.pending[old]
            return tensors


def serve(conn, weights_conn, build, rollout_cfg, model_cfg, tokenizer, max_model_len: int, threads: int, device: str):
    """The rollout process (or a rollout rank): build the engine (``build``, as ``RemoteEngine`` takes it), then
    answer requests until told to stop."""
    from dapo.runtime.libraries import setup_library_logging

    setup_library_logging()  # a spawned process starts bare: the libraries' harmless noise stays off the console
    ignore_stop_signals()
    torch.set_num_threads(threads)
    try:
        engine = build(rollout_cfg, model_cfg, tokenizer, max_model_len=max_model_len, device=device, logprobs=True)
        conn.send(("ok", engine.backend))
    except Exception as err:
        conn.send(("error", _describe(err)))
        return
    versions = _Versions(weights_conn)
    loaded = None  # the version the engine's weights are (None: as built; the trainer's version replaces them)
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if message[0] == "stop":
            return
        try:
            _, version, prompt_ids, params = message
            if version != loaded:
                engine.update_weights(unpack(versions.take(version)))
                loaded = version
            conn.send(("ok", engine.generate(prompt_ids, params)))
        except Exception as err:
            conn.send(("error", _describe(err)))


def ignore_stop_signals() -> None:
    """The trainer says when the rollout side stops. A SIGTERM, SIGINT or SIGUSR1 sent to the whole job (a scheduler's
    preemption, Ctrl-C in a terminal) also reaches the trainer, whose checkpoint then waits for the collections in
    flight (docs/async.md): a rollout side that died of the signal would fail them. When the trainer is gone its
    pipe or connection closes and the rollout side ends; SIGKILL still ends it at once."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def _describe(err: BaseException) -> str:
    lines = traceback.format_exception(err)
    return f"{type(err).__name__}: {err} (in {os.getpid()}: {lines[-2].strip() if len(lines) > 1 else ''})"
