// Stream-K tail of the forward kernel's static persistent schedule (tiles of equal cost).
//
// With T tiles on G CTAs the stride walk gives ceil(T / G) tiles to some CTAs and floor(T / G)
// to the others: the last wave runs T mod G tiles while the rest of the SMs idle (at 16k tokens
// and hdim 128 on the H200, 2048 tiles are 15.5 waves of 132: 3% of the run). With a stream-K
// tail the plain kernel stops after floor(T / G) waves, and a second kernel (kStreamKPieces) cuts
// the n-blocks of the T mod G tiles left (the units) into one contiguous range per CTA: CTA c takes
// units [begin(c), begin(c+1)), tile by tile, so a tile is computed in pieces by consecutive CTAs.
// Each piece runs the usual mainloop over its n-blocks and ends with the unnormalised output, the
// running max and this thread's share of the running sum of its rows. Per warp (a warp's rows are
// its own in every piece: the same thread holds the same rows), the pieces of a tile meet in
// global memory:
//   - each piece adds 1 to the tile's arrival counter (once per CTA);
//   - a piece that is not the last to arrive writes its state to its slot and raises its ready
//     flag (release);
//   - the last to arrive waits for the other pieces' ready flags (acquire), merges every piece in
//     piece order (a fixed order, so the result does not depend on which piece came last: the
//     forward stays bitwise repeatable), and finishes the tile as usual (finalize, epilogue).
// Only the last arrival waits, and only for pieces that have already arrived, so the CTAs need
// not be resident together: there is no deadlock whatever order the hardware runs them in.
// The launch zeroes the counters and flags (workspace) before every run.
#pragma once

#include <cutlass/cutlass.h>

#include <cmath>
#include <cute/tensor.hpp>

#include "sm90/stream_k_tail.hpp"
#include "sm90/trace_sm90.hpp"
#include "sm90/utils_sm90.hpp"

namespace cuflash::sm90 {

// Device: where a CTA of the pieces' kernel is in its range. Every role of the CTA walks the same
// cursor. kEnabled false (every other kernel): never used, no code.
template <bool kEnabled>
struct StreamKCursor {
  // The current piece's first unit and the end of this CTA's range; the rest of the piece is
  // computed when asked (the producer has few registers to keep it in).
  int unit = 0;
  int unit_end = 0;

  // This CTA's first tile; num_tiles when its range is empty.
  CUTLASS_DEVICE int start(StreamKTail const& sk, int num_tiles) {
    int const cta = int(blockIdx.x);
    unit = cta < sk.sk_ctas ? sk.begin(cta) : 0;
    unit_end = cta < sk.sk_ctas ? sk.begin(cta + 1) : 0;
    return tile(sk, num_tiles);
  }
  // The tile after the current piece's: the next tile's first unit.
  CUTLASS_DEVICE int next(StreamKTail const& sk, int num_tiles) {
    unit = stream_k_next_unit(sk, unit);
    return tile(sk, num_tiles);
  }
  CUTLASS_DEVICE StreamKPiece piece(StreamKTail const& sk) const {
    return stream_k_piece(sk, unit, unit_end);
  }

