// shoal's low-bit matmuls: y = x @ W.T with W in a GGUF's own block formats, as llama.cpp
// computes them. Each row of x is cut into blocks of 32 along the input and rounded to int8
// with one float scale per block (ggml's Q8 activations); each block's products with the
// weights' codes are summed exactly in int32 (AVX-512 VNNI `vpdpbusd`, or AVX2's
// `vpmaddubsw` + `vpmaddwd`, or SSE2's `pmaddwd` on 16-bit values: the same integers), then scaled into a float32
// accumulator, block after block in input order.
//
//   q4: w = d * c + m per block (c a 4-bit code, d and m float16): Q4_1 as stored; Q4_0 is
//       m = -8 d. A block adds (d * d_x) * sum(c * q_x), then m * sum(x): the float sum of
//       the block's unrounded inputs, so the minimum's term carries no activation rounding.
//   q8: w = d * c (c int8): Q8_0 as stored. A block adds (d * d_x) * sum(c * q_x).
//
// Row invariance by construction: one output of one row is the same sequence of integer
// sums and float operations whatever the other rows are, whichever thread computes it and
// whichever instruction set: the integer sums are exact, and the float operations (one
// multiply, one or two fused multiply-adds per block) are the same on every path.
//
// The weights are packed at load (model/quant.py) in panels of 16 outputs, a panel's
// blocks one after another, so a thread streams its panels' bytes in order:
//   q4: per (panel, block) 320 bytes: 4 lines of 64 bytes, line L holding the codes of
//       inputs 8L..8L+3 in its low nibbles and 8L+4..8L+7 in its high nibbles, output o's
//       four codes at bytes 4o..4o+3 (vpdpbusd's layout); then d[16], m[16] as float16.
//   q8: per (panel, block) 544 bytes: 8 lines of 64 bytes, line j holding inputs 4j..4j+3,
//       each code stored plus 128 (vpdpbusd multiplies unsigned by signed bytes: the extra
//       128 * sum(q_x) is taken off again, exactly); then d[16] as float16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lowbit.h"
#include "vec.h"

namespace lowbit {
int cpu_rows_rule() {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") ? 1 : 2;
}
std::atomic<int> few_rows_rule{cpu_rows_rule()};
}  // namespace lowbit

