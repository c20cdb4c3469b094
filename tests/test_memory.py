"""Each phase's peak memory (perf/peak_rss_<phase>_gb): its own peak, enclosing phases get their children's."""

import sys
import time

import pytest

from dapo.runtime.memory import GIB, PhaseMemory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident set read from /proc (Linux)")
MIB = 2**20


def touched(mib: int) -> bytearray:
    return bytearray(b"\x01") * (mib * MIB)  # written, so resident (not lazily mapped zero pages)


def test_each_phase_gets_its_own_peak_and_the_enclosing_one_the_largest():
    mem = PhaseMemory(interval_s=0.001)
    base = mem.rss_bytes()
    mem.enter("step")
    mem.enter("update")
    block = touched(300)
    mem.exit("update")
    del block  # a large block goes back to the system at once (mmap'd)
    mem.enter("eval")
    mem.exit("eval")
    mem.exit("step")
    peaks = mem.take()
    mem.close()
    assert peaks["perf/peak_rss_update_gb"] * GIB >= base + 290 * MIB
    assert peaks["perf/peak_rss_eval_gb"] * GIB < base + 100 * MIB  # not the run's peak so far: its own
    assert peaks["perf/peak_rss_step_gb"] == peaks["perf/peak_rss_update_gb"]
    assert not any("cuda" in k for k in peaks)


def test_a_peak_freed_before_the_phase_ends_is_still_seen():
    """Only the background samples can see it: at the phase's start and end the block is not there."""
    mem = PhaseMemory(interval_s=0.002)
    base = mem.rss_bytes()
    mem.enter("old_logprob")
    block = touched(200)
    time.sleep(0.2)
    del block
    mem.exit("old_logprob")
    peak = mem.take()["perf/peak_rss_old_logprob_gb"] * GIB
    mem.close()
    assert peak >= base + 190 * MIB


def test_take_starts_afresh_and_a_phase_entered_twice_keeps_its_larger_peak():
    mem = PhaseMemory(interval_s=0.001)
    base = mem.rss_bytes()
    mem.enter("checkpoint")
    block = touched(150)
    mem.exit("checkpoint")
    del block
    mem.enter("checkpoint")
    mem.exit("checkpoint")
    first = mem.take()
    assert first["perf/peak_rss_checkpoint_gb"] * GIB >= base + 140 * MIB
    assert mem.take() == {}
    mem.enter("checkpoint")
    mem.exit("checkpoint")
    assert mem.take()["perf/peak_rss_checkpoint_gb"] * GIB < base + 100 * MIB
    mem.close()


def test_a_phase_block_closes_its_phase_when_it_raises():
    mem = PhaseMemory(interval_s=0.001)
    with pytest.raises(KeyError), mem.phase("update"):
        raise KeyError("x")
    with mem.phase("eval"):
        pass
    assert set(mem.take()) == {"perf/peak_rss_update_gb", "perf/peak_rss_eval_gb"}
    assert mem._open == []
    mem.close()


def test_close_while_the_sampler_goes_to_sleep_does_not_hang(monkeypatch):
    """close() arriving just as the sampler, finding no phase open, clears its wake-up: the wake-up close
    sets must not be lost (it was, once, and close() waited forever on the thread)."""
    import threading
    import types

    from dapo.runtime import memory

    holder = {}

    class CloseDuringClear(threading.Event):
        def clear(self):
            if "closer" not in holder:  # the first time the sampler goes to sleep: close() runs now
                holder["closer"] = threading.Thread(target=holder["mem"].close, daemon=True)
                holder["closer"].start()
                time.sleep(0.2)  # close() has had every chance to set its wake-up before this clear()
            super().clear()

    fake = types.SimpleNamespace(Lock=threading.Lock, Thread=threading.Thread, Event=CloseDuringClear)
    monkeypatch.setattr(memory, "threading", fake)
    mem = holder["mem"] = PhaseMemory(interval_s=0.001)
    mem.enter("update")
    mem.exit("update")  # nothing open: the sampler's next round clears the wake-up
    deadline = time.monotonic() + 10
    while "closer" not in holder and time.monotonic() < deadline:
        time.sleep(0.01)
    holder["closer"].join(timeout=10)
    assert not holder["closer"].is_alive(), "close() never returned: the sampler slept through its wake-up"
    assert not mem._thread.is_alive()
