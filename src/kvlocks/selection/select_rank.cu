// LOCKS combine (Eq. 5) and page selection in one CUDA launch: the decode step's path on CUDA.
//
// Same inputs, outputs and choice as the Triton kernel of kvlocks/selection/fused.py: per (sequence,
// KV head) row, each head's log-sum-exp from the score programs' (max, sum) statistics, the combined
// ranking of every full page, and the pages to attend (sink + recent + the top (k - forced) ranked,
// ties to the lower page), ascending, -1 padded. Grid (chunks, rows); each block:
//
// 1. reduces the statistics to the G log2-sum-exps (one warp per head), ranks its chunk's pages
//    (coalesced loads of the per-head scores, one page per thread and step), stores the ranking and
//    puts each candidate's order key (float32 -> uint32, same order) in shared memory;
// 2. radix-selects the chunk's top (k - forced): the keys rebased (minus their minimum, shifted so
//    their highest differing bit is bit 31; same order), 8-bit digits from the top, a 256-bin
//    shared-memory histogram per digit (atomics), the threshold digit picked by one warp (suffix
//    sums over lanes), stopping as soon as every key left in the threshold digit is chosen. The
//    winners' output positions come from one block scan of (keys above the threshold, ties) counts;
// 3. a row of one chunk writes its output directly; otherwise each block writes its winners (page
//    order) and takes a ticket from the row's arrival counter (after a fence); the last block of
//    the row resets the counter, gathers every chunk's winners (L2 loads) and runs step 2 on them.
//
// Output slots: a winner with page p goes to (its rank among the winners) + (forced pages below p);
// the forced pages fill the remaining slots in ascending order.

#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr unsigned FULL = 0xffffffffu;
constexpr int BINS = 256;
constexpr int MAX_G = 16;
constexpr int MAX_FORCED = 64;
constexpr int MAX_WARPS = 32;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

struct Params {
  const float* scores;        // [rows, G, max_pages] per-head page scores (natural log)
  const float* stats;         // [rows, n_sc, 2, gp] score programs' (max, sum of exp2), log2 units
  const int32_t* seq_lens;    // [B]
  const int32_t* sink_start;  // [B] or null (sink at page 0)
  float* ranking;             // [rows, max_pages]
  float* lse;                 // [rows, G] natural log
  uint32_t* ckey;             // [rows, n_chunks, m] chunk winners' order keys
  int32_t* cidx;              // [rows, n_chunks, m] their pages
  int32_t* ccnt;              // [rows, n_chunks]
  int32_t* done;              // [rows] arrival counters (zero between launches)
  int32_t* out;               // [rows, k]
  int hkv, g, gp, n_sc, max_pages, n_chunks, chunk, m;
  int page_size, k, sink, recent, rule, cap;
};

struct Shared {  // the static part; keys, pages and flags follow in dynamic shared memory
  int hist[2][BINS];
  float lse2[MAX_G];
  uint32_t wtmp[MAX_WARPS];
  uint32_t wtmp2[MAX_WARPS];
  int forced[MAX_FORCED];
  int pick[3];  // threshold digit, keys above it, keys in it
  int ticket;
};

__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = x == 0.0f ? 0u : __float_as_uint(x);  // -0.0 ranks as +0.0
  return (u >> 31) ? ~u : (u | 0x80000000u);
}

// Block-wide sum / min / max of one value per thread (every thread gets the result).
template <int OP>
__device__ __forceinline__ uint32_t warp_op(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) {
    uint32_t w = __shfl_xor_sync(FULL, v, o);
    v = OP == 0 ? v + w : (OP == 1 ? min(v, w) : max(v, w));
  }
  return v;
}

template <int OP>
__device__ uint32_t block_op(uint32_t v, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_op<OP>(v);
  __syncthreads();  // wtmp free
  if (lane == 0) sh.wtmp[warp] = v;
  __syncthreads();
  uint32_t id = OP == 0 ? 0u : (OP == 1 ? 0xffffffffu : 0u);
  uint32_t x = lane < nw ? sh.wtmp[lane] : id;
  return warp_op<OP>(x);
}