namespace {

using lowbit::few_rows_one_stream;
using lowbit::half_to_float;
using lowbit::in_register;
using lowbit::input;
using lowbit::kBlock;
using lowbit::kPanel;
using lowbit::matmul_path;
using lowbit::pair_sums;
using lowbit::shift_epi16;
constexpr int64_t kQ4Bytes = 4 * 64 + 2 * kPanel * 2;
constexpr int64_t kQ8Bytes = 8 * 64 + kPanel * 2;
constexpr int64_t kRows = 4;         // rows of x sharing one pass over a panel's weights (two panels on VNNI)
constexpr int64_t kPrefetch = 2048;  // bytes ahead of the block being read

// Q4: Q4_0 and Q4_1; Q8: Q8_0; Q5_0, Q5_1: a Q4 panel's lines with a fifth bit per code in a line of its own
enum Kind : int { kQ4 = 0, kQ8 = 1, kQ50 = 2, kQ51 = 3 };

// where a (panel, block)'s parts lie: its bytes in all, the scales d[16] and minimums m[16] (float16; m < 0: none)
struct Layout {
  int64_t bytes, d, m;
};
constexpr Layout layout(int kind) {
  return kind == kQ4 ? Layout{kQ4Bytes, 256, 288} : kind == kQ8 ? Layout{kQ8Bytes, 512, -1}
       : kind == kQ50 ? Layout{352, 320, -1} : Layout{384, 320, 352};
}

// Activations rounded per block: codes, the scale d_x, the exact float sum, the codes' sum.
struct Quantized {
  const int8_t* q;
  const float* d;
  const float* sum;
  const int32_t* qsum;
  int64_t K, B;
};

struct Args {
  Quantized x;
  const uint8_t* w;
  float* y;  // [M, N] float32
  int64_t M, N, P;
  int kind;
};

// One row's blocks: amax / 127 as the scale, codes rounded to nearest even, the block's float sum
// as (x[i] + x[i + 16]) added across lanes by one fixed tree. Compiled once for every CPU, on the
// baseline's registers (vec.h, W = 16), so every path rounds the same codes.
// No contraction: x * inv is rounded before it is rounded to an integer, as the tests' model does.
__attribute__((optimize("fp-contract=off")))
void quantize_rows(const char* x, int64_t stride_bytes, at::ScalarType t, int64_t r0, int64_t r1, int8_t* q, float* d,
                   float* sum, int32_t* qsum, int64_t K) {
  const int64_t B = K / kBlock;
  std::vector<float> buf(t == at::kFloat ? 0 : K);
  typedef vf<16> F;
  const F magic = F::set(12582912.0f), zero = F::zero();  // 1.5 * 2^23
  for (int64_t r = r0; r < r1; ++r) {
    const char* row = x + r * stride_bytes;
    const float* v = reinterpret_cast<const float*>(row);
    if (t != at::kFloat) {
      for (int64_t i = 0; i < K; ++i) buf[i] = input(row, i, t);
      v = buf.data();
    }
    for (int64_t b = 0; b < B; ++b) {
      const F v0 = F::load(v + b * kBlock), v1 = F::load(v + b * kBlock + 16);
      const F a0 = select(v0 < zero, zero - v0, v0), a1 = select(v1 < zero, zero - v1, v1);
      const float amax = lane_max(vmax(a0, a1));
      // below 1e-30 a block counts as zeros (127 / amax would overflow near float's smallest numbers)
      const float inv = amax > 1e-30f ? 127.0f / amax : 0.0f;
      F y0 = v0 * F::set(inv), y1 = v1 * F::set(inv);
      y0 = (y0 + magic) - magic;  // round to nearest even (|y| <= 127)
      y1 = (y1 + magic) - magic;
      const vi<16> c0 = to_int(y0), c1 = to_int(y1);
      int8_t* out = q + r * K + b * kBlock;
      for (int k = 0; k < F::kParts; ++k) {
        const Regs<16>::b b0 = __builtin_convertvector(c0.p[k], Regs<16>::b), b1 = __builtin_convertvector(c1.p[k], Regs<16>::b);
        std::memcpy(out + 4 * k, &b0, 4);
        std::memcpy(out + 16 + 4 * k, &b1, 4);
      }
      const vi<16> cs = c0 + c1;
      int32_t qs = 0;
      for (int i = 0; i < 16; ++i) qs += cs.lane(i);
      const float total = lane_sum(v0 + v1);
      // a NaN or infinity in the block reaches its sum: the scale carries it into every output, so the
      // row's logits are not finite and the sampler fails that request alone (never laundered into codes)
      d[r * B + b] = std::isfinite(total) ? amax / 127.0f : total;
      sum[r * B + b] = total;
      qsum[r * B + b] = qs;
    }
  }
}

// ---- x86-64 baseline (SSE2, every x86-64 CPU): 16-bit products summed in pairs, four outputs a register ----
// The codes and activations widen to int16, `pmaddwd` sums pairs of products exactly in int32, and a block's
// pairs add up to the same integers the other paths find. The float part is per output, in scalar code: the
// same multiply and fused multiply-adds as the vector paths (std::fma, exact without FMA hardware too).

// the float part of one block for four outputs: acc += (d * d_x) * s, then (q4) += m * sum(x)
INL void scale_block(float* acc, const int32_t* s, const float* d, const float* m, float dx, float xsum) {
  for (int o = 0; o < 4; ++o) {
    acc[o] = std::fma(d[o] * dx, static_cast<float>(s[o]), acc[o]);
    if (m != nullptr) acc[o] = std::fma(m[o], xsum, acc[o]);
  }
}

template <int R>
void panel_sse2(const Args& a, int64_t p, int64_t r0) {
  const int64_t B = a.x.B, K = a.x.K;
  const bool nibbles = a.kind != kQ8, q5 = a.kind == kQ50 || a.kind == kQ51;
  const Layout lay = layout(a.kind);
  float acc[R][kPanel] = {};
  const __m128i low4 = _mm_set1_epi8(0x0F), zero = _mm_setzero_si128(), bias = _mm_set1_epi16(128), fifth = _mm_set1_epi8(0x10);
  const __m128i offset = _mm_set1_epi16(a.kind == kQ50 ? 16 : 0);  // Q5_0's codes sit 16 above the weight's multiple of d
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* blk = a.w + (p * B + b) * lay.bytes;
    __m128i xs[R][8];  // per row, inputs 4j..4j+3 as int16, twice: what one output's four codes meet
    for (int r = 0; r < R; ++r) lowbit::widen_block(a.x.q + (r0 + r) * K + b * kBlock, xs[r]);
    for (int g = 0; g < 4; ++g) {  // outputs 4g..4g+3: bytes 16g..16g+15 of every line
      __m128i s01[R], s23[R];  // pairs of partial sums of outputs 4g, 4g+1 and of 4g+2, 4g+3
      for (int r = 0; r < R; ++r) s01[r] = s23[r] = zero;
      if (nibbles) {
        for (int L = 0; L < 4; ++L) {  // line L: inputs 8L..8L+3 in the low nibbles, 8L+4..8L+7 in the high
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 64 * L + 16 * g));
          __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
          if (q5) {  // the fifth bits: bit 2L (low nibbles' inputs) and 2L + 1 (high) of the line after the four
            const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + 16 * g));
            lo = _mm_or_si128(lo, _mm_and_si128(shift_epi16(h, 4 - 2 * L), fifth));
            hi = _mm_or_si128(hi, _mm_and_si128(shift_epi16(h, 3 - 2 * L), fifth));
          }
          const __m128i lo01 = _mm_sub_epi16(_mm_unpacklo_epi8(lo, zero), offset), lo23 = _mm_sub_epi16(_mm_unpackhi_epi8(lo, zero), offset);
          const __m128i hi01 = _mm_sub_epi16(_mm_unpacklo_epi8(hi, zero), offset), hi23 = _mm_sub_epi16(_mm_unpackhi_epi8(hi, zero), offset);
          for (int r = 0; r < R; ++r) {
            s01[r] = _mm_add_epi32(s01[r], _mm_add_epi32(_mm_madd_epi16(lo01, xs[r][2 * L]), _mm_madd_epi16(hi01, xs[r][2 * L + 1])));
            s23[r] = _mm_add_epi32(s23[r], _mm_add_epi32(_mm_madd_epi16(lo23, xs[r][2 * L]), _mm_madd_epi16(hi23, xs[r][2 * L + 1])));
          }
        }
      } else {
        for (int j = 0; j < 8; ++j) {  // line j: inputs 4j..4j+3, each code stored plus 128
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 64 * j + 16 * g));
          const __m128i c01 = _mm_sub_epi16(_mm_unpacklo_epi8(v, zero), bias), c23 = _mm_sub_epi16(_mm_unpackhi_epi8(v, zero), bias);
          for (int r = 0; r < R; ++r) {
            s01[r] = _mm_add_epi32(s01[r], _mm_madd_epi16(c01, xs[r][j]));
            s23[r] = _mm_add_epi32(s23[r], _mm_madd_epi16(c23, xs[r][j]));
          }
        }
      }
      float d[4], m[4];  // the outputs' float16 scales (and minimums), converted once for every row
      for (int o = 0; o < 4; ++o) {
        d[o] = half_to_float(blk + lay.d + 8 * g + 2 * o);
        m[o] = lay.m >= 0 ? half_to_float(blk + lay.m + 8 * g + 2 * o) : 0.0f;
      }
      for (int r = 0; r < R; ++r) {
        int32_t s[4];
        _mm_storeu_si128(reinterpret_cast<__m128i*>(s), pair_sums(s01[r], s23[r]));
        const int64_t i = (r0 + r) * B + b;
        scale_block(&acc[r][4 * g], s, d, lay.m >= 0 ? m : nullptr, a.x.d[i], a.x.sum[i]);
      }
    }
  }
  const int64_t n = std::min(kPanel, a.N - p * kPanel);
  for (int r = 0; r < R; ++r) std::memcpy(a.y + (r0 + r) * a.N + p * kPanel, acc[r], n * sizeof(float));
}

