#!/usr/bin/env bash
# The test suite as `make test` runs it, on an emulated slower 2-core machine: torch's AVX-512 and AMX kernels off
# (ATen's ATEN_CPU_CAPABILITY, oneDNN's ONEDNN_MAX_CPU_ISA) and one core kept busy by a spinning process beside it.
#   scripts/slow_machine_test.sh [LOG]        # prints the wall time, the CPU seconds and the 30 slowest tests
set -euo pipefail
cd "$(dirname "$0")/.."
log=${1:-/tmp/slow_machine_test.log}
python3 -c 'while True: pass' &
spinner=$!
trap 'kill $spinner' EXIT
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
/usr/bin/time -f "wall %e s, CPU %U s user + %S s system" .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-4}" \
    --dist loadfile --no-loadscope-reorder --durations=30 -p no:cacheprovider > "$log" 2>&1 || true
tail -n 45 "$log"
