#!/usr/bin/env bash
# The GPU benchmark plan (benchmarks/benchmark_gpu.py) on a machine whose Python has CUDA JAX but
# not every dependency: installs the wheels benchmarks/gpu_wheels.sh put in .whl/ (if any), then runs
#   benchmarks/benchmark_gpu.sh OUT_DIR [benchmark_gpu.py flags, e.g. --parts step,torch --deadline 560]
# BENCH=benchmarks/gpu_speed.py runs that plan instead (the speed levers beside PyTorch).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 OUT_DIR [benchmark_gpu.py flags]" >&2; exit 2; }
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=$1
shift
exec "${PYTHON:-python3}" "${BENCH:-benchmarks/benchmark_gpu.py}" --out "$out" "$@"
