// FlashAttention backward for sm90a at head dims 129-256 (tested on an H200 on 2026-11-28;
// 1.02-1.14x of cuDNN unmasked and 0.93-1.03x causal there, where sm80's ran 0.67-0.86x).
//
// Why not bwd_kernel.cuh's dataflow: it works on S^T (64 keys per consumer warpgroup as the
// wgmma M) so that P^T / dS^T stay in registers as A operands, and holds dK and dV of its 64
// keys in registers: 2 x 64 x 256 floats per warpgroup, 256 registers per thread, over the
// 240 a consumer thread has. This kernel follows FlashAttention-3's d256 dataflow (its
// hopper/ sources, read 2026-11-28; our code): one CTA per (key block of 80, query head,
// batch); per query block of 64 rows the two consumer warpgroups compute
//   S  = Q K^T,  dP = dO V^T   (M = the 64 queries; each warpgroup 40 of the 80 keys)
//   P  = exp(S - LSE), masked;  dS = P * (dP - dsum)     (registers, then shared memory, 16-bit)
//   dV^T += dO^T P,  dK^T += Q^T dS   (M = the head dim: each warpgroup owns 128 of its 256
//                                      columns of dK and dV, held in registers over the loop;
//                                      both operands from shared memory)
//   dQ  = dS K                  (two chunks of 128 columns, each warpgroup 64 of a chunk's)
// and adds dQ into the float32 dq_accum by reductions from registers (red.global.add.v2.f32).
// The d64 / d128 kernel's dQ tile through shared memory and the dQ writer warp do not fit: Q
// (two stages), dO, K, V, P and dS take 196 KiB of the 227 and a 64-row float tile of 256
// columns is 64 KiB (FlashAttention-3 adds dQ from registers at d256 too). Deterministic
// mode: the consumers add in turns themselves (turns_of, dq_rank: the d64 / d128 kernel's
// order), each warp waiting for its block's count before its first reduction of the step; the
// count is raised at the next step's first barrier (after its S / dP GEMMs are issued, so
// that the fence's wait for the reductions runs under them), or after the loop.
//
// Shared with bwd_kernel.cuh (declared there): the TMA side (BwdGlobalTiles, load_tiles), the
// LSE / dsum rows (store_query_rows), the mask (kernel_band, query_blocks, key_out), the
// pipelines' parameters, GQA's accumulators (kv_accum, kv_accum_block) and MHA's staged
// stores (store_dkv_rows).
#pragma once

#include "flash/sm90/cute_config.h"  // first: before any CuTe header

#include "flash/sm90/bwd_kernel.cuh"

namespace transformer_fa {
namespace flash {
namespace sm90 {

using namespace cute;

// The d256 backward's tile: kBlockM = 64 query rows per step, kBlockN = 80 key rows per CTA,
// two consumer warpgroups (plus the producer warpgroup), Q in two stages, dO in one.
//
// Shared memory (bytes; each buffer 1024-aligned):
//   Q     2 x 64 x 256 x 2   65536
//   dO    1 x 64 x 256 x 2   32768   (a second stage would take the total to 229 KiB)
//   K, V  2 x 80 x 256 x 2   81920
//   P, dS 2 x 80 x 64 x 2    20480
//   LSE, dsum rows  2 x 2 x 64 x 4   1024, and the barriers
//   total about 197.1 KiB of 227 (static_assert in the launch).
// Registers per consumer thread (240 after setmaxnreg): dV^T and dK^T, 2 x 64 x 80 floats per
// warpgroup each = 80 + 80, live over the loop; S and dP 20 + 20 and P / dS 16-bit 10 + 10
// during the softmax part of a step; a dQ chunk 32 (64 x 64 floats per warpgroup) after it.
// Peak about 160 + 50 + addresses; ptxas (nvcc 13.0): no spills (docs/flash_kernel_notes.md).
template <class Element_>
struct BwdConfigD256 : BwdGlobalTiles<Element_, 64, 80, 256> {
  using Element = Element_;
  static constexpr int kHeadDim = 256;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 80;
  static constexpr int kStages = 2;    // Q, and the LSE / dsum rows
  static constexpr int kStagesDo = 1;  // dO
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  // dQ by reductions from registers (no dQ writer; deterministic mode: in turns, by the
  // consumers): the launch picks bwd_kernel_d256 for configs that say so.
  static constexpr bool kDqFromRegisters = true;

