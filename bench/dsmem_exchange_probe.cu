// Probe: the cost of exchanging a tile between the two CTAs of a cluster through distributed
// shared memory, at the sizes a head-dim split of the hdim256 backward would exchange per step
// (bench/NOTES.md, the thirty-fifth run's plan: fp32 S / dP partials, 40 KB each per 64 x 160
// tile). Stands alone, without the cuflash library; on a Hopper GPU:
//
//   tools/gpu_check.sh with STEPS=dsmem_probe, or: nvcc -gencode=arch=compute_90a,code=sm_90a -O3 \
//     -o /tmp/dsmem_exchange_probe bench/dsmem_exchange_probe.cu
//   /tmp/dsmem_exchange_probe
//
// One CTA per SM (200 KB of dynamic shared memory), clusters of two, 256 threads. Every step each
// CTA sends `chunks` x 4 KB into its peer's receive buffer and waits for the peer's tile in its
// own, reads it, and tells the peer its buffer is free again: a full barrier (transaction bytes)
// per receive buffer and an empty barrier (one arrival per warp of the reader) per sender. One
// receive buffer, and each step's data depend on the last tile read: a step is one synchronous
// round (tile out, tile in, buffer freed), the exchange as it would sit between two GEMMs, so
// the bytes per clock printed are per round, not the network's streaming bandwidth.
// Modes: st.async of 16 bytes per thread to the peer; the same to the CTA's own rank (the
// protocol's own cost, if the CTA's own shared::cluster addresses do not take the network's
// path: not verified); one bulk copy of the tile staged in local shared memory (its staging
// stores and proxy fence are in the round too). Prints clocks per round and bytes per clock per
// SM, one direction. Exits 1 on any CUDA error or on a GPU that is not sm_90.
#include <cstdio>
#include <vector>

#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 256;
constexpr int kSmemBytes = 200 << 10;
constexpr int kChunkBytes = kThreads * 16;  // one float4 per thread

enum Mode : int { kStAsyncPeer = 0, kStAsyncSelf = 1, kBulkPeer = 2 };

__device__ unsigned smem_addr(void const* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// The address of the same shared-memory location in CTA `rank` of the cluster.
__device__ unsigned cluster_addr(unsigned local, unsigned rank) {
  unsigned out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(local), "r"(rank));
  return out;
}

__device__ void wait_parity(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

__device__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}

__global__ void __cluster_dims__(2, 1, 1)
    exchange_kernel(int mode, int chunks, int steps, long long* clocks, float* sink) {
  extern __shared__ __align__(128) float4 smem[];
  __shared__ __align__(8) unsigned long long full_bar, empty_bar;
  int const t = threadIdx.x;
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  unsigned const peer = mode == kStAsyncSelf ? rank : rank ^ 1;
  float4* recv = smem;                       // what the peer sends lands here
  float4* stage = smem + chunks * kThreads;  // bulk mode: the tile staged locally first
  unsigned const bytes = chunks * kChunkBytes;
  unsigned const full = smem_addr(&full_bar), empty = smem_addr(&empty_bar);
  if (t == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(empty), "r"(kThreads / 32));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();
  unsigned const peer_recv = cluster_addr(smem_addr(recv), peer);
  unsigned const peer_full = cluster_addr(full, peer);
  unsigned const peer_empty = cluster_addr(empty, peer);
  float4 acc = make_float4(t, 1.f, 2.f, 3.f);
  long long const start = clock64();
  for (int i = 0; i < steps; ++i) {
    wait_parity(empty, (i & 1) ^ 1);  // the peer has read what this CTA sent last step
    if (t == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full), "r"(bytes) : "memory");
    }
    if (mode != kBulkPeer) {
      for (int j = 0; j < chunks; ++j) {
        asm volatile(
            "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                peer_recv + (j * kThreads + t) * 16),
            "f"(acc.x + j), "f"(acc.y), "f"(acc.z), "f"(acc.w), "r"(peer_full)
            : "memory");
      }
    } else {
      for (int j = 0; j < chunks; ++j) {
        float4 v = acc;
        v.x += j;
        stage[j * kThreads + t] = v;
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
      if (t == 0) {
        asm volatile(
            "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                peer_recv),
            "r"(smem_addr(stage)), "r"(bytes), "r"(peer_full)
            : "memory");
      }
    }
    wait_parity(full, i & 1);  // the peer's tile has landed here
    for (int j = 0; j < chunks; ++j) {
      float4 const v = recv[j * kThreads + t];
      acc.x += v.x;
      acc.y += v.y;
    }
    // (The stage is rewritten next step only after the empty barrier's wait, which follows the
    // peer's full barrier, which the bulk copy's completion completed: no barrier needed here.)
    __syncwarp();
    if (t % 32 == 0) {
      asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(peer_empty) : "memory");
    }
  }
  wait_parity(empty, (steps & 1) ^ 1);  // the peer has read the last tile: the CTA may exit
  long long const elapsed = clock64() - start;
  cluster_sync();
  if (t == 0) clocks[blockIdx.x] = elapsed;
  sink[blockIdx.x * kThreads + t] = acc.x + acc.y;
}

}  // namespace

