#!/usr/bin/env bash
# memkit's one entry point for building on a fresh machine.
#   ./dev.sh example   build and run the main example
#   ./dev.sh test      build everything and run the whole test suite (what CI runs)
#   ./dev.sh bench     build (in build-bench/, optimized) and run the benchmarks
#   ./dev.sh fuzz [seconds]  run each libFuzzer target (tests/fuzz/) for [seconds] (default 120: 10 minutes)
#   ./dev.sh gpu-build       build the CUDA tests, benchmarks and example for a GPU (sm_90 unless MEMKIT_GPU_ARCH
#                            says otherwise; no GPU needed) in build-gpu/ and stage them in build-gpu/carry/;
#                            MEMKIT_GPU_CUDNN=1 also builds attention::cudnn (-DMEMKIT_USE_CUDNN=ON: its tests and
#                            the BM_flash_cuda_cudnn rows; cuDNN's libraries are not carried: the GPU machine's own,
#                            or PyTorch's nvidia-cudnn wheel, which `./dev.sh gpu` puts on LD_LIBRARY_PATH);
#                            MEMKIT_GPU_CUDNN=0 turns it off again in an existing build-gpu/; the peers' wheels
#                            (Liger, bitsandbytes slimmed to CUDA 13) go to build-gpu/carry/wheels/ when pip can
#                            download them (alone: python3 bench/gpu/peer_wheels.py stage DIR)
#   ./dev.sh gpu [OUTDIR] [options]  on a machine with an NVIDIA GPU: the GPU suite, every CUDA benchmark, the
#                            PyTorch peers and the example's device run, in at most 8 minutes; writes
#                            OUTDIR/results.md and results.json (bench/gpu/measure.py --help). Without a GPU it
#                            says so and exits 0. It uses build-gpu/carry/ (or build-gpu/) when present, else
#                            builds first (nvcc, CMake, doctest and Google Benchmark needed there)
# Installs missing Debian packages when run as root; otherwise prints the exact command to run.
set -euo pipefail
cd "$(dirname "$0")"

# `bench` and `example` build in directories of their own: the test build compiles the benchmarks and the host
# example for smoke runs only (-O1).
case ${1:-} in
  gpu-build) build_dir=${MEMKIT_GPU_BUILD_DIR:-build-gpu} ;;
  bench) build_dir=${MEMKIT_BENCH_BUILD_DIR:-build-bench} ;;
  example) build_dir=${MEMKIT_EXAMPLE_BUILD_DIR:-build-example} ;;
  *) build_dir=${MEMKIT_BUILD_DIR:-build} ;;
esac
jobs=$(nproc 2>/dev/null || echo 2)

# `gpu` runs on a GPU machine, which may have no package registry: it installs nothing, and builds only when no
# binaries were built (or carried) beforehand.
if [[ ${1:-} == gpu ]]; then
  if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then export PATH=/usr/local/cuda/bin:$PATH; fi
  if nvidia-smi -L 2>/dev/null | grep -q '^GPU' && [[ ! -x build-gpu/carry/tests/memkit_cuda_tests && ! -x build-gpu/tests/memkit_cuda_tests ]]; then
    echo "memkit gpu: no CUDA binaries in build-gpu/: building them first (./dev.sh gpu-build)"
    MEMKIT_GPU_ARCH=${MEMKIT_GPU_ARCH:-native} "$0" gpu-build
  fi
  exec python3 bench/gpu/measure.py "${@:2}"
fi