  using TileSdP = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // S = Q K^T, dP = dO V^T
  using TileKV = Shape<Int<kHeadDim>, Int<kBlockN>, Int<kBlockM>>;   // dV^T = dO^T P, dK^T = Q^T dS
  static constexpr int kDqChunk = 128;                               // dQ's columns per GEMM
  using TileDQ = Shape<Int<kBlockM>, Int<kDqChunk>, Int<kBlockN>>;   // dQ = dS K, a chunk

  // S, dP: the warpgroups split the keys (N = 40 each: an extended wgmma shape, cute_config.h).
  static constexpr int kKeysPerWarpgroup = kBlockN / kConsumerWarpgroups;
  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM>, Int<kKeysPerWarpgroup>, Int<kHeadDim>>>(),
      Layout<Shape<_1, Int<kConsumerWarpgroups>, _1>>{}));
  // dV^T, dK^T: A = dO^T / Q^T (MN-major views of dO / Q), B = P / dS as (keys, queries)
  // (K-major: how the consumers store them); the warpgroups take turns along the head dim (64
  // rows each, twice).
  using MmaKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileKV, GMMA::Major::MN, GMMA::Major::K>(),
      Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>{}));
  // dQ: A = dS as (queries, keys) (an MN-major view), B = K^T (an MN-major view of K); the
  // warpgroups split a chunk's columns.
  using MmaDQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM>, Int<kDqChunk / kConsumerWarpgroups>, Int<kBlockN>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<_1, Int<kConsumerWarpgroups>, _1>>{}));
  static_assert(size<1>(typename MmaSdP::AtomShape_MNK{}) == kKeysPerWarpgroup &&
                size<1>(typename MmaKV::AtomShape_MNK{}) == kBlockN &&
                size<1>(typename MmaDQ::AtomShape_MNK{}) == kDqChunk / kConsumerWarpgroups,
                "wgmma N: one instruction spans each GEMM's N");

  using SmemLayoutQ = SmemStagedRowsK<Element, kBlockM, kHeadDim, kStages>;
  using SmemLayoutQt = SmemStagedRowsMN<Element, kBlockM, kHeadDim, kStages>;
  using SmemLayoutDo = SmemStagedRowsK<Element, kBlockM, kHeadDim, kStagesDo>;
  using SmemLayoutDot = SmemStagedRowsMN<Element, kBlockM, kHeadDim, kStagesDo>;
  using SmemLayoutK = SmemRowsK<Element, kBlockN, kHeadDim>;  // K and V
  using SmemLayoutKt = SmemRowsMN<Element, kBlockN, kHeadDim>;
  // One dQ chunk's columns of K^T, at kDqChunk * kBlockN elements per chunk (whole atoms).
  using SmemLayoutKtChunk = SmemRowsMN<Element, kBlockN, kDqChunk>;
  // P and dS: (keys, queries) K-major, as the dV / dK GEMMs read them, and their (queries,
  // keys) view, as the consumers write them and the dQ GEMM reads dS.
  using SmemLayoutPt = SmemRowsK<Element, kBlockN, kBlockM>;
  using SmemLayoutP = SmemRowsMN<Element, kBlockN, kBlockM>;
  // MHA's dK and dV on their way out (after the loop), in K's and V's buffers.
  using SmemLayoutDKV = SmemLayoutRowsSwizzled<kBlockN, kHeadDim>;
  static_assert(cosize_v<SmemLayoutDKV> <= cosize_v<SmemLayoutK>, "dK / dV staging in K / V");

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineDo = cutlass::PipelineTmaAsync<kStagesDo>;
  using PipelineRows = cutlass::PipelineAsync<kStages>;  // LSE / dsum, with Q's stages
  static_assert(std::is_same_v<typename Pipeline::PipelineState,
                               typename PipelineRows::PipelineState>);

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutDo>, 1024> dout;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> v;
    cute::array_aligned<Element, cosize_v<SmemLayoutPt>, 1024> p;
    cute::array_aligned<Element, cosize_v<SmemLayoutPt>, 1024> ds;
    cute::array_aligned<float, kStages * kBlockM> lse_log2;  // LSE * log2(e) per stage
    cute::array_aligned<float, kStages * kBlockM> dsum;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_kv;
    alignas(16) typename Pipeline::SharedStorage pipe_q;
    alignas(16) typename PipelineDo::SharedStorage pipe_do;
    alignas(16) typename PipelineRows::SharedStorage pipe_rows;
  };
};

