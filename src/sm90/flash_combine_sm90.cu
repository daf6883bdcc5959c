// Split-KV combine: merges the fp32 partial outputs of the splits by their log-sum-exp,
//   lse = log(sum_s exp(lse_s)),  out = sum_s exp(lse_s - lse) * out_s,
// one warp per (row, head). A split with lse -inf (it saw no key) has weight 0 and its partial
// output does not enter the sum (it may hold anything); a row where every split is -inf, or past
// seqused, gives out 0, lse -inf. After a split-KV forward the kernel is that kernel's
// programmatic dependent: it is scheduled while the forward's last CTAs run and waits for them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "api/kernels.hpp"
#include "api/params.hpp"
#include "cuflash/error.hpp"
#include "cuflash/tensor.hpp"

namespace cuflash::sm90 {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxDimPerLane = 8;  // head_dim <= 256
// Splits whose partial outputs a lane loads before it adds any of them: the loads of a decode's
// few splits then wait for memory once per group rather than once per split.
constexpr int kSplitsPerLoad = 4;

__device__ __forceinline__ void store_out(float value, float* ptr) { *ptr = value; }
__device__ __forceinline__ void store_out(float value, __half* ptr) {
  *ptr = __float2half_rn(value);
}
__device__ __forceinline__ void store_out(float value, __nv_bfloat16* ptr) {
  *ptr = __float2bfloat16_rn(value);
}

template <class OutT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    flash_combine_kernel(CombineParams const p, bool const packed, std::int64_t const num_rows) {
  // Launched as the forward's programmatic dependent: wait for that grid's partials. Without
  // the launch attribute there is nothing to wait for.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  std::int64_t const task = std::int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  int const lane = threadIdx.x % 32;
  if (task >= num_rows * p.num_heads) return;
  int const head = int(task % p.num_heads);
  std::int64_t const row = task / p.num_heads;

  // Where the row lives, and whether seqused leaves it out.
  std::int64_t batch = 0, pos = row;
  bool valid = true;
  if (packed) {
    if (p.cu_seqlens != nullptr) {
      // Rows before the first sequence or past the last (a padded batch) belong to none: not
      // written, as the reference leaves them (the forward's partials hold nothing there).
      if (row < p.cu_seqlens[0] || row >= p.cu_seqlens[p.batch]) return;
      int lo = 0, hi = p.batch;  // last sequence whose start is <= row
      while (hi - lo > 1) {
        int const mid = (lo + hi) / 2;
        if (p.cu_seqlens[mid] <= row)
          lo = mid;
        else
          hi = mid;
      }
      if (p.seqused != nullptr) valid = row - p.cu_seqlens[lo] < p.seqused[lo];
    } else if (p.seqused != nullptr) {
      valid = row < p.seqused[0];
    }
  } else {
    batch = row / p.seqlen;
    pos = row % p.seqlen;
    if (p.seqused != nullptr) valid = pos < p.seqused[batch];
  }
  std::int64_t const op_base =
      batch * p.op_batch_stride + pos * p.op_row_stride + head * p.op_head_stride;
  std::int64_t const lp_base =
      batch * p.lp_batch_stride + pos * p.lp_row_stride + head * p.lp_head_stride;

  float max_lse = -INFINITY;
  if (valid) {
    for (int s = lane; s < p.num_splits; s += 32)
      max_lse = fmaxf(max_lse, p.lse_partial[lp_base + s * p.lp_split_stride]);
    for (int offset = 16; offset > 0; offset /= 2)
      max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffff, max_lse, offset));
  }
  float lse = -INFINITY;
  float acc[kMaxDimPerLane] = {};
  if (max_lse != -INFINITY) {
    float sum = 0.f;
    for (int s = lane; s < p.num_splits; s += 32)
      sum += expf(p.lse_partial[lp_base + s * p.lp_split_stride] - max_lse);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
    lse = max_lse + logf(sum);
    // Splits in groups of 32, lane j holding split s0 + j's weight (0 where it saw no key), and
    // within a group kSplitsPerLoad splits' partials loaded before any is added. The sum runs
    // over the splits in order, as one split at a time would.
    for (int s0 = 0; s0 < p.num_splits; s0 += 32) {
      int const count = min(32, p.num_splits - s0);
      float weight_of_lane = 0.f;
      int seen_by_lane = 0;  // the split saw a key (lse above -inf): its partial enters the sum
      if (lane < count) {
        float const split_lse = p.lse_partial[lp_base + (s0 + lane) * p.lp_split_stride];
        seen_by_lane = split_lse != -INFINITY;
        if (seen_by_lane) weight_of_lane = expf(split_lse - lse);
      }
      for (int j0 = 0; j0 < count; j0 += kSplitsPerLoad) {
        float part[kSplitsPerLoad][kMaxDimPerLane];
#pragma unroll
        for (int u = 0; u < kSplitsPerLoad; ++u) {
          // Past the group's end: the group's last split again, a valid address, not added.
          int const s = s0 + min(j0 + u, count - 1);
          float const* split_out = p.out_partial + op_base + s * p.op_split_stride;
#pragma unroll
          for (int i = 0; i < kMaxDimPerLane; ++i) {
            int const d = lane + 32 * i;
            part[u][i] = d < p.head_dim ? split_out[d] : 0.f;
          }
        }
#pragma unroll
        for (int u = 0; u < kSplitsPerLoad; ++u) {
          float const weight = __shfl_sync(0xffffffff, weight_of_lane, (j0 + u) & 31);
          int const seen = __shfl_sync(0xffffffff, seen_by_lane, (j0 + u) & 31);
          if (j0 + u < count && seen) {
#pragma unroll
            for (int i = 0; i < kMaxDimPerLane; ++i) acc[i] += weight * part[u][i];
          }
        }
      }
    }
  }
  OutT* out = static_cast<OutT*>(p.out) + batch * p.o_batch_stride + pos * p.o_row_stride +
              head * p.o_head_stride;
