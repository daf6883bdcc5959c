# Shared by setup_and_demo.sh and setup_and_test.sh (sourced, not run): installs what the build
# needs on a fresh Debian machine with the CUDA toolkit, then configures and builds cuflash.
#
# Environment (all optional):
#   CUFLASH_ENABLE_CUDA  ON / OFF; default ON when nvcc is found (PATH or /usr/local/cuda/bin)
#   CUFLASH_KERNEL_SET   ci (default) | all | custom, see CMakeLists.txt
#   CUFLASH_BUILD_DIR    build folder (default: build/ in the checkout)
#   CUFLASH_JOBS         parallel compile jobs (default 2: a CuTe kernel takes gigabytes)
#   PYTHON               interpreter to install the Python build tools into (default python3)

set -euo pipefail

CUFLASH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CUFLASH_BUILD_DIR=${CUFLASH_BUILD_DIR:-$CUFLASH_ROOT/build}
CUFLASH_JOBS=${CUFLASH_JOBS:-2}
CUFLASH_KERNEL_SET=${CUFLASH_KERNEL_SET:-ci}
PYTHON=${PYTHON:-python3}
CUTLASS_PIP_VERSION=4.2.0.0
JAX_PIP_VERSION=0.10.2

log() { printf '\n==> %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# cmake, a C++ toolchain, GoogleTest and Python from Debian, for whatever is missing.
install_system_packages() {
  local missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v g++ >/dev/null 2>&1 || missing+=(g++)
  command -v make >/dev/null 2>&1 || missing+=(make)
  [ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
  command -v "$PYTHON" >/dev/null 2>&1 || missing+=(python3 python3-pip python3-venv)
  if [ ${#missing[@]} -eq 0 ]; then
    return
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: missing ${missing[*]} and no apt-get to install them" >&2
    exit 1
  fi
  log "Installing ${missing[*]} (apt-get)"
  as_root apt-get update
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

# An interpreter that pip may install into: the given one, or a virtual environment in the
# build folder when the system marks its Python as externally managed (PEP 668).
select_python() {
  local managed
  managed=$("$PYTHON" - <<'PY'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
print("yes" if os.path.exists(marker) and not in_venv else "no")
PY
)
  if [ "$managed" = yes ]; then
    local venv="$CUFLASH_ROOT/build-venv"
    if [ ! -x "$venv/bin/python" ]; then
      log "Creating a virtual environment in $venv (the system Python is externally managed)"
      "$PYTHON" -m venv "$venv" || {
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv
        "$PYTHON" -m venv "$venv"
      }
    fi
    PYTHON="$venv/bin/python"
    export PATH="$venv/bin:$PATH"
  fi
  PYTHON=$(command -v "$PYTHON")
}

# CUTLASS/CuTe headers (the nvidia-cutlass wheel ships them) and the Python build tools.
install_python_packages() {
  log "Installing nvidia-cutlass==$CUTLASS_PIP_VERSION and the Python build tools into $PYTHON"
  "$PYTHON" -m pip install --disable-pip-version-check --no-deps "nvidia-cutlass==$CUTLASS_PIP_VERSION"
  "$PYTHON" -m pip install --disable-pip-version-check \
    "nanobind>=2.0" "scikit-build-core>=0.10" numpy pytest ml_dtypes
}

# JAX (CPU) for the tests of the JAX custom calls (tests/python/test_jax_*.py), installed before the
# package so that its build finds jaxlib's XLA FFI headers. Those tests skip without it, so a
# failed download is reported and the run goes on.
install_test_packages() {
  log "Installing jax==$JAX_PIP_VERSION (CPU) for the JAX tests"
  "$PYTHON" -m pip install --disable-pip-version-check "jax==$JAX_PIP_VERSION" ||
    log "warning: jax could not be installed; the JAX tests will skip"
}

# ON when nvcc is present (the build needs no GPU), unless CUFLASH_ENABLE_CUDA says otherwise.
detect_cuda() {
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  if [ -z "${CUFLASH_ENABLE_CUDA:-}" ]; then
    if command -v nvcc >/dev/null 2>&1; then CUFLASH_ENABLE_CUDA=ON; else CUFLASH_ENABLE_CUDA=OFF; fi
  fi
  export CUFLASH_ENABLE_CUDA CUFLASH_KERNEL_SET
  if [ "$CUFLASH_ENABLE_CUDA" = ON ]; then
    log "CUDA: $(command -v nvcc) ($(nvcc --version | tail -n 1)); kernel set '$CUFLASH_KERNEL_SET'"
  else
    log "CUDA: off (nvcc not found or CUFLASH_ENABLE_CUDA=OFF); building the CPU reference only"
  fi
}

# configure_and_build ON|OFF: builds cuflash, the demo and (when ON) the tests.
configure_and_build() {
  local tests=$1
  log "Configuring $CUFLASH_BUILD_DIR (tests $tests)"
  cmake -S "$CUFLASH_ROOT" -B "$CUFLASH_BUILD_DIR" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCUFLASH_ENABLE_CUDA="$CUFLASH_ENABLE_CUDA" \
    -DCUFLASH_KERNEL_SET="$CUFLASH_KERNEL_SET" \
    -DCUFLASH_BUILD_TESTS="$tests" \
    -DPython3_EXECUTABLE="$PYTHON"
  log "Building with $CUFLASH_JOBS jobs"
  local start=$SECONDS
  local build_log="$CUFLASH_BUILD_DIR/build_output.log"
  cmake --build "$CUFLASH_BUILD_DIR" -j "$CUFLASH_JOBS" 2>&1 | tee "$build_log"
  log "Built in $((SECONDS - start)) s"
  check_wgmma_pipelining "$build_log"
}

# ptxas names the kernels whose WGMMAs it had to serialise ("(C75xx) Potential Performance Loss:
# wgmma.mma_async instructions are serialized ..."): each GEMM is then waited for before the next
# is issued, a large loss that no test sees. A build that prints one fails, naming them.
check_wgmma_pipelining() {
  local found
  found=$(grep -o "(C75[0-9][0-9]) Potential Performance Loss: wgmma[^']*'[^']*'" "$1" | sort -u || true)
  if [ -n "$found" ]; then
    echo "error: ptxas serialised the WGMMAs of these kernels (see $1):" >&2
    echo "$found" >&2
    return 1
  fi
}

setup_environment() {
  install_system_packages
  select_python
  install_python_packages
  detect_cuda
}
