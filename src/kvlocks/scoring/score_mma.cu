// LOCKS page scoring (Eq. 4) on the tensor cores with hand-placed mma.sync fragments.
//
// Same inputs and outputs as the Triton score kernels (kvlocks/scoring/triton.py): per (sequence,
// KV head) row and chunk of pages, the per-head page scores (natural log) and the per-head running
// (max, sum of exp2) over the chunk's pages, in log2 units, for the combine kernel.
// Layout of the summary store: docs/paged-layout.md (int4 basis [P, Hkv, R, D/2], int8 coefficients
// [P, Hkv, S, R] and centroids [P, Hkv, D], float16 scales). S = 16, R = 8, D = 64 or 128, G <= 16.
//
// Each warp takes tiles of 16 pages (tiles interleaved across the block's warps) in groups of four;
// a group's summary bytes are copied into shared memory with cp.async while the previous group is
// computed (page ids are loaded a tile ahead). Per group, two pages per projection step:
//
// 1. projections: mma m16n8k16 with A = the int4 basis rows of a page pair (rows 0-7 page a,
//    8-15 page b), B = the queries (N = 8 heads per n-tile). Every lane reads D/8 contiguous
//    bytes of one basis row, and the contraction index k is mapped to head-dim positions so that
//    those bytes are the lane's A fragment with no data movement: a nibble n becomes the float16
//    subnormal (n + 8) 2^-24 by one lop3 per two values (exact); the +8 adds 8 sum(q) 2^-24 to
//    every projection, computed once per program by the same MMA and subtracted in float32. High
//    nibbles are kept at 16x their value (exact) and the queries at those positions are divided
//    by 16 (exact, power of two). The queries are scaled by a power of two into float16's range
//    once per program.
// 2. the projections times the basis scales, split into float16 hi + lo parts (no precision lost),
//    transposed in registers (movmatrix) into the B fragment of mma m16n8k8 with A = the page's
//    int8 coefficients [S = 16, R = 8]: the within-page logits, in the accumulator layout.
// 3. the coefficient scales and 1/sqrt(D) log2(e), exp2, and the sum over the 16 keys as a
//    reduce-scatter across lanes (7 shuffles per 4 pages). The exp2 runs without subtracting a
//    maximum: the logits are relative to the page centroid, so they straddle zero; a group whose
//    sums leave [2^-100, 2^100] is redone with the maximum subtracted (exact path).
// 4. the centroid term q.mu (one m16n8k16 chain per 16 pages, A = the int8 centroids) is added
//    to the log2-sum-exp: log-sum-exp(x + c) = log-sum-exp(x) + c.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int S = 16;      // page size (keys per page)
constexpr int R = 8;       // summary rank
constexpr int TILE = 16;   // pages per warp iteration
constexpr unsigned FULL = 0xffffffffu;
// Accumulator chains of a page pair's projection MMAs (k-steps dealt round-robin). Four (half the
// dependent-MMA depth, 8 more registers per n-tile) timed on the H200: glm4-9b-1m 1M 103.4 vs
// 103.4-103.7 us, llama3-8b 173.6-174.2 vs 171.5-171.9 (docs/benchmarks.md).
constexpr int CHAINS = 2;
constexpr float LN2 = 0.6931471805599453f;

__device__ __forceinline__ void mma16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                      uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma8(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// 8x8 b16 matrix in fragment layout (lane holds row lane/4, columns 2(lane%4), +1) -> its transpose
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t b, uint32_t c) {  // (a & b) ^ c
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ uint32_t hsub2(uint32_t x, uint32_t k) {
  uint32_t d;
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(x), "r"(k));
  return d;
}