 private:
  CUTLASS_DEVICE int tile(StreamKTail const& sk, int num_tiles) const {
    return unit < unit_end ? sk.dp_tiles + unit / sk.n_blocks : num_tiles;
  }
};

// Device: meets the other pieces of a tile (see the top of this file); called by every MMA
// thread. arrival: an int of shared memory; barrier_id: a named barrier of the MMA threads.
// out: this thread's accumulator as (rows, cols); row_max / row_sum: the online softmax state of
// its rows. Returns true when this piece is the tile's last: then out and the state hold the
// merged tile.
template <int kNumMmaThreads, int kRows, class TensorO>
CUTLASS_DEVICE bool stream_k_meet(StreamKTail const& sk, StreamKPiece const& piece, int cta,
                                  int thread_idx, int* arrival, int barrier_id, TensorO& out,
                                  float (&row_max)[kRows],
                                  float (&row_sum)[kRows], float scale_log2) {
  using namespace cute;
  constexpr int kWarps = kNumMmaThreads / 32;
  constexpr int kCols = decltype(size<1>(out))::value;
  static_assert(decltype(size<0>(out))::value == kRows && kRows == 2 && kCols % 4 == 0);
  // A slot: kVecs float4 per thread, thread-minor (each warp store is 512 contiguous bytes),
  // written and read through L2 (the reader is another SM).
  constexpr int kVecs = kRows * kCols / 4 + 1;  // the output, then (max, max, sum, sum)
  int const warp = thread_idx / 32, lane = thread_idx % 32;
  auto slot_vec = [&](int slot, int v) {
    return reinterpret_cast<float4*>(sk.partial) +
           (size_t(slot) * kVecs + v) * kNumMmaThreads + thread_idx;
  };

  // Which arrival this piece is, decided once for the whole CTA (the epilogue that follows
  // synchronises the MMA warpgroups): thread 0 adds, the others read it from shared memory. The
  // first barrier keeps the previous piece's value until every thread has read it.
  cutlass::arch::NamedBarrier::sync(kNumMmaThreads, barrier_id);
  if (thread_idx == 0) *arrival = atomicAdd(sk.sync + sk.arrival_index(piece.tile), 1);
  cutlass::arch::NamedBarrier::sync(kNumMmaThreads, barrier_id);
  int const arrived = *reinterpret_cast<int volatile*>(arrival);
  trace::mark(thread_idx, trace::kMeetArrived);
  int const own = cta - piece.first_cta;
  if (arrived < piece.num_pieces - 1) {
    int const slot = sk.slot(cta, piece.tile);
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < kCols; n += 4)
        __stcg(slot_vec(slot, (m * kCols + n) / 4),
               make_float4(out(m, n), out(m, n + 1), out(m, n + 2), out(m, n + 3)));
    }
    __stcg(slot_vec(slot, kVecs - 1), make_float4(row_max[0], row_max[1], row_sum[0], row_sum[1]));
    // Each lane's stores are made visible device-wide before lane 0 raises the flag.
    __threadfence();
    __syncwarp();
    if (lane == 0) semaphore_increment(sk.sync + sk.ready_index(slot, warp, kWarps));
    return false;
  }
  // The last piece: every other piece has arrived; wait until its state is written. Every lane
  // polls (one request per warp) and acquires for itself.
  for (int p = 0; p < piece.num_pieces; ++p) {
    if (p != own)
      semaphore_poll_eq(sk.sync + sk.ready_index(sk.slot(piece.first_cta + p, piece.tile), warp, kWarps), 1);
  }
  // Maxima first, then every piece's rows rescaled to them and summed in piece order. Each term
  // is one fused multiply-add whether the piece is this thread's registers or a slot, so the bits
  // do not depend on which piece came last.
  float max_all[kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < kRows; ++m) max_all[m] = row_max[m];
  for (int p = 0; p < piece.num_pieces; ++p) {
    if (p == own) continue;
    float4 const stats = __ldcg(slot_vec(sk.slot(piece.first_cta + p, piece.tile), kVecs - 1));
    max_all[0] = fmaxf(max_all[0], stats.x);
    max_all[1] = fmaxf(max_all[1], stats.y);
  }
  // A row no piece saw a key for keeps max -inf: its factors are all 0.
  auto factor = [&](float piece_max, int m) {
    return piece_max == -INFINITY ? 0.f : exp2f((piece_max - max_all[m]) * scale_log2);
  };
  // Piece p's (max, max, sum, sum).
  auto stats_of = [&](int p) {
    return p == own ? make_float4(row_max[0], row_max[1], row_sum[0], row_sum[1])
                    : __ldcg(slot_vec(sk.slot(piece.first_cta + p, piece.tile), kVecs - 1));
  };
  float sum_all[kRows] = {0.f, 0.f};
  // Row by row, and within a row piece by piece, so that a slot's loads for the row are issued
  // together (the merge is bound by their latency otherwise); each element, and the row's sum,
  // still adds its terms in piece order.
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < kRows; ++m) {
    float acc[kCols];
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < kCols; ++n) acc[n] = 0.f;
    for (int p = 0; p < piece.num_pieces; ++p) {
      float4 const stats = stats_of(p);
      float const f = factor(m == 0 ? stats.x : stats.y, m);
      sum_all[m] = __fmaf_rn(m == 0 ? stats.z : stats.w, f, sum_all[m]);
      if (p == own) {
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < kCols; ++n) acc[n] = __fmaf_rn(out(m, n), f, acc[n]);
      } else {
        int const slot = sk.slot(piece.first_cta + p, piece.tile);
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < kCols; n += 4) {
          float4 const v = __ldcg(slot_vec(slot, (m * kCols + n) / 4));
          acc[n] = __fmaf_rn(v.x, f, acc[n]);
          acc[n + 1] = __fmaf_rn(v.y, f, acc[n + 1]);
          acc[n + 2] = __fmaf_rn(v.z, f, acc[n + 2]);
          acc[n + 3] = __fmaf_rn(v.w, f, acc[n + 3]);
        }
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < kCols; ++n) out(m, n) = acc[n];
  }
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < kRows; ++m) {
    row_max[m] = max_all[m];
    row_sum[m] = sum_all[m];
  }
  return true;
}

}  // namespace cuflash::sm90
