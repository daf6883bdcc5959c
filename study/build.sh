#!/bin/bash
# usage: build.sh <src.cu> <out-prefix> [extra nvcc flags]
set -e
WT=${WT:-/work/wt-bwd256b}
src=$1; out=$2; shift 2
/usr/local/cuda/bin/nvcc -DCUFLASH_HAS_CUDA=1 -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -I$WT/include -I$WT/src -I/work/main/.cutlass/include -I/work/main/build-local/generated -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math -lineinfo -Xcompiler=-Wno-unused-parameter -DCUTLASS_ENABLE_GDC_FOR_SM90 -std=c++17 -Xptxas -v -cubin "$@" -o $out.cubin $src 2> $out.ptxas.txt
grep -E "Compiling entry|registers|spill" $out.ptxas.txt | grep -B1 -A2 "flash_bwd_kernel" | head -20
