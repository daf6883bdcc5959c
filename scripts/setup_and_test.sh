#!/usr/bin/env bash
# Fresh Debian machine with the CUDA toolkit (no GPU needed) -> every test run: installs the
# build dependencies, builds cuflash with its tests, runs them with ctest, then installs the
# Python package (pip install .) and runs pytest on tests/python. Fails on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

setup_environment
configure_and_build ON

log "C++ tests (ctest)"
ctest --test-dir "$CUFLASH_BUILD_DIR" --output-on-failure -j "$CUFLASH_JOBS"

cd "$CUFLASH_ROOT"
shopt -s nullglob
python_tests=(tests/python/test_*.py tests/python/*_test.py)
shopt -u nullglob
if [ ! -f pyproject.toml ] || [ ${#python_tests[@]} -eq 0 ]; then
  log "Python tests: none yet (no pyproject.toml or no tests/python/test_*.py); skipping pytest"
  exit 0
fi

install_test_packages
log "Installing the Python package (pip install .)"
start=$SECONDS
CMAKE_BUILD_PARALLEL_LEVEL="$CUFLASH_JOBS" \
  "$PYTHON" -m pip install --disable-pip-version-check --no-build-isolation .
log "Python package built in $((SECONDS - start)) s"

log "Python tests (pytest)"
status=0
"$PYTHON" -m pytest tests/python -ra || status=$?
if [ "$status" -eq 5 ]; then
  # pytest's 5 means that no test was collected: test files that hold no test are a failure.
  echo "error: pytest collected no tests from ${python_tests[*]}" >&2
  exit 1
fi
exit "$status"