__device__ __forceinline__ uint32_t hfma2(uint32_t x, uint32_t m, uint32_t k) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(x), "r"(m), "r"(k));
  return d;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float2 unpack_half2(uint32_t x) {
  return __half22float2(*reinterpret_cast<__half2*>(&x));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float half_at(const __half* p) { return __half2float(__ldg(p)); }

// Eight int4 (one 32-bit word, element 2i in the low nibble of byte i) -> four half2 registers of
// float16 subnormals, exact: x0 = (e0 + 8, e4 + 8) 2^-24, x1 = 16 (e1 + 8, e5 + 8) 2^-24,
// x2 = (e2 + 8, e6 + 8) 2^-24, x3 = 16 (e3 + 8, e7 + 8) 2^-24 (one lop3 per register). The +8 offset contributes 8 sum_d q[d] 2^-24 to every
// projection, which the caller subtracts once per program (Warp::off).
__device__ __forceinline__ void int4_word_to_subnormal(uint32_t w, uint32_t (&x)[4]) {
  const uint32_t w8 = w >> 8;
  x[0] = and_xor(w, 0x000F000Fu, 0x00080008u);
  x[1] = and_xor(w, 0x00F000F0u, 0x00800080u);
  x[2] = and_xor(w8, 0x000F000Fu, 0x00080008u);
  x[3] = and_xor(w8, 0x00F000F0u, 0x00800080u);
}

// Eight int8 (words w0 = e0..e3, w1 = e4..e7) -> x0 = (e0, e4), x1 = 16 (e1, e5), x2 = (e2, e6),
// x3 = 16 (e3, e7): the same positions as int4_word_to_subnormal, so both share the query fragments.
__device__ __forceinline__ void int8_words_to_half2(uint32_t w0, uint32_t w1, uint32_t (&x)[4]) {
  const uint32_t u0 = w0 ^ 0x80808080u, u1 = w1 ^ 0x80808080u;  // offset binary: e + 128
  const uint32_t t0 = prmt(u0, u1, 0x5140u), t1 = prmt(u0, u1, 0x7362u);  // (e0 e4 e1 e5), (e2 e6 e3 e7)
  const uint32_t k = 0x64646464u;  // high byte of float16 1024
  const uint32_t bias = 0x64806480u, sixteen = 0x4C004C00u, bias16 = 0xF480F480u;  // 1152, 16, -18432
  x[0] = hsub2(prmt(t0, k, 0x4140u), bias);            // 1024 + e + 128 - 1152 = e
  x[1] = hfma2(prmt(t0, k, 0x4342u), sixteen, bias16);  // 16 (1024 + e + 128) - 18432 = 16 e
  x[2] = hsub2(prmt(t1, k, 0x4140u), bias);
  x[3] = hfma2(prmt(t1, k, 0x4342u), sixteen, bias16);
}

// Two int8 pairs (16-bit each: row a's two values, row b's two values) -> (a0, a1), (b0, b1) as half2.
__device__ __forceinline__ void int8_pairs_to_half2(uint32_t pa, uint32_t pb, uint32_t& xa, uint32_t& xb) {
  const uint32_t u = prmt(pa, pb, 0x5410u) ^ 0x80808080u;
  xa = hsub2(prmt(u, 0x64646464u, 0x4140u), 0x64806480u);
  xb = hsub2(prmt(u, 0x64646464u, 0x4342u), 0x64806480u);
}

// A lane's D/8 bytes of one basis row (in shared memory) as 32-bit words.
template <int D>
struct Chunk;
template <>
struct Chunk<128> {
  static constexpr int W = 4;
  __device__ static void load(const uint8_t* p, uint32_t (&w)[4]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  }
};
template <>
struct Chunk<64> {
  static constexpr int W = 2;
  __device__ static void load(const uint8_t* p, uint32_t (&w)[2]) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x; w[1] = v.y;
  }
};

struct Params {
  const void* q;
  int64_t stride_qb, stride_qh;  // elements
  int q_dtype;                   // 0 float16, 1 bfloat16, 2 float32
  const uint8_t* basis;
  const __half* bscale;
  const int8_t* coef;
  const __half* cscale;
  const int8_t* cen;
  const __half* censcale;
  const int32_t* block_table;
  int64_t stride_bt;
  const int32_t* seq_lens;
  float* scores;  // [B, Hkv, G, max_pages]
  float* stats;   // [B * Hkv, n_chunks, 2, GB]
  int hkv, g, gb, max_pages, n_chunks, ppp;  // ppp: pages per program, a multiple of TILE
  float qk_scale2;  // scale * log2(e)
};

// The per-warp state shared by the page-group steps: the query fragments and constants.
template <int D, int NT>
struct Warp {
  static constexpr int KS = D / 16;  // k-steps of the projection
  uint32_t qf[NT][KS][2];
  float off[NT][2];  // the basis' subnormal offset, 8 sum_d q[g][d] * 2^-24, heads 2c, 2c + 1
  int lane, gid, c, h;
  float kappa;  // 2^-e * scale * log2(e): logits from the scaled accumulators, in log2 units
};

