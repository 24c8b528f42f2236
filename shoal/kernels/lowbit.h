// What shoal's low-bit matmuls share (lowbit.cpp: a GGUF's 32-weight blocks; kquants.cpp: its 256-weight
// K-quant super-blocks): the panel of 16 outputs the packed weights keep side by side, the float16 scales,
// and the choice of instruction set.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>

int64_t shoal_isa_level();  // cpu.cpp: 3 AVX-512, 2 AVX2 with FMA, 1 baseline

namespace lowbit {

constexpr int64_t kBlock = 32;  // inputs per block: the codes' (and the activations') rounding unit
constexpr int64_t kPanel = 16;  // outputs packed side by side (one zmm of int32 or float32)

#define LOWBIT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LOWBIT_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// element i of a row of float32, bfloat16 or float16 activations, as float32
inline float input(const void* x, int64_t i, c10::ScalarType t) {
  switch (t) {
    case c10::kBFloat16: return static_cast<float>(static_cast<const c10::BFloat16*>(x)[i]);
    case c10::kHalf: return static_cast<float>(static_cast<const c10::Half*>(x)[i]);
    default: return static_cast<const float*>(x)[i];
  }
}

// v shifted left by s bits (right by -s) in 16-bit lanes, per instruction set. With a mask of one bit position per
// byte after it, a byte's own bit s places lower (higher) lands there and no bit of its neighbour does, for |s| < 8:
// how the kernels put a code's fifth (and sixth) bits back beside its low nibble.
inline __attribute__((always_inline)) __m128i shift_epi16(__m128i v, int s) {
  return s >= 0 ? _mm_slli_epi16(v, s) : _mm_srli_epi16(v, -s);
}
LOWBIT_AVX2 inline __attribute__((always_inline)) __m256i shift_epi16(__m256i v, int s) {
  return s >= 0 ? _mm256_slli_epi16(v, s) : _mm256_srli_epi16(v, -s);
}
LOWBIT_VNNI inline __attribute__((always_inline)) __m512i shift_epi16(__m512i v, int s) {
  return s >= 0 ? _mm512_slli_epi16(v, s) : _mm512_srli_epi16(v, -s);
}

// 3: AVX-512 VNNI, 2: AVX2, 1: SSE2 (the baseline); capped by the process's level (SHOAL_CPU_ISA)
inline int matmul_path() {
  const int64_t level = shoal_isa_level();
  if (level >= 3 && __builtin_cpu_supports("avx512vnni")) return 3;
  return level >= 2 ? 2 : 1;
}

// Whether one or two rows of activations stream a matmul's weights one panel at a time, on the narrower kernels:
// an AMD CPU (Zen 4). Reading weights from memory for one row, the 512-bit VNNI kernel for 32-weight blocks, which
// takes two panels a pass, streamed 21 GB/s on a Zen 4 against 29 for the AVX2 kernel, a panel at a time (the
// thirty-first round of benchmarks/NOTES.md), and the K-quants' VNNI kernels 15-25% faster a panel at a time (the
// thirty-third). An Intel Xeon (Sapphire Rapids' family) is the other way round: 31 GB/s for the VNNI kernel at one
// row against 14-18 for the AVX2 one (19-28 since that one prefetches), and 4% more for the K-quants two panels a
// pass (the thirty-fifth round). Every kernel gives the same bits, so this choice is speed only.
// The rule in force: 1 one panel at a time (the CPU's where it is AMD's), 2 two panels a pass (elsewhere);
// use_rows_rule sets it, so that tests run every kernel on every CPU. lowbit.cpp holds it.
extern std::atomic<int> few_rows_rule;
int cpu_rows_rule();  // the CPU's: 1 on AMD, 2 elsewhere
inline bool few_rows_one_stream() { return few_rows_rule.load(std::memory_order_relaxed) == 1; }

// An empty asm that takes v in a register and gives it back. GCC cannot see through it, so a running sum stays
// the chain of adds the code writes. Without it, GCC's reassociation regrouped a Q4 block of 4 rows into a tree
// that computed its 64 products first, and they spilled: 440 instructions a block, 123 of them moves to and from
// the stack. With it the sums stay in registers (the float accumulators go to L1 instead, one store a block), and
// a layer's Q4 matmuls at 4 to 512 rows take 21-26% less time (benchmarks/NOTES.md, twenty-fourth round). The
// integers are exact, so the order changes no bit. One row has registers to spare; there the tree is as fast.
template <int R>
LOWBIT_AVX2 inline __attribute__((always_inline)) void in_register(__m256i& v) {
  if constexpr (R > 1) asm("" : "+x"(v));
}

// SSE2: [a0, a1, b0, b1], [c0, c1, e0, e1] (pairs of partial sums of outputs a, b, c, e) -> [a, b, c, e]
inline __m128i pair_sums(__m128i ab, __m128i ce) {
  const __m128 x = _mm_castsi128_ps(ab), y = _mm_castsi128_ps(ce);
  return _mm_add_epi32(_mm_castps_si128(_mm_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0))),
                       _mm_castps_si128(_mm_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1))));
}

// SSE2: a block's 32 int8 activations as int16, each group of four inputs twice in one register (xs[j]: inputs
// 4j..4j+3): what one output's four codes meet in pmaddwd
inline void widen_block(const int8_t* xq, __m128i* xs) {
  for (int h = 0; h < 2; ++h) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16 * h));
    const __m128i lo = _mm_srai_epi16(_mm_unpacklo_epi8(v, v), 8), hi = _mm_srai_epi16(_mm_unpackhi_epi8(v, v), 8);
    xs[4 * h] = _mm_unpacklo_epi64(lo, lo);
    xs[4 * h + 1] = _mm_unpackhi_epi64(lo, lo);
    xs[4 * h + 2] = _mm_unpacklo_epi64(hi, hi);
    xs[4 * h + 3] = _mm_unpackhi_epi64(hi, hi);
  }
}

}  // namespace lowbit
