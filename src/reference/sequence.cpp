#include "reference/sequence.hpp"

#include <algorithm>

#include "reference/numeric.hpp"

namespace cuflash::reference {
namespace {

// seqused may ask for more rows than a sequence has; clamping keeps every read in bounds.
void apply_seqused(SequenceRows& rows, const std::optional<TensorView>& seqused) {
  rows.length = rows.capacity;
  if (!seqused) return;
  for (int b = 0; b < rows.batch; ++b) {
    const std::int64_t used = load_int(*seqused, b * seqused->stride[0]);
    rows.length[b] = std::clamp<std::int64_t>(used, 0, rows.capacity[b]);
  }
}

}  // namespace

std::int64_t SequenceRows::offset(const TensorView& t, int b, std::int64_t pos) const {
  switch (layout) {
    case TokenLayout::kDense:
      return b * t.stride[0] + pos * t.stride[1];
    case TokenLayout::kPacked:
      return (start[b] + pos) * t.stride[0];
    case TokenLayout::kPaged: {
      const std::int64_t page = load_int(page_table, offset_of(page_table, {b, pos / page_size}));
      return page * t.stride[0] + (pos % page_size) * t.stride[1];
    }
  }
  return 0;
}

std::int64_t SequenceRows::storage_row(int b, std::int64_t pos) const {
  switch (layout) {
    case TokenLayout::kDense:
      return b * dense_rows + pos;
    case TokenLayout::kPacked:
      return start[b] + pos;
    case TokenLayout::kPaged: {
      const std::int64_t page = load_int(page_table, offset_of(page_table, {b, pos / page_size}));
      return page * page_size + pos % page_size;
    }
  }
  return 0;
}

std::int64_t SequenceRows::storage_offset(const TensorView& t, std::int64_t row) const {
  switch (layout) {
    case TokenLayout::kDense:
      return (row / dense_rows) * t.stride[0] + (row % dense_rows) * t.stride[1];
    case TokenLayout::kPacked:
      return row * t.stride[0];
    case TokenLayout::kPaged:
      return (row / page_size) * t.stride[0] + (row % page_size) * t.stride[1];
  }
  return 0;
}

std::int64_t SequenceRows::max_length() const {
  std::int64_t result = 0;
  for (std::int64_t len : length) result = std::max(result, len);
  return result;
}

SequenceRows dense_rows(int batch, std::int64_t seqlen, const std::optional<TensorView>& seqused) {
  SequenceRows rows;
  rows.layout = TokenLayout::kDense;
  rows.batch = batch;
  rows.dense_rows = seqlen;
  rows.start.assign(batch, 0);
  rows.capacity.assign(batch, seqlen);
  apply_seqused(rows, seqused);
  return rows;
}

SequenceRows packed_rows(const TensorView& cu_seqlens, const std::optional<TensorView>& seqused) {
  SequenceRows rows;
  rows.layout = TokenLayout::kPacked;
  rows.batch = static_cast<int>(cu_seqlens.shape[0] - 1);
  rows.start.resize(rows.batch);
  rows.capacity.resize(rows.batch);
  for (int b = 0; b < rows.batch; ++b) {
    rows.start[b] = load_int(cu_seqlens, b * cu_seqlens.stride[0]);
    const std::int64_t end = load_int(cu_seqlens, (b + 1) * cu_seqlens.stride[0]);
    rows.capacity[b] = std::max<std::int64_t>(end - rows.start[b], 0);
  }
  apply_seqused(rows, seqused);
  return rows;
}

SequenceRows paged_rows(const TensorView& page_table, std::int64_t page_size,
                        const std::optional<TensorView>& seqused) {
  SequenceRows rows;
  rows.layout = TokenLayout::kPaged;
  rows.batch = static_cast<int>(page_table.shape[0]);
  rows.page_table = page_table;
  rows.page_size = page_size;
  rows.start.assign(rows.batch, 0);
  rows.capacity.assign(rows.batch, page_table.shape[1] * page_size);
  apply_seqused(rows, seqused);
  return rows;
}

Sequences make_sequences(const SequenceLayout& seq, const TensorView& q, const TensorView& k) {
  Sequences result;
  if (seq.cu_seqlens_q) {
    result.q = packed_rows(*seq.cu_seqlens_q, seq.seqused_q);
  } else {
    result.q = dense_rows(static_cast<int>(q.shape[0]), q.shape[1], seq.seqused_q);
  }
  result.batch = result.q.batch;
  if (seq.page_table) {
    result.k = paged_rows(*seq.page_table, k.shape[1], seq.seqused_k);
  } else if (seq.cu_seqlens_k) {
    result.k = packed_rows(*seq.cu_seqlens_k, seq.seqused_k);
  } else {
    result.k = dense_rows(static_cast<int>(k.shape[0]), k.shape[1], seq.seqused_k);
  }
  return result;
}

}  // namespace cuflash::reference
