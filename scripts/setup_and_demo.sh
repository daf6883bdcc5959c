#!/usr/bin/env bash
# Fresh Debian machine with the CUDA toolkit (no GPU needed) -> built cuflash and a demo run:
# installs the build dependencies, configures (CUDA kernels when nvcc exists), builds with two
# jobs and runs examples/cuflash_demo (GPU when one is usable, else the CPU reference).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

setup_environment
configure_and_build OFF
log "Running the demo"
"$CUFLASH_BUILD_DIR/examples/cuflash_demo"