// cp.async: 16 bytes global -> shared, bypassing L1; completion tracked in commit groups per thread
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The summary bytes of four pages (one group step), as stored, staged in shared memory.
template <int D>
struct alignas(16) GroupSlot {
  uint8_t basis[4][R * D / 2];
  int8_t coef[4][S * R];
  uint16_t cs[4][S];  // float16 bits
  uint16_t bs[4][R];
};

// The centroids of a tile's 16 pages.
template <int D>
struct alignas(16) CentroidSlot {
  int8_t cen[TILE][D];
};

// Copies group j of a tile (pages 4j..4j+3, ids in lanes 0-15 of `pid`) into `slot` (whole warp):
// lanes 8i..8i+7 copy page i, so each lane computes one record address.
template <int D>
__device__ __forceinline__ void issue_group(GroupSlot<D>& slot, const Params& p, int pid, int j, int h, int lane) {
  constexpr int CB = R * D / 2 / 16;  // 16-byte chunks of one page's basis (32 or 16)
  const int i = lane >> 3, q = lane & 7;
  const int64_t ph = (int64_t)__shfl_sync(FULL, pid, 4 * j + i) * p.hkv + h;
  const uint8_t* src = p.basis + ph * (R * D / 2) + 16 * q;
#pragma unroll
  for (int k = 0; k < CB / 8; ++k) cp_async16(slot.basis[i] + 16 * q + 128 * k, src + 128 * k);
  cp_async16(slot.coef[i] + 16 * q, p.coef + ph * (S * R) + 16 * q);  // 8 chunks per page
  if (q < 2) cp_async16(slot.cs[i] + 8 * q, reinterpret_cast<const uint16_t*>(p.cscale) + ph * S + 8 * q);
  else if (q == 2) cp_async16(slot.bs[i], reinterpret_cast<const uint16_t*>(p.bscale) + ph * R);
}

// Copies the centroids of a tile's 16 pages into `slot` (whole warp): lanes 2i, 2i + 1 copy page i.
template <int D>
__device__ __forceinline__ void issue_centroids(CentroidSlot<D>& slot, const Params& p, int pid, int h, int lane) {
  constexpr int CC = D / 16;  // 16-byte chunks per centroid (8 or 4)
  const int i = lane >> 1, q = lane & 1;
  const int64_t ph = (int64_t)__shfl_sync(FULL, pid, i) * p.hkv + h;
#pragma unroll
  for (int k = 0; k < CC / 2; ++k) cp_async16(slot.cen[i] + 16 * (2 * k + q), p.cen + ph * D + 16 * (2 * k + q));
}

__device__ __forceinline__ float half_bits(uint32_t x) { return __half2float(__ushort_as_half((unsigned short)x)); }

// Within-page log2-sum-exp of the deviation logits (centroid term excluded) of the group's four
// pages: one value per lane, for page 2 bit4(lane) + bit3(lane) and head nt * 8 + 2 (lane % 4) +
// bit2(lane). SAFE subtracts each (page, head)'s maximum before exp2; otherwise `bad` says whether
// a valid lane's sum left [2^-100, 2^100] (then the caller reruns with SAFE).
template <int D, int NT, bool SAFE>
__device__ __forceinline__ void group_lse(const Warp<D, NT>& w, const GroupSlot<D>& r, bool valid,
                                          float (&out)[NT], bool& bad) {
  float v[4][NT][2];
  float mx[4][NT][2];
#pragma unroll
  for (int pr = 0; pr < 2; ++pr) {
    // CHAINS accumulator chains (k-step t into chain t % CHAINS) for the tensor pipe's latency
    float acc[CHAINS][NT][4];
#pragma unroll
    for (int ch = 0; ch < CHAINS; ++ch) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[ch][nt][i] = 0.f;
      }
    }
    uint32_t b0[Chunk<D>::W], b1[Chunk<D>::W];
    const int at = w.gid * (D / 2) + w.c * (D / 8);  // this lane's bytes of basis row gid
    Chunk<D>::load(r.basis[2 * pr] + at, b0);
    Chunk<D>::load(r.basis[2 * pr + 1] + at, b1);