// ---- AVX2 (and AVX-512 CPUs without VNNI): two halves of 8 outputs ----

#define AVX2_TARGET LOWBIT_AVX2

AVX2_TARGET inline __m256i dot4_u8s8(__m256i u, __m256i s) {  // per 32-bit lane: sum of 4 u8 * s8 products, exact here
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// acc(row, half h) += (d * d_x) * isum, then (q4) m * sum(x): a block's float part for outputs 8h..8h+7
template <int R>
AVX2_TARGET inline __attribute__((always_inline)) void scale_half_avx2(const Args& a, const uint8_t* blk, int64_t b, int64_t r0, int h, const __m256i* isum,
                                        __m256 (&acc)[R][2]) {
  const Layout lay = layout(a.kind);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + lay.d + 16 * h)));
  const __m256 m = lay.m >= 0 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + lay.m + 16 * h))) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const int64_t i = (r0 + r) * a.x.B + b;
    const __m256 t = _mm256_mul_ps(d, _mm256_set1_ps(a.x.d[i]));
    acc[r][h] = _mm256_fmadd_ps(t, _mm256_cvtepi32_ps(isum[r]), acc[r][h]);
    if (lay.m >= 0) acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.x.sum[i]), acc[r][h]);
  }
}

template <int R>
AVX2_TARGET inline __attribute__((always_inline)) void store_rows_avx2(const Args& a, int64_t p, int64_t r0, const __m256 (&acc)[R][2]) {
  const int64_t n = std::min(kPanel, a.N - p * kPanel);
  for (int r = 0; r < R; ++r) {
    float out[kPanel];
    _mm256_storeu_ps(out, acc[r][0]);
    _mm256_storeu_ps(out + 8, acc[r][1]);
    std::memcpy(a.y + (r0 + r) * a.N + p * kPanel, out, n * sizeof(float));
  }
}

