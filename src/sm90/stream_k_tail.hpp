// The plan of the forward's stream-K tail (stream_k_sm90.hpp has the kernel side): which CTA
// runs which n-blocks of the last wave's tiles, and where a piece's state goes. Plain C++ with
// host-device annotations under nvcc, so that the host tests can check the cut.
#pragma once

#include "sm90/tile_size_sm90.hpp"

#if defined(__CUDACC__)
#define CUFLASH_HOST_DEVICE __host__ __device__
#else
#define CUFLASH_HOST_DEVICE
#endif

namespace cuflash::sm90 {

struct StreamKTail {
  int dp_tiles = 0;   // tiles [0, dp_tiles) go to the stride walk, whole
  int n_blocks = 0;   // n-blocks per tile (every tile has the same)
  int num_units = 0;  // n-blocks of the tail: (num_tiles - dp_tiles) * n_blocks
  int sk_ctas = 0;    // CTAs [0, sk_ctas) share the tail; 0: no stream-K tail
  int grid = 0;       // the plan's grid: more than the tail tiles, and the ready flags' offset
  int* sync = nullptr;       // arrivals [grid] (per tail tile), then ready flags [2 grid][warp]
  float* partial = nullptr;  // [2 grid] slots of a piece's state (stream_k_meet's layout)

  CUFLASH_HOST_DEVICE bool enabled() const { return sk_ctas > 0; }
  CUFLASH_HOST_DEVICE int begin(int cta) const {
    return int((long long)cta * num_units / sk_ctas);
  }
  // The CTA whose range holds unit u.
  CUFLASH_HOST_DEVICE int cta_of(int u) const {
    int c = int((long long)u * sk_ctas / num_units);
    while (c + 1 < sk_ctas && begin(c + 1) <= u) ++c;
    while (c > 0 && begin(c) > u) --c;
    return c;
  }
  // Arrival counter of tail tile j, and ready flag of a slot's warp, as indices into sync: the
  // flags start past every arrival counter (tail tiles < grid), whatever sk_ctas is.
  CUFLASH_HOST_DEVICE int arrival_index(int tile) const { return tile; }
  CUFLASH_HOST_DEVICE int ready_index(int slot, int warp, int warps) const {
    return grid + slot * warps + warp;
  }
  // The slot of CTA c's piece of tail tile j: a CTA has at most two pieces that are not whole
  // tiles, its first (slot 2c) and its last (slot 2c + 1).
  CUFLASH_HOST_DEVICE int slot(int cta, int tile) const {
    return 2 * cta + (begin(cta) / n_blocks == tile ? 0 : 1);
  }
};

// Host: the tail's shape for num_tiles tiles of n_blocks n-blocks on `grid` CTAs, of which
// sk_ctas share the tail (dispatch's count, FwdParams::stream_k_ctas; any count is correct once
// clamped to the grid and to the units, so that every sharing CTA has at least one n-block: the
// pieces of a tile are then exactly the CTAs from its first unit's to its last unit's); disabled
// when sk_ctas is 0 or there is no tail.
inline StreamKTail plan_stream_k_tail(int num_tiles, int n_blocks, int grid, int sk_ctas) {
  StreamKTail plan;
  int const tail_tiles = grid > 0 ? num_tiles % grid : 0;
  if (sk_ctas <= 0 || tail_tiles == 0 || n_blocks <= 0) return plan;
  plan.grid = grid;
  plan.dp_tiles = num_tiles - tail_tiles;
  plan.n_blocks = n_blocks;
  plan.num_units = tail_tiles * n_blocks;
  int const most = grid < plan.num_units ? grid : plan.num_units;
  plan.sk_ctas = sk_ctas < most ? sk_ctas : most;
  return plan;
}

// A piece of a CTA's range: the tail tile (relative to dp_tiles), its n-block range, and where it
// stands among the tile's pieces. A CTA's pieces start at its first unit and then at the first
// unit of each next tile (stream_k_next_unit) until its range ends.
struct StreamKPiece {
  int tile;        // tail tile, 0-based
  int n_lo, n_hi;  // n-blocks [n_lo, n_hi) of the tile
  int first_cta;   // the CTA of the tile's piece 0
  int num_pieces;  // CTAs sharing the tile; 1: a whole tile, nothing to merge
};

CUFLASH_HOST_DEVICE inline StreamKPiece stream_k_piece(StreamKTail const& sk, int unit, int unit_end) {
  int const tile = unit / sk.n_blocks;
  int const tile_begin = tile * sk.n_blocks;
  int const tile_end = tile_begin + sk.n_blocks;
  int const first_cta = sk.cta_of(tile_begin);
  int const last_cta = sk.cta_of(tile_end - 1);
  return {tile, unit - tile_begin, (unit_end < tile_end ? unit_end : tile_end) - tile_begin, first_cta,
          last_cta - first_cta + 1};
}

// The first unit of the tile after the one holding `unit` (a CTA's next piece starts there).
CUFLASH_HOST_DEVICE inline int stream_k_next_unit(StreamKTail const& sk, int unit) {
  return (unit / sk.n_blocks + 1) * sk.n_blocks;
}

}  // namespace cuflash::sm90