#pragma unroll
    for (int u = 0; u < Chunk<D>::W; ++u) {
      uint32_t x0[4], x1[4];
      int4_word_to_subnormal(b0[u], x0);
      int4_word_to_subnormal(b1[u], x1);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        mma16(acc[(2 * u) % CHAINS][nt], x0[0], x1[0], x0[1], x1[1], w.qf[nt][2 * u][0], w.qf[nt][2 * u][1]);
        mma16(acc[(2 * u + 1) % CHAINS][nt], x0[2], x1[2], x0[3], x1[3], w.qf[nt][2 * u + 1][0],
              w.qf[nt][2 * u + 1][1]);
      }
    }
#pragma unroll
    for (int ch = 1; ch < CHAINS; ++ch) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[0][nt][i] += acc[ch][nt][i];
      }
    }
#pragma unroll
    for (int pg = 0; pg < 2; ++pg) {
      const int page = 2 * pr + pg;
      uint32_t ca0, ca1;  // coefficient rows gid, gid + 8 as float16 A fragments
      const uint16_t* cf = reinterpret_cast<const uint16_t*>(r.coef[page]) + w.gid * (R / 2) + w.c;
      int8_pairs_to_half2(cf[0], cf[8 * (R / 2)], ca0, ca1);
      const float bs = half_bits(r.bs[page][w.gid]) * 16777216.f;  // undoes the subnormal 2^-24
      const float wk0 = half_bits(r.cs[page][w.gid]) * w.kappa, wk1 = half_bits(r.cs[page][w.gid + 8]) * w.kappa;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        // projections of this page (basis row gid, heads 2c, 2c+1) -> float16 hi + lo -> B fragments
        const float y0 = (acc[0][nt][2 * pg] - w.off[nt][0]) * bs, y1 = (acc[0][nt][2 * pg + 1] - w.off[nt][1]) * bs;
        const uint32_t hi = pack_half2(y0, y1);
        const float2 hf = unpack_half2(hi);
        const uint32_t lo = pack_half2(y0 - hf.x, y1 - hf.y);
        float dv[4] = {0.f, 0.f, 0.f, 0.f};
        mma8(dv, ca0, ca1, transpose8x8(hi));
        mma8(dv, ca0, ca1, transpose8x8(lo));
        // dv: keys gid (0, 1) and gid + 8 (2, 3), heads 2c (0, 2) and 2c + 1 (1, 3)
        const float l0 = dv[0] * wk0, l1 = dv[1] * wk0, l2 = dv[2] * wk1, l3 = dv[3] * wk1;
        if (SAFE) {
          float m0 = fmaxf(l0, l2), m1 = fmaxf(l1, l3);
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) {
            m0 = fmaxf(m0, __shfl_xor_sync(FULL, m0, o));
            m1 = fmaxf(m1, __shfl_xor_sync(FULL, m1, o));
          }
          mx[page][nt][0] = m0;
          mx[page][nt][1] = m1;
          v[page][nt][0] = fast_exp2(l0 - m0) + fast_exp2(l2 - m0);
          v[page][nt][1] = fast_exp2(l1 - m1) + fast_exp2(l3 - m1);
        } else {
          v[page][nt][0] = fast_exp2(l0) + fast_exp2(l2);
          v[page][nt][1] = fast_exp2(l1) + fast_exp2(l3);
        }
      }
    }
  }
  // reduce-scatter over lane bits 4, 3, 2 (the 8 lanes holding the same heads)
  const bool h4 = w.lane & 16, h3 = w.lane & 8, h2 = w.lane & 4;
  bad = false;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    float s1[2][2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
#pragma unroll
      for (int gb = 0; gb < 2; ++gb) {
        const float keep = h4 ? v[2 + q][nt][gb] : v[q][nt][gb];
        const float send = h4 ? v[q][nt][gb] : v[2 + q][nt][gb];
        s1[q][gb] = keep + __shfl_xor_sync(FULL, send, 16);
      }
    }
    float s2[2];