// Q4: both halves of the panel in one pass, so that each broadcast of four activation bytes feeds two
// vpmaddubsw. Each block prefetches the weights kPrefetch ahead, as the VNNI kernel does: on an Intel Xeon one row
// streamed a layer's weights at 14 GB/s without it and 19-28 with it (benchmarks/NOTES.md, thirty-fifth round).
// A pair sum of 4-bit codes is at most 2 * 15 * 127 = 3,810 in magnitude, so a block's eight of them add up
// exactly in int16 (at most 30,480), and one vpmaddwd widens them.
// Q5 (Q5_0, Q5_1: the fifth bit from the line after the four): a pair sum reaches 2 * 31 * 127 = 7,874, so
// four of them at most (31,496) share an int16 sum: it is widened after lines 0-1 and again after 2-3.
template <int R, bool Q5>
AVX2_TARGET void panel_avx2_q4(const Args& a, int64_t p, int64_t r0) {
  const int64_t B = a.x.B, K = a.x.K;
  const int64_t bytes = layout(a.kind).bytes;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), fifth = _mm256_set1_epi8(0x10);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* blk = a.w + (p * B + b) * bytes;
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch + l), _MM_HINT_T0);
    __m256i s16[R][2], wide[R][2];
    for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = wide[r][0] = wide[r][1] = _mm256_setzero_si256();
    for (int L = 0; L < 4; ++L) {
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * L + 32 * h));
        lo[h] = _mm256_and_si256(v, low4);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if constexpr (Q5) {
          const __m256i f = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256 + 32 * h));
          lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(shift_epi16(f, 4 - 2 * L), fifth));
          hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(shift_epi16(f, 3 - 2 * L), fifth));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.x.q + (r0 + r) * K + b * kBlock + 8 * L;
        int32_t x0, x1;
        std::memcpy(&x0, xq, 4);
        std::memcpy(&x1, xq + 4, 4);
        const __m256i b0 = _mm256_set1_epi32(x0), b1 = _mm256_set1_epi32(x1);
        for (int h = 0; h < 2; ++h) {  // one product at a time into the running sum, kept in a register
          s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_maddubs_epi16(lo[h], b0));
          in_register<R>(s16[r][h]);
          s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_maddubs_epi16(hi[h], b1));
          in_register<R>(s16[r][h]);
        }
      }
      if (Q5 && L == 1) {
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) {
            wide[r][h] = _mm256_madd_epi16(s16[r][h], ones);
            s16[r][h] = _mm256_setzero_si256();
          }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256i isum[R];
      for (int r = 0; r < R; ++r) {
        isum[r] = _mm256_madd_epi16(s16[r][h], ones);
        if constexpr (Q5) isum[r] = _mm256_add_epi32(wide[r][h], isum[r]);
        // Q5_0's codes are 16 above the weight's multiple of d: take 16 * sum(q_x) off, exactly
        if (Q5 && a.kind == kQ50) isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(16 * a.x.qsum[(r0 + r) * B + b]));
      }
      scale_half_avx2<R>(a, blk, b, r0, h, isum, acc);
    }
  }
  store_rows_avx2<R>(a, p, r0, acc);
}

