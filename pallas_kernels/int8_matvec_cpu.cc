// y[r, n] = x_scale[r] * scale[n] * sum_k x[r, k] * w[k, n]: a few int16 rows (x rounded
// per row by int8_matvec_cpu.py) times an int8 weight stored [K, N] with one float32 scale
// per output column. w8a16's decode product on CPU.
//
// Grouped (`GsmInt8MatvecGrouped`): groups of g consecutive k share a float16 scale and
// offset per column, w[k, n] ~ scale[k / g, n] * q[k, n] + zero[k / g, n], so
//   y[r, n] = x_scale[r] * sum_g (scale[g, n] * sum_{k in g} x[r, k] q[k, n]
//                                 + zero[g, n] * sum_{k in g} x[r, k]).
// The integer sums run per group (the chunk is g), and each group's scale and offset are
// applied as the group's sum is added in float32.
//
// The int8 weight is read once, as stored, and widened in registers: two weight rows at a
// time become int16 pairs, multiplied by the activation's int16 pair (vpdpwssd), summed
// exactly in int32 (chunks of kChunk k), then in float32. One or two rows of x stream the
// weight in memory order, spans of up to kStream columns (`stream_rows`); three or more
// use register tiles of 64 columns, four rows at a time (`block_rows`). Weight rows are
// prefetched into L2 kStreamAhead rows ahead. Columns are split across XLA:CPU's intra-op
// thread pool in chunks claimed from an atomic counter, so the calling thread always makes
// progress by itself. Each column is summed by one thread in a fixed order: the result
// does not depend on the thread count or on which other rows share the call.
//
// Built at first use by int8_matvec_cpu.py (g++ -O3 -march=native) and called through
// jax.ffi; its plain references are `int8_matvec_reference` there and the int64 product
// in tests/test_int8_matvec_cpu.py.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "int8_matvec_cpu.cc needs AVX-512 F, BW and VL (int8_matvec_cpu.py checks the CPU first)"
#endif
#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 64;  // columns per block: one cache line of int8

// Integer sums stay exact in int32 for this many k: |x| <= 32767, |w| <= 128, so
// 512 * 32767 * 128 < 2**31. Longer rows are summed in chunks, each added in float32.
constexpr int64_t kChunk = 512;

struct Problem {
  const int16_t* x;
  const float* x_scale;
  const int8_t* w;
  const float* scale;       // [N] float32 (per column), or null when grouped
  const uint16_t* gscale;   // [K / group, N] float16 bits (grouped), else null
  const uint16_t* gzero;    // [K / group, N] float16 bits (grouped), else null
  float* y;
  int64_t rows, k, n;
  int64_t chunk;            // k per integer sum: the group when grouped, else kChunk
};
// Weight rows ahead prefetched into L2 (_MM_HINT_T1): L1's few fill buffers keep too few
// lines in flight to stream from DRAM (8-10 GB/s with L1 prefetches or none, ~22 GB/s
// with these; SmolLM2's weights, one core, AMD EPYC).
constexpr int64_t kStreamAhead = 16;
constexpr int64_t kStream = 2048;  // widest column span of the one- and two-row path

// One 64-column block, rows r0..r0+R-1. Two weight rows (k, k+1) at a time: their int8
// values are widened to int16 and interleaved, so each 32-bit lane holds the pair
// (w[k, c], w[k+1, c]) of one column c; a multiply-add of 16-bit pairs against the pair
// (x[r, k], x[r, k+1]) adds both products into that column's int32 sum. In a 128-bit
// lane L of half h, the "lo" vector holds columns h*32 + L*8 + 0..3, "hi" L*8 + 4..7.
static inline __m512i pair_dot(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// The activation pair (x[row, kk], x[row, kk + 1]) in every 32-bit lane (0 for a missing
// second row).
static inline __m512i x_pair(const Problem& p, int64_t row, int64_t kk, bool pair) {
  const int16_t* xr = p.x + row * p.k;
  const uint32_t lo = static_cast<uint16_t>(xr[kk]);
  const uint32_t hi = pair ? static_cast<uint16_t>(xr[kk + 1]) : 0u;
  return _mm512_set1_epi32(static_cast<int32_t>(lo | (hi << 16)));
}

// 32 columns of weight rows a and b widened to int16 and interleaved into the pairs
// (a[c], b[c]): `lo` columns L*8 + 0..3, `hi` L*8 + 4..7 of each 128-bit lane L. Unmasked
// loads when all 32 columns of both rows are there; else `ma` / `mb` (0: a zero row).
static inline void weight_pairs(const int8_t* a, const int8_t* b, bool whole, __mmask32 ma,
                                __mmask32 mb, __m512i& lo, __m512i& hi) {
  __m512i wa, wb;
  if (whole) {
    wa = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
    wb = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  } else {
    wa = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(ma, a));
    wb = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mb, b));
  }
  lo = _mm512_unpacklo_epi16(wa, wb);
  hi = _mm512_unpackhi_epi16(wa, wb);
}

