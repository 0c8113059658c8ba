#!/usr/bin/env bash
# On a machine with an NVIDIA GPU whose image brings its own torch (the H200 runs
# used torch 2.11 + CUDA 13): install the wheels found in $WHEELS (default .whl:
# executorch 1.5.1 cp312 and friends, --no-deps so torch stays the image's) into
# $SITE (default /tmp/site), and build the runtime with CUDA and the benchmark
# hooks against that torch in build/cuda. Source it from the repository root: it
# exports PYTHONPATH (and PATH) for the commands after it. Where executorch is
# already installed, leave $WHEELS empty or absent.
set -e
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH=$SITE:$PWD/build/cuda/site
export PATH=$SITE/bin:$PATH
cmake -S runtime -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DOFFGRAPH_KV_BENCHMARKS=ON -DPython_EXECUTABLE="$(command -v python3)" \
  -DCMAKE_PREFIX_PATH="$SITE" >/tmp/cmake.log 2>&1 || { cat /tmp/cmake.log; exit 1; }
grep -E "offgraph-kv:" /tmp/cmake.log
cmake --build build/cuda >/tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
# Lay the package out as an install would: offgraph_kv/<stage> from the top-level folders.
rm -rf build/cuda/site && mkdir -p build/cuda/site/offgraph_kv
for d in backend partitioner runtime schemas; do cp -r $d build/cuda/site/offgraph_kv/; done
cp build/cuda/_runtime*.so build/cuda/_bench*.so build/cuda/site/offgraph_kv/runtime/
cp build/cuda/generated/manifest_generated.py build/cuda/site/offgraph_kv/schemas/
python3 -c "import offgraph_kv.runtime as r, torch; print('runtime ok, torch', torch.__version__, torch.cuda.get_device_name())"
