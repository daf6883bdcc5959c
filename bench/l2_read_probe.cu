// How fast the SMs can pull data from L2 into shared memory with bulk copies, the way the
// forward's producer streams K / V blocks: one CTA per SM, one thread issuing cp.async.bulk
// copies into a ring of shared-memory stages on mbarriers, the working set small enough to stay
// in L2. Question it answers (bench/NOTES.md, the forward's tile-boundary lead): can the card
// read twice the K / V the hdim128 forward reads now (about 5 TB/s at 640 TFLOP/s), i.e. can each
// of two MMA warpgroups stream its own K / V?
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/l2_read_probe bench/l2_read_probe.cu
//   /tmp/l2_read_probe            # a table over stages and block sizes
//
// Each line: stages in flight per SM, bytes per stage (64 KB = one hdim128 K + V block of 128
// keys; 2-3 stages of it fit), working set, and the aggregate L2 -> shared memory rate in TB/s
// (the median of five timed launches after a warm-up). Every launch asks for nearly all of an
// SM's shared memory, so that its CTAs run one per SM whatever the ring uses.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                          \
  do {                                                                                       \
    cudaError_t err_ = (call);                                                               \
    if (err_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_));     \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

constexpr int kMaxStages = 8;
constexpr int kChunkBytes = 16384;  // one bulk copy; a stage is several

__device__ __forceinline__ uint32_t smem_addr(void const* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One elected thread per CTA: `blocks` stages of `stage_bytes` each, read from pseudo-random
// block offsets of the working set, `stages` of them in flight. The sum of one word per stage
// goes to `sink` so that nothing is optimised away.
__global__ void l2_read(char const* src, std::size_t working_set, int stage_bytes, int stages, int blocks,
                        unsigned long long* sink) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(&full[s])) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  std::size_t const num_blocks = working_set / stage_bytes;
  unsigned long long acc = 0;
  for (int i = 0; i < blocks + stages; ++i) {
    // Retire the copy issued `stages` iterations ago, then reuse its stage.
    if (i >= stages) {
      int const j = i - stages;
      int const s = j % stages;
      bar_wait(smem_addr(&full[s]), uint32_t(j / stages) & 1);
      acc += *reinterpret_cast<unsigned long long const*>(ring + std::size_t(s) * stage_bytes);
    }
    if (i >= blocks) continue;
    int const s = i % stages;
    uint32_t const bar = smem_addr(&full[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(stage_bytes) : "memory");
    std::size_t const block = (std::size_t(blockIdx.x) * 7919 + std::size_t(i) * 104729) % num_blocks;
    char const* from = src + block * stage_bytes;
    char* to = ring + std::size_t(s) * stage_bytes;
    for (int off = 0; off < stage_bytes; off += kChunkBytes) {
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
              smem_addr(to + off)),
          "l"(from + off), "r"(kChunkBytes), "r"(bar)
          : "memory");
    }
  }
  atomicAdd(sink, acc);
}

int main() {
  int device = 0, num_sm = 0, max_smem = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&num_sm, cudaDevAttrMultiProcessorCount, device));
  CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, num_sm, prop.l2CacheSize >> 20);

  std::size_t const max_working_set = std::size_t(256) << 20;
  char* src = nullptr;
  unsigned long long* sink = nullptr;
  CHECK(cudaMalloc(&src, max_working_set));
  CHECK(cudaMemset(src, 1, max_working_set));
  CHECK(cudaMalloc(&sink, sizeof(unsigned long long)));
  // The kernel's static shared memory (the barriers) is well under 1 KB.
  int const launch_smem = max_smem - 1024;
  CHECK(cudaFuncSetAttribute(l2_read, cudaFuncAttributeMaxDynamicSharedMemorySize, launch_smem));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));

  std::printf("stages  stage_KB  working_set_MB  TB/s\n");
  // 16 MB: the K / V of a 16k-token, 16-head hdim128 call (16 * 2048 * 128 * 2 bytes * 2) at 2k,
  // per batch row in flight; 256 MB: mostly past the L2 (HBM), for contrast.
  for (std::size_t working_set_mb : {16, 256}) {
    for (int stage_kb : {32, 64}) {
      for (int stages : {2, 3, 4, 6}) {
        int const stage_bytes = stage_kb << 10;
        if (stages > kMaxStages || stages * stage_bytes > launch_smem || stage_bytes % kChunkBytes != 0) continue;
        std::size_t const working_set = working_set_mb << 20;
        int const blocks = 4000 * 64 / stage_kb;  // 250 MB per SM at any stage size
        auto launch = [&] {
          l2_read<<<num_sm, 32, launch_smem>>>(src, working_set, stage_bytes, stages, blocks, sink);
        };
        launch();  // warm-up: the working set into L2
        CHECK(cudaGetLastError());
        std::vector<float> ms(5);
        for (float& m : ms) {
          CHECK(cudaEventRecord(start));
          launch();
          CHECK(cudaEventRecord(stop));
          CHECK(cudaEventSynchronize(stop));
          CHECK(cudaEventElapsedTime(&m, start, stop));
        }
        std::sort(ms.begin(), ms.end());
        double const bytes = double(num_sm) * blocks * stage_bytes;
        std::printf("%6d  %8d  %14zu  %.2f\n", stages, stage_kb, working_set_mb, bytes / (ms[2] * 1e-3) / 1e12);
      }
    }
  }
  CHECK(cudaFree(src));
  CHECK(cudaFree(sink));
  return 0;
}