// Exclusive scan of one value per thread in thread order; *total gets the sum.
__device__ uint32_t block_exclusive_scan(uint32_t v, Shared& sh, uint32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  uint32_t inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    uint32_t y = __shfl_up_sync(FULL, inc, o);
    if (lane >= o) inc += y;
  }
  __syncthreads();
  if (lane == 31) sh.wtmp2[warp] = inc;
  __syncthreads();
  uint32_t before = 0, all = 0;
  for (int w = 0; w < nw; ++w) {
    uint32_t t = sh.wtmp2[w];
    before += w < warp ? t : 0u;
    all += t;
  }
  *total = all;
  return before + inc - v;
}

// Forced pages (sink range, recent range) of a row with `total` pages.
struct Forced {
  int total, s_lo, s_hi, r_lo, f;
  __device__ Forced(int n, int ss, int S, int sink, int recent) {
    total = (n + S - 1) / S;
    s_lo = min(ss, total);
    s_hi = min(ss + sink, total);
    r_lo = max(total - recent, 0);
    int overlap = max(min(s_hi, total) - max(s_lo, r_lo), 0);
    f = (s_hi - s_lo) + (total - r_lo) - overlap;
  }
  __device__ bool is_forced(int p) const { return (p >= s_lo && p < s_hi) || p >= r_lo; }
  __device__ int below(int x) const {  // forced pages with index < x
    int a = min(max(x - s_lo, 0), s_hi - s_lo);
    int c = min(max(x - r_lo, 0), total - r_lo);
    int o_lo = max(s_lo, r_lo);
    int o = min(max(x - o_lo, 0), max(s_hi - o_lo, 0));
    return a + c - o;
  }
};

struct Threshold {
  uint32_t lo, shift, prefix, kmask;
  int remaining;
  __device__ uint32_t masked(uint32_t key) const { return ((key - lo) << shift) & kmask; }
};

// Radix select over keys[0, n) where valid (null: all valid): the need-th largest key's leading
// digits (over the rebased keys). Selected: masked(key) > prefix, and the first `remaining` (by
// position) with masked(key) == prefix. Every thread gets the result.
__device__ Threshold radix_threshold(const uint32_t* keys, const uint8_t* valid, int n, int need, Shared& sh) {
  const int t = threadIdx.x, nt = blockDim.x;  // strided over the keys: no bank conflicts, order unused
  uint32_t lo = 0xffffffffu, hi = 0u, cnt = 0;
  for (int e = t; e < n; e += nt) {
    if (valid && !valid[e]) continue;
    lo = min(lo, keys[e]);
    hi = max(hi, keys[e]);
    ++cnt;
  }
  for (int i = t; i < BINS; i += nt) sh.hist[0][i] = 0;
  Threshold th;
  th.lo = block_op<1>(lo, sh);
  hi = block_op<2>(hi, sh);
  int n_in = (int)block_op<0>(cnt, sh);
  th.shift = hi > th.lo ? __clz(hi - th.lo) : 0u;
  th.prefix = 0u;
  th.kmask = 0u;
  th.remaining = max(need, 1);
  for (int pass = 0; pass < 4 && n_in > th.remaining; ++pass) {
    const int buf = pass & 1, sft = 24 - 8 * pass;
    for (int i = t; i < BINS; i += nt) sh.hist[buf ^ 1][i] = 0;  // the next pass's (last used two passes ago)
    for (int e = t; e < n; e += nt) {
      if (valid && !valid[e]) continue;
      uint32_t rk = (keys[e] - th.lo) << th.shift;
      if ((rk & th.kmask) == th.prefix) atomicAdd(&sh.hist[buf][(rk >> sft) & 0xff], 1);
    }
    __syncthreads();
    if (t < 32) {  // lane l owns bins 8l .. 8l + 7; the largest digit d with (keys with digit >= d) >= remaining
      int h[8], s = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        h[i] = sh.hist[buf][8 * t + i];
        s += h[i];
      }
      int suf = s;  // keys in lanes >= this one
      for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_down_sync(FULL, suf, o);
        if (t + o < 32) suf += y;
      }
      int ge = suf - s, cand = -1, cand_ge = 0, cand_h = 0;
#pragma unroll
      for (int i = 7; i >= 0; --i) {
        ge += h[i];
        if (cand < 0 && ge >= th.remaining) {
          cand = 8 * t + i;
          cand_ge = ge;
          cand_h = h[i];
        }
      }
      int best = __reduce_max_sync(FULL, cand);
      if (cand == best && cand >= 0) {
        sh.pick[0] = best;
        sh.pick[1] = cand_ge - cand_h;
        sh.pick[2] = cand_h;
      }
    }
    __syncthreads();
    const int d = sh.pick[0];
    th.remaining -= sh.pick[1];
    th.prefix |= (uint32_t)d << sft;
    th.kmask |= 0xffu << sft;
    n_in = sh.pick[2];
  }
  return th;
}