#pragma unroll
    for (int gb = 0; gb < 2; ++gb) {
      const float keep = h3 ? s1[1][gb] : s1[0][gb];
      const float send = h3 ? s1[0][gb] : s1[1][gb];
      s2[gb] = keep + __shfl_xor_sync(FULL, send, 8);
    }
    const float keep = h2 ? s2[1] : s2[0];
    const float send = h2 ? s2[0] : s2[1];
    const float sum = keep + __shfl_xor_sync(FULL, send, 4);
    if (SAFE) {
      const int page = 2 * (int)h4 + (int)h3;
      float m = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) m = (q == page) ? (h2 ? mx[q][nt][1] : mx[q][nt][0]) : m;
      out[nt] = m + fast_log2(sum);
    } else {
      bad |= valid && !(sum >= 0x1p-100f && sum <= 0x1p100f);  // pages past the end: not stored
      out[nt] = fast_log2(sum);
    }
  }
}

// The exact path, out of line: it runs only for groups whose sums left the fast path's range, and
// inlined it would cost the hot loop registers.
template <int D, int NT>
__device__ __noinline__ void group_lse_safe(const Warp<D, NT> w, const GroupSlot<D>& r, bool valid,
                                            float (&out)[NT]) {
  bool unused;
  group_lse<D, NT, true>(w, r, valid, out, unused);
}

// The centroid term of a tile's 16 pages: rows gid and gid + 8, heads 2c, 2c + 1, in log2 units.
template <int D, int NT>
__device__ __forceinline__ void centroid_term(const Warp<D, NT>& w, const CentroidSlot<D>& slot, float sa, float sb,
                                              float (&cq)[NT][4]) {
  const uint32_t* ca = reinterpret_cast<const uint32_t*>(slot.cen[w.gid] + w.c * (D / 4));
  const uint32_t* cb = reinterpret_cast<const uint32_t*>(slot.cen[w.gid + 8] + w.c * (D / 4));
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) cq[nt][0] = cq[nt][1] = cq[nt][2] = cq[nt][3] = 0.f;
#pragma unroll
  for (int u = 0; u < Chunk<D>::W; ++u) {
    uint32_t xa[4], xb[4];
    int8_words_to_half2(ca[2 * u], ca[2 * u + 1], xa);
    int8_words_to_half2(cb[2 * u], cb[2 * u + 1], xb);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      mma16(cq[nt], xa[0], xb[0], xa[1], xb[1], w.qf[nt][2 * u][0], w.qf[nt][2 * u][1]);
      mma16(cq[nt], xa[2], xb[2], xa[3], xb[3], w.qf[nt][2 * u + 1][0], w.qf[nt][2 * u + 1][1]);
    }
  }
  sa *= w.kappa;
  sb *= w.kappa;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    cq[nt][0] *= sa; cq[nt][1] *= sa; cq[nt][2] *= sb; cq[nt][3] *= sb;
  }
}