// Weight rows kStreamAhead and kStreamAhead + 1 below `a` (one cache line) into L2.
static inline void prefetch_ahead(const int8_t* a, int64_t n) {
  _mm_prefetch(reinterpret_cast<const char*>(a + kStreamAhead * n), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(a + (kStreamAhead + 1) * n), _MM_HINT_T1);
}

// The column (within its 64-column block) of lane i of accumulator j of that block (j: half
// h = j / 2, lo or hi = j % 2; see weight_pairs).
static inline int lane_column(int j, int i) {
  return (j / 2) * 32 + (i / 4) * 8 + (j % 2) * 4 + i % 4;
}

// The sum over k0..k1 of row `row`'s int16 values (the grouped offset's multiplier).
static inline float x_sum(const Problem& p, int64_t row, int64_t k0, int64_t k1) {
  const int16_t* xr = p.x + row * p.k;
  int32_t s = 0;
  for (int64_t k = k0; k < k1; ++k) s += xr[k];
  return static_cast<float>(s);
}

// 16 float16 of `src` (the first `count`; the rest 0) as float32.
static inline __m512 halves(const uint16_t* src, int64_t count) {
  const __mmask16 m = count >= 16 ? (__mmask16)0xFFFF
                      : (__mmask16)((1u << std::max<int64_t>(0, count)) - 1);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src));
}

// A group's per-column factors (scale or offset, float16 [.., N] at `row`) for the 32
// columns col .. col + 31 (`count` of them there), in the lane order of weight_pairs:
// lo[i] is column (i / 4) * 8 + i % 4, hi[i] that plus 4.
static inline void lane_factors(const uint16_t* row, int64_t col, int64_t count, __m512& lo,
                                __m512& hi) {
  const __m512 a = halves(row + col, count), b = halves(row + col + 16, count - 16);
  const __m512i ilo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                        27);
  const __m512i ihi = _mm512_add_epi32(ilo, _mm512_set1_epi32(4));
  lo = _mm512_permutex2var_ps(a, ilo, b);
  hi = _mm512_permutex2var_ps(a, ihi, b);
}

// One chunk's 32 columns (two accumulators, lane order) added into their float32 totals:
// plain (the per-column scale comes at the end) or, grouped, times the group's scale plus
// its offset times the chunk's x sum.
template <bool GROUPED>
static inline void add_chunk(const Problem& p, int64_t g, int64_t col, int64_t count,
                             int R, const float* xs, const __m512i* acc, float* const* total) {
  __m512 s_lo, s_hi, z_lo, z_hi;
  if (GROUPED) {
    lane_factors(p.gscale + g * p.n, col, count, s_lo, s_hi);
    lane_factors(p.gzero + g * p.n, col, count, z_lo, z_hi);
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < 2; ++t) {
      float* tot = total[r] + t * 16;
      const __m512 a = _mm512_cvtepi32_ps(acc[r * 2 + t]);
      __m512 v = _mm512_load_ps(tot);
      if (GROUPED) {
        v = _mm512_fmadd_ps(a, t ? s_hi : s_lo, v);
        v = _mm512_fmadd_ps(_mm512_set1_ps(xs[r]), t ? z_hi : z_lo, v);
      } else {
        v = _mm512_add_ps(v, a);
      }
      _mm512_store_ps(tot, v);
    }
  }
}

