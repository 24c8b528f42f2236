// 16-lane vectors for shoal's kernels (cpu.cpp, lowbit.cpp), held in the registers of the instruction set a
// kernel is compiled for. A kernel is written once for 16 lanes, as a template on W, the bytes of one
// register: 64 on AVX-512 (one zmm), 32 on AVX2 (two ymm), 16 on the x86-64 baseline (four xmm, SSE2).
//
// Why not one 64-byte GCC vector type everywhere: without AVX-512, GCC has no 64-byte register mode, so a
// variable of that type lives on the stack, and every operation on it loads and stores its halves. The
// attention op compiled that way for AVX2 ran 27-36x slower than on AVX-512 on the same core, slower than
// the baseline (benchmarks/NOTES.md, fourteenth round). Here each part is a native register type, every
// operation works part by part, and whole-vector loads and stores go part by part too (one memcpy of the
// 64 bytes would again go through memory).
//
// Lanes are independent in every operation but the two reductions, which combine lanes in one fixed tree
// on every instruction set. So a kernel gives the same bits on each where the arithmetic is the same: AVX2
// and AVX-512 both contract a * b + c into one FMA; the baseline has no FMA and rounds twice.
#pragma once

#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace {

#define INL static inline __attribute__((always_inline))
#define MINL inline __attribute__((always_inline))  // members and friends
// An entry point that runs a kernel on one instruction set: everything it calls is inlined into it, and so
// compiled for that set
#define SHOAL_ENTRY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"), flatten))
#define SHOAL_ENTRY_AVX2 __attribute__((target("avx2,fma,f16c"), flatten))
#define SHOAL_ENTRY_BASELINE __attribute__((flatten))

constexpr int64_t kLanes = 16;  // a vf's lanes, on every instruction set

// A kernel body NAME<W>(args, first row, end row) compiled per instruction set, as NAME_avx512, NAME_avx2 and
// NAME_baseline (ops.h run_rows picks one)
#define SHOAL_ISA_VARIANTS(NAME, ARGS)                                                                          \
  SHOAL_ENTRY_AVX512 void NAME##_avx512(const ARGS& a, int64_t b, int64_t e) { NAME<64>(a, b, e); } \
  SHOAL_ENTRY_AVX2 void NAME##_avx2(const ARGS& a, int64_t b, int64_t e) { NAME<32>(a, b, e); } \
  SHOAL_ENTRY_BASELINE void NAME##_baseline(const ARGS& a, int64_t b, int64_t e) { NAME<16>(a, b, e); }

// One register's types per width, spelled out: GCC drops a vector attribute that depends on a template
// parameter where the type is passed on as a template argument. Broadcasts use the ISA's own set1: with
// a shuffle of {x, 0, ...}, GCC widened the scalar load of x into a whole vector's load (a misaligned
// 64-byte load per key in the attention's value pass, 10% of its time). An intrinsic inlines only into a
// function built for its instruction set, so splat is not forced inline into the generic templates: each
// entry point that runs a kernel for one instruction set is `flatten`, and takes it in there (SHOAL_ENTRY).
//
// max and min are the ISA's own instructions, which are exactly `a > b ? a : b` and `a < b ? a : b` (NaN and
// signed zeros included): GCC lowered that select to a compare and a blend. floor rounds toward -inf in one
// instruction where the ISA has one (SSE4.1 and up); the baseline has none (Regs<16>::kFloor is false).
template <int W>
struct Regs;

#define SHOAL_REGS(W, TARGET, SET1_PS, SET1_EPI32, MAX_PS, MIN_PS, CAST)                             \
  template <>                                                                                        \
  struct Regs<W> {                                                                                   \
    typedef float f __attribute__((vector_size(W)));                                                \
    typedef int32_t i __attribute__((vector_size(W)));                                              \
    typedef uint32_t u __attribute__((vector_size(W)));                                             \
    typedef uint16_t h __attribute__((vector_size(W / 2)));  /* as many 16-bit lanes as f has */   \
    typedef int8_t b __attribute__((vector_size(W / 4)));    /* as many 8-bit lanes as f has */    \
    TARGET static inline f splat(float x) { return (f)SET1_PS(x); }                                 \
    TARGET static inline i splat(int32_t x) { return (i)SET1_EPI32(x); }                            \
    TARGET static inline f max(f a, f b) { return (f)MAX_PS((CAST)a, (CAST)b); }                    \
    TARGET static inline f min(f a, f b) { return (f)MIN_PS((CAST)a, (CAST)b); }                    \
    static constexpr bool kFloor = W > 16;                                                           \
    TARGET static inline f floor(f a);                                                               \
  };
