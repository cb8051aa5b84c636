// Hopper-only device code: the bulk-copy engine's float reduction into global memory
// (cp.reduce.async.bulk), with which both backwards (sm80 built for sm_90a, and sm90) add their
// dQ tiles, and the flags that put the reductions of several CTAs in order.
#pragma once

#include <cstdint>

namespace transformer_fa {
namespace flash {

namespace sm90 {

// Bulk-copy engine (sm90; callers use it only when __CUDA_ARCH__ >= 900, elsewhere these
// trap). One thread adds `bytes` (a multiple of 16, 16-byte aligned) of float32 from shared
// into global memory, asynchronously, and waits for its own committed copies.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TFA_SM90(...) asm volatile(__VA_ARGS__)
#else
#define TFA_SM90(...) __trap()
#endif
__device__ __forceinline__ void bulk_reduce_add_f32(float* gdst, uint32_t ssrc, uint32_t bytes) {
  TFA_SM90("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
           "cp.async.bulk.commit_group;\n" ::"l"(gdst), "r"(ssrc), "r"(bytes) : "memory");
}
// The shared-memory sources of this thread's bulk copies have been read, all but the
// kPending most recently committed.
template <int kPending = 0>
__device__ __forceinline__ void bulk_wait_read() {
  TFA_SM90("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// This thread's bulk copies have completed.
__device__ __forceinline__ void bulk_wait_all() {
  TFA_SM90("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// Orders this thread's (generic proxy) shared-memory writes before bulk-copy (async proxy)
// reads of them.
__device__ __forceinline__ void fence_proxy_async_smem() {
  TFA_SM90("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Ordering bulk reductions of different CTAs (the sm90 backward's deterministic dQ): a CTA
// whose reductions have completed (bulk_wait_all) orders their async-proxy writes before its
// later generic-proxy operations with this fence, then releases a flag; the CTA that acquires
// the flag issues the same fence before its own reductions.
__device__ __forceinline__ void fence_proxy_async_global() {
  TFA_SM90("fence.proxy.async.global;\n" ::: "memory");
}
// Waits until *flag == value (acquire, GPU scope), sleeping between reads. kWholeWarp: every
// lane of the warp calls it (each read acquires) and the warp leaves the loop together; a
// single lane asleep in a wait can be left behind at the compiler's convergence point, so
// that its warp meets a later aligned barrier in two parts and hangs there.
template <bool kWholeWarp = false>
__device__ __forceinline__ void wait_flag_eq(const int* flag, int value) {
  for (int ns = 32;; ns = ns < 1024 ? 2 * ns : ns) {
    int seen = value;  // (the load's; below sm90 the load traps)
    TFA_SM90("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(flag) : "memory");
    if (kWholeWarp ? __all_sync(0xffffffffu, seen == value) : seen == value) { return; }
    __nanosleep(ns);
  }
}
// *flag += 1 (release, GPU scope): what this thread wrote before is visible to an acquirer.
__device__ __forceinline__ void release_flag_inc(int* flag) {
  TFA_SM90("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(flag) : "memory");
}
#undef TFA_SM90

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
