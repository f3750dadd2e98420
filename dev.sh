#!/usr/bin/env bash
# memkit's one entry point for building on a fresh machine.
#   ./dev.sh example   build and run the main example
#   ./dev.sh test      build everything and run the whole test suite (what CI runs)
#   ./dev.sh bench     build and run the benchmarks
# Installs missing Debian packages when run as root; otherwise prints the exact command to run.
set -euo pipefail
cd "$(dirname "$0")"

build_dir=${MEMKIT_BUILD_DIR:-build}
jobs=$(nproc 2>/dev/null || echo 2)

# Debian package -> a file that proves it is installed.
declare -A package_probe=(
  [cmake]=/usr/bin/cmake
  [g++]=/usr/bin/g++
  [ninja-build]=/usr/bin/ninja
  [doctest-dev]=/usr/include/doctest/doctest.h
  [libbenchmark-dev]=/usr/include/benchmark/benchmark.h
  [libopenblas-dev]=/usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h  # GEMM baseline and the MEMKIT_USE_CBLAS test
  [openmpi-bin]=/usr/bin/mpirun.openmpi                                    # runs the sharded optimizer tests (tests/mpi)
  [libopenmpi-dev]=/usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h          # dist/mpi_communicator.hpp
)
missing=()
for package in "${!package_probe[@]}"; do
  [[ -e ${package_probe[$package]} ]] || missing+=("$package")
done
if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "memkit: installing missing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "memkit: missing Debian packages: ${missing[*]}" >&2
    echo "memkit: run:  sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
fi

# The CUDA Toolkit is not a Debian package here; use it when it is installed.
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
command -v nvcc >/dev/null || echo "memkit: nvcc not found: building and testing the host parts only" >&2

if [[ ! -f $build_dir/CMakeCache.txt ]]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi

case ${1:-} in
  example)
    cmake --build "$build_dir" -j "$jobs" --target memkit_example_train_llama
    # Writes its CSV, SVG and checkpoints under train_llama_out/ (next to where it runs); flags follow.
    "$build_dir"/examples/memkit_example_train_llama "${@:2}"
    ;;
  test)
    cmake --build "$build_dir" -j "$jobs"
    # Say up front whether the GPU suite can run here (CTest lists it as Skipped when it cannot).
    if [[ -x $build_dir/tests/memkit_cuda_tests ]]; then "$build_dir"/tests/memkit_cuda_tests --memkit-gpu-probe; fi
    ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"
    ;;
  bench)
    cmake --build "$build_dir" -j "$jobs"
    for bench in "$build_dir"/bench/memkit_bench_*; do "$bench"; done
    ;;
  *)
    echo "usage: $0 example|test|bench" >&2
    exit 2
    ;;
esac
