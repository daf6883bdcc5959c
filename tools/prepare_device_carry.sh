#!/usr/bin/env bash
# Prepares the git-ignored folders that tools/gpu_check.sh needs on the GPU machine, which has
# no network: .cutlass/include (CUTLASS/CuTe headers from the nvidia-cutlass wheel) and
# .deps/googletest (GoogleTest sources, built there). Carry both with the call.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}

include=$("$python" -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))" 2>/dev/null || true)
if [[ -z $include || ! -f $include/cute/tensor.hpp ]]; then
  "$python" -m pip install --no-deps nvidia-cutlass==4.2.0.0
  include=$("$python" -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
fi
rm -rf "$root/.cutlass" && mkdir -p "$root/.cutlass" && cp -r "$include" "$root/.cutlass/include"

gtest_src=/usr/src/googletest
if [[ ! -d $gtest_src ]]; then
  apt-get update && apt-get install -y --no-install-recommends googletest
fi
rm -rf "$root/.deps/googletest" && mkdir -p "$root/.deps" && cp -r "$gtest_src" "$root/.deps/googletest"
du -sh "$root/.cutlass" "$root/.deps"
