#!/usr/bin/env bash
# The runtime under AddressSanitizer + UndefinedBehaviorSanitizer: the C++ unit
# tests, then one end-to-end generation with growths (a toy program exported
# here, run through executorch.runtime with the sanitizer runtimes preloaded
# into Python and the sanitized _runtime module in place of the installed one).
#   bash tools/sanitize.sh [OUT_DIR]     (after the README's install; ~3 min on 2 cores)
# Exit status 0 only if both parts ran clean; the log ends with a summary line.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/sanitize-out}
build=build/sanitize
mkdir -p "$out"
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S runtime -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DOFFGRAPH_KV_CUDA=OFF \
  -DPython_EXECUTABLE="$(command -v python)" "-DCMAKE_CXX_FLAGS=$flags" \
  "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined" \
  > "$out/configure.log"
cmake --build "$build" > "$out/build.log"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 ctest --test-dir "$build" --output-on-failure > "$out/unit.log" 2>&1
grep "tests passed" "$out/unit.log"

# The package as installed, with the sanitized extension module swapped in.
site="$build/site"
rm -rf "$site" && mkdir -p "$site/offgraph_kv"
for d in backend partitioner runtime schemas; do cp -r "$d" "$site/offgraph_kv/"; done
cp "$build"/_runtime*.so "$site/offgraph_kv/runtime/"
cp "$build/generated/manifest_generated.py" "$site/offgraph_kv/schemas/"
pte="$out/toy.pte"
[ -f "$pte" ] || python tools/sanitize_generation.py export "$pte" > "$out/export.log" 2>&1
# Python and torch are not instrumented: their leaks are not ours to report.
LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
python tools/sanitize_generation.py run "$pte" "$(realpath "$site")" > "$out/generation.log" 2>&1
tail -2 "$out/generation.log"
echo "sanitize: unit tests and generation clean under ASan + UBSan"