// Q8: codes reach 127, so a pair sum fills int16 and each is widened at once. Both halves per broadcast, as Q4.
template <int R>
AVX2_TARGET void panel_avx2_q8(const Args& a, int64_t p, int64_t r0) {
  const int64_t B = a.x.B, K = a.x.K;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* blk = a.w + (p * B + b) * kQ8Bytes;
    for (int64_t l = 0; l < kQ8Bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch + l), _MM_HINT_T0);
    __m256i isum[R][2];
    for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i w[2], aw[2];
      for (int h = 0; h < 2; ++h) {
        w[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * h)), bias);
        aw[h] = _mm256_sign_epi8(w[h], w[h]);
      }
      for (int r = 0; r < R; ++r) {
        int32_t x0;
        std::memcpy(&x0, a.x.q + (r0 + r) * K + b * kBlock + 4 * j, 4);
        const __m256i bx = _mm256_set1_epi32(x0);
        for (int h = 0; h < 2; ++h) isum[r][h] = _mm256_add_epi32(isum[r][h], dot4_u8s8(aw[h], _mm256_sign_epi8(bx, w[h])));
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256i half[R];
      for (int r = 0; r < R; ++r) half[r] = isum[r][h];
      scale_half_avx2<R>(a, blk, b, r0, h, half, acc);
    }
  }
  store_rows_avx2<R>(a, p, r0, acc);
}

template <int R>
AVX2_TARGET void panel_avx2(const Args& a, int64_t p, int64_t r0) {
  if (a.kind == kQ4) return panel_avx2_q4<R, false>(a, p, r0);
  if (a.kind == kQ8) return panel_avx2_q8<R>(a, p, r0);
  panel_avx2_q4<R, true>(a, p, r0);
}

// ---- AVX-512 with VNNI: one panel in a vector, vpdpbusd ----

#define VNNI_TARGET LOWBIT_VNNI