// y for the columns c0 .. c0 + width of rows r0 .. r0 + R - 1 from totals in lane order
// (64 per block): times the row's scale and, per column, its scale (not grouped).
template <bool GROUPED, int R>
static inline void write_rows(const Problem& p, int64_t r0, int64_t c0, int64_t width,
                              const float* total, int64_t stride) {
  for (int r = 0; r < R; ++r) {
    const float sx = p.x_scale[r0 + r];
    for (int64_t blk = 0; blk * kBlock < width; ++blk)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 16; ++i) {
          const int64_t c = blk * kBlock + lane_column(j, i);
          if (c >= width) continue;
          const float v = total[r * stride + blk * kBlock + j * 16 + i] * sx;
          p.y[(r0 + r) * p.n + c0 + c] = GROUPED ? v : v * p.scale[c0 + c];
        }
  }
}

// Columns c0 .. c0 + NB * 64 (NB blocks side by side, so each weight row is read as
// NB contiguous cache lines), rows r0 .. r0 + R - 1; R * NB * 4 int32 accumulators.
template <bool GROUPED, int R, int NB, bool FULL>
void block_rows(const Problem& p, int64_t r0, int64_t c0) {
  __mmask32 m[NB][2];
  int64_t width[NB];
  for (int s = 0; s < NB; ++s) {
    width[s] = std::max<int64_t>(0, std::min<int64_t>(kBlock, p.n - c0 - s * kBlock));
    const int64_t w0 = std::min<int64_t>(32, width[s]), w1 = width[s] - w0;
    m[s][0] = w0 == 32 ? 0xFFFFFFFFu : (__mmask32)((1ULL << w0) - 1);
    m[s][1] = w1 == 32 ? 0xFFFFFFFFu : (__mmask32)((1ULL << std::max<int64_t>(0, w1)) - 1);
  }
  alignas(64) float total[R][NB * kBlock] = {};
  for (int64_t k0 = 0; k0 < p.k; k0 += p.chunk) {
    const int64_t k1 = std::min(p.k, k0 + p.chunk);
    __m512i acc[R][NB * 4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB * 4; ++j) acc[r][j] = _mm512_setzero_si512();
    for (int64_t kk = k0; kk < k1; kk += 2) {
      const bool pair = kk + 1 < k1;
      __m512i xv[R];
      for (int r = 0; r < R; ++r) xv[r] = x_pair(p, r0 + r, kk, pair);
      const int8_t* a = p.w + kk * p.n + c0;
      const int8_t* b = pair ? a + p.n : a;
      if (kk + kStreamAhead + 1 < p.k)
        for (int s = 0; s < NB; ++s) prefetch_ahead(a + s * kBlock, p.n);
      for (int s = 0; s < NB; ++s) {
        for (int h = 0; h < 2; ++h) {
          const int64_t off = s * kBlock + h * 32;
          __m512i lo, hi;
          weight_pairs(a + off, b + off, FULL && pair, m[s][h], pair ? m[s][h] : 0u, lo, hi);
          for (int r = 0; r < R; ++r) {
            acc[r][s * 4 + h * 2] = pair_dot(acc[r][s * 4 + h * 2], lo, xv[r]);
            acc[r][s * 4 + h * 2 + 1] = pair_dot(acc[r][s * 4 + h * 2 + 1], hi, xv[r]);
          }
        }
      }
    }
    float xs[R];
    if (GROUPED)
      for (int r = 0; r < R; ++r) xs[r] = x_sum(p, r0 + r, k0, k1);
    for (int s = 0; s < NB; ++s)
      for (int h = 0; h < 2; ++h) {
        const int64_t off = s * kBlock + h * 32;
        __m512i pairs[R * 2];
        float* tot[R];
        for (int r = 0; r < R; ++r) {
          pairs[r * 2] = acc[r][s * 4 + h * 2];
          pairs[r * 2 + 1] = acc[r][s * 4 + h * 2 + 1];
          tot[r] = total[r] + off;
        }
        add_chunk<GROUPED>(p, k0 / p.chunk, c0 + off, width[s] - h * 32, R, xs, pairs, tot);
      }
  }
  for (int s = 0; s < NB; ++s)
    write_rows<GROUPED, R>(p, r0, c0 + s * kBlock, width[s], &total[0][s * kBlock],
                           NB * kBlock);
}

