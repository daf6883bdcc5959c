// Small device helpers shared by the sm90 kernels: WGMMA issue, accumulator layout views,
// register conversions, shared-memory row clearing. Everything is force-inlined: a call boundary inside a WGMMA
// sequence serialises it (ptxas warning C7510).
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include <cute/tensor.hpp>
#include <limits>

namespace cuflash::sm90 {

// A softmax scale as the launches put it into the kernels' exponent (exp2(s * scale * log2 e -
// ...)): 0 becomes the smallest normal float. With 0 itself a masked score (-inf) times the scale
// is NaN; with FLT_MIN every finite score times it is 0 or next to it and -inf stays -inf, so each
// visible key weighs the same and the masked ones nothing, which is what a scale of 0 means.
inline float exponent_scale(float scale) { return scale == 0.f ? std::numeric_limits<float>::min() : scale; }

// Issues C (+)= A * B over all k-blocks as one WGMMA batch. wait < 0 leaves the batch in
// flight (the caller waits with warpgroup_wait<N>); otherwise waits until <= wait remain.
template <bool kZeroInit, int kWait, class TiledMma, class TensorA, class TensorB, class TensorC>
CUTLASS_DEVICE void gemm(TiledMma& tiled_mma, TensorA const& tCrA, TensorB const& tCrB,
                         TensorC& tCrC) {
  using namespace cute;
  constexpr bool kIsRS =
      !is_base_of<GMMA::DescriptorIterator, typename TensorA::engine_type::iterator>::value;
  if constexpr (kIsRS) warpgroup_fence_operand(const_cast<TensorA&>(tCrA));
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
    cute::gemm(tiled_mma, tCrA(_, _, k_block), tCrB(_, _, k_block), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(tCrC);
  if constexpr (kIsRS) warpgroup_fence_operand(const_cast<TensorA&>(tCrA));
}

// WGMMA accumulator ((2 cols, 2 rows, N/8), MMA_M, MMA_N) viewed as (rows, cols).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(Layout acc) {
  using namespace cute;
  static_assert(decltype(rank(acc))::value == 3);
  static_assert(decltype(rank(get<0>(acc)))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// The same accumulator registers as the A operand of a 16-bit RS WGMMA whose K is the
// accumulator's N: ((2, 2, 2), MMA_M, N/16). Lets P stay in registers for O += P V.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_a_operand_layout(Layout acc) {
  using namespace cute;
  auto col_groups = logical_divide(get<0, 2>(acc), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(col_groups)),
                     get<1>(acc), coalesce(make_layout(get<0, 1>(col_groups), get<2>(acc))));
}

// Converts a register tensor element-wise into `out` (same size), vectorised (cvt.rn.bf16x2 etc.).
template <class TensorIn, class TensorOut>
CUTLASS_DEVICE void convert_into(TensorIn const& in, TensorOut& out) {
  using namespace cute;
  using From = typename TensorIn::value_type;
  using To = typename TensorOut::value_type;
  constexpr int kNumel = decltype(size(in))::value;
  static_assert(kNumel == decltype(size(out))::value);
  cutlass::NumericArrayConverter<To, From, kNumel> convert_op;
  *reinterpret_cast<cutlass::Array<To, kNumel>*>(out.data()) =
      convert_op(*reinterpret_cast<cutlass::Array<From, kNumel> const*>(in.data()));
}

CUTLASS_DEVICE float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Zeroes rows [row_begin, kRows) of a kRows x kCols tile of 16-bit elements in shared memory,
// shared out among num_threads threads from `thread`. element(r, c) is the address of element
// (r, c). By 16-byte chunks: the tiles are loaded with the head dim contiguous, and their
// swizzles move whole chunks, so 8 consecutive elements of a row stay together. The caller
// fences for the async proxy (a WGMMA reads it next) and synchronizes the readers.
template <int kRows, int kCols, class ElementAddress>
CUTLASS_DEVICE void zero_smem_rows(ElementAddress const& element, int row_begin, int thread, int num_threads) {
  static_assert(kCols % 8 == 0, "rows of whole 16-byte chunks");
  constexpr int kChunksPerRow = kCols / 8;
  CUTLASS_PRAGMA_NO_UNROLL
  for (int i = thread; i < (kRows - row_begin) * kChunksPerRow; i += num_threads) {
    uint32_t const chunk = cute::cast_smem_ptr_to_uint(element(row_begin + i / kChunksPerRow, (i % kChunksPerRow) * 8));
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(chunk), "r"(0) : "memory");
  }
}

// One unordered read of a semaphore.
CUTLASS_DEVICE int semaphore_peek(int const* ptr) {
  int current;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(current) : "l"(ptr) : "memory");
  return current;
}
// A semaphore value not read ahead (semaphore_poll_eq's `seen`): the counters are never negative.
constexpr int kSemaphoreNotRead = -1;

// One read with acquire ordering, issued early so that its round trip runs under other work: a
// value that already grants the turn needs no poll and no fence after it (semaphore_poll_eq's
// `seen`). Like any acquire load it discards the SM's L1 lines (CCTL.IVALL), so it is for once
// per turn, not for polling.
CUTLASS_DEVICE int semaphore_peek_acquire(int const* ptr) {
  int current;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(current) : "l"(ptr) : "memory");
  return current;
}

// Spin until *ptr == value (>= 0) by one thread, polling without ordering and then acquiring
// once (an acquire load per poll would also discard the L1 lines of the CTA's other warps each
// time). A backoff between polls (nanosleep, 200 ns) measured no change: what costs is the
// semaphores sharing a line, not how often it is polled (bench/NOTES.md).
// `seen`: a value read earlier by semaphore_peek_acquire, or kSemaphoreNotRead. A match returns
// at once: it was acquired, and it still grants the turn, since the counter moves past `value`
// only once the caller itself has taken its turn.
CUTLASS_DEVICE void semaphore_poll_eq(int const* ptr, int value, int seen = kSemaphoreNotRead) {
  if (seen == value) { return; }
  int current;
  do { current = semaphore_peek(ptr); } while (current != value);
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}

// Release this block's writes to the next: this thread's, and by cumulativity those of the
// threads it synchronized with (a named barrier) or that made theirs visible with a fence.
CUTLASS_DEVICE void semaphore_increment(int* ptr) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(ptr) : "memory");
}

// blockIdx / threadIdx.x read anew at each use (not merged with earlier reads by the compiler).
template <int Dim>
CUTE_DEVICE uint32_t ctaid_volatile() {
  uint32_t v;
  if constexpr (Dim == 0) {
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(v));
  } else if constexpr (Dim == 1) {
    asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(v));
  } else {
    asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(v));
  }
  return v;
}
template <int Dim>
CUTE_DEVICE uint32_t nctaid_volatile() {
  uint32_t v;
  if constexpr (Dim == 0) {
    asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(v));
  } else {
    asm volatile("mov.u32 %0, %%nctaid.y;\n" : "=r"(v));
  }
  return v;
}
CUTE_DEVICE uint32_t tid_x_volatile() {
  uint32_t v;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(v));
  return v;
}

}  // namespace cuflash::sm90
