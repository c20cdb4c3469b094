#!/usr/bin/env bash
# The test suite as `make test` runs it, on an emulated slower 2-core machine met for the first time: torch's AVX-512
# and AMX kernels off (ATen's ATEN_CPU_CAPABILITY, oneDNN's ONEDNN_MAX_CPU_ISA), one core kept busy by a spinning
# process beside it, and empty caches, as a fresh clone on a fresh machine has them: torch.compile's compiled kernels
# (TORCHINDUCTOR_CACHE_DIR), vLLM's model inspection (VLLM_CACHE_ROOT), matplotlib's font list (MPLCONFIGDIR), the
# caches under XDG_CACHE_HOME and the repository's bytecode. Each pays its one-time cost inside the run, as on CI.
# Fixed CPU-bound loops are timed before and after the suite: a machine that slows during the run (a cloud host's
# neighbours) shows as a longer second time, so two runs' figures can be told apart from a change's effect.
#   scripts/slow_machine_test.sh [LOG]        # prints the wall time, the CPU seconds and the 30 slowest tests
set -euo pipefail
cd "$(dirname "$0")/.."
log=${1:-/tmp/slow_machine_test.log}
fresh=$(mktemp -d)
find src tests scripts benchmarks -name __pycache__ -type d -prune -exec rm -rf {} +
export TORCHINDUCTOR_CACHE_DIR=$fresh/torchinductor VLLM_CACHE_ROOT=$fresh/vllm MPLCONFIGDIR=$fresh/matplotlib \
    XDG_CACHE_HOME=$fresh/cache
python3 -c 'while True: pass' &
spinner=$!
trap 'kill $spinner; rm -rf "$fresh"' EXIT
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
probe() {  # CPU seconds of 50 million Python additions and of 3,000 256x256 matmuls on one thread
    .venv/bin/python -c '
import time
import torch
torch.set_num_threads(1)
t = time.process_time(); sum(range(50_000_000)); py = time.process_time() - t
a = torch.randn(256, 256)
t = time.process_time()
for _ in range(3000):
    a @ a
print(f"{py:.2f} s (Python), {time.process_time() - t:.2f} s (torch)")'
}
before=$(probe)
/usr/bin/time -f "wall %e s, CPU %U s user + %S s system" env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest \
    -q -n "${TEST_WORKERS:-4}" --dist loadfile --no-loadscope-reorder --durations=30 -p no:cacheprovider > "$log" 2>&1 || true
tail -n 45 "$log"
echo "CPU probe: ${before} before the suite; $(probe) after"