// One or two rows over the columns [c0, c1) (at most kStream): every weight row of the
// span is read front to back, two rows at a time, so the weight streams in memory order
// (at N <= kStream the whole matrix is one sequential read); the int32 sums live in an
// L1-resident array, in the lane order of `weight_pairs`.
template <bool GROUPED, int R>
void stream_rows(const Problem& p, int64_t r0, int64_t c0, int64_t c1) {
  const int64_t width = c1 - c0;
  const int64_t nblk = (width + kBlock - 1) / kBlock;
  const int64_t last = width - (nblk - 1) * kBlock;  // columns in the last block
  const __mmask32 l0 = last >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ULL << last) - 1);
  const __mmask32 l1 = last <= 32 ? 0u
                       : last == 64 ? 0xFFFFFFFFu : (__mmask32)((1ULL << (last - 32)) - 1);
  alignas(64) int32_t acc[R][kStream];
  alignas(64) float total[R][kStream];
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < nblk * kBlock; ++c) total[r][c] = 0.0f;
  for (int64_t k0 = 0; k0 < p.k; k0 += p.chunk) {
    const int64_t k1 = std::min(p.k, k0 + p.chunk);
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < nblk * kBlock; c += 16)
        _mm512_store_si512(acc[r] + c, _mm512_setzero_si512());
    for (int64_t kk = k0; kk < k1; kk += 2) {
      const bool pair = kk + 1 < k1;
      __m512i xv[R];
      for (int r = 0; r < R; ++r) xv[r] = x_pair(p, r0 + r, kk, pair);
      const int8_t* a = p.w + kk * p.n + c0;
      const int8_t* b = pair ? a + p.n : a;
      const bool ahead = kk + kStreamAhead + 1 < p.k;
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const bool full = blk + 1 < nblk || last == kBlock;
        if (ahead) prefetch_ahead(a + blk * kBlock, p.n);
        for (int h = 0; h < 2; ++h) {
          const int64_t off = blk * kBlock + h * 32;
          const __mmask32 ma = full ? 0xFFFFFFFFu : (h ? l1 : l0);
          __m512i lo, hi;
          weight_pairs(a + off, b + off, full && pair, ma, pair ? ma : 0u, lo, hi);
          for (int r = 0; r < R; ++r) {
            int32_t* q = acc[r] + off;
            _mm512_store_si512(q, pair_dot(_mm512_load_si512(q), lo, xv[r]));
            _mm512_store_si512(q + 16, pair_dot(_mm512_load_si512(q + 16), hi, xv[r]));
          }
        }
      }
    }
    float xs[R];
    if (GROUPED)
      for (int r = 0; r < R; ++r) xs[r] = x_sum(p, r0 + r, k0, k1);
    for (int64_t off = 0; off < nblk * kBlock; off += 32) {
      __m512i pairs[R * 2];
      float* tot[R];
      for (int r = 0; r < R; ++r) {
        pairs[r * 2] = _mm512_load_si512(acc[r] + off);
        pairs[r * 2 + 1] = _mm512_load_si512(acc[r] + off + 16);
        tot[r] = total[r] + off;
      }
      add_chunk<GROUPED>(p, k0 / p.chunk, c0 + off, width - off, R, xs, pairs, tot);
    }
  }
  write_rows<GROUPED, R>(p, r0, c0, width, &total[0][0], kStream);
}

// One tile of kTile columns, all rows: one row keeps the tile's four blocks in flight
// together, two rows two, more rows one at a time (each R * NB * 4 <= 16 accumulators).
constexpr int64_t kTile = 4 * kBlock;

template <bool GROUPED, bool FULL>
void column_tile_rows(const Problem& p, int64_t c0) {
  for (int64_t r0 = 0; r0 < p.rows; r0 += 4) {
    const int64_t rows = std::min<int64_t>(4, p.rows - r0);
    if (rows == 1) {
      block_rows<GROUPED, 1, 4, FULL>(p, r0, c0);
    } else if (rows == 2) {
      block_rows<GROUPED, 2, 2, FULL>(p, r0, c0);
      if (c0 + 2 * kBlock < p.n) block_rows<GROUPED, 2, 2, FULL>(p, r0, c0 + 2 * kBlock);
    } else {
      for (int64_t c = c0; c < std::min(p.n, c0 + kTile); c += kBlock) {
        if (rows == 4) block_rows<GROUPED, 4, 1, FULL>(p, r0, c);
        else block_rows<GROUPED, 3, 1, FULL>(p, r0, c);
      }
    }
  }
}

template <bool GROUPED>
void column_tile(const Problem& p, int64_t c0) {
  if (c0 + kTile <= p.n) column_tile_rows<GROUPED, true>(p, c0);
  else column_tile_rows<GROUPED, false>(p, c0);
}