// NP adjacent panels at once: each broadcast of four activation bytes feeds NP vpdpbusd, which
// halves the loads per product with two panels (loads, not arithmetic, bound this loop).
template <int R, int NP>
VNNI_TARGET void panel_vnni(const Args& a, int64_t p, int64_t r0) {
  const int64_t B = a.x.B, K = a.x.K;
  __m512 acc[NP][R];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < R; ++r) acc[q][r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  const bool nibbles = a.kind != kQ8, q5 = a.kind == kQ50 || a.kind == kQ51;
  const Layout lay = layout(a.kind);
  const int64_t bytes = lay.bytes;
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* blk[NP];
    for (int q = 0; q < NP; ++q) {
      blk[q] = a.w + ((p + q) * B + b) * bytes;
      for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk[q] + kPrefetch + l), _MM_HINT_T0);
    }
    __m512i isum[NP][R];
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < R; ++r) isum[q][r] = _mm512_setzero_si512();
    if (nibbles) {
      for (int L = 0; L < 4; ++L) {
        __m512i lo[NP], hi[NP];
        for (int q = 0; q < NP; ++q) {
          const __m512i v = _mm512_loadu_si512(blk[q] + 64 * L);
          lo[q] = _mm512_and_si512(v, low4);
          hi[q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if (q5) {  // the fifth bits: bit 2L (low nibbles' inputs) and 2L + 1 (high) of the line after the four
            const __m512i f = _mm512_loadu_si512(blk[q] + 256);
            lo[q] = _mm512_or_si512(lo[q], _mm512_and_si512(shift_epi16(f, 4 - 2 * L), fifth));
            hi[q] = _mm512_or_si512(hi[q], _mm512_and_si512(shift_epi16(f, 3 - 2 * L), fifth));
          }
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.x.q + (r0 + r) * K + b * kBlock + 8 * L;
          int32_t x0, x1;
          std::memcpy(&x0, xq, 4);
          std::memcpy(&x1, xq + 4, 4);
          const __m512i b0 = _mm512_set1_epi32(x0), b1 = _mm512_set1_epi32(x1);
          for (int q = 0; q < NP; ++q) {
            isum[q][r] = _mm512_dpbusd_epi32(isum[q][r], lo[q], b0);
            isum[q][r] = _mm512_dpbusd_epi32(isum[q][r], hi[q], b1);
          }
        }
      }
      if (a.kind == kQ50) {  // Q5_0's codes are 16 above the weight's multiple of d: take off 16 * sum(q_x)
        for (int r = 0; r < R; ++r) {
          const __m512i off = _mm512_set1_epi32(16 * a.x.qsum[(r0 + r) * B + b]);
          for (int q = 0; q < NP; ++q) isum[q][r] = _mm512_sub_epi32(isum[q][r], off);
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        __m512i w[NP];
        for (int q = 0; q < NP; ++q) w[q] = _mm512_loadu_si512(blk[q] + 64 * j);
        for (int r = 0; r < R; ++r) {
          int32_t x0;
          std::memcpy(&x0, a.x.q + (r0 + r) * K + b * kBlock + 4 * j, 4);
          const __m512i b0 = _mm512_set1_epi32(x0);
          for (int q = 0; q < NP; ++q) isum[q][r] = _mm512_dpbusd_epi32(isum[q][r], w[q], b0);
        }
      }
      for (int r = 0; r < R; ++r) {  // the stored codes are c + 128: take off 128 * sum(q_x)
        const __m512i off = _mm512_set1_epi32(128 * a.x.qsum[(r0 + r) * B + b]);
        for (int q = 0; q < NP; ++q) isum[q][r] = _mm512_sub_epi32(isum[q][r], off);
      }
    }
    for (int q = 0; q < NP; ++q) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[q] + lay.d)));
      const __m512 m = lay.m >= 0 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[q] + lay.m))) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * B + b;
        const __m512 t = _mm512_mul_ps(d, _mm512_set1_ps(a.x.d[i]));
        acc[q][r] = _mm512_fmadd_ps(t, _mm512_cvtepi32_ps(isum[q][r]), acc[q][r]);
        if (lay.m >= 0) acc[q][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.x.sum[i]), acc[q][r]);
      }
    }
  }
  for (int q = 0; q < NP; ++q) {
    const int64_t n = std::min(kPanel, a.N - (p + q) * kPanel);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(a.y + (r0 + r) * a.N + (p + q) * kPanel, static_cast<__mmask16>((1u << n) - 1), acc[q][r]);
  }
}

// NP panels from p for rows [r0, r0 + nr), nr <= kRows, in one VNNI pass
template <int NP>
void panels_vnni(const Args& a, int64_t p, int64_t r0, int64_t nr) {
  switch (nr) {
    case 4: return panel_vnni<4, NP>(a, p, r0);
    case 3: return panel_vnni<3, NP>(a, p, r0);
    case 2: return panel_vnni<2, NP>(a, p, r0);
    default: return panel_vnni<1, NP>(a, p, r0);
  }
}

// Fewer rows than this take the AVX2 kernels on an AVX-512 VNNI CPU where few rows stream one panel at a time
// (lowbit.h few_rows_one_stream: AMD's Zen 4); at four rows the 512-bit ones are as fast or faster there too.
constexpr int64_t kVnniMinRows = 3;

// the rows below which an AVX-512 VNNI CPU takes the AVX2 kernels: kVnniMinRows on AMD, none elsewhere
inline int64_t vnni_min_rows() { return few_rows_one_stream() ? kVnniMinRows : 1; }

// a panel for rows [r0, r0 + nr), nr <= kRows, on the chosen path
void panel(const Args& a, int64_t p, int64_t r0, int64_t nr, int path) {
  if (path == 3 && nr < vnni_min_rows()) path = 2;
  if (path == 3) return panels_vnni<1>(a, p, r0, nr);
  if (path == 2) {
    switch (nr) {
      case 4: return panel_avx2<4>(a, p, r0);
      case 3: return panel_avx2<3>(a, p, r0);
      case 2: return panel_avx2<2>(a, p, r0);
      default: return panel_avx2<1>(a, p, r0);
    }
  }
  switch (nr) {
    case 4: return panel_sse2<4>(a, p, r0);
    case 3: return panel_sse2<3>(a, p, r0);
    case 2: return panel_sse2<2>(a, p, r0);
    default: return panel_sse2<1>(a, p, r0);
  }
}