// Prints the failing call and returns false on a CUDA error.
bool ok(cudaError_t e, char const* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return false;
}

int main() {
  int device = 0;
  cudaDeviceProp prop{};
  if (!ok(cudaGetDevice(&device), "cudaGetDevice") || !ok(cudaGetDeviceProperties(&prop, device), "properties")) return 1;
  if (prop.major != 9) {
    std::fprintf(stderr, "%s is sm_%d%d; the probe is built for sm_90a\n", prop.name, prop.major, prop.minor);
    return 1;
  }
  int const ctas = prop.multiProcessorCount / 2 * 2;
  long long* clocks = nullptr;
  float* sink = nullptr;
  if (!ok(cudaMalloc(&clocks, ctas * sizeof(long long)), "cudaMalloc") ||
      !ok(cudaMalloc(&sink, ctas * kThreads * sizeof(float)), "cudaMalloc") ||
      !ok(cudaFuncSetAttribute(exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
          "cudaFuncSetAttribute")) {
    return 1;
  }
  std::printf("%s, %d SMs, %d CTAs in clusters of 2, %d KB of shared memory each\n", prop.name,
              prop.multiProcessorCount, ctas, kSmemBytes >> 10);
  char const* names[] = {"st.async peer", "st.async self", "bulk peer"};
  int const chunk_counts[] = {1, 2, 5, 10, 20};  // 4, 8, 20, 40, 80 KB
  constexpr int kSteps = 400;
  std::vector<long long> host(ctas);
  cudaEvent_t begin, end;
  if (!ok(cudaEventCreate(&begin), "cudaEventCreate") || !ok(cudaEventCreate(&end), "cudaEventCreate")) return 1;
  for (int mode = 0; mode < 3; ++mode) {
    for (int chunks : chunk_counts) {
      exchange_kernel<<<ctas, kThreads, kSmemBytes>>>(mode, chunks, 20, clocks, sink);  // warm-up
      cudaEventRecord(begin);
      exchange_kernel<<<ctas, kThreads, kSmemBytes>>>(mode, chunks, kSteps, clocks, sink);
      cudaEventRecord(end);
      if (!ok(cudaGetLastError(), "launch") || !ok(cudaEventSynchronize(end), "kernel")) return 1;
      float ms = 0.f;
      cudaEventElapsedTime(&ms, begin, end);
      if (!ok(cudaMemcpy(host.data(), clocks, ctas * sizeof(long long), cudaMemcpyDeviceToHost), "cudaMemcpy")) return 1;
      double per_step = 0;
      for (long long c : host) per_step += static_cast<double>(c);
      per_step /= static_cast<double>(ctas) * kSteps;
      std::printf("%-14s %3d KB/CTA/round %7.0f clk/round %6.1f B/clk/SM %.3f us/round\n", names[mode],
                  chunks * kChunkBytes / 1024, per_step, chunks * kChunkBytes / per_step, ms * 1e3 / kSteps);
    }
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  return 0;
}
