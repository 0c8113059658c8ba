#!/usr/bin/env bash
# On the H200 machine (torch 2.11 + CUDA 13 image): install the carried wheels
# (executorch 1.5.1 cp312 and friends, --no-deps: torch stays the image's) and
# build the runtime with CUDA against that torch. Source it: exports PYTHONPATH.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/build/cuda/site
export PATH=/tmp/site/bin:$PATH
cmake -S runtime -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DOFFGRAPH_KV_BENCHMARKS=ON -DPython_EXECUTABLE="$(command -v python3)" \
  -DCMAKE_PREFIX_PATH=/tmp/site >/tmp/cmake.log 2>&1 || { cat /tmp/cmake.log; exit 1; }
grep -E "offgraph-kv:" /tmp/cmake.log
cmake --build build/cuda >/tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
# Lay the package out as an install would: offgraph_kv/<stage> from the top-level folders.
rm -rf build/cuda/site && mkdir -p build/cuda/site/offgraph_kv
for d in backend partitioner runtime schemas; do cp -r $d build/cuda/site/offgraph_kv/; done
cp build/cuda/_runtime*.so build/cuda/_bench*.so build/cuda/site/offgraph_kv/runtime/
cp build/cuda/generated/manifest_generated.py build/cuda/site/offgraph_kv/schemas/
python3 -c "import offgraph_kv.runtime as r, torch; print('runtime ok, torch', torch.__version__, torch.cuda.get_device_name())"
