// Backward with paged k/v (page_table): the sm90 backward kernel reads k/v as dense rows, so
//   1. gather_paged_kv copies each sequence's pages into dense (B, Sk, H_kv, D) k and v in the
//      workspace (Sk = max_pages * page_size; rows past the sequence are zeros);
//   2. the dense backward runs on them, writing dense dk / dv into the workspace;
//   3. the gradient rows go back to the pages: page_ref_keys and a stable radix sort list, per
//      page, the (sequence, page column) entries that read it, in ascending order, and
//      scatter_paged_grads sums them per page row in that order and writes dk / dv. A page that
//      several entries read gets the sum of their gradients; a page none reads gets zeros.
// No atomics anywhere: with deterministic = true the result is bitwise repeatable, as the dense
// backward's is. The extra traffic is a few passes over k/v, linear in the sequence length.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>

#include <cstddef>
#include <cstdint>
#include <string>

#include "api/kernels.hpp"
#include "api/params.hpp"
#include "api/workspace_layout.hpp"
#include "cuflash/error.hpp"
#include "cuflash/tensor.hpp"

namespace cuflash::sm90 {
namespace {

constexpr int kThreads = 256;

// The pages and the dense copies, as the kernels see them.
struct PagedKv {
  const int* page_table = nullptr;
  std::int64_t page_table_batch_stride = 0;
  const int* seqused_k = nullptr;
  int batch = 0, seqlen_k = 0, page_size = 0, num_pages = 0, max_pages = 0;
  int num_heads_kv = 0, head_dim = 0, head_dim_v = 0;
  // Pages (num_pages, page_size, H_kv, D), 16-bit elements, last dim contiguous.
  std::int64_t page_stride = 0, row_stride = 0, head_stride = 0;
};

__device__ __forceinline__ int sequence_keys(PagedKv const& c, int b) {
  return c.seqused_k != nullptr ? min(c.seqused_k[b], c.seqlen_k) : c.seqlen_k;
}

// The page that row s of sequence b lives in, or -1 (past the sequence, or not a page).
__device__ __forceinline__ int page_of(PagedKv const& c, int b, int s) {
  if (s >= sequence_keys(c, b)) return -1;
  int const page = c.page_table[b * c.page_table_batch_stride + s / c.page_size];
  return page >= 0 && page < c.num_pages ? page : -1;
}

// One block per (row s, sequence b): the row's k / v of every kv head into the dense copy.
__global__ void __launch_bounds__(kThreads)
    gather_paged_kv(PagedKv const c, std::uint16_t const* k, std::int64_t k_page, std::int64_t k_row,
                    std::int64_t k_head, std::uint16_t const* v, std::int64_t v_page, std::int64_t v_row,
                    std::int64_t v_head, std::uint16_t* k_dense, std::uint16_t* v_dense) {
  int const s = blockIdx.x, b = blockIdx.y;
  int const page = page_of(c, b, s);
  int const r = s % c.page_size;
  std::int64_t const dense_row = std::int64_t(b) * c.seqlen_k + s;
  int const k_width = c.num_heads_kv * c.head_dim, v_width = c.num_heads_kv * c.head_dim_v;
  for (int i = threadIdx.x; i < k_width; i += kThreads) {
    int const h = i / c.head_dim, d = i % c.head_dim;
    k_dense[dense_row * k_width + i] = page < 0 ? 0 : k[page * k_page + r * k_row + h * k_head + d];
  }
  for (int i = threadIdx.x; i < v_width; i += kThreads) {
    int const h = i / c.head_dim_v, d = i % c.head_dim_v;
    v_dense[dense_row * v_width + i] = page < 0 ? 0 : v[page * v_page + r * v_row + h * v_head + d];
  }
}

// Sort keys of the page-table entries e = b * max_pages + column: the page an entry reads, or
// num_pages (sorted last) for the columns past the sequence and entries that are not pages.
__global__ void __launch_bounds__(kThreads) page_ref_keys(PagedKv const c, int* keys, int* entries) {
  int const e = blockIdx.x * kThreads + threadIdx.x;
  if (e >= c.batch * c.max_pages) return;
  int const b = e / c.max_pages, column = e % c.max_pages;
  int const page = page_of(c, b, column * c.page_size);
  keys[e] = page < 0 ? c.num_pages : page;
  entries[e] = e;
}

__device__ __forceinline__ int lower_bound(int const* sorted, int n, int value) {
  int lo = 0, hi = n;
  while (lo < hi) {
    int const mid = (lo + hi) / 2;
    if (sorted[mid] < value) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

template <class Element>
__device__ __forceinline__ float to_float(std::uint16_t bits) {
  Element value;
  static_assert(sizeof(Element) == sizeof(bits));
  memcpy(&value, &bits, sizeof(bits));
  return float(value);
}

template <class Element>
__device__ __forceinline__ void store(Element* ptr, float value) {
  *ptr = Element(value);
}

// One block per page row (page * page_size + r): dk / dv of that row, the sum over the entries
// that read the page (sorted: ascending (sequence, column)) of their dense gradient row.
template <class Element>
__global__ void __launch_bounds__(kThreads)
    scatter_paged_grads(PagedKv const c, int const* sorted_keys, int const* sorted_entries, int num_entries,
                        std::uint16_t const* dk_dense, std::uint16_t const* dv_dense, Element* dk,
                        std::int64_t dk_page, std::int64_t dk_row, std::int64_t dk_head, Element* dv,
                        std::int64_t dv_page, std::int64_t dv_row, std::int64_t dv_head) {
  int const page = blockIdx.x / c.page_size, r = blockIdx.x % c.page_size;
  int const first = lower_bound(sorted_keys, num_entries, page);
  int const last = lower_bound(sorted_keys, num_entries, page + 1);
  int const k_width = c.num_heads_kv * c.head_dim, v_width = c.num_heads_kv * c.head_dim_v;
  for (int i = threadIdx.x; i < k_width + v_width; i += kThreads) {
    bool const is_k = i < k_width;
    int const width = is_k ? k_width : v_width;
    int const j = is_k ? i : i - k_width;
    std::uint16_t const* dense = is_k ? dk_dense : dv_dense;
    float sum = 0.f;
    for (int ref = first; ref < last; ++ref) {
      int const e = sorted_entries[ref];
      int const b = e / c.max_pages, s = (e % c.max_pages) * c.page_size + r;
      if (s < sequence_keys(c, b)) sum += to_float<Element>(dense[(std::int64_t(b) * c.seqlen_k + s) * width + j]);
    }
    int const dim = is_k ? c.head_dim : c.head_dim_v;
    int const h = j / dim, d = j % dim;
    if (is_k) store(dk + page * dk_page + r * dk_row + h * dk_head + d, sum);
    else store(dv + page * dv_page + r * dv_row + h * dv_head + d, sum);
  }
}

PagedKv paged_kv(BwdParams const& p) {
  PagedKv c;
  c.page_table = p.page_table;
  c.page_table_batch_stride = p.page_table_batch_stride;
  c.seqused_k = p.seqused_k;
  c.batch = p.batch;
  c.seqlen_k = p.seqlen_k;
  c.page_size = p.page_size;
  c.num_pages = p.page_size > 0 ? p.total_k / p.page_size : 0;
  c.max_pages = p.page_size > 0 ? p.seqlen_k / p.page_size : 0;
  c.num_heads_kv = p.num_heads_kv;
  c.head_dim = p.head_dim;
  c.head_dim_v = p.head_dim_v;
  return c;
}

int key_bits(int num_pages) {  // bits that hold 0..num_pages (the sentinel included)
  int bits = 1;
  while ((1ll << bits) <= num_pages) ++bits;
  return bits;
}

// The workspace: the dense backward's, then the dense k / v / dk / dv, the sort buffers and the
// sort's scratch. `dense` is the backward of the gathered rows, its pointers relative to `base`.
struct PagedLayout {
  BwdParams dense;
  std::size_t dense_workspace = 0, k = 0, v = 0, dk = 0, dv = 0;
  std::size_t keys = 0, entries = 0, sorted_keys = 0, sorted_entries = 0, sort_scratch = 0;
  std::size_t sort_scratch_bytes = 0, total = 0;
};

PagedLayout paged_layout(BwdParams const& p, char* base) {
  PagedKv const c = paged_kv(p);
  if (p.batch > 65535) {
    throw Error(Error::Kind::kNotSupported, "page_table",
                "the sm90 paged backward takes at most 65535 sequences, got " + std::to_string(p.batch));
  }
  // The dense rows (and the backward's row counts) are 32-bit: batch x max_pages x page_size.
  if (std::int64_t(p.batch) * p.seqlen_k > INT32_MAX) {
    throw Error(Error::Kind::kNotSupported, "page_table",
                "the sm90 paged backward gathers batch x max_pages x page_size = " +
                    std::to_string(std::int64_t(p.batch) * p.seqlen_k) + " rows, more than 2^31 - 1");
  }
  std::int64_t const rows = std::int64_t(p.batch) * p.seqlen_k;
  std::int64_t const k_width = std::int64_t(p.num_heads_kv) * p.head_dim;
  std::int64_t const v_width = std::int64_t(p.num_heads_kv) * p.head_dim_v;
  int const num_entries = c.batch * c.max_pages;

  PagedLayout l;
  l.dense = p;
  l.dense.page_table = nullptr;
  l.dense.page_table_batch_stride = 0;
  l.dense.page_size = 0;
  l.dense.total_k = int(rows);
  l.dense.k_batch_stride = l.dense.dk_batch_stride = p.seqlen_k * k_width;
  l.dense.k_row_stride = l.dense.dk_row_stride = k_width;
  l.dense.k_head_stride = l.dense.dk_head_stride = p.head_dim;
  l.dense.v_batch_stride = l.dense.dv_batch_stride = p.seqlen_k * v_width;
  l.dense.v_row_stride = l.dense.dv_row_stride = v_width;
  l.dense.v_head_stride = l.dense.dv_head_stride = p.head_dim_v;

  WorkspaceLayoutBuilder buffers;
  // The dense backward's own checks (dtype, head dims, alignment) run here,
  // before anything is launched, with 256-byte aligned placeholders for the buffers it will read
  // and write in the workspace (the pages themselves need no alignment: gather and scatter read
  // and write them element by element).
  l.dense.k = l.dense.v = reinterpret_cast<void const*>(std::uintptr_t{kWorkspaceAlignment});
  l.dense.dk = l.dense.dv = reinterpret_cast<void*>(std::uintptr_t{kWorkspaceAlignment});
  std::size_t const dense_bytes = backward_workspace_bytes(l.dense);
  l.dense_workspace = buffers.take(dense_bytes);
  l.k = buffers.take(sizeof(std::uint16_t) * rows * k_width);
  l.v = buffers.take(sizeof(std::uint16_t) * rows * v_width);
  l.dk = buffers.take(sizeof(std::uint16_t) * rows * k_width);
  l.dv = buffers.take(sizeof(std::uint16_t) * rows * v_width);
  l.keys = buffers.take(sizeof(int) * num_entries);
  l.entries = buffers.take(sizeof(int) * num_entries);
  l.sorted_keys = buffers.take(sizeof(int) * num_entries);
  l.sorted_entries = buffers.take(sizeof(int) * num_entries);
  if (num_entries > 0) {
    cub::DeviceRadixSort::SortPairs(nullptr, l.sort_scratch_bytes, static_cast<int const*>(nullptr),
                                    static_cast<int*>(nullptr), static_cast<int const*>(nullptr),
                                    static_cast<int*>(nullptr), num_entries, 0, key_bits(c.num_pages));
  }
  l.sort_scratch = buffers.take(l.sort_scratch_bytes);
  l.total = buffers.total();

  if (base != nullptr) {
    l.dense.k = base + l.k;
    l.dense.v = base + l.v;
    l.dense.dk = base + l.dk;
    l.dense.dv = base + l.dv;
    l.dense.workspace = base + l.dense_workspace;
    l.dense.workspace_bytes = dense_bytes;
  }
  return l;
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(Error::Kind::kCuda, "", std::string("cuflash paged backward: ") + what + ": " +
                                            cudaGetErrorString(status));
  }
}

}  // namespace

std::size_t paged_backward_workspace_bytes(const BwdParams& params) {
  return paged_layout(params, nullptr).total;
}

void run_paged_backward(BwdParams& params, StreamHandle stream_handle) {
  cudaStream_t const stream = static_cast<cudaStream_t>(stream_handle);
  PagedLayout const layout = paged_layout(params, static_cast<char*>(params.workspace));
  if (layout.total > 0 && (params.workspace == nullptr || params.workspace_bytes < layout.total)) {
    throw Error(Error::Kind::kInvalidArgument, "workspace",
                "the sm90 paged backward needs " + std::to_string(layout.total) + " bytes of workspace, got " +
                    std::to_string(params.workspace == nullptr ? 0 : params.workspace_bytes));
  }
  char* const base = static_cast<char*>(params.workspace);
  PagedKv const c = paged_kv(params);
  auto const pages = [](void const* ptr) { return static_cast<std::uint16_t const*>(ptr); };

  if (params.batch > 0 && params.seqlen_k > 0) {
    gather_paged_kv<<<dim3(params.seqlen_k, params.batch), kThreads, 0, stream>>>(
        c, pages(params.k), params.k_batch_stride, params.k_row_stride, params.k_head_stride, pages(params.v),
        params.v_batch_stride, params.v_row_stride, params.v_head_stride,
        reinterpret_cast<std::uint16_t*>(base + layout.k), reinterpret_cast<std::uint16_t*>(base + layout.v));
    check(cudaGetLastError(), "gathering the pages");
  }

  BwdParams dense = layout.dense;
  run_backward(dense, stream_handle);

  int const num_entries = c.batch * c.max_pages;
  int* const keys = reinterpret_cast<int*>(base + layout.keys);
  int* const entries = reinterpret_cast<int*>(base + layout.entries);
  int* const sorted_keys = reinterpret_cast<int*>(base + layout.sorted_keys);
  int* const sorted_entries = reinterpret_cast<int*>(base + layout.sorted_entries);
  if (num_entries > 0) {
    page_ref_keys<<<(num_entries + kThreads - 1) / kThreads, kThreads, 0, stream>>>(c, keys, entries);
    check(cudaGetLastError(), "listing the page references");
    std::size_t scratch_bytes = layout.sort_scratch_bytes;
    check(cub::DeviceRadixSort::SortPairs(base + layout.sort_scratch, scratch_bytes, keys, sorted_keys, entries,
                                          sorted_entries, num_entries, 0, key_bits(c.num_pages), stream),
          "sorting the page references");
  }
  std::int64_t const page_rows = std::int64_t(c.num_pages) * c.page_size;
  if (page_rows == 0) return;
  auto const launch = [&](auto* dk, auto* dv) {
    scatter_paged_grads<<<unsigned(page_rows), kThreads, 0, stream>>>(
        c, sorted_keys, sorted_entries, num_entries, reinterpret_cast<std::uint16_t const*>(base + layout.dk),
        reinterpret_cast<std::uint16_t const*>(base + layout.dv), dk, params.dk_batch_stride, params.dk_row_stride,
        params.dk_head_stride, dv, params.dv_batch_stride, params.dv_row_stride, params.dv_head_stride);
  };
  if (DType(params.dtype) == DType::kBFloat16) {
    launch(static_cast<__nv_bfloat16*>(params.dk), static_cast<__nv_bfloat16*>(params.dv));
  } else {
    launch(static_cast<__half*>(params.dk), static_cast<__half*>(params.dv));
  }
  check(cudaGetLastError(), "writing the page gradients");
}

}  // namespace cuflash::sm90
