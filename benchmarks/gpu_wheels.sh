#!/usr/bin/env bash
# Wheels of the project's dependencies that the lent GPU machine's Python (3.12, with CUDA JAX,
# flax, optax, orbax, torch, numpy, pillow, sentencepiece, absl, etils, protobuf, PyYAML) lacks,
# at the versions of requirements/constraints.txt, into .whl/ (git-ignored) for the `run` tool
# to carry. Run here, once, from the repository root:  benchmarks/gpu_wheels.sh
# On the GPU machine benchmarks/benchmark_gpu.sh installs them into /tmp/site before the plan.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=()
for name in grain array-record portpicker ml-collections clu tensorboardX ftfy wcwidth; do
    pin=$(grep -i -E "^${name//-/[-_]}==" requirements/constraints.txt || true)
    [ -n "$pin" ] || { echo "no pin for $name in requirements/constraints.txt" >&2; exit 1; }
    pins+=("$pin")
done
mkdir -p .whl  # keep one version of each there: two stop the install
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls -l .whl
