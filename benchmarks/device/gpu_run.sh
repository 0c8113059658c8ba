#!/usr/bin/env bash
# Everything the GPU evidence needs, in the order of what matters most, each
# step's output under $OUT. Run from the repository root on a machine with an
# NVIDIA GPU:
#   bash benchmarks/device/gpu_run.sh tests     # unit tests, growth copy, attention kernels, CUDA pytest, memcheck (~9 min)
#   bash benchmarks/device/gpu_run.sh cuda      # unit tests, growth copy, CUDA pytest, memcheck (~6 min)
#   bash benchmarks/device/gpu_run.sh growth    # growth copy vs memcpy only (~2 min)
#   bash benchmarks/device/gpu_run.sh profile   # kernels and GPU-busy time per decode step (4 layers)
#   bash benchmarks/device/gpu_run.sh bench     # python -m benchmarks.cuda, 32 layers, to 32K tokens
#   bash benchmarks/device/gpu_run.sh static    # python -m benchmarks.cuda.static: baseline 2 beside offgraph-kv (~7 min)
#   bash benchmarks/device/gpu_run.sh long      # 100K-token generation (16 layers) + what the checks cost per step (~8 min;
#                                               # reuses /tmp/long/long_run.pte: `long_run --build-only` in an earlier run)
#   bash benchmarks/device/gpu_run.sh sessions  # sessions, rewind, saved contexts and map growth on CUDA, + builds the long-run program
#   bash benchmarks/device/gpu_run.sh kernels   # our Triton kernels: GPU kernel tests, their oracle tests, kernels vs torch (~5 min)
#   bash benchmarks/device/gpu_run.sh kernels-alone  # the kernels vs torch without the 16-layer programs (SWEEP=1: + variant sweeps)
#   bash benchmarks/device/gpu_run.sh sanitize  # compute-sanitizer memcheck / racecheck / synccheck over our kernels with graphs (~5 min)
#   bash benchmarks/device/gpu_run.sh graphs    # CUDA-graph decode: graphs on/off vs the gpt-fast recipe, then its CUDA tests (~8 min;
#                                               # GRAPHS_ARGS=--skip-max leaves out the recipe at max capacity)
#   bash benchmarks/device/gpu_run.sh 8b-build  # exports the Llama-3-8B-shaped program to /tmp/w8b (~8 min)
#   bash benchmarks/device/gpu_run.sh 8b        # ... then load it cold and time decode at 1K / 8K / 32K (~2 min)
# A second argument, where a mode takes one, is its layer count (long: its token count).
# Environment (all optional):
#   OUT            where the outputs go (default build/gpu_run)
#   TIME_BUDGET_S  seconds one mode may take in all (default 600); steps that would
#                  start too late are skipped, long steps are cut to what is left
#   GPU_TAG        the GPU's name in the result files (default h200: cuda_${TAG}.json, ...)
#   WHEELS, SITE   see gpu_setup.sh (wheels to install when the image lacks executorch)
set +e
OUT=${OUT:-$PWD/build/gpu_run}
BUDGET=${TIME_BUDGET_S:-600}
TAG=${GPU_TAG:-h200}
mkdir -p "$OUT"
# Seconds left before the budget less a margin (for what runs after the step).
time_left() { echo $((BUDGET - $1 - SECONDS)); }
source benchmarks/device/gpu_setup.sh > "$OUT/setup.log" 2>&1 || { tail -30 "$OUT/setup.log"; exit 1; }
set +e
export AOTI_RUNTIME_CHECK_INPUTS=1
case "${1:-tests}" in
  tests|cuda)
    ctest --test-dir build/cuda --output-on-failure > "$OUT/unit.txt" 2>&1; tail -3 "$OUT/unit.txt"
    grep -E "^  |Failed" "$OUT/unit.txt"
    tests="tests/test_cuda.py"
    python3 -m benchmarks.cuda.growth --out "$OUT/cuda_growth_${TAG}.json" > "$OUT/growth.txt" 2>&1
    grep -E "PASS|FAIL|grid|Error" "$OUT/growth.txt" | cut -c1-230
    if [ "$1" = tests ]; then
    tests="$tests tests/test_host_runner.py"
    python3 -m benchmarks.cuda.attention --out "$OUT/cuda_attention_${TAG}.json" > "$OUT/attention.txt" 2>&1
    grep -E " 32768 | 8192 " "$OUT/attention.txt"
    fi
    rm -rf /tmp/pt
    timeout 480 python3 -u -m pytest -q -p no:cacheprovider $tests \
      --basetemp=/tmp/pt -rs --junitxml="$OUT/cuda_tests_${TAG}.junit.xml" > "$OUT/pytest_cuda.txt" 2>&1
    grep -E "passed|failed" "$OUT/pytest_cuda.txt" | tail -1
    left=$(time_left 15)
    [ $left -gt 60 ] || { echo "no time left for memcheck"; exit 0; }
    timeout $left compute-sanitizer --tool memcheck python3 -m benchmarks.cuda.sanitize /tmp/pt/pte0/toy_1.pte \
      > "$OUT/cuda_memcheck_${TAG}.log" 2>&1
    grep -E "^length|ERROR SUMMARY" "$OUT/cuda_memcheck_${TAG}.log"
    ;;
  bench)
    # The bf16 oracle tests beside the bench's compile (their GPU work ends before the bench times anything).
    timeout 240 python3 -u -m pytest -q -p no:cacheprovider tests/test_cuda.py -k bf16 --basetemp=/tmp/pt -rs \
      --junitxml="$OUT/cuda_bf16_tests_${TAG}.junit.xml" > "$OUT/pytest_bf16.txt" 2>&1 &
    export AOTI_RUNTIME_CHECK_INPUTS=0
    timeout $(time_left 25) python3 -m benchmarks.cuda --workdir /tmp/cuda_bench --out "$OUT/cuda_${TAG}.json" ${2:+--layers $2} \
      > "$OUT/bench.txt" 2>&1
    grep -E "PASS|FAIL|n/a|Error" "$OUT/bench.txt"
    wait
    grep -E "passed|failed" "$OUT/pytest_bf16.txt" | tail -1
    ;;
  static)
    export AOTI_RUNTIME_CHECK_INPUTS=0
    timeout $(time_left 20) python3 -m benchmarks.cuda.static --workdir /tmp/cuda_static --out "$OUT/cuda_static_${TAG}.json" \
      ${2:+--layers $2} > "$OUT/static.txt" 2>&1
    grep -E "PASS|FAIL|n/a|Error|baseline 2:|offgraph-kv" "$OUT/static.txt" | cut -c1-400
    ;;
  long)
    export AOTI_RUNTIME_CHECK_INPUTS=1
    timeout $(time_left 60) python3 -m benchmarks.cuda.long_run --workdir /tmp/long --out "$OUT/long_run_${TAG}.json" \
      --reuse ${2:+--tokens $2} > "$OUT/long.txt" 2>&1
    grep -vE "Warning|warn|generate:" "$OUT/long.txt" | tail -16
    left=$(time_left 20)
    [ $left -gt 60 ] || { echo "no time left for the checks benchmark"; exit 0; }
    timeout $left python3 -m benchmarks.cpu.checks --device cuda --pte /tmp/long/long_run.pte --rounds 3 --steps 300 \
      --out "$OUT/checks_${TAG}.json" > "$OUT/checks.txt" 2>&1
    grep -E "SHA|decode step|Error" "$OUT/checks.txt"
    ;;
  kernels)
    # The oracle tests compile beside the benchmark's two 16-layer programs (their GPU work is small).
    (timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py > "$OUT/pytest_kernels.txt" 2>&1
     timeout 300 python3 -m pytest -q -p no:cacheprovider -n 3 tests/test_cuda.py -k "kernels_mixed or growth" \
       --junitxml="$OUT/cuda_kernels_tests_${TAG}.junit.xml" >> "$OUT/pytest_kernels.txt" 2>&1) &
    export AOTI_RUNTIME_CHECK_INPUTS=0
    timeout $(time_left 30) python3 -m benchmarks.cuda.kernels --layers ${2:-16} --sweep \
      --out "$OUT/cuda_kernels_${TAG}.json" > "$OUT/kernels.txt" 2>&1
    grep -E "^built|build failed|ctx|^\{" "$OUT/kernels.txt" | cut -c1-300
    wait
    grep -E "passed|failed" "$OUT/pytest_kernels.txt"
    ;;
  kernels-alone)
    (timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py > "$OUT/pytest_kernels.txt" 2>&1
     timeout 240 python3 -m pytest -q -p no:cacheprovider -n 2 tests/test_cuda.py -k "kernels_mixed" \
       --junitxml="$OUT/cuda_kernels_tests_${TAG}.junit.xml" >> "$OUT/pytest_kernels.txt" 2>&1) &
    export AOTI_RUNTIME_CHECK_INPUTS=0
    timeout $(time_left 30) python3 -m benchmarks.cuda.kernels --skip-decode ${SWEEP:+--sweep --prefill-sweep} \
      --out "$OUT/cuda_kernels_${TAG}.json" > "$OUT/kernels.txt" 2>&1
    grep -E "ctx|window|^\{|Error" "$OUT/kernels.txt" | cut -c1-300
    wait
    grep -E "passed|failed" "$OUT/pytest_kernels.txt"
    ;;
  sanitize)
    # Our Triton kernels launched by the compiled code and replayed from captured graphs,
    # across growths (map and copy) and ring wraps, under each of the sanitizer's tools.
    pte=/tmp/sanitize/kernels.pte; mkdir -p /tmp/sanitize
    python3 -m benchmarks.cuda.sanitize --build "$pte" > "$OUT/sanitize_build.txt" 2>&1; tail -1 "$OUT/sanitize_build.txt"
    for run in "memcheck map" "racecheck map" "memcheck copy" "synccheck map" "initcheck map"; do
      set -- $run
      left=$(time_left 10)
      [ $left -gt 30 ] || { echo "no time left for $run"; break; }
      timeout $left compute-sanitizer --tool $1 --error-exitcode 9 python3 -m benchmarks.cuda.sanitize "$pte" \
        --growth $2 --expect-graphs > "$OUT/cuda_${1}_${2}_${TAG}.log" 2>&1
      echo "$1 $2: rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/cuda_${1}_${2}_${TAG}.log" | tr '\n' ' ')"
      grep -E "^graphs" "$OUT/cuda_${1}_${2}_${TAG}.log"
    done
    ;;
  sessions)
    (timeout 400 python3 -m benchmarks.cuda.long_run --workdir /tmp/long --build-only > "$OUT/long_build.txt" 2>&1
     tail -1 "$OUT/long_build.txt" | cut -c1-200) &
    timeout 500 python3 -u -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "session or rewind or map or rejected" \
      --basetemp=/tmp/pt -rs --junitxml="$OUT/cuda_sessions_${TAG}.junit.xml" > "$OUT/pytest_sessions.txt" 2>&1
    grep -E "passed|failed|Error" "$OUT/pytest_sessions.txt" | tail -5
    wait
    ;;
  graphs)
    # The benchmark alone on the machine (tests beside it took CPU and GPU time from its steps), then the tests.
    export AOTI_RUNTIME_CHECK_INPUTS=0
    timeout $(time_left 150) python3 -m benchmarks.cuda.graphs --layers ${2:-16} $GRAPHS_ARGS --out "$OUT/cuda_graphs_${TAG}.json" \
      > "$OUT/graphs.txt" 2>&1
    grep -E "PASS|FAIL|info|Error|error|offgraph-kv graphs|gpt-fast C" "$OUT/graphs.txt" | cut -c1-300
    export AOTI_RUNTIME_CHECK_INPUTS=1
    timeout $(time_left 10) python3 -m pytest -q -p no:cacheprovider -n 3 tests/test_cuda.py tests/test_decode_graphs.py \
       -k "graph or rejected or sessions" --basetemp=/tmp/pt -rs \
       --junitxml="$OUT/cuda_graphs_tests_${TAG}.junit.xml" > "$OUT/pytest_graphs.txt" 2>&1
    grep -E "passed|failed|Error" "$OUT/pytest_graphs.txt" | tail -8
    ;;
  8b-build|8b)
    export AOTI_RUNTIME_CHECK_INPUTS=0
    flag=--reuse; [ "$1" = 8b-build ] && flag=--build-only
    timeout $(time_left 10) python3 -m benchmarks.cpu.weights --device cuda --shapes 8b --variants outside \
      --contexts 1024,8192,32768 --workdir /tmp/w8b $flag --out "$OUT/weights_cuda_8b_${TAG}.json" > "$OUT/w8b.txt" 2>&1
    grep -E "decode at|error|built|load_s|device_used_added" "$OUT/w8b.txt" | cut -c1-300
    ;;
  growth)
    python3 -m benchmarks.cuda.growth --out "$OUT/cuda_growth_${TAG}.json" > "$OUT/growth.txt" 2>&1
    grep -E "PASS|FAIL|grid|Error" "$OUT/growth.txt" | cut -c1-230
    ;;
  profile)
    timeout $(time_left 25) python3 -m benchmarks.cuda.profile --layers ${2:-4} --out "$OUT/cuda_profile_${TAG}.json" \
      > "$OUT/profile.txt" 2>&1
    grep -vE "Warning|warn" "$OUT/profile.txt" | tail -14
    ;;
esac