# Debian package -> a file that proves it is installed.
declare -A package_probe=(
  [cmake]=/usr/bin/cmake
  [g++]=/usr/bin/g++
  [ninja-build]=/usr/bin/ninja
  [doctest-dev]=/usr/include/doctest/doctest.h
  [libbenchmark-dev]=/usr/include/benchmark/benchmark.h
  [libopenblas-dev]=/usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h  # GEMM baseline and the MEMKIT_USE_CBLAS test
  [openmpi-bin]=/usr/bin/mpirun.openmpi                                    # runs the sharded optimizer tests (tests/mpi)
  [libopenmpi-dev]=/usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h          # distributed/mpi_communicator.hpp
  [clang-14]=/usr/bin/clang++-14                                            # the clang -Werror and sanitizer checks
  [libclang-rt-14-dev]=/usr/lib/llvm-14/lib/clang/14.0.6/lib/linux/libclang_rt.asan-x86_64.a  # ASan, UBSan, TSan, libFuzzer
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

# The SASS check (tests/sass/sass_check.py) reads the kernels' machine code with cuobjdump and nvdisasm. A CUDA
# toolkit installed from pip wheels lacks them; they come as pip wheels of their own.
if command -v nvcc >/dev/null && ! command -v cuobjdump >/dev/null && command -v python3 >/dev/null; then
  purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [[ ! -x $purelib/nvidia/cu13/bin/cuobjdump || ! -x $purelib/nvidia/cu13/bin/nvdisasm ]]; then
    sass_tools=(nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.2.51)
    if [[ $(id -u) == 0 ]]; then
      echo "memkit: installing cuobjdump and nvdisasm for the SASS check: ${sass_tools[*]}"
      python3 -m pip install -q "${sass_tools[@]}" >/dev/null 2>&1 ||
        echo "memkit: pip could not install ${sass_tools[*]}; the SASS check will report Skipped" >&2
    else
      echo "memkit: the SASS check needs: python3 -m pip install ${sass_tools[*]}" >&2
    fi
  fi
fi

if [[ ${1:-} == gpu-build && ! -f $build_dir/CMakeCache.txt ]]; then
  command -v nvcc >/dev/null || { echo "memkit: gpu-build needs nvcc (the CUDA Toolkit)" >&2; exit 1; }
  # Device code for the GPU's architecture (90: H100 / H200), host code optimized as a user builds it.
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${MEMKIT_GPU_ARCH:-90}" \
    -DMEMKIT_CLANG_CHECKS=OFF
fi
# attention::cudnn for the GPU build (option off unless asked; the setting stays in build-gpu/'s cache).
if [[ ${1:-} == gpu-build && -n ${MEMKIT_GPU_CUDNN:-} ]]; then
  cmake -S . -B "$build_dir" -DMEMKIT_USE_CUDNN="$([[ $MEMKIT_GPU_CUDNN == 1 ]] && echo ON || echo OFF)" >/dev/null
fi
if [[ ! -f $build_dir/CMakeCache.txt ]]; then
  configure=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
  [[ ${1:-} == bench || ${1:-} == example ]] || configure+=(-DMEMKIT_BENCHMARK_SMOKE_BUILD=ON -DMEMKIT_EXAMPLE_SMOKE_BUILD=ON)
  # Without a GPU here the CUDA code is only compiled, never run: one virtual architecture (compute_90: the
  # device code through cicc to PTX, no ptxas), device code at nvcc's fastest compile level and host code of
  # the .cu files unoptimized (-O0; it was about 60% of their compile time at -O3): adam_cuda_test.cu 68 ->
  # 32 s of CPU (measured 2026-11-26). The SASS check (tests/sass) still compiles its kernels for sm_80 and
  # sm_90 with ptxas and reads them. With a GPU, CMakeLists.txt's defaults (or the user's choice) stand.
  if command -v nvcc >/dev/null && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    configure+=(-DCMAKE_CUDA_ARCHITECTURES=90-virtual "-DCMAKE_CUDA_FLAGS_RELEASE=-O0 -DNDEBUG -Ofc=max")
  fi
  cmake -S . -B "$build_dir" "${configure[@]}"
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
  gpu-build)
    gpu_targets=(memkit_cuda_tests memkit_example_train_llama_cuda memkit_bench_bandwidth_cuda memkit_bench_quant_cuda
      memkit_bench_adam_cuda memkit_bench_attention_cuda memkit_bench_loss_cuda)
    with_cudnn=$(sed -n 's/^MEMKIT_USE_CUDNN:BOOL=//p' "$build_dir/CMakeCache.txt")
    [[ $with_cudnn == ON ]] && gpu_targets+=(memkit_cudnn_tests)
    cmake --build "$build_dir" -j "$jobs" --target "${gpu_targets[@]}"
    # build-gpu/carry/: the binaries (host symbols stripped) and the libraries they need beyond glibc, libstdc++
    # and the CUDA Toolkit (Google Benchmark), small enough to carry to a GPU machine; commit.json says what
    # they were built from.
    carry=$build_dir/carry
    rm -rf "$carry" && mkdir -p "$carry/tests" "$carry/examples" "$carry/bench" "$carry/lib"
    cp "$build_dir/tests/memkit_cuda_tests" "$carry/tests/"
    # Not libcudnn*: about 530 MB (its engine libraries), past what a GPU visit can carry (64 MiB).
    [[ $with_cudnn == ON ]] && cp "$build_dir/tests/memkit_cudnn_tests" "$carry/tests/"
    cp "$build_dir/examples/memkit_example_train_llama_cuda" "$carry/examples/"
    cp "$build_dir"/bench/memkit_bench_*_cuda "$carry/bench/"
    strip --strip-unneeded "$carry"/tests/* "$carry"/examples/* "$carry"/bench/* 2>/dev/null || true
    for binary in "$carry"/tests/* "$carry"/examples/* "$carry"/bench/*; do
      ldd "$binary" | awk '/=> \// {print $3}' | grep -E 'libbenchmark' || true
    done | sort -u | while read -r lib; do cp -L "$lib" "$carry/lib/"; done
    printf '{"commit": "%s", "describe": "%s", "source_dir": "%s", "built": "%s", "nvcc": "%s", "arch": "%s", "cudnn": "%s"}\n' \
      "$(git rev-parse HEAD 2>/dev/null || echo unknown)" "$(git describe --always --dirty 2>/dev/null || echo unknown)" \
      "$PWD" "$(date -u '+%Y-%m-%d %H:%M UTC')" "$(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')" \
      "$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$build_dir/CMakeCache.txt")" "${with_cudnn:-OFF}" \
      >"$carry/commit.json"
    # The PyTorch peers a GPU machine may lack (Liger, bitsandbytes) as wheels, as far as the carry's 64 MiB allow
    # (bench/gpu/peer_wheels.py; MEMKIT_GPU_PEER_WHEELS=0 leaves them out). measure.py installs them there.
    if [[ ${MEMKIT_GPU_PEER_WHEELS:-1} != 0 ]]; then
      python3 bench/gpu/peer_wheels.py stage "$carry/wheels" || echo "memkit: peer wheels not staged" >&2
    fi
    du -sh "$carry"
    echo "memkit: carry $carry to the GPU machine and run ./dev.sh gpu OUTDIR there"
    ;;
  bench)
    cmake --build "$build_dir" -j "$jobs"
    for bench in "$build_dir"/bench/memkit_bench_*; do "$bench"; done
    ;;
  fuzz)
    # A clang build of the libFuzzer targets with ASan + UBSan (tests/checks.cmake), then each target for
    # [seconds], starting from the committed corpus and regressions. New interesting inputs go to
    # $fuzz_dir/corpus/<target>/ (copy the worthwhile ones to tests/fuzz/corpus/), crashes to
    # $fuzz_dir/findings/<target>/ (minimize, fix, add to tests/fuzz/regressions/). Exit 1 on any finding.
    seconds=${2:-120}
    fuzz_dir=${MEMKIT_FUZZ_BUILD_DIR:-build-fuzz}
    if [[ ! -f $fuzz_dir/CMakeCache.txt ]]; then
      cmake -S . -B "$fuzz_dir" -G Ninja -DCMAKE_CXX_COMPILER="$(command -v clang++-14 || command -v clang++)" \
        -DCMAKE_BUILD_TYPE=Release -DMEMKIT_CHECK_BUILD=libfuzzer -DMEMKIT_BUILD_BENCHMARKS=OFF \
        -DMEMKIT_BUILD_EXAMPLES=OFF -DMEMKIT_BUILD_TOOLS=OFF -DMEMKIT_ENABLE_CUDA=OFF -DMEMKIT_CLANG_CHECKS=OFF
    fi
    cmake --build "$fuzz_dir" -j "$jobs"
    findings=0
    for target in json safetensors hf_config bnb_linear4bit adam_state bnb_adam_state sharded_adam_state peft_adapter consolidate; do
      mkdir -p "$fuzz_dir/corpus/$target" "$fuzz_dir/findings/$target"
      inputs=("$fuzz_dir/corpus/$target" "tests/fuzz/corpus/$target")
      [[ -d tests/fuzz/regressions/$target ]] && inputs+=("tests/fuzz/regressions/$target")
      before=$(find "$fuzz_dir/findings/$target" -type f | wc -l)
      # -malloc_limit_mb: one allocation above 2 GiB is a finding (sizes taken from the input unchecked).
      "$fuzz_dir/tests/fuzz/memkit_fuzz_$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
        -malloc_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$fuzz_dir/findings/$target/" \
        "${inputs[@]}" >"$fuzz_dir/$target.log" 2>&1 || true
      after=$(find "$fuzz_dir/findings/$target" -type f | wc -l)
      executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$fuzz_dir/$target.log" | tail -1)
      echo "memkit fuzz: $target: ${executions:-?} executions in ${seconds} s, $((after - before)) new findings (log: $fuzz_dir/$target.log)"
      findings=$((findings + after - before))
      [[ -n $executions ]] || { echo "memkit fuzz: $target did not run to the end (see its log)" >&2; findings=$((findings + 1)); }
    done
    ((findings == 0)) || { echo "memkit fuzz: $findings findings in $fuzz_dir/findings/" >&2; exit 1; }
    ;;
  *)
    echo "usage: $0 example|test|bench|fuzz [seconds]|gpu-build|gpu [OUTDIR]" >&2
    exit 2
    ;;
esac