// Work shared between the calling thread and the pool's: blocks of `chunk` column blocks
// claimed in order; `done` counts finished chunks.
template <bool GROUPED>
struct Shared {
  Problem p;
  int64_t unit, chunks;  // columns per chunk of work, number of chunks
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= chunks) return;
      const int64_t c0 = c * unit, c1 = std::min(p.n, c0 + unit);
      if (p.rows <= 2) {
        if (p.rows == 2) stream_rows<GROUPED, 2>(p, 0, c0, c1);
        else stream_rows<GROUPED, 1>(p, 0, c0, c1);
      } else {
        for (int64_t t = c0; t < c1; t += kTile) column_tile<GROUPED>(p, t);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Splits the columns between the calling thread and the pool and waits for all of them.
template <bool GROUPED>
void run(ffi::ThreadPool& pool, const Problem& p) {
  if (p.rows == 0 || p.n == 0) return;  // an empty result
  auto shared = std::make_shared<Shared<GROUPED>>();
  shared->p = p;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // one or two rows: spans of up to kStream columns, at least one per thread; more rows:
  // tiles of kTile columns, about four chunks per thread
  const int64_t per_thread = (p.n + threads - 1) / threads;
  const int64_t unit = p.rows <= 2
      ? std::min(kStream, (per_thread + kBlock - 1) / kBlock * kBlock)
      : std::max<int64_t>(1, (p.n + kTile - 1) / kTile / (4 * threads)) * kTile;
  shared->unit = unit;
  shared->chunks = (p.n + unit - 1) / unit;
  const int64_t helpers = std::min<int64_t>(threads - 1, shared->chunks - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([shared] { shared->work(); });
  shared->work();
  while (shared->done.load(std::memory_order_acquire) < shared->chunks)
    std::this_thread::yield();
}

// x [rows, K], x_scale [rows], w [K, N]: the shapes both entry points share.
static inline bool product_shapes(const ffi::Buffer<ffi::S16>& x,
                                  const ffi::Buffer<ffi::F32>& x_scale,
                                  const ffi::Buffer<ffi::S8>& w) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  return xd.size() == 2 && wd.size() == 2 && wd[0] == xd[1] &&
         x_scale.dimensions().size() == 1 && x_scale.dimensions()[0] == xd[0];
}

ffi::Error Int8MatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S16> x,
                          ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  if (!product_shapes(x, x_scale, w) || scale.dimensions().size() != 1 ||
      scale.dimensions()[0] != w.dimensions()[1])
    return ffi::Error::InvalidArgument(
        "int8_matvec: x [rows, K], x_scale [rows], w [K, N], scale [N]");
  const auto xd = x.dimensions();
  run<false>(pool, Problem{x.typed_data(), x_scale.typed_data(), w.typed_data(),
                           scale.typed_data(), nullptr, nullptr, y->typed_data(), xd[0], xd[1],
                           w.dimensions()[1], kChunk});
  return ffi::Error::Success();
}

ffi::Error Int8MatvecGroupedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S16> x,
                                 ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::S8> w,
                                 ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> zero,
                                 ffi::ResultBuffer<ffi::F32> y) {
  const auto sd = scale.dimensions(), zd = zero.dimensions();
  if (!product_shapes(x, x_scale, w) || sd.size() != 2 || zd.size() != 2 || sd[0] != zd[0] ||
      sd[1] != zd[1] || sd[1] != w.dimensions()[1] || sd[0] < 1)
    return ffi::Error::InvalidArgument(
        "int8_matvec_grouped: x [rows, K], x_scale [rows], w [K, N], scale and zero [G, N]");
  const int64_t k = x.dimensions()[1], groups = sd[0];
  const int64_t group = k / groups;
  if (group * groups != k || group % 2 || group > kChunk)
    return ffi::Error::InvalidArgument(
        "int8_matvec_grouped: the group (K / G) must be even, at most 512, and divide K");
  run<true>(pool, Problem{x.typed_data(), x_scale.typed_data(), w.typed_data(), nullptr,
                          reinterpret_cast<const uint16_t*>(scale.typed_data()),
                          reinterpret_cast<const uint16_t*>(zero.typed_data()),
                          y->typed_data(), x.dimensions()[0], k, w.dimensions()[1], group});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GsmInt8Matvec, Int8MatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GsmInt8MatvecGrouped, Int8MatvecGroupedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