// The mask as in bwd_kernel (kCausal: a right bound alone; kLocal: a left bound with or
// without a right one; neither: the keys' end only).
template <class Cfg, bool kCausal, bool kLocal>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
bwd_kernel_d256(__grid_constant__ const typename Cfg::Params params) {
  using Element = typename Cfg::Element;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineDo = typename Cfg::PipelineDo;
  using PipelineRows = typename Cfg::PipelineRows;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kHeadDim = Cfg::kHeadDim;
  constexpr bool kBand = kCausal || kLocal;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  int const warp_idx = cutlass::canonical_warp_idx_sync();
  int const warpgroup_idx = cutlass::canonical_warp_group_idx();
  BwdParams const& args = params.args;
  GridTile const gt = bwd_grid_tile(args, params.group_heads);
  int const n_block = gt.tile, head = gt.head, batch = gt.batch;
  int const kv_head = head / (args.h / args.h_k);
  SeqInfo const si = seq_info(args, batch);
  Band const band = kernel_band<kCausal, kLocal>(args, si);
  int const key0 = n_block * kBlockN;
  if (key0 >= si.rows_k) { return; }  // past this (packed) sequence: the whole CTA leaves
  KeyBlockQueries<kBand> const kq =
      key_block_queries<Cfg, kBand>(si, band, n_block, params.dq_rotate);
  QueryBlocks<!kBand> const& qb = kq.qb;
  TurnCounts const counts =
      turn_counts_of<kBlockM, kBlockN>(args, batch, head, kv_head, n_block);

  if (threadIdx.x == 0) { prefetch_and_init(params, shared); }
  Pipeline pipe_q(shared.pipe_q,
                  tma_pipe_params<Pipeline>(warpgroup_idx, Cfg::kBytesQ, Cfg::kConsumerThreads),
                  Shape<_1, _1, _1>{});
  PipelineDo pipe_do(
      shared.pipe_do,
      tma_pipe_params<PipelineDo>(warpgroup_idx, Cfg::kBytesQ, Cfg::kConsumerThreads),
      Shape<_1, _1, _1>{});
  PipelineRows pipe_rows(shared.pipe_rows,
                         rows_pipe_params<PipelineRows>(warpgroup_idx, Cfg::kConsumerThreads));
  __syncthreads();  // barrier inits visible to all before any use

  if (warpgroup_idx == 0) {
    // ---------------- producer: thread 0 loads, warp 1 the LSE / dsum rows ----------------
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (warp_idx == 1) {
      int64_t const lse_offset = si.q_off(args.lse_batch_stride, args.lse_row_stride) +
                                 int64_t(head) * args.lse_head_stride;
      store_query_rows<kBlockM>(pipe_rows, shared.lse_log2.data(), shared.dsum.data(), args, si,
                                lse_offset, qb);
      return;
    }
    if (threadIdx.x != 0) { return; }
    load_tiles<Cfg>(params, shared, pipe_q, pipe_do, si, head, kv_head, batch, n_block, qb);
    return;
  }

  // ---------------- consumers: two warpgroups ----------------
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  int const tidx = threadIdx.x - 128;

  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutQt{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Cfg::SmemLayoutDo{});
  Tensor sdOt = make_tensor(make_smem_ptr(shared.dout.data()), typename Cfg::SmemLayoutDot{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutK{});
  Tensor sP = make_tensor(make_smem_ptr(shared.p.data()), typename Cfg::SmemLayoutP{});
  Tensor sPt = make_tensor(make_smem_ptr(shared.p.data()), typename Cfg::SmemLayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(shared.ds.data()), typename Cfg::SmemLayoutP{});
  Tensor sdSt = make_tensor(make_smem_ptr(shared.ds.data()), typename Cfg::SmemLayoutPt{});
  // K^T's columns [kDqChunk * c, kDqChunk * (c + 1)): whole 128-byte atoms, kDqChunk * kBlockN
  // elements apart (a multiple of the swizzle's 1024 bytes).
  auto sKt_chunk = [&](int c) {
    return make_tensor(make_smem_ptr(shared.k.data() + c * Cfg::kDqChunk * kBlockN),
                       typename Cfg::SmemLayoutKtChunk{});
  };

  typename Cfg::MmaSdP mma_sdp;
  typename Cfg::MmaKV mma_kv;
  typename Cfg::MmaDQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  auto thr_kv = mma_kv.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  // Shared-memory descriptors of every GEMM operand.
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);      // (..., stage)
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);   // (..., 1)
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  Tensor tdVrdOt = thr_kv.partition_fragment_A(sdOt);  // (..., 1)
  Tensor tdVrPt = thr_kv.partition_fragment_B(sPt);
  Tensor tdKrQt = thr_kv.partition_fragment_A(sQt);    // (..., stage)
  Tensor tdKrdSt = thr_kv.partition_fragment_B(sdSt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt0 = thr_dq.partition_fragment_B(sKt_chunk(0));
  Tensor tdQrKt1 = thr_dq.partition_fragment_B(sKt_chunk(1));
  static_assert(kHeadDim == 2 * Cfg::kDqChunk);
  // P and dS from the accumulator layout (queries, keys) into their (keys, queries) K-major
  // tiles by stmatrix.trans, two 8 x 8 matrices per instruction (a warpgroup's 40 keys are not
  // a multiple of the 16 that the x4 form takes; the x1 form left 4 / 8 bytes of spills in
  // the no-mask kernel, this one none).
  auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U16x4_STSM_T, Element>{}, mma_sdp);
  auto thr_r2s = r2s.get_thread_slice(tidx);
  Tensor tPsP = thr_r2s.partition_D(sP);
  Tensor tdSsdS = thr_r2s.partition_D(sdS);

  Tensor tdVrdV = partition_fragment_C(mma_kv, select<0, 1>(typename Cfg::TileKV{}));  // dV^T
  Tensor tdKrdK = partition_fragment_C(mma_kv, select<0, 1>(typename Cfg::TileKV{}));  // dK^T
  clear(tdVrdV);
  clear(tdKrdK);

  using LayoutS = decltype(
      partition_fragment_C(mma_sdp, select<0, 1>(typename Cfg::TileSdP{})).layout());
  Tensor cS = make_identity_tensor(select<0, 1>(typename Cfg::TileSdP{}));  // (query, key)
  Tensor tScS = thr_sdp.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor cdQ = make_identity_tensor(select<0, 1>(typename Cfg::TileDQ{}));  // (query, column)
  Tensor tdQcdQ = thr_dq.partition_C(cdQ);

  // dQ: reductions into dq_accum (zeroed by the launch) from registers, the query rows of the
  // sequence only. The accumulator's elements 2i, 2i + 1 are adjacent columns, an even one
  // first: adjacent in dq_accum's layout too. Its rows and columns are constant offsets
  // (multiples of 8) from its first element's, so dq_accum's offsets are too: one address per
  // step (none kept across the loop per element).
  float* const dq_accum = sm80::dqa_block(args, si, 0, head);
  int const dq_row0 = get<0>(tdQcdQ(0)), dq_col0 = get<1>(tdQcdQ(0));
  auto add_dq = [&](auto const& tdQrdQ, int query0, int chunk_col0) {
    float* const dst =
        dq_accum + sm80::dqa_offset(sm80::dqa_row(si, query0 + dq_row0), chunk_col0 + dq_col0,
                                    kHeadDim);
    int const valid_rows = si.len_q - query0;
    CUTE_UNROLL
    for (int i = 0; i < size(tdQrdQ); i += 2) {
      int const row = get<0>(tdQcdQ(i)), col = get<1>(tdQcdQ(i));
      if (row < valid_rows) {
        sm80::atomic_add2(dst + (row - dq_row0) * kHeadDim + (col - dq_col0) * 8, tdQrdQ(i),
                          tdQrdQ(i + 1));
      }
    }
  };

  float const scale_log2 = args.scale_softmax_log2;
  shared.barrier_kv.wait(0);
  typename Pipeline::PipelineState read_q;  // Q and the LSE / dsum rows
  typename PipelineDo::PipelineState read_do;
  // Deterministic mode: the query block whose count this CTA raises next (-1: none).
  int dq_added = -1;
  auto raise_dq_count = [&] {
    if (tidx == 0 && dq_added >= 0) { sm90::release_flag_inc(counts.dq + dq_added); }
  };
  int m_block = qb.start();
  for (int i = 0; i < qb.count(); ++i, m_block = qb.next(m_block)) {
    int const query0 = m_block * kBlockM;
    Tensor tSrS = partition_fragment_C(mma_sdp, select<0, 1>(typename Cfg::TileSdP{}));
    Tensor tdPrdP = partition_fragment_C(mma_sdp, select<0, 1>(typename Cfg::TileSdP{}));
    pipe_q.consumer_wait(read_q);
    wg_gemm<true>(mma_sdp, tSrQ(_, _, _, read_q.index()), tSrK, tSrS);
    pipe_do.consumer_wait(read_do);
    wg_gemm<true>(mma_sdp, tdPrdO(_, _, _, read_do.index()), tdPrV, tdPrdP);
    // Both warpgroups are done with the previous block's GEMMs (each waited for all of its
    // own before this barrier): P's and dS's buffers are free. (Here, while S and dP run, not
    // after the softmax: fewer registers are live across it.) Deterministic: the previous
    // block's reductions of every thread are complete and visible past the barrier.
    if (args.deterministic) { __threadfence(); }
    named_barrier_sync(Cfg::kConsumerThreads, kBarDsFree);
    raise_dq_count();

    Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));   // (query, key)
    Tensor dp = make_tensor(tdPrdP.data(), acc_rowcol(tdPrdP.layout()));
    bool const masked = band_cuts(band, query0, query0 + kBlockM - 1, key0, key0 + kBlockN - 1);
    pipe_rows.consumer_wait(read_q);
    float const* lse_log2_of = shared.lse_log2.data() + read_q.index() * kBlockM;
    float const* dsum_of = shared.dsum.data() + read_q.index() * kBlockM;
    warpgroup_wait<1>();  // S
    warpgroup_fence_operand(tSrS);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      int const row = get<0>(tScS_rc(r, 0));
      float const lse_log2 = lse_log2_of[row];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        int const key = key0 + get<1>(tScS_rc(r, c));
        bool const out = masked && key_out(band, si.len_k, query0 + row, key);
        s(r, c) = fast_exp2(out ? -INFINITY : s(r, c) * scale_log2 - lse_log2);  // (bwd_kernel)
      }
    }
    Tensor tPrP = make_tensor<Element>(LayoutS{});
    convert_fragment<Element>(tSrS, tPrP);
    copy(r2s, thr_r2s.retile_S(tPrP), tPsP);
    warpgroup_wait<0>();  // dP
    warpgroup_fence_operand(tdPrdP);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      float const dsum = dsum_of[get<0>(tScS_rc(r, 0))];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) { dp(r, c) = s(r, c) * (dp(r, c) - dsum); }
    }
    pipe_rows.consumer_release(read_q);
    Tensor tdSrdS = make_tensor<Element>(LayoutS{});
    convert_fragment<Element>(tdPrdP, tdSrdS);
    copy(r2s, thr_r2s.retile_S(tdSrdS), tdSsdS);
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> wgmma reads
    named_barrier_sync(Cfg::kConsumerThreads, kBarDsReady);  // both warpgroups' keys of P, dS

    wg_gemm<false>(mma_kv, tdVrdOt(_, _, _, read_do.index()), tdVrPt, tdVrdV);
    wg_gemm<false>(mma_kv, tdKrQt(_, _, _, read_q.index()), tdKrdSt, tdKrdK);
    Tensor tdQrdQ = partition_fragment_C(mma_dq, select<0, 1>(typename Cfg::TileDQ{}));
    wg_gemm<true>(mma_dq, tdQrdS, tdQrKt0, tdQrdQ);
    warpgroup_wait<0>();
    pipe_q.consumer_release(read_q);
    pipe_do.consumer_release(read_do);
    ++read_q;
    ++read_do;
    if (args.deterministic) {
      sm90::wait_flag_eq<true>(counts.dq + m_block,
                               dq_rank<kBlockM, kBlockN>(kq, band, si, m_block, n_block));
      dq_added = m_block;
    }
    add_dq(tdQrdQ, query0, 0);
    wg_gemm<true>(mma_dq, tdQrdS, tdQrKt1, tdQrdQ);
    warpgroup_wait<0>();
    add_dq(tdQrdQ, query0, Cfg::kDqChunk);
  }
  // Both warpgroups past their last GEMM (K and V read for the last time): K's and V's buffers
  // take MHA's dK and dV. (Without query blocks no GEMM read them; barrier_kv was waited on.)
  // Deterministic: the last block's turn passed on.
  if (args.deterministic) { __threadfence(); }
  named_barrier_sync(Cfg::kConsumerThreads, kBarDsFree);
  raise_dq_count();

  // ---------------- epilogue: dV and dK (times the softmax scale) ----------------
  Tensor cKV = make_identity_tensor(select<0, 1>(typename Cfg::TileKV{}));  // (column, key)
  Tensor tKVcKV = thr_kv.partition_C(cKV);
  if (args.h != args.h_k) {
    // GQA: into the accumulators (kv_accum), the keys of the sequence only (the conversion
    // writes the rest as zeros). Elements 2i, 2i + 1 are adjacent keys of one column here: one
    // reduction each. dK's softmax scale: in the conversion.
    float* const dk_acc = kv_accum_block(args, si, batch, kv_head);
    float* const dv_acc = dk_acc + kv_accum(args).floats;
    int const row0 = si.k_packed ? si.start_k : 0;
    // (one tile after the other: fewer addresses live at once)
    auto add_tile = [&](float* acc, auto const& tile) {
      CUTE_UNROLL
      for (int i = 0; i < size(tile); ++i) {
        int const key = key0 + get<1>(tKVcKV(i));
        if (key < si.len_k) {
          atomicAdd(acc + sm80::dqa_offset(row0 + key, get<0>(tKVcKV(i)), kHeadDim), tile(i));
        }
      }
    };
    wait_kv_turn(args, counts, head, kv_head);
    add_tile(dv_acc, tdVrdV);
    add_tile(dk_acc, tdKrdK);
    pass_kv_turn<Cfg::kConsumerThreads>(args, counts, tidx);
    return;
  }
  // MHA: dK and dV staged as (key, column) rows in K's and V's buffers (2-byte writes from the
  // transposed accumulators), then each warpgroup stores 40 key rows in 16-byte chunks
  // (padding rows past the sequence's keys get zeros: their P and dS are 0).
  Tensor sdK = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutDKV{});
  Tensor sdV = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutDKV{});
  auto stage = [&](auto& staged, auto const& tile, float scale) {
    CUTE_UNROLL
    for (int i = 0; i < size(tile); ++i) {
      staged(get<1>(tKVcKV(i)), get<0>(tKVcKV(i))) = static_cast<Element>(tile(i) * scale);
    }
  };
  stage(sdV, tdVrdV, 1.f);
  stage(sdK, tdKrdK, args.scale_softmax);
  // (the stores below read rows that the other warpgroup wrote)
  named_barrier_sync(Cfg::kConsumerThreads, kBarDkvStaged);
  constexpr int kRowsPerWarpgroup = Cfg::kKeysPerWarpgroup;
  static_assert(kRowsPerWarpgroup <= 64, "store_staged_rows stores up to 64 rows");
  int const wg = tidx / 128;
  int const row0 = wg * kRowsPerWarpgroup;
  int const rows = min(kRowsPerWarpgroup, si.rows_k - key0 - row0);
  store_dkv_rows<kHeadDim, Element>(args, si, head, sdK, sdV, row0, int64_t(key0 + row0), rows,
                                    tidx % 128);
}

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