// Positions of the selected keys among keys[0, n): calls emit(e, pos) for each; returns the count.
template <typename Emit>
__device__ int emit_selected(const uint32_t* keys, const uint8_t* valid, int n, int need, const Threshold& th,
                             Shared& sh, Emit emit) {
  const int t = threadIdx.x, nt = blockDim.x;
  const int per = (n + nt - 1) / nt, b0 = min(t * per, n), b1 = min(b0 + per, n);
  uint32_t gt = 0, tie = 0;
  if (need > 0) {
    for (int e = b0; e < b1; ++e) {
      if (valid && !valid[e]) continue;
      uint32_t km = th.masked(keys[e]);
      gt += km > th.prefix;
      tie += km == th.prefix;
    }
  }
  uint32_t total;
  uint32_t before = block_exclusive_scan((gt << 16) | tie, sh, &total);  // counts < 2^16 (cap checked)
  uint32_t g_b = before >> 16, t_b = before & 0xffffu;
  const uint32_t rem = (uint32_t)th.remaining;
  if (need > 0) {
    for (int e = b0; e < b1; ++e) {
      if (valid && !valid[e]) continue;
      uint32_t km = th.masked(keys[e]);
      if (km > th.prefix) {
        emit(e, (int)(g_b + min(t_b, rem)));
        ++g_b;
      } else if (km == th.prefix) {
        if (t_b < rem) emit(e, (int)(g_b + t_b));
        ++t_b;
      }
    }
  }
  return need > 0 ? (int)((total >> 16) + min(total & 0xffffu, rem)) : 0;
}

// The row's output from its selected winners (keys/pages in shared memory, page order).
__device__ void write_row(const Params& p, int row, const Forced& fc, const uint32_t* keys, const int32_t* pages,
                          const uint8_t* valid, int n, int need, uint8_t* filled, Shared& sh) {
  int32_t* out = p.out + (int64_t)row * p.k;
  const int t = threadIdx.x, nt = blockDim.x;
  for (int i = t; i < p.k; i += nt) filled[i] = 0;
  if (t == 0) {  // the forced pages, ascending (sink and recent ranges merged, overlap once)
    int i = 0, a = fc.s_lo, c = fc.r_lo;
    while (i < fc.f && i < MAX_FORCED) {
      int next;
      if (a < fc.s_hi && (c >= fc.total || a <= c)) {
        next = a++;
        if (next == c) ++c;
      } else {
        next = c++;
      }
      sh.forced[i++] = next;
    }
  }
  Threshold th = radix_threshold(keys, valid, n, need, sh);
  emit_selected(keys, valid, n, need, th, sh, [&](int e, int pos) {
    int slot = pos + fc.below(pages[e]);
    out[slot] = pages[e];
    filled[slot] = 1;
  });
  __syncthreads();
  if (t < 32) {  // the unfilled slots, in order, get the forced pages (then -1)
    int m = 0;
    for (int base = 0; base < p.k; base += 32) {
      int slot = base + t;
      bool empty = slot < p.k && !filled[slot];
      unsigned bal = __ballot_sync(FULL, empty);
      if (empty) {
        int j = m + __popc(bal & ((1u << t) - 1u));
        out[slot] = j < fc.f ? sh.forced[j] : -1;
      }
      m += __popc(bal);
    }
  }
}