// The kernel body; CSLOTS centroid slots per warp (a tile's centroids are read at its first group
// and the next tile's copied at its last group).
template <int D, int NT, int WARPS>
__device__ __forceinline__ void score_body(const Params& p) {
  constexpr int CSLOTS = 2;
  constexpr int KS = D / 16;
  __shared__ float qs[NT * 8][D];
  __shared__ float red[WARPS];
  __shared__ float st_m[WARPS][NT * 8], st_l[WARPS][NT * 8];
  __shared__ GroupSlot<D> gslots[WARPS][2];
  __shared__ CentroidSlot<D> cslots[WARPS][CSLOTS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row = blockIdx.y, chunk = blockIdx.x;
  const int b = row / p.hkv, h = row % p.hkv;
  const int pc = __ldg(p.seq_lens + b) / S;
  // this program's pages [start, end): the row's full pages spread over all n_chunks programs, in
  // multiples of TILE and at most ppp each, so a sequence much shorter than the plan's max_pages is
  // not scored by a few programs of ppp pages while the others idle
  const int per = min(p.ppp, max(TILE, ((pc + p.n_chunks - 1) / p.n_chunks + TILE - 1) / TILE * TILE));
  const int start = chunk * per;
  const int end = min(start + per, pc);
  if (start >= end) {  // no page: the chunk's statistics are empty (max -inf, sum 0)
    if (tid < p.gb) {
      float* st = p.stats + ((int64_t)row * p.n_chunks + chunk) * 2 * p.gb;
      st[tid] = -INFINITY;
      st[p.gb + tid] = 0.f;
    }
    return;
  }
  const int32_t* bt = p.block_table + (int64_t)b * p.stride_bt;
  const int gid = lane >> 2;
  // page ids of a tile: lane l holds page t0 + (l % 16); page id 0 stands in past the end (not stored)
  auto tile_ids = [&](int t0) { const int mine = t0 + (lane & 15); return mine < end ? __ldg(bt + mine) : 0; };
  // centroid scales of rows gid, gid + 8 of a tile
  auto cen_scales = [&](int pid, float& sa, float& sb) {
    sa = half_at(p.censcale + (int64_t)__shfl_sync(FULL, pid, gid) * p.hkv + h);
    sb = half_at(p.censcale + (int64_t)__shfl_sync(FULL, pid, gid + 8) * p.hkv + h);
  };
  GroupSlot<D>* gslot = gslots[warp];
  CentroidSlot<D>* cslot = cslots[warp];
  int t0 = start + warp * TILE;
  constexpr int j_first = 0;  // this warp's first group of its first tile
  int pid = 0, pid_n1 = 0;  // page ids of this warp's current and next tile (loaded a tile ahead)
  float sa = 0.f, sb = 0.f;
  if (t0 + 4 * j_first < end) {  // the first copies overlap the query set-up
    pid = tile_ids(t0);
    pid_n1 = tile_ids(t0 + WARPS * TILE);
    issue_centroids(cslot[0], p, pid, h, lane);
    issue_group(gslot[0], p, pid, j_first, h, lane);
    cp_async_commit();
    cen_scales(pid, sa, sb);
  }

  // queries of the group -> shared memory (float32), and their largest magnitude
  float amax = 0.f;
  for (int i = tid; i < NT * 8 * D; i += WARPS * 32) {
    const int g = i / D, d = i % D;
    float x = 0.f;
    if (g < p.g) {
      const int64_t off = (int64_t)b * p.stride_qb + (int64_t)(h * p.g + g) * p.stride_qh + d;
      if (p.q_dtype == 0) x = __half2float(reinterpret_cast<const __half*>(p.q)[off]);
      else if (p.q_dtype == 1) x = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p.q)[off]);
      else x = reinterpret_cast<const float*>(p.q)[off];
    }
    qs[g][d] = x;
    amax = fmaxf(amax, fabsf(x));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, o));
  if (lane == 0) red[warp] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int i = 0; i < WARPS; ++i) amax = fmaxf(amax, red[i]);
  // a power of two that puts the largest query element in (512, 1024]: the projections (at most
  // |q| sqrt(D) < 2^14) then fit float16
  int e = 0;
  if (amax > 0.f && isfinite(amax)) e = max(-126, min(127, (int)floorf(log2f(1024.f / amax))));
  const float qscale = ldexpf(1.f, e);

  Warp<D, NT> w;
  w.lane = lane;
  w.gid = gid;
  w.c = lane & 3;
  w.h = h;
  w.kappa = ldexpf(p.qk_scale2, -e);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int g = nt * 8 + w.gid;
