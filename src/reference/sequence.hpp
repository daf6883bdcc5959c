// Per-batch sequence lengths and token addressing for the three layouts: dense (B, S, ...),
// packed (total, ...) with cu_seqlens, and paged (pages, page_size, ...) with a page table.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "cuflash/options.hpp"

namespace cuflash::reference {

enum class TokenLayout { kDense, kPacked, kPaged };

// The rows of one side (queries or keys) of every sequence in a batch.
struct SequenceRows {
  TokenLayout layout = TokenLayout::kDense;
  int batch = 0;
  std::int64_t dense_rows = 0;         // dense: rows per batch entry
  std::vector<std::int64_t> start;     // packed: first row of each sequence
  std::vector<std::int64_t> capacity;  // rows allotted to each sequence
  std::vector<std::int64_t> length;    // rows in use: capacity capped by seqused
  TensorView page_table;               // paged: (B, max_pages) int32
  std::int64_t page_size = 0;

  // Element offset of token `pos` of sequence `b` in `t`, a tensor laid out like this side
  // (its leading one or two dims address the token; later dims are added by the caller).
  std::int64_t offset(const TensorView& t, int b, std::int64_t pos) const;
  // Storage row of a token: b * S + pos (dense), start + pos (packed) or
  // page * page_size + pos % page_size (paged). Distinct tokens of different sequences may
  // share a storage row only when pages are shared.
  std::int64_t storage_row(int b, std::int64_t pos) const;
  // Element offset of storage row `row` (see storage_row) in `t`.
  std::int64_t storage_offset(const TensorView& t, std::int64_t row) const;
  std::int64_t max_length() const;
};

SequenceRows dense_rows(int batch, std::int64_t seqlen, const std::optional<TensorView>& seqused);
SequenceRows packed_rows(const TensorView& cu_seqlens, const std::optional<TensorView>& seqused);
SequenceRows paged_rows(const TensorView& page_table, std::int64_t page_size,
                        const std::optional<TensorView>& seqused);

struct Sequences {
  int batch = 0;
  SequenceRows q, k;
};

// Sequences of a forward or backward call; q and k are the (possibly packed or paged) inputs.
Sequences make_sequences(const SequenceLayout& seq, const TensorView& q, const TensorView& k);

}  // namespace cuflash::reference
