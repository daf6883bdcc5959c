// Packed GQA: the query heads that share a kv head become the rows of one forward tile.
// Tile row r of a tile of kv head h_kv is query row r / group of head h_kv * group + r % group,
// so a tile covers `group` times fewer query rows and a kv head's K/V are read once for all of
// its query heads. Short query lengths (decode) then fill whole 128-row tiles. Q is gathered row
// by row (mainloop_fwd_sm90.hpp, load_q_packed), O and LSE are stored row by row
// (epilogue_fwd_sm90.hpp), and the mask sees the query row (mask.hpp, query_row).
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/fast_math.h>

namespace cuflash::sm90 {

struct PackGqa {
  int group = 1;  // query heads per kv head when packed, else 1
  cutlass::FastDivmod divmod;

  // (query row, head) of tile row `row` in a tile of head `tile_head` (the kv head when packed).
  CUTLASS_DEVICE void split(int row, int tile_head, int& query_row, int& head) const {
    if (group == 1) {
      query_row = row;
      head = tile_head;
      return;
    }
    int head_in_group;
    divmod.fast_divmod(query_row, head_in_group, row);
    head = tile_head * group + head_in_group;
  }
};

}  // namespace cuflash::sm90