#pragma unroll
    for (int t = 0; t < KS; ++t) {
      const int d = w.c * (D / 4) + 8 * (t >> 1) + 2 * (t & 1);
      const float* q = qs[g];
      w.qf[nt][t][0] = pack_half2(q[d] * qscale, q[d + 4] * qscale);
      w.qf[nt][t][1] = pack_half2(q[d + 1] * qscale * 0.0625f, q[d + 5] * qscale * 0.0625f);
    }
    // the subnormal offset as the tensor cores compute it: the projection of an all-zero basis word
    uint32_t z[4];
    int4_word_to_subnormal(0u, z);
    float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int t = 0; t < KS; t += 2) {
      mma16(o, z[0], z[0], z[1], z[1], w.qf[nt][t][0], w.qf[nt][t][1]);
      mma16(o, z[2], z[2], z[3], z[3], w.qf[nt][t + 1][0], w.qf[nt][t + 1][1]);
    }
    w.off[nt][0] = o[0];
    w.off[nt][1] = o[1];
  }

  float m_run[NT], l_run[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) { m_run[nt] = -INFINITY; l_run[nt] = 0.f; }
  const bool h4 = lane & 16, h3 = lane & 8, h2 = lane & 4;

  // Software pipeline over this warp's groups (tiles start + (warp + k WARPS) * TILE, up to four
  // groups each): group n + 1's bytes (and at a tile's last group, the next tile's centroids) are copied
  // into shared memory while group n is computed; one commit group per step.
  if (t0 + 4 * j_first < end) {
    int n = 0, tile = 0;
    while (true) {
      const int t_next = t0 + WARPS * TILE;
      const bool more = t_next < end;
      const int ng = min(4, (end - t0 + 3) >> 2);  // groups of this tile with a page to score
      const int pid_next = pid_n1;
      const int pid_n2 = tile_ids(t_next + WARPS * TILE);  // used a tile from now: no wait here
      float sa_next = 0.f, sb_next = 0.f;
      if (more) cen_scales(pid_next, sa_next, sb_next);
      float cq[NT][4];
#pragma unroll 1
      for (int j = j_first; j < ng; ++j, ++n) {
        __syncwarp();  // every lane is done reading the slot the next copy overwrites
        if (j + 1 < ng) {
          issue_group(gslot[(n + 1) & 1], p, pid, j + 1, h, lane);
        } else if (more) {
          issue_centroids(cslot[(tile + 1) % CSLOTS], p, pid_next, h, lane);
          issue_group(gslot[(n + 1) & 1], p, pid_next, 0, h, lane);
        }
        cp_async_commit();
        cp_async_wait<1>();  // everything but the copy just issued has landed
        __syncwarp();
        if (j == j_first) centroid_term(w, cslot[tile % CSLOTS], sa, sb, cq);
        const GroupSlot<D>& slot = gslot[n & 1];
        const int pt = 4 * j + 2 * (int)h4 + (int)h3;  // this lane's page within the tile
        const int page = t0 + pt;
        float lse[NT];
        bool bad;
        group_lse<D, NT, false>(w, slot, page < end, lse, bad);
        if (__any_sync(FULL, bad)) group_lse_safe(w, slot, page < end, lse);
        const int src = 4 * (pt & 7) + w.c;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float c0 = __shfl_sync(FULL, j >= 2 ? cq[nt][2] : cq[nt][0], src);
          const float c1 = __shfl_sync(FULL, j >= 2 ? cq[nt][3] : cq[nt][1], src);
          const float x = lse[nt] + (h2 ? c1 : c0);  // log2 units
          const int g = nt * 8 + 2 * w.c + (int)h2;
          if (page < end) {
            if (g < p.g) p.scores[((int64_t)row * p.g + g) * p.max_pages + page] = x * LN2;
            const float mn = fmaxf(m_run[nt], x);
            l_run[nt] = l_run[nt] * fast_exp2(m_run[nt] - mn) + fast_exp2(x - mn);
            m_run[nt] = mn;
          }
        }
      }
      if (!more) break;
      t0 = t_next;
      pid = pid_next;
      pid_n1 = pid_n2;
      sa = sa_next;
      sb = sb_next;
      ++tile;
    }
    cp_async_wait<0>();
  }

  // per-head (max, sum) over the lanes holding the same head (bits 3, 4), then over the warps
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int o = 8; o <= 16; o <<= 1) {
      const float om = __shfl_xor_sync(FULL, m_run[nt], o), ol = __shfl_xor_sync(FULL, l_run[nt], o);
      const float mn = fmaxf(m_run[nt], om);
      const float safe = mn == -INFINITY ? 0.f : mn;
      l_run[nt] = l_run[nt] * fast_exp2(m_run[nt] - safe) + ol * fast_exp2(om - safe);
      m_run[nt] = mn;
    }
    if (lane < 8) {
      st_m[warp][nt * 8 + 2 * w.c + (int)h2] = m_run[nt];
      st_l[warp][nt * 8 + 2 * w.c + (int)h2] = l_run[nt];
    }
  }
  __syncthreads();
  if (tid < p.gb) {
    float m = -INFINITY, l = 0.f;
    if (tid < p.g) {
#pragma unroll
      for (int i = 0; i < WARPS; ++i) {
        const float om = st_m[i][tid], ol = st_l[i][tid];
        const float mn = fmaxf(m, om);
        const float safe = mn == -INFINITY ? 0.f : mn;
        l = l * exp2f(m - safe) + ol * exp2f(om - safe);
        m = mn;
      }
    }
    float* st = p.stats + ((int64_t)row * p.n_chunks + chunk) * 2 * p.gb;
    st[tid] = m;
    st[p.gb + tid] = l;
  }
}