template <int GM>  // heads held in registers: G <= GM
__global__ void __launch_bounds__(512) rank_select_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char dyn[];
  __shared__ Shared sh;
  uint32_t* keys = reinterpret_cast<uint32_t*>(dyn);
  int32_t* pages = reinterpret_cast<int32_t*>(keys + p.cap);
  uint8_t* valid = reinterpret_cast<uint8_t*>(pages + p.cap);
  uint8_t* filled = valid + p.cap;

  const int c = blockIdx.x, row = blockIdx.y, b = row / p.hkv;
  const int t = threadIdx.x, nt = blockDim.x, lane = t & 31, warp = t >> 5, nw = nt >> 5;
  const int n = p.seq_lens[b];
  const int ss = p.sink_start ? p.sink_start[b] : 0;
  const Forced fc(n, ss, p.page_size, p.sink, p.recent);
  const int pc = n / p.page_size;
  const int G = p.g;

  // 1. each head's log2-sum-exp over the row (one warp per head; 256 statistics per round in flight)
  for (int g = warp; g < G; g += nw) {
    float mx = -INFINITY, l = 0.0f;
    for (int i0 = 0; i0 < p.n_sc; i0 += 256) {
      float mi[8], li[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = i0 + 32 * j + lane;
        const float* st = p.stats + ((int64_t)row * p.n_sc + i) * 2 * p.gp + g;
        mi[j] = i < p.n_sc ? st[0] : -INFINITY;
        li[j] = i < p.n_sc ? st[p.gp] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float mn = fmaxf(mx, mi[j]);
        float ms = mn == -INFINITY ? 0.0f : mn;
        l = l * exp2f(mx - ms) + li[j] * exp2f(mi[j] - ms);
        mx = mn;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      float mo = __shfl_xor_sync(FULL, mx, o), lo = __shfl_xor_sync(FULL, l, o);
      float mn = fmaxf(mx, mo);
      float ms = mn == -INFINITY ? 0.0f : mn;
      l = l * exp2f(mx - ms) + lo * exp2f(mo - ms);
      mx = mn;
    }
    if (lane == 0) {
      float v = l > 0.0f ? mx + log2f(l) : -INFINITY;
      sh.lse2[g] = v;
      if (c == 0) p.lse[(int64_t)row * G + g] = v * LN2;
    }
  }
  __syncthreads();

  // 2. the chunk's ranking and candidate keys (position i = page c * chunk + i), four pages per
  //    thread and step, every head's scores loaded before any is used
  const int base = c * p.chunk;
  const int limit = fc.total > p.k ? pc : 0;  // candidates: full pages, and only if not all pages fit
  const float* sc = p.scores + (int64_t)row * G * p.max_pages + base;
  const int n_here = min(p.chunk, max(p.max_pages - base, 0));
  const bool vec = (p.max_pages & 3) == 0;  // 16-byte aligned rows (base: a multiple of 4)
  uint32_t nv = 0;  // this thread's candidates
  for (int q0 = 4 * t; q0 < n_here; q0 += 4 * nt) {
    float s[GM][4];
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      if (g < G) {
        const float* src = sc + (int64_t)g * p.max_pages + q0;
        if (vec && q0 + 4 <= n_here) {
          const float4 v = *reinterpret_cast<const float4*>(src);
          s[g][0] = v.x;
          s[g][1] = v.y;
          s[g][2] = v.z;
          s[g][3] = v.w;
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) s[g][j] = q0 + j < n_here ? src[j] : 0.0f;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = q0 + j, pg = base + i;
      if (i >= n_here) break;
      float rank = 0.0f;
      if (pg < pc) {
        if (p.rule == 2) {  // sum_mass: log-sum-exp over the group
          float mx = -INFINITY, acc = 0.0f;
#pragma unroll
          for (int g = 0; g < GM; ++g) {
            if (g < G) {
              float s2 = s[g][j] * LOG2E;
              float mn = fmaxf(mx, s2);
              acc = acc * exp2f(mx - mn) + exp2f(s2 - mn);
              mx = mn;
            }
          }
          rank = (mx + log2f(acc)) * LN2;
        } else {  // mean_share / max_share of each head's share exp(s - lse)
          float acc = 0.0f;
#pragma unroll
          for (int g = 0; g < GM; ++g) {
            if (g < G) {
              float l2 = sh.lse2[g];
              float share = l2 > -INFINITY ? exp2f(s[g][j] * LOG2E - l2) : 0.0f;
              acc = p.rule == 0 ? acc + share : fmaxf(acc, share);
            }
          }
          rank = p.rule == 0 ? acc / (float)G : acc;
        }
        p.ranking[(int64_t)row * p.max_pages + pg] = rank;
      }
      const bool ok = pg < limit && !fc.is_forced(pg);
      keys[i] = order_key(ok ? rank : 0.0f);
      pages[i] = pg;
      valid[i] = ok;
      nv += ok;
    }
  }
  const int n_valid = (int)block_op<0>(nv, sh);  // (its barriers order the stores above)
  const int k_free = p.k - fc.f;

  if (p.n_chunks == 1) {  // one chunk: its winners are the row's
    if (fc.total <= p.k) {
      for (int i = t; i < p.k; i += nt) p.out[(int64_t)row * p.k + i] = i < fc.total ? i : -1;
    } else {
      write_row(p, row, fc, keys, pages, valid, n_here, min(k_free, n_valid), filled, sh);
    }
    return;
  }

  // 3. the chunk's winners, then the row's last block merges
  const int need = min(k_free, n_valid);
  const int64_t slot = (int64_t)row * p.n_chunks + c;
  Threshold th = radix_threshold(keys, valid, n_here, need, sh);
  int cnt = emit_selected(keys, valid, n_here, need, th, sh, [&](int e, int pos) {
    p.ckey[slot * p.m + pos] = keys[e];
    p.cidx[slot * p.m + pos] = pages[e];
  });
  if (t == 0) p.ccnt[slot] = cnt;
  __threadfence();
  __syncthreads();
  if (t == 0) sh.ticket = atomicAdd(p.done + row, 1);
  __syncthreads();
  if (sh.ticket != p.n_chunks - 1) return;
  if (t == 0) atomicExch(p.done + row, 0);
  __threadfence();
  if (fc.total <= p.k) {
    for (int i = t; i < p.k; i += nt) p.out[(int64_t)row * p.k + i] = i < fc.total ? i : -1;
    return;
  }
  // gather the winners in chunk order (= page order) into shared memory
  int* offs = &sh.hist[0][0];  // reused: the chunks' prefix counts (n_chunks < 2 * BINS, checked on the host)
  const int ci = t < p.n_chunks ? __ldcg(p.ccnt + (int64_t)row * p.n_chunks + t) : 0;
  uint32_t n_all;
  const uint32_t before = block_exclusive_scan((uint32_t)ci, sh, &n_all);
  if (t < p.n_chunks) offs[t] = (int)before;
  if (t == 0) offs[p.n_chunks] = (int)n_all;
  __syncthreads();
  const int n_win = offs[p.n_chunks];
#pragma unroll 4
  for (int f = t; f < p.n_chunks * p.m; f += nt) {
    int ci = f / p.m, j = f % p.m;
    int at = offs[ci] + j;
    if (at < offs[ci + 1]) {
      int64_t src = ((int64_t)row * p.n_chunks + ci) * p.m + j;
      keys[at] = __ldcg(p.ckey + src);
      pages[at] = __ldcg(p.cidx + src);
    }
  }
  __syncthreads();
  write_row(p, row, fc, keys, pages, nullptr, n_win, min(k_free, n_win), filled, sh);
}

}  // namespace

