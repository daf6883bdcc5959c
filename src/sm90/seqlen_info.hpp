// Per-sequence lengths and row offsets for dense, packed (cu_seqlens) and capped (seqused) layouts.
#pragma once

#include <cutlass/cutlass.h>

namespace cuflash::sm90 {

struct SeqlenInfo {
  int offset_q = 0;  // first row of this sequence in a packed q/out/lse, 0 when dense
  int offset_k = 0;
  int seqlen_q = 0;        // query rows that attend (capped by seqused_q)
  int seqlen_q_range = 0;  // rows this sequence owns in out/lse; rows past seqlen_q get 0 / -inf
  int seqlen_k = 0;        // keys that can be attended (capped by seqused_k, itself capped)

  CUTLASS_DEVICE SeqlenInfo(int batch_idx, int max_seqlen_q, int max_seqlen_k,
                            const int* cu_seqlens_q, const int* cu_seqlens_k, const int* seqused_q,
                            const int* seqused_k) {
    if (cu_seqlens_q != nullptr) {
      offset_q = cu_seqlens_q[batch_idx];
      seqlen_q_range = cu_seqlens_q[batch_idx + 1] - offset_q;
    } else {
      seqlen_q_range = max_seqlen_q;
    }
    seqlen_q = seqused_q != nullptr ? seqused_q[batch_idx] : seqlen_q_range;
    seqlen_q = seqlen_q < seqlen_q_range ? seqlen_q : seqlen_q_range;
    if (cu_seqlens_k != nullptr) {
      offset_k = cu_seqlens_k[batch_idx];
      seqlen_k = cu_seqlens_k[batch_idx + 1] - offset_k;
    } else {
      seqlen_k = max_seqlen_k;
    }
    // seqused_k past the sequence's keys (or a paged sequence's max_pages * page_size) is capped,
    // as the reference does, so that no key row or page-table entry past them is read.
    if (seqused_k != nullptr) seqlen_k = min(seqused_k[batch_idx], seqlen_k);
  }
};

}  // namespace cuflash::sm90