// Programmatic dependent launch (kvlocks/pdl.py). Launched with the attribute (`pdl`, KernelOptions.pdl),
// this kernel may start before the kernel ahead of it has finished, so it first waits for that kernel's
// completion; launched without it the wait returns at once. Then the kernel after this one (the fused
// selection) may be scheduled as soon as every block of this one has got that far; it waits for this
// kernel's completion before reading anything. Without a dependent launched that way this does nothing.
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Resident blocks per SM: what the compiler's register allocation allows (92 registers on sm_90:
// 5 blocks of 4 warps).
template <int D, int NT, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) score_kernel(const Params p) {
  allow_dependents();
  score_body<D, NT, WARPS>(p);
}

using Kernel = void (*)(const Params);
constexpr int WARPS = 4;

// The compiled variants: head_dim 64 / 128, one or two n-tiles of 8 heads (G <= 8 / <= 16).
Kernel pick(int head_dim, int nt) {
#define KVLOCKS_VARIANT(D_, NT_) \
  if (head_dim == D_ && nt == NT_) return score_kernel<D_, NT_, WARPS>;
  KVLOCKS_VARIANT(128, 1)
  KVLOCKS_VARIANT(128, 2)
  KVLOCKS_VARIANT(64, 1)
  KVLOCKS_VARIANT(64, 2)
#undef KVLOCKS_VARIANT
  return nullptr;
}

}  // namespace

extern "C" {

// Launches on `stream`; returns a cudaError_t (0 = success), -1 for an unsupported (head_dim, G).
int kvlocks_score_mma(const void* q, int64_t stride_qb, int64_t stride_qh, int q_dtype, const void* basis,
                      const void* bscale, const void* coef, const void* cscale, const void* cen,
                      const void* censcale, const void* block_table, int64_t stride_bt, const void* seq_lens,
                      void* scores, void* stats, int batch, int hkv, int g, int gb, int max_pages, int n_chunks,
                      int ppp, float qk_scale2, int head_dim, int pdl, void* stream) {
  Params p;
  p.q = q;
  p.stride_qb = stride_qb;
  p.stride_qh = stride_qh;
  p.q_dtype = q_dtype;
  p.basis = static_cast<const uint8_t*>(basis);
  p.bscale = static_cast<const __half*>(bscale);
  p.coef = static_cast<const int8_t*>(coef);
  p.cscale = static_cast<const __half*>(cscale);
  p.cen = static_cast<const int8_t*>(cen);
  p.censcale = static_cast<const __half*>(censcale);
  p.block_table = static_cast<const int32_t*>(block_table);
  p.stride_bt = stride_bt;
  p.seq_lens = static_cast<const int32_t*>(seq_lens);
  p.scores = static_cast<float*>(scores);
  p.stats = static_cast<float*>(stats);
  p.hkv = hkv;
  p.g = g;
  p.gb = gb;
  p.max_pages = max_pages;
  p.n_chunks = n_chunks;
  p.ppp = ppp;
  p.qk_scale2 = qk_scale2;
  const Kernel k = pick(head_dim, g > 8 ? 2 : 1);
  if (k == nullptr) return -1;
  void* args[] = {&p};
  const dim3 grid(n_chunks, batch * hkv);
  if (!pdl)
    return (int)cudaLaunchKernel(reinterpret_cast<const void*>(k), grid, dim3(WARPS * 32), args, 0,
                                 static_cast<cudaStream_t>(stream));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(WARPS * 32);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelExC(&cfg, reinterpret_cast<const void*>(k), args);
}

// Resident blocks per SM of a variant (what the launch sizes aim at), or -1.
int kvlocks_score_mma_blocks_per_sm(int head_dim, int nt) {
  const Kernel k = pick(head_dim, nt);
  int n = 0;
  if (k == nullptr || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, WARPS * 32, 0) != cudaSuccess) return -1;
  return n;
}

const char* kvlocks_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