SHOAL_REGS(64, __attribute__((target("avx512f"))), _mm512_set1_ps, _mm512_set1_epi32, _mm512_max_ps, _mm512_min_ps, __m512)
SHOAL_REGS(32, __attribute__((target("avx"))), _mm256_set1_ps, _mm256_set1_epi32, _mm256_max_ps, _mm256_min_ps, __m256)
SHOAL_REGS(16, , _mm_set1_ps, _mm_set1_epi32, _mm_max_ps, _mm_min_ps, __m128)
#undef SHOAL_REGS
__attribute__((target("avx512f"))) inline Regs<64>::f Regs<64>::floor(f a) {
  return (f)_mm512_roundscale_ps((__m512)a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}
__attribute__((target("avx"))) inline Regs<32>::f Regs<32>::floor(f a) { return (f)_mm256_floor_ps((__m256)a); }

// One register's worth of int8 values (W / 4 of them) sign-extended to int32 lanes. Written with each instruction
// set's own widening: GCC lowers a convertvector from int8 lanes one lane at a time (a movsbl and an insert per
// lane made an int8 KV cache read 2.8x slower than a float32 one).
template <int W>
struct WidenI8;
template <>
struct WidenI8<64> {
  __attribute__((target("avx512f"))) static inline Regs<64>::i from(const void* p) {
    return (Regs<64>::i)_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
};
template <>
struct WidenI8<32> {
  __attribute__((target("avx2"))) static inline Regs<32>::i from(const void* p) {
    return (Regs<32>::i)_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  }
};
template <>
struct WidenI8<16> {  // SSE2 has no pmovsx: each byte into the top of its lane, then an arithmetic shift down
  static inline Regs<16>::i from(const void* p) {
    int32_t four;
    std::memcpy(&four, p, 4);
    __m128i x = _mm_cvtsi32_si128(four);
    x = _mm_unpacklo_epi8(x, x);
    x = _mm_unpacklo_epi16(x, x);
    return (Regs<16>::i)_mm_srai_epi32(x, 24);
  }
};

template <int W>
struct vi;

template <int W>
struct vf {
  typedef typename Regs<W>::f part;
  static constexpr int kParts = 64 / W, kPartLanes = W / 4;
  part p[kParts];

  static MINL vf zero() { vf v; for (int k = 0; k < kParts; ++k) v.p[k] = part{}; return v; }
  static MINL vf load(const float* s) { vf v; for (int k = 0; k < kParts; ++k) std::memcpy(&v.p[k], s + k * kPartLanes, W); return v; }
  // a broadcast, written as a shuffle: GCC turns a lane-by-lane initializer into one insert per lane
  static MINL vf set(float x) { vf v; for (int k = 0; k < kParts; ++k) v.p[k] = Regs<W>::splat(x); return v; }
  MINL void store(float* s) const { for (int k = 0; k < kParts; ++k) std::memcpy(s + k * kPartLanes, &p[k], W); }
  MINL float first() const { return p[0][0]; }

#define SHOAL_VF_OP(OP) \
  friend MINL vf operator OP(vf a, vf b) { vf r; for (int k = 0; k < kParts; ++k) r.p[k] = a.p[k] OP b.p[k]; return r; }
  SHOAL_VF_OP(+)
  SHOAL_VF_OP(-)
  SHOAL_VF_OP(*)
  SHOAL_VF_OP(/)
#undef SHOAL_VF_OP
#define SHOAL_VF_CMP(OP) \
  friend MINL vi<W> operator OP(vf a, vf b) { vi<W> r; for (int k = 0; k < kParts; ++k) r.p[k] = a.p[k] OP b.p[k]; return r; }
  SHOAL_VF_CMP(<)
  SHOAL_VF_CMP(>)
#undef SHOAL_VF_CMP
};

template <int W>
struct vi {
  typedef typename Regs<W>::i part;
  static constexpr int kParts = 64 / W, kPartLanes = W / 4;
  part p[kParts];

  static MINL vi set(int32_t x) { vi v; for (int k = 0; k < kParts; ++k) v.p[k] = Regs<W>::splat(x); return v; }
  static MINL vi iota() {  // lanes 0..15
    vi v;
    for (int k = 0; k < kParts; ++k)
      for (int l = 0; l < kPartLanes; ++l) v.p[k][l] = k * kPartLanes + l;
    return v;
  }
  MINL int32_t lane(int i) const { return p[i / kPartLanes][i % kPartLanes]; }

#define SHOAL_VI_OP(OP) \
  friend MINL vi operator OP(vi a, vi b) { vi r; for (int k = 0; k < kParts; ++k) r.p[k] = a.p[k] OP b.p[k]; return r; }
  SHOAL_VI_OP(+)
  SHOAL_VI_OP(&)
  SHOAL_VI_OP(>=)
  SHOAL_VI_OP(<=)
#undef SHOAL_VI_OP
  friend MINL vi operator<<(vi a, int s) { vi r; for (int k = 0; k < kParts; ++k) r.p[k] = a.p[k] << s; return r; }
};

// m ? a : b per lane (m: all ones or zeros, as comparisons give)
template <int W>
INL vf<W> select(vi<W> m, vf<W> a, vf<W> b) {
  vf<W> r;
  for (int k = 0; k < vf<W>::kParts; ++k) r.p[k] = m.p[k] ? a.p[k] : b.p[k];
  return r;
}

template <int W>
INL vf<W> fmadd(vf<W> a, vf<W> b, vf<W> c) { return a * b + c; }  // contracted to one FMA where the ISA has it

template <int W>
INL vf<W> vmax(vf<W> a, vf<W> b) {  // a > b ? a : b
  vf<W> r;
  for (int k = 0; k < vf<W>::kParts; ++k) r.p[k] = Regs<W>::max(a.p[k], b.p[k]);
  return r;
}

template <int W>
INL vf<W> vmin(vf<W> a, vf<W> b) {  // a < b ? a : b
  vf<W> r;
  for (int k = 0; k < vf<W>::kParts; ++k) r.p[k] = Regs<W>::min(a.p[k], b.p[k]);
  return r;
}

template <int W>
INL vi<W> to_int(vf<W> a) {  // truncating, as a C cast
  vi<W> r;
  for (int k = 0; k < vf<W>::kParts; ++k) r.p[k] = __builtin_convertvector(a.p[k], typename vi<W>::part);
  return r;
}

template <int W>
INL vf<W> to_float(vi<W> a) {
  vf<W> r;
  for (int k = 0; k < vf<W>::kParts; ++k) r.p[k] = __builtin_convertvector(a.p[k], typename vf<W>::part);
  return r;
}

// floor(a) as integers, and as floats in *f, for |a| < 2^31. Without a rounding instruction (the baseline):
// truncate, then take one where truncation went up. Both give the same values, but for the sign of a zero (-0
// floors to -0 with the instruction, to +0 without); vexp's argument is never -0 (x * log2e + 0.5 rounds to +0).
template <int W>
INL vi<W> floor_int(vf<W> a, vf<W>* f) {
  if constexpr (Regs<W>::kFloor) {
    for (int k = 0; k < vf<W>::kParts; ++k) f->p[k] = Regs<W>::floor(a.p[k]);
    return to_int(*f);
  } else {
    vi<W> n = to_int(a);
    n = n + (to_float(n) > a);  // a compare gives -1 where true
    *f = to_float(n);
    return n;
  }
}

template <int W>
INL vf<W> bits_to_float(vi<W> a) {  // the same bits, as floats
  vf<W> r;
  for (int k = 0; k < vf<W>::kParts; ++k) r.p[k] = (typename vf<W>::part)a.p[k];
  return r;
}

// The reductions' tree: lane i combines with lane i + 8, then i + 4, i + 2, i + 1; lane 0 holds the result.
// Across parts first (whole registers), then within the one part left, by the same strides.
template <int W, class Op>
INL float lane_tree(vf<W> v, Op op) {
  typedef typename vf<W>::part part;
  part a[vf<W>::kParts];
  for (int k = 0; k < vf<W>::kParts; ++k) a[k] = v.p[k];
  for (int n = vf<W>::kParts / 2; n >= 1; n /= 2)
    for (int k = 0; k < n; ++k) a[k] = op(a[k], a[k + n]);
  part x = a[0];
  if constexpr (W == 64) {
    x = op(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
  } else if constexpr (W == 32) {
    x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3));
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 2, 3, 0, 1));
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 1, 0, 1, 0, 1, 0));
  } else {
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1));
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 1, 0));
  }
  return x[0];
}

struct Add { template <class P> MINL P operator()(P a, P b) const { return a + b; } };
struct Max { template <class P> MINL P operator()(P a, P b) const { return a > b ? a : b; } };

template <int W>
INL float lane_sum(vf<W> v) { return lane_tree<W>(v, Add{}); }

template <int W>
INL float lane_max(vf<W> v) { return lane_tree<W>(v, Max{}); }  // exact in any order

}  // namespace
