#!/usr/bin/env bash
# The CPU kernels alone, outside a compiled program: a kernel of the working tree against the same
# file at another git revision, in turns (shared cores drift; turns make it land on both alike).
#   bash benchmarks/cpu/native/run.sh attention_from_memory REV [rounds [rows]] # rows_attention.cpp (decode)
#   bash benchmarks/cpu/native/run.sh wide_attention REV [rounds]          # rows_attention.cpp (64-wide steps)
#   bash benchmarks/cpu/native/run.sh dynamic_linear_rows REV [rounds]     # dynamic_linear.cpp
#   bash benchmarks/cpu/native/run.sh decode_linear_from_memory REV [rounds] # decode_linear.cpp (bf16, int8, int4)
#   bash benchmarks/cpu/native/run.sh wide_linear_rows REV [rounds]         # decode_linear.cpp, steps of 2-64 rows
# Flags: inductor's ISA flags for this machine (as the export compiles the kernels), -O3, OpenMP.
set -euo pipefail
cd "$(dirname "$0")/../../.."
bench=$1 rev=$2 rounds=${3:-3}
shift $(($# < 3 ? $# : 3))  # the rest goes to the benchmark
case $bench in
  attention_from_memory | wide_attention) source=backend/native/rows_attention.cpp ;;
  dynamic_linear_rows) source=backend/native/dynamic_linear.cpp ;;
  decode_linear_from_memory | wide_linear_rows) source=backend/native/decode_linear.cpp ;;
  *) echo "unknown benchmark $bench" >&2; exit 2 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# (the attention kernel was decode_attention.cpp before it took every step width)
git show "$rev:$source" > "$work/$(basename "$source")" 2>/dev/null ||
  git show "$rev:backend/native/decode_attention.cpp" > "$work/$(basename "$source")"
for header in backend/native/*.h; do  # the revision's headers beside its file (today's where it had none)
  git show "$rev:$header" > "$work/$(basename "$header")" 2>/dev/null || cp "$header" "$work/"
done
flags=$(python -c "from offgraph_kv.backend.cpu_kernels import _compile_flags; print(' '.join(_compile_flags()))")
for which in before after; do
  src=$([ $which = before ] && echo "$work/$(basename "$source")" || echo "$PWD/$source")
  g++ $flags -I backend/native -DKERNEL_SOURCE="\"$src\"" "benchmarks/cpu/native/$bench.cpp" \
      benchmarks/cpu/native/shim_stubs.cpp -o "$work/$which" 2>&1 | grep -E "error" || true
done
for i in $(seq "$rounds"); do
  for which in before after; do echo "$which ($([ $which = before ] && echo "$rev" || echo working tree)):"; OMP_NUM_THREADS=1 "$work/$which" "$@"; done
done