#pragma unroll
  for (int i = 0; i < kMaxDimPerLane; ++i) {
    int const d = lane + 32 * i;
    if (d < p.head_dim) store_out(acc[i], out + d);
  }
  if (p.lse != nullptr && lane == 0) {
    p.lse[batch * p.lse_batch_stride + pos * p.lse_row_stride + head * p.lse_head_stride] = lse;
  }
}

}  // namespace

void run_combine(const CombineParams& params, StreamHandle stream, bool after_forward) {
  if (params.head_dim > 32 * kMaxDimPerLane) {
    throw Error(Error::Kind::kNotSupported, "out",
                "the sm90 combine kernel supports head dims up to 256");
  }
  // Packed rows (cu_seqlens, or inputs without a batch dimension) are addressed by row alone.
  bool const packed = params.cu_seqlens != nullptr || params.packed;
  std::int64_t const num_rows =
      packed ? std::int64_t(params.seqlen) : std::int64_t(params.batch) * params.seqlen;
  std::int64_t const num_tasks = num_rows * params.num_heads;
  if (num_tasks == 0) return;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned((num_tasks + kWarpsPerBlock - 1) / kWarpsPerBlock));
  config.blockDim = dim3(kWarpsPerBlock * 32);
  config.dynamicSmemBytes = 0;
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = overlap;
  config.numAttrs = after_forward ? 1 : 0;
  cudaError_t status = cudaSuccess;
  switch (DType(params.out_dtype)) {
    case DType::kFloat16:
      status = cudaLaunchKernelEx(&config, flash_combine_kernel<__half>, params, packed, num_rows);
      break;
    case DType::kBFloat16:
      status = cudaLaunchKernelEx(&config, flash_combine_kernel<__nv_bfloat16>, params, packed,
                                  num_rows);
      break;
    default:
      status = cudaLaunchKernelEx(&config, flash_combine_kernel<float>, params, packed, num_rows);
      break;
  }
  if (status == cudaSuccess) status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw Error(
        Error::Kind::kCuda, "",
        std::string("cuflash combine: kernel launch failed: ") + cudaGetErrorString(status));
  }
}

}  // namespace cuflash::sm90