// two panels [p, p + 2) for rows [r0, r0 + nr): on VNNI one pass, elsewhere one panel after the other
void panel_pair(const Args& a, int64_t p, int64_t r0, int64_t nr, int path) {
  if (path == 3 && nr >= vnni_min_rows()) return panels_vnni<2>(a, p, r0, nr);
  panel(a, p, r0, nr, path);
  panel(a, p + 1, r0, nr, path);
}

// x [M, K] (rows of contiguous elements; float32, bfloat16 or float16), w packed [P, B, bytes] -> [M, N] in x's dtype
at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int kind) {
  const char* name = kind == kQ4 ? "q4_linear" : kind == kQ8 ? "q8_linear" : "gguf_linear";
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [rows, inputs] with contiguous rows");
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, name, ": float32, bfloat16 or float16 inputs, not ", t);
  const int64_t M = x.size(0), K = x.size(1), B = K / kBlock, P = (N + kPanel - 1) / kPanel;
  const int64_t bytes = layout(kind).bytes;
  TORCH_CHECK(K % kBlock == 0, name, ": inputs must be a multiple of ", kBlock, ", not ", K);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 && w.size(0) == P && w.size(1) == B &&
                  w.size(2) == bytes, name, ": packed weights [", P, ", ", B, ", ", bytes, "] expected");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y.to(t);
  // the rounded activations in one scratch buffer: scales, sums and codes' sums per block, then the codes
  at::Tensor scratch = at::empty({M * B * 12 + M * K}, x.options().dtype(at::kByte));
  float* xd = reinterpret_cast<float*>(scratch.data_ptr<uint8_t>());
  int32_t* xqs = reinterpret_cast<int32_t*>(xd + 2 * M * B);
  int8_t* xq = reinterpret_cast<int8_t*>(xqs + M * B);
  Args a{{xq, xd, xd + M * B, xqs, K, B}, w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, P, kind};
  const char* xp = static_cast<const char*>(x.data_ptr());
  const int64_t stride = x.stride(0) * x.element_size();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) { quantize_rows(xp, stride, t, r0, r1, xq, xd, xd + M * B, xqs, K); });
  const int path = matmul_path();
  // threads take pairs of panels (a thread's share stays contiguous in memory)
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t p = 2 * q0; p < std::min(P, 2 * q1); p += 2)
      for (int64_t r = 0; r < M; r += kRows) {
        const int64_t nr = std::min(kRows, M - r);
        if (p + 1 < P) panel_pair(a, p, r, nr, path);
        else panel(a, p, r, nr, path);
      }
  });
  return t == at::kFloat ? y : y.to(t);
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, int64_t n) { return lowbit_linear(x, w, n, kQ4); }
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, int64_t n) { return lowbit_linear(x, w, n, kQ8); }

int64_t matmul_isa() { return matmul_path(); }

// 0: the CPU's rule for few rows (lowbit.h few_rows_one_stream), 1: one panel at a time, 2: two a pass; returns the
// rule now in force. For tests and comparisons: a process normally keeps its CPU's.
int64_t use_rows_rule(int64_t rule) {
  TORCH_CHECK(rule >= 0 && rule <= 2, "use_rows_rule: 0 (the CPU's), 1 or 2");
  lowbit::few_rows_rule.store(rule == 0 ? lowbit::cpu_rows_rule() : static_cast<int>(rule));
  return lowbit::few_rows_rule.load();
}

// the path one row of a 32-weight-block matmul takes (matmul_isa, or AVX2 where few rows stream one panel at a time)
int64_t one_row_isa() {
  const int path = matmul_path();
  return path == 3 && vnni_min_rows() > 1 ? 2 : path;
}

}  // namespace

// kquants.cpp's gguf_linear, for the types of 32-weight blocks: 0 Q4_0/Q4_1, 1 Q8_0, 2 Q5_0, 3 Q5_1
at::Tensor shoal_block32_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, int kind) { return lowbit_linear(x, w, n, kind); }

TORCH_LIBRARY_FRAGMENT(shoal_kernels, m) {
  m.def("q4_linear(Tensor x, Tensor w, int n) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor w, int n) -> Tensor");
  m.def("matmul_isa() -> int", &matmul_isa);
  m.def("one_row_isa() -> int", &one_row_isa);
  m.def("use_rows_rule(int rule) -> int", &use_rows_rule);
}

TORCH_LIBRARY_IMPL(shoal_kernels, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
}