extern "C" {

// Launches on `stream`; returns a cudaError_t (0 = success).
int kvlocks_rank_select(const void* scores, const void* stats, const void* seq_lens, const void* sink_start,
                        void* ranking, void* lse, void* ckey, void* cidx, void* ccnt, void* done, void* out, int batch,
                        int hkv, int g, int gp, int n_sc, int max_pages, int n_chunks, int chunk, int m, int page_size,
                        int k, int sink, int recent, int rule, int cap, int threads, void* stream) {
  Params p;
  p.scores = static_cast<const float*>(scores);
  p.stats = static_cast<const float*>(stats);
  p.seq_lens = static_cast<const int32_t*>(seq_lens);
  p.sink_start = static_cast<const int32_t*>(sink_start);
  p.ranking = static_cast<float*>(ranking);
  p.lse = static_cast<float*>(lse);
  p.ckey = static_cast<uint32_t*>(ckey);
  p.cidx = static_cast<int32_t*>(cidx);
  p.ccnt = static_cast<int32_t*>(ccnt);
  p.done = static_cast<int32_t*>(done);
  p.out = static_cast<int32_t*>(out);
  p.hkv = hkv;
  p.g = g;
  p.gp = gp;
  p.n_sc = n_sc;
  p.max_pages = max_pages;
  p.n_chunks = n_chunks;
  p.chunk = chunk;
  p.m = m;
  p.page_size = page_size;
  p.k = k;
  p.sink = sink;
  p.recent = recent;
  p.rule = rule;
  p.cap = cap;
  const size_t smem = (size_t)cap * 9 + (size_t)k;
  const dim3 grid(n_chunks, batch * hkv);
  const auto kernel = g <= 8 ? rank_select_kernel<8> : rank_select_kernel<16>;
  static size_t allowed[2] = {0, 0};
  size_t& ok = allowed[g <= 8 ? 0 : 1];
  if (smem > 48 * 1024 && smem > ok) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
    ok = smem;
  }
  kernel<<<grid, threads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  return (int)cudaGetLastError();
}

const char* kvlocks_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
