// shoal's CPU kernels. First, batch-invariant paged attention: one fused op per layer that
// writes the step's keys and values into the cache and attends, for every query row of the
// step. Then a decoder layer's row-wise ops (residual add + RMSNorm, rotary, SiLU-and-multiply).
//
// Invariance by construction. A query row (one position of one sequence, one query head)
// is computed by the same sequence of floating-point operations whatever else is in the
// step, whichever task or thread it falls in and whichever neighbours share its vectors:
//   - its visible keys are [lo, hi]: hi its own position, lo 0 or the window's start;
//   - keys are visited in tiles of kTile positions counted from 0; the tiles the row sees
//     are those that meet [lo, hi], in order, and nothing else;
//   - a score is q . k summed over the head dimension in order (one fused multiply-add per
//     element, 16 keys side by side in a vector's lanes), then scaled by nothing: q comes
//     in already scaled, in float32; where the layer softcaps (Gemma 2), s -> cap * tanh(s / cap) (tile_softcap);
//   - per tile an online softmax: the tile's maximum over the row's visible keys (exact in
//     any order), p = exp(s - m) with the row's hidden keys set to +0, the tile's sum of p
//     over the row's own span of key vectors (+0 lanes add nothing), summed across lanes by
//     one fixed tree, and the running (m, l, acc) rescaled by exp(m_old - m_new);
//   - acc += p_j * v_j over the row's visible keys in key order (head dimension in lanes);
//   - out = acc / l, rounded once to the model's dtype.
// Other rows in the same vectors only occupy other lanes. So a decode, any row of a prefill
// chunk of any length or start, and a row next to longer contexts give the same bits. A few long
// decodes are spread over the threads in two passes (split_decodes) that keep each row's
// operations and their order, so they give those bits too.
//
// The cache: kv [2, Hkv, blocks, block_size, D]. Values are stored as torch's other
// backends store them ([block_size, D] per block); keys are stored transposed within their
// block ([D, block_size]), so that 16 consecutive keys of one dimension are contiguous when
// the block size is a multiple of 16. This op is the only reader and writer of that layout.
// The cache's dtype may differ from the activations' (a float32 model with a bfloat16 cache):
// keys and values are rounded once to it when written, and read back as float32.
//
// An int8 cache is kv [2, Hkv, blocks, block_size, D + 4] int8: each block holds its codes
// (keys [D, block_size], values [block_size, D], as above) and then block_size float32 scales,
// one per token and head. A token's key (or value) row of one head is quantized on its own:
// scale = max|x| / 127, code = round(x / scale) (half to even), so its codes depend on its own
// values only, never on which tokens were written with it: a prefill in one chunk or in many,
// and a decode, give the same codes, and reads give code * scale in float32.
//
// One source serves every x86-64 CPU: the task's body is compiled for AVX-512, for AVX2 with
// FMA, and for the baseline, and one is picked per process by what the CPU has.
// The choice is fixed per host, so answers are invariant on a host, not across hosts.

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#include <sys/mman.h>

#include "ops.h"
#include "vec.h"

namespace {

constexpr int64_t kTile = 64;          // keys per softmax tile: a multiple of kLanes
constexpr int64_t kTileVecs = kTile / kLanes;
// A chunk's positions per task (times the group's query heads): the longest of these that still gives every thread
// kTasksPerThread tasks. Each task copies every tile it sees once and shares it among its rows, so longer tasks copy
// less: at 6,000 keys a task of 32 positions spent 11-16% of its time copying tiles, one of 128 about 5% (with this
// round's other changes the op took 0.91x the time on one thread; benchmarks/NOTES.md, twenty-sixth round). The
// shorter lengths are for many threads.
constexpr int64_t kTaskPositions[] = {128, 64, 32};
constexpr int64_t kTasksPerThread = 4;
// How far ahead of its reads a task prefetches the cache, in keys. The hardware's stream prefetchers stop at
// each 4 KB page, and one head's keys (or values) of a float32 block of 16 tokens at D = 64 fill one page: so
// without this every block began with a wait on memory, and a decode read its cache at 8 GB/s where the core
// streams 22. Prefetches change no arithmetic.
constexpr int64_t kAhead = 2 * kTile;

// Register blocking per instruction set (W bytes a register, vec.h). The score pass keeps kScoreRows rows
// times kScoreVecs 16-key vectors of a tile in registers, and shares each load of keys among those rows;
// the value pass keeps kValueRows rows times kValueVecs 16-lane vectors of the head dimension, and shares
// each load of a value among those rows. Every lane's arithmetic is the same for any blocking, so the
// blocking changes speed only, never bits. Sized to the registers: 32 zmm on AVX-512, 16 ymm on AVX2 and
// 16 xmm on the baseline, where a 16-lane vector takes one, two and four of them. AVX-512's score pass takes 6
// rows (24 accumulators): with 4, a loop of it alone reached 80% of the core's FMA rate, with 6 97%.
template <int W>
struct Blocking;
template <>
struct Blocking<64> { static constexpr int64_t kScoreRows = 6, kScoreVecs = 4, kValueRows = 4, kValueVecs = 4; };
template <>
struct Blocking<32> { static constexpr int64_t kScoreRows = 3, kScoreVecs = 2, kValueRows = 3, kValueVecs = 2; };
template <>
struct Blocking<16> { static constexpr int64_t kScoreRows = 2, kScoreVecs = 1, kValueRows = 2, kValueVecs = 1; };

enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2, kI8 = 3 };

// x in lanes lo..hi (which may reach past either end), `fill` elsewhere
template <int W>
INL vf<W> visible(vf<W> x, int64_t lo, int64_t hi, vf<W> fill) {
  if (lo <= 0 && hi >= kLanes - 1) return x;
  const int32_t l = static_cast<int32_t>(std::max<int64_t>(lo, -1)), h = static_cast<int32_t>(std::min<int64_t>(hi, kLanes));
  const vi<W> lane = vi<W>::iota();
  return select((lane >= vi<W>::set(l)) & (lane <= vi<W>::set(h)), x, fill);
}

// exp for x <= 0 (Cephes' expf): clamped below at -87.3, where it is 2^-126; hidden
// lanes are zeroed by the caller, never by underflow.
template <int W>
INL vf<W> vexp(vf<W> x) {
  typedef vf<W> F;
  x = vmin(vmax(x, F::set(-87.3365447505531f)), F::set(88.0f));
  F fx;
  vi<W> n = floor_int(fmadd(x, F::set(1.44269504088896341f), F::set(0.5f)), &fx);
  x = x - fx * F::set(0.693359375f);
  x = x - fx * F::set(-2.12194440e-4f);
  F z = x * x;
  F y = F::set(1.9875691500e-4f);
  y = fmadd(y, x, F::set(1.3981999507e-3f));
  y = fmadd(y, x, F::set(8.3334519073e-3f));
  y = fmadd(y, x, F::set(4.1665795894e-2f));
  y = fmadd(y, x, F::set(1.6666665459e-1f));
  y = fmadd(y, x, F::set(5.0000001201e-1f));
  y = fmadd(y, z, x) + F::set(1.0f);
  return y * bits_to_float((n + vi<W>::set(127)) << 23);
}


INL float to_float(const void* p, int64_t i, int dt) {
  switch (dt) {
    case kBF16: { uint32_t b = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16; float f; std::memcpy(&f, &b, 4); return f; }
    case kF16: return c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// 16 contiguous elements as floats, into buf (16 floats); bfloat16 widened a register at a time
template <int W>
INL void load16(const void* p, int64_t i, int dt, float* buf) {
  if (dt == kF32) {
    vf<W>::load(static_cast<const float*>(p) + i).store(buf);  // a register at a time (a memcpy went 16 bytes at a time)
  } else if (dt == kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(p) + i;
    for (int k = 0; k < 64 / W; ++k) {
      typename Regs<W>::h h;
      std::memcpy(&h, src + k * (W / 4), W / 2);
      const typename Regs<W>::u f = __builtin_convertvector(h, typename Regs<W>::u) << 16;
      std::memcpy(buf + k * (W / 4), &f, W);
    }
  } else {
    for (int l = 0; l < kLanes; ++l) buf[l] = to_float(p, i + l, dt);
  }
}

struct Ctx {
  const char* q; int64_t q_row, q_head;  // element strides of q [T, Hq, D]
  const char* kv; int64_t Hkv, NB, bs, D, D16, G;
  const int32_t* tables; int64_t max_blocks;
  const int32_t* row_seq;
  const int32_t* row_pos;
  float scale;
  int64_t window;  // 0: none
  float softcap;  // 0: none; else scores s -> softcap * tanh(s / softcap) (Gemma 2)
  int dt; int64_t esize;  // q's and out's
  int kvdt; int64_t kv_esize, block_bytes;  // the cache's: one head's keys (or values) of one block
  char* out;  // [T, Hq, D] in dt, contiguous
};

struct Task { int64_t row0, rows, head; };

INL const char* key_block(const Ctx& c, int64_t head, int64_t block) {  // [D, bs] (then int8's bs scales)
  return c.kv + (head * c.NB + block) * c.block_bytes;
}
INL const char* value_block(const Ctx& c, int64_t head, int64_t block) {  // [bs, D] (then int8's bs scales)
  return c.kv + ((c.Hkv + head) * c.NB + block) * c.block_bytes;
}
INL const float* block_scales(const Ctx& c, const char* block) {  // an int8 block's scale per token
  return reinterpret_cast<const float*>(block + c.bs * c.D);
}

// 16 int8 codes times their scales (16 lanes of scales, or one broadcast), as floats into buf
template <int W>
INL void load16_i8(const char* p, vf<W> scale, float* buf) {
  vf<W> v;
  for (int k = 0; k < vf<W>::kParts; ++k) v.p[k] = __builtin_convertvector(WidenI8<W>::from(p + k * (W / 4)), typename vf<W>::part);
  (v * scale).store(buf);
}

// element i of a cache block as a float (an int8 code times its token's scale)
INL float cache_float(const Ctx& c, const char* block, int64_t i, int64_t token) {
  if (c.kvdt == kI8) return static_cast<float>(reinterpret_cast<const int8_t*>(block)[i]) * block_scales(c, block)[token];
  return to_float(block, i, c.kvdt);
}

// Where a tile's keys and values are: copied into the tile's float32 scratch (keys Kt [D, kTile], values
// Vs [kTile, D16]), or read where they lie in the cache. Both give the same floats; the kernels below are
// compiled for each, so that the copy's fixed strides stay plain address arithmetic.
struct CopiedKeys {  // key vector v's dimension d
  const float* Kt;
  MINL const float* at(int64_t v, int64_t d) const { return Kt + d * kTile + v * kLanes; }
};
struct CacheKeys {
  const float* const* K; const int64_t* ks;
  MINL const float* at(int64_t v, int64_t d) const { return K[v] + d * ks[v]; }
};
struct CopiedValues {  // key j's value row
  const float* Vs; int64_t D16;
  MINL const float* row(int64_t j) const { return Vs + j * D16; }
};
struct CacheValues {
  const float* const* V;
  MINL const float* row(int64_t j) const { return V[j]; }
};

// What the value pass of one tile reads and writes.
template <typename Values>
struct Span {
  float* Acc; const float* S; Values V; const int64_t* lo; const int64_t* hi;
  int64_t D16, R, ts, te, dc;
};

// acc(row r) += p_j v_j for keys j0..j1 (tile offsets), NV vectors of head-dimension lanes from dc
template <int W, int NV, typename Values>
INL void row_values(const Span<Values>& s, int64_t r, int64_t j0, int64_t j1) {
  typedef vf<W> F;
  F acc[NV];
  float* a = s.Acc + r * s.D16 + s.dc;
  for (int v = 0; v < NV; ++v) acc[v] = F::load(a + v * kLanes);
  for (int64_t j = j0; j <= j1; ++j) {
    const F p = F::set(s.S[r * kTile + j]);
    const float* val = s.V.row(j) + s.dc;
    for (int v = 0; v < NV; ++v) acc[v] = fmadd(p, F::load(val + v * kLanes), acc[v]);
  }
  for (int v = 0; v < NV; ++v) acc[v].store(a + v * kLanes);
}

// The tile's value pass for every row: each row over its own visible keys, in key order. Rows
// whose spans overlap take the shared keys together (one load of v_j for kValueRows rows).
template <int W, int NV, typename Values>
INL void values_tile(const Span<Values>& s) {
  typedef vf<W> F;
  constexpr int64_t RB = Blocking<W>::kValueRows;
  for (int64_t r0 = 0; r0 < s.R; r0 += RB) {
    const int64_t rb = std::min(RB, s.R - r0);
    int64_t ra[RB], rz[RB], common_a = 0, common_b = kTile;
    bool all = rb == RB;
    for (int64_t r = 0; r < rb; ++r) {
      const int64_t row = r0 + r;
      if (s.hi[row] < s.ts || s.lo[row] >= s.te) { ra[r] = 1; rz[r] = 0; all = false; continue; }
      ra[r] = std::max(s.lo[row], s.ts) - s.ts;
      rz[r] = std::min(s.hi[row], s.te - 1) - s.ts;
      common_a = std::max(common_a, ra[r]);
      common_b = std::min(common_b, rz[r]);
    }
    if (!all || common_a > common_b) {
      for (int64_t r = 0; r < rb; ++r)
        if (ra[r] <= rz[r]) row_values<W, NV>(s, r0 + r, ra[r], rz[r]);
      continue;
    }
    for (int64_t r = 0; r < RB; ++r)
      if (ra[r] < common_a) row_values<W, NV>(s, r0 + r, ra[r], common_a - 1);
    F acc[RB][NV];
    for (int64_t r = 0; r < RB; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = F::load(s.Acc + (r0 + r) * s.D16 + s.dc + v * kLanes);
    for (int64_t j = common_a; j <= common_b; ++j) {
      F val[NV];
      for (int v = 0; v < NV; ++v) val[v] = F::load(s.V.row(j) + s.dc + v * kLanes);
      for (int64_t r = 0; r < RB; ++r) {
        const F p = F::set(s.S[(r0 + r) * kTile + j]);
        for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(p, val[v], acc[r][v]);
      }
    }
    for (int64_t r = 0; r < RB; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v].store(s.Acc + (r0 + r) * s.D16 + s.dc + v * kLanes);
    for (int64_t r = 0; r < RB; ++r)
      if (rz[r] > common_b) row_values<W, NV>(s, r0 + r, common_b + 1, rz[r]);
  }
}

// The value pass over nv (1..NV) vectors of head-dimension lanes, each count its own unrolled loop
template <int W, int NV, typename Values>
INL void values_tile_upto(const Span<Values>& s, int64_t nv) {
  if constexpr (NV > 1) {
    if (nv < NV) return values_tile_upto<W, NV - 1>(s, nv);
  }
  values_tile<W, NV>(s);
}

// The value pass of a tile over head-dimension lanes [d0, d1), kValueVecs vectors at a time
template <int W, typename Values>
INL void values_lanes(Span<Values> s, int64_t d0, int64_t d1) {
  constexpr int64_t NV = Blocking<W>::kValueVecs;
  for (s.dc = d0; s.dc < d1; s.dc += NV * kLanes) values_tile_upto<W, NV>(s, std::min(NV * kLanes, d1 - s.dc) / kLanes);
}

// Scores for rows [r0, r0 + RB) and the tile's key vectors [v0, v0 + VB): S = q . k, summed over the
// head dimension in order, one FMA per element (a lane's value depends on its row and key only)
template <int W, int RB, int VB, typename Keys>
INL void scores_block(const float* Qs, const Keys& keys, float* S, int64_t D, int64_t r0, int64_t rb, int64_t v0) {
  typedef vf<W> F;
  F a[RB][VB];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < VB; ++v) a[r][v] = F::zero();
  if (rb == RB) {
    for (int64_t d = 0; d < D; ++d) {
      F k[VB];
      for (int v = 0; v < VB; ++v) k[v] = F::load(keys.at(v0 + v, d));
      for (int r = 0; r < RB; ++r) {
        const F qd = F::set(Qs[(r0 + r) * D + d]);
        for (int v = 0; v < VB; ++v) a[r][v] = fmadd(qd, k[v], a[r][v]);
      }
    }
  } else {
    for (int64_t r = 0; r < rb; ++r)
      for (int64_t d = 0; d < D; ++d) {
        const F qd = F::set(Qs[(r0 + r) * D + d]);
        for (int v = 0; v < VB; ++v) a[r][v] = fmadd(qd, F::load(keys.at(v0 + v, d)), a[r][v]);
      }
  }
  for (int64_t r = 0; r < rb; ++r)
    for (int v = 0; v < VB; ++v) a[r][v].store(&S[(r0 + r) * kTile + (v0 + v) * kLanes]);
}

// A logit softcap over R rows of a tile's scores: s -> cap * tanh(s / cap), with tanh(y) = sign(y) (1 - e) / (1 + e),
// e = exp(-2 |y|) (vexp's, for arguments <= 0): the same operations in the same order on every path, so the same bits.
template <int W>
INL void tile_softcap(float* S, int64_t R, float cap) {
  typedef vf<W> F;
  const F c = F::set(cap), zero = F::zero(), one = F::set(1.0f), two = F::set(2.0f);
  for (float* s = S; s < S + R * kTile; s += kLanes) {
    const F y = F::load(s) / c;
    const F e = vexp(vmin(y, zero - y) * two);
    const F t = (one - e) / (one + e);
    (c * select(y < zero, zero - t, t)).store(s);
  }
}

// Scores for R rows and every key of a tile (softcapped where the layer says)
template <int W, typename Keys>
INL void tile_scores(const float* Qs, const Keys& keys, float* S, int64_t D, int64_t R, float softcap) {
  typedef Blocking<W> B;
  for (int64_t v0 = 0; v0 < kTileVecs; v0 += B::kScoreVecs)
    for (int64_t r0 = 0; r0 < R; r0 += B::kScoreRows)
      scores_block<W, B::kScoreRows, B::kScoreVecs>(Qs, keys, S, D, r0, std::min(B::kScoreRows, R - r0), v0);
  if (softcap > 0.0f) tile_softcap<W>(S, R, softcap);
}

// Prefetch (into L2) one head's keys of positions [from, to) of a sequence (nothing when empty)
INL void prefetch_keys(const Ctx& c, int64_t head, const int32_t* table, int64_t from, int64_t to) {
  const int64_t key_dim = c.bs * c.kv_esize;  // bytes between a key's dimensions ([D, bs] blocks)
  for (int64_t j0 = from; j0 < to; j0 += kLanes) {
    const char* kb = key_block(c, head, table[j0 / c.bs]);
    const int64_t off = j0 % c.bs;
    for (int64_t d = 0; d < c.D; ++d) __builtin_prefetch(kb + d * key_dim + off * c.kv_esize, 0, 2);
    if (c.kvdt == kI8) __builtin_prefetch(block_scales(c, kb) + off, 0, 2);
  }
}

// The same for bytes [b0, b1) of their value rows
INL void prefetch_values(const Ctx& c, int64_t head, const int32_t* table, int64_t from, int64_t to, int64_t b0, int64_t b1) {
  for (int64_t j = from; j < to; ++j) {
    const char* vb = value_block(c, head, table[j / c.bs]);
    const char* row = vb + (j % c.bs) * c.D * c.kv_esize;
    for (int64_t b = b0; b < b1; b += 64) __builtin_prefetch(row + b, 0, 2);
    if (c.kvdt == kI8 && j % c.bs % kLanes == 0) __builtin_prefetch(block_scales(c, vb) + j % c.bs, 0, 2);
  }
}

// A thread's working buffers, kept between tasks: a decode task is small, and allocating and
// zeroing ~40 KB for each one cost more than its arithmetic (32 decode rows at 100 keys: 670 us a
// layer). Buffers only grow, zero-filled, so every float in them is finite; lanes past a tile's
// last key are never read unmasked (scores are selected by `visible`, values by key range).
struct Scratch {
  std::vector<float> f;
  std::vector<int64_t> i;
};
thread_local Scratch t_scratch;

// n floats of v from a 64-byte boundary, so that the kernels' 32- and 64-byte loads and stores of tiles, queries,
// scores and accumulators never straddle two cache lines. A vector's data is only 16-byte aligned (a large one
// sits 16 bytes past a page's start), and where it fell so, one 32-byte load in two, and every 64-byte one, was
// split: a 512-row chunk at 6,000 keys took 11% longer on one thread (benchmarks/NOTES.md, twenty-fifth round).
// The alignment varied from process to process and thread to thread, which made timings of the op drift.
INL float* grown(std::vector<float>& v, size_t n) {
  constexpr size_t kAlign = 64 / sizeof(float);
  if (v.size() < n + kAlign) v.resize(n + kAlign, 0.0f);
  const uintptr_t at = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<float*>((at + 63) & ~uintptr_t{63});
}

// n rounded up to whole 16-float (64-byte) vectors: scratch arrays laid one after another each start on a boundary
INL int64_t whole(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// A task of a few rows (a decode) reads a float32 cache where it lies: whole 16-key vectors of keys, and
// value rows when D is a multiple of 16; for it, copying a tile cost more than its arithmetic. Everything
// else is first copied into the tile's float32 keys Kt ([D, kTile]) and values Vs ([kTile, D16]): other
// dtypes, a tile's last partial vector, and the tasks of many rows, which read a tile many times. In place,
// 16 keys of a float32 block at D = 64 are one 4 KB page, so a tile's keys and values all fall in the same
// L1 sets, and a 512-row chunk ran 7-10% slower.
INL bool in_place(const Ctx& c, const Task& task) { return c.kvdt == kF32 && task.rows * c.G <= 8; }

// The n keys of the tile from ts, as kTileVecs vectors: vector v's dimension d is the 16 floats at
// K[v] + d * ks[v]. Vectors past n point at Kt, whose floats are all finite (see Scratch).
template <int W>
INL void tile_keys(const Ctx& c, const Task& task, const int32_t* table, int64_t ts, int64_t n, float* Kt, const float** K,
                   int64_t* ks) {
  typedef vf<W> F;
  const int64_t D = c.D, head = task.head;
  for (int64_t v = 0; v < kTileVecs; ++v) { K[v] = &Kt[v * kLanes]; ks[v] = kTile; }
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int64_t key = ts + j0, off = key % c.bs;
    const char* kb = key_block(c, head, table[key / c.bs]);
    if (c.bs % kLanes == 0 && j0 + kLanes <= n) {
      if (in_place(c, task)) {
        K[j0 / kLanes] = reinterpret_cast<const float*>(kb) + off;
        ks[j0 / kLanes] = c.bs;
      } else if (c.kvdt == kI8) {
        const F sc = F::load(block_scales(c, kb) + off);
        for (int64_t d = 0; d < D; ++d) load16_i8<W>(kb + d * c.bs + off, sc, &Kt[d * kTile + j0]);
      } else {
        for (int64_t d = 0; d < D; ++d) load16<W>(kb, d * c.bs + off, c.kvdt, &Kt[d * kTile + j0]);
      }
    } else {
      for (int64_t d = 0; d < D; ++d) std::fill(&Kt[d * kTile + j0], &Kt[d * kTile + j0] + kLanes, 0.0f);  // a partial vector: no stale keys
      for (int64_t j = j0; j < std::min(n, j0 + kLanes); ++j) {
        const int64_t kk = ts + j;
        const char* b = key_block(c, head, table[kk / c.bs]);
        for (int64_t d = 0; d < D; ++d) Kt[d * kTile + j] = cache_float(c, b, d * c.bs + kk % c.bs, kk % c.bs);
      }
    }
  }
}

// The n value rows of the tile from ts: key j's row is the D16 floats at V[j]
template <int W>
INL void tile_values(const Ctx& c, const Task& task, const int32_t* table, int64_t ts, int64_t n, float* Vs, const float** V) {
  typedef vf<W> F;
  const int64_t D = c.D, head = task.head;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t kk = ts + j, off = kk % c.bs;
    const char* block = value_block(c, head, table[kk / c.bs]);
    const char* vb = block + off * D * c.kv_esize;
    float* vrow = &Vs[j * c.D16];
    V[j] = vrow;
    if (in_place(c, task) && D % kLanes == 0) {
      V[j] = reinterpret_cast<const float*>(vb);
    } else if (c.kvdt == kI8) {
      const float sc = block_scales(c, block)[off];
      if (D % kLanes == 0) {
        for (int64_t d = 0; d < D; d += kLanes) load16_i8<W>(vb + d, F::set(sc), vrow + d);
      } else {
        for (int64_t d = 0; d < D; ++d) vrow[d] = static_cast<float>(reinterpret_cast<const int8_t*>(vb)[d]) * sc;
      }
    } else if (D % kLanes == 0) {
      for (int64_t d = 0; d < D; d += kLanes) load16<W>(vb, d, c.kvdt, vrow + d);
    } else {
      for (int64_t d = 0; d < D; ++d) vrow[d] = to_float(vb, d, c.kvdt);
    }
  }
}

// The first key a row at position p sees (its window's start, or 0)
INL int64_t first_key(const Ctx& c, int64_t p) { return c.window > 0 ? std::max<int64_t>(0, p - c.window + 1) : 0; }

// The scaled query rows of a task (none where Qs is null) and each row's visible keys [lo, hi]
INL void task_rows(const Ctx& c, const Task& task, float* Qs, int64_t* lo, int64_t* hi) {
  const int64_t D = c.D, G = c.G;
  for (int64_t i = 0; i < task.rows; ++i) {
    const int64_t t = task.row0 + i, p = c.row_pos[t];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const char* qrow = c.q + (t * c.q_row + (task.head * G + g) * c.q_head) * c.esize;
      if (Qs) for (int64_t d = 0; d < D; ++d) Qs[r * D + d] = to_float(qrow, d, c.dt) * c.scale;
      hi[r] = p;
      lo[r] = first_key(c, p);
    }
  }
}

// A task's online-softmax state per row (running maximum, sum and accumulator, from `at` in the thread's
// scratch) and each row's visible keys [lo, hi]
struct Rows {
  float* M; float* Lsum; float* Mt; float* Acc; int64_t* lo; int64_t* hi;  // Mt: the tile's maxima (tile_softmax)
  float* end;  // the first float after Acc
};
INL int64_t rows_floats(int64_t R, int64_t D16) { return whole(3 * R) + R * D16; }  // what fresh_rows lays out
INL Rows fresh_rows(float* at, int64_t R, int64_t D16) {
  float* acc = at + whole(3 * R);
  Rows s{at, at + R, at + 2 * R, acc, nullptr, nullptr, acc + R * D16};
  std::fill(s.M, s.M + R, -FLT_MAX);
  std::fill(s.Lsum, s.Lsum + R, 0.0f);
  std::fill(s.Acc, s.Acc + R * D16, 0.0f);
  if (t_scratch.i.size() < static_cast<size_t>(2 * R)) t_scratch.i.resize(2 * R);
  s.lo = t_scratch.i.data();
  s.hi = s.lo + R;
  return s;
}

// a * b + c as the path computes it: one FMA with AVX2 and AVX-512, a multiply and an add on the baseline. Spelled
// out, because whether GCC contracts a * b + c depends on the code around it: in tile_softmax's two passes it left
// the running sum's update uncontracted on AVX2 and AVX-512, which moved the last bit of some rows' outputs.
template <int W>
INL float mul_add(float a, float b, float c) {
  if constexpr (W > 16) return __builtin_fmaf(a, b, c);
  else return a * b + c;
}

// A row's maximum over its visible keys [a, b] (offsets) of a tile's scores s, and its running maximum m. kWhole:
// the row sees the whole tile (most rows, most tiles), so the loop has a fixed length and masks no lane.
template <int W, bool kWhole>
INL float tile_max(const float* s, int64_t a, int64_t b, float m) {
  typedef vf<W> F;
  F mt = F::set(-INFINITY);
  for (int64_t v = kWhole ? 0 : a / kLanes; v <= (kWhole ? kTileVecs - 1 : b / kLanes); ++v) {
    F x = F::load(s + v * kLanes);
    if constexpr (!kWhole) x = visible(x, a - v * kLanes, b - v * kLanes, F::set(-INFINITY));
    mt = vmax(mt, x);
  }
  return std::max(m, lane_max(mt));
}

// The row's p = exp(s - m_new) over [a, b], written over s, and their sum (kWhole as for tile_max)
template <int W, bool kWhole>
INL float tile_exp(float* s, int64_t a, int64_t b, float m_new) {
  typedef vf<W> F;
  const F mv = F::set(m_new);
  F ls = F::zero();
  for (int64_t v = kWhole ? 0 : a / kLanes; v <= (kWhole ? kTileVecs - 1 : b / kLanes); ++v) {
    F p = vexp(F::load(s + v * kLanes) - mv);
    if constexpr (!kWhole) p = visible(p, a - v * kLanes, b - v * kLanes, F::zero());
    p.store(s + v * kLanes);
    ls = ls + p;
  }
  return lane_sum(ls);
}

// The online softmax step of a tile [ts, te) for every row that sees some of it: S (kTile scores a row) becomes
// p, each row's running maximum M and sum Lsum move on, and its accumulator's lanes [d0, d1) are rescaled by
// alpha = exp(m_old - m_new). Where the maximum did not move (most tiles after the first few), alpha is 1 (vexp(0)
// is 1 exactly, on every path) and the rescale would give the same floats, so both are skipped. In two passes over
// the rows, all the maxima (into Mt) and then the exponentials, so that rows' reductions overlap where one row at a
// time waited on its own; each row's operations and their order are the same. Both ways of running a task
// (task_body, split_values) call this.
template <int W>
INL void tile_softmax(const Rows& rs, float* S, int64_t R, int64_t ts, int64_t te, int64_t D16, int64_t d0, int64_t d1) {
  typedef vf<W> F;
  // row r's visible keys in this tile as offsets [a, b]; false where it sees none (its state is then untouched)
  auto span = [&](int64_t r, int64_t& a, int64_t& b) {
    a = std::max(rs.lo[r], ts) - ts;
    b = std::min(rs.hi[r], te - 1) - ts;
    return a <= b;
  };
  auto whole = [](int64_t a, int64_t b) { return a == 0 && b == kTile - 1; };  // it sees every key of the tile
  int64_t a, b;
  for (int64_t r = 0; r < R; ++r) {
    if (!span(r, a, b)) continue;
    float* s = &S[r * kTile];
    rs.Mt[r] = whole(a, b) ? tile_max<W, true>(s, a, b, rs.M[r]) : tile_max<W, false>(s, a, b, rs.M[r]);
  }
  for (int64_t r = 0; r < R; ++r) {
    if (!span(r, a, b)) continue;
    float* s = &S[r * kTile];
    const float m = rs.M[r], m_new = rs.Mt[r];
    const float alpha = m_new == m ? 1.0f : vexp(F::set(m - m_new)).first();
    const float sum = whole(a, b) ? tile_exp<W, true>(s, a, b, m_new) : tile_exp<W, false>(s, a, b, m_new);
    rs.Lsum[r] = mul_add<W>(rs.Lsum[r], alpha, sum);
    rs.M[r] = m_new;
    if (alpha == 1.0f) continue;
    const F av = F::set(alpha);
    for (float* acc = &rs.Acc[r * D16] + d0; acc < &rs.Acc[r * D16] + d1; acc += kLanes) (F::load(acc) * av).store(acc);
  }
}

// out = acc / l for lanes [d0, d1) of a task's rows, rounded once to the model's dtype
INL void task_out(const Ctx& c, const Task& task, const float* Acc, const float* Lsum, int64_t d0, int64_t d1) {
  const int64_t G = c.G, D = c.D, Hq = c.Hkv * G;
  for (int64_t i = 0; i < task.rows; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      const int64_t base = ((task.row0 + i) * Hq + task.head * G + g) * D;
      const float* acc = &Acc[r * c.D16];
      const float l = Lsum[r];
      for (int64_t d = d0; d < d1; ++d) {
        const float o = acc[d] / l;
        switch (c.dt) {
          case kBF16: reinterpret_cast<c10::BFloat16*>(c.out)[base + d] = c10::BFloat16(o); break;
          case kF16: reinterpret_cast<c10::Half*>(c.out)[base + d] = c10::Half(o); break;
          default: reinterpret_cast<float*>(c.out)[base + d] = o;
        }
      }
    }
  }
}

template <int W>
INL void task_body(const Ctx& c, const Task& task) {
  const int64_t D = c.D, D16 = c.D16, R = task.rows * c.G;
  const int32_t* table = c.tables + static_cast<int64_t>(c.row_seq[task.row0]) * c.max_blocks;
  float* Qs = grown(t_scratch.f, whole(R * D) + R * kTile + rows_floats(R, D16) + D * kTile + kTile * D16);
  float* S = Qs + whole(R * D);
  const Rows rs = fresh_rows(S + R * kTile, R, D16);
  float *Lsum = rs.Lsum, *Acc = rs.Acc, *Kt = rs.end, *Vs = Kt + D * kTile;
  int64_t *lo = rs.lo, *hi = rs.hi;
  task_rows(c, task, Qs, lo, hi);
  const int64_t klo = *std::min_element(lo, lo + R), khi = *std::max_element(hi, hi + R);
  const float* K[kTileVecs];
  int64_t ks[kTileVecs];
  const float* V[kTile];
  for (int64_t ts = klo / kTile * kTile; ts <= khi; ts += kTile) {
    const int64_t te = std::min(ts + kTile, khi + 1), n = te - ts;
    if (task.rows == 1) {  // a prefill chunk's tile takes long enough for the hardware's prefetchers
      prefetch_keys(c, task.head, table, ts + kAhead, std::min(ts + kAhead + kTile, khi + 1));
      prefetch_values(c, task.head, table, ts + kAhead, std::min(ts + kAhead + kTile, khi + 1), 0, D * c.kv_esize);
    }
    tile_keys<W>(c, task, table, ts, n, Kt, K, ks);
    tile_values<W>(c, task, table, ts, n, Vs, V);
    const bool place = in_place(c, task);
    // scores for every row and every key of the tile
    if (place) tile_scores<W>(Qs, CacheKeys{K, ks}, S, D, R, c.softcap);
    else tile_scores<W>(Qs, CopiedKeys{Kt}, S, D, R, c.softcap);
    tile_softmax<W>(rs, S, R, ts, te, D16, 0, D16);  // per row over its visible keys in this tile; S becomes p
    // acc += p_j v_j, keys in order; rows that share a key range share the value loads
    if (place) values_lanes<W>(Span<CacheValues>{Acc, S, {V}, lo, hi, D16, R, ts, te, 0}, 0, D16);
    else values_lanes<W>(Span<CopiedValues>{Acc, S, {Vs, D16}, lo, hi, D16, R, ts, te, 0}, 0, D16);
  }
  task_out(c, task, Acc, Lsum, 0, D);
}

// ---- a few long decodes, split across threads
//
// A step of one decode at 8k of context is 3 tasks (one per KV head) on 2 threads: one thread reads two
// heads' cache while the other waits, and a core alone streams only about two thirds of what two do. Splitting a
// row's keys among threads would change its sums, so a split decode runs in two passes that keep every
// operation of task_body in the same order:
//   - scores: q . k for every key, any key range on any thread (a score depends on its own key only),
//     kept whole in a buffer;
//   - values: per slice of the head dimension (lanes never mix), the row's tiles in key order, each with
//     tile_softmax on its scores and the value pass of task_body over that slice. Each slice recomputes the
//     same softmax; the exponentials are cheap beside the cache reads.
// So a split decode gives task_body's bits, on every path.

struct Split {
  Task task;        // a run of a few rows (a decode, or one with its drafted tokens) on one KV head
  float* S;         // its raw scores: [tiles, rows * G, kTile]
  int64_t t0, tiles;  // its first tile (in tiles from position 0) and how many
};
constexpr int64_t kSplitTiles = 8;    // tiles of scores per work item of the first pass
constexpr int64_t kSplitLanes = 32;   // head-dimension lanes per work item of the second pass

template <int W>
INL void split_scores(const Ctx& c, const Split& sp, int64_t first, int64_t last) {  // tiles [first, last) of sp
  const int64_t D = c.D, R = sp.task.rows * c.G;
  const int32_t* table = c.tables + static_cast<int64_t>(c.row_seq[sp.task.row0]) * c.max_blocks;
  float* Qs = grown(t_scratch.f, whole(R * D) + D * kTile);
  float* Kt = Qs + whole(R * D);
  if (t_scratch.i.size() < static_cast<size_t>(2 * R)) t_scratch.i.resize(2 * R);
  int64_t* lo = t_scratch.i.data();
  int64_t* hi = lo + R;
  task_rows(c, sp.task, Qs, lo, hi);
  const int64_t khi = *std::max_element(hi, hi + R);
  const float* K[kTileVecs];
  int64_t ks[kTileVecs];
  const int64_t ahead = kAhead / kTile;
  prefetch_keys(c, sp.task.head, table, (sp.t0 + first) * kTile, std::min((sp.t0 + std::min(first + ahead, last)) * kTile, khi + 1));
  for (int64_t t = first; t < last; ++t) {
    const int64_t ts = (sp.t0 + t) * kTile, n = std::min(ts + kTile, khi + 1) - ts;
    if (t + ahead < last) prefetch_keys(c, sp.task.head, table, ts + kAhead, std::min(ts + kAhead + kTile, khi + 1));
    tile_keys<W>(c, sp.task, table, ts, n, Kt, K, ks);
    float* S = sp.S + t * R * kTile;
    if (in_place(c, sp.task)) tile_scores<W>(Qs, CacheKeys{K, ks}, S, D, R, c.softcap);
    else tile_scores<W>(Qs, CopiedKeys{Kt}, S, D, R, c.softcap);
  }
}

template <int W>
INL void split_values(const Ctx& c, const Split& sp, int64_t dc, int64_t nv) {  // lanes [dc, dc + 16 nv)
  const int64_t D = c.D, D16 = c.D16, R = sp.task.rows * c.G;
  const int32_t* table = c.tables + static_cast<int64_t>(c.row_seq[sp.task.row0]) * c.max_blocks;
  float* S = grown(t_scratch.f, R * kTile + rows_floats(R, D16) + kTile * D16);
  const Rows rs = fresh_rows(S + R * kTile, R, D16);
  float *Lsum = rs.Lsum, *Acc = rs.Acc, *Vs = rs.end;
  int64_t *lo = rs.lo, *hi = rs.hi;
  task_rows(c, sp.task, nullptr, lo, hi);
  const int64_t khi = *std::max_element(hi, hi + R), b0 = dc * c.kv_esize, b1 = std::min(dc + nv * kLanes, D) * c.kv_esize;
  const float* V[kTile];
  for (int64_t t = 0; t < sp.tiles; ++t) {
    const int64_t ts = (sp.t0 + t) * kTile, te = std::min(ts + kTile, khi + 1), n = te - ts;
    prefetch_values(c, sp.task.head, table, ts + kAhead, std::min(ts + kAhead + kTile, khi + 1), b0, b1);
    tile_values<W>(c, sp.task, table, ts, n, Vs, V);
    std::memcpy(S, sp.S + t * R * kTile, R * kTile * sizeof(float));
    tile_softmax<W>(rs, S, R, ts, te, D16, dc, dc + nv * kLanes);
    if (in_place(c, sp.task)) values_lanes<W>(Span<CacheValues>{Acc, S, {V}, lo, hi, D16, R, ts, te, 0}, dc, dc + nv * kLanes);
    else values_lanes<W>(Span<CopiedValues>{Acc, S, {Vs, D16}, lo, hi, D16, R, ts, te, 0}, dc, dc + nv * kLanes);
  }
  task_out(c, sp.task, Acc, Lsum, dc, std::min(dc + nv * kLanes, D));
}

// The same bodies compiled three times; `isa()` picks one per process, so a host always runs the same code.
SHOAL_ENTRY_AVX512 void task_avx512(const Ctx& c, const Task& t) { task_body<64>(c, t); }
SHOAL_ENTRY_AVX2 void task_avx2(const Ctx& c, const Task& t) { task_body<32>(c, t); }
SHOAL_ENTRY_BASELINE void task_baseline(const Ctx& c, const Task& t) { task_body<16>(c, t); }
SHOAL_ENTRY_AVX512 void scores_avx512(const Ctx& c, const Split& s, int64_t a, int64_t b) { split_scores<64>(c, s, a, b); }
SHOAL_ENTRY_AVX2 void scores_avx2(const Ctx& c, const Split& s, int64_t a, int64_t b) { split_scores<32>(c, s, a, b); }
SHOAL_ENTRY_BASELINE void scores_baseline(const Ctx& c, const Split& s, int64_t a, int64_t b) { split_scores<16>(c, s, a, b); }
SHOAL_ENTRY_AVX512 void values_avx512(const Ctx& c, const Split& s, int64_t dc, int64_t nv) { split_values<64>(c, s, dc, nv); }
SHOAL_ENTRY_AVX2 void values_avx2(const Ctx& c, const Split& s, int64_t dc, int64_t nv) { split_values<32>(c, s, dc, nv); }
SHOAL_ENTRY_BASELINE void values_baseline(const Ctx& c, const Split& s, int64_t dc, int64_t nv) { split_values<16>(c, s, dc, nv); }

// ------------------------------------------------------------------ row-wise ops of a decoder layer
// Each fuses what torch runs as several ops (RMSNorm alone is about 15 on the CPU), and each row is
// computed on its own in one fixed order, so they are row-invariant like everything on this path.

// A row's elements as floats, and back: one dtype switch per row, so the loops vectorize.
INL void load_row(const char* p, int64_t n, int dt, float* out) {
  switch (dt) {
    case kBF16: for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(reinterpret_cast<const c10::BFloat16*>(p)[i]); break;
    case kF16: for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(reinterpret_cast<const c10::Half*>(p)[i]); break;
    default: std::memcpy(out, p, n * sizeof(float));
  }
}

INL void store_row(char* p, int64_t n, int dt, const float* in) {
  switch (dt) {
    case kBF16: for (int64_t i = 0; i < n; ++i) reinterpret_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(in[i]); break;
    case kF16: for (int64_t i = 0; i < n; ++i) reinterpret_cast<c10::Half*>(p)[i] = c10::Half(in[i]); break;
    default: std::memcpy(p, in, n * sizeof(float));
  }
}

INL void round_row(float* v, int64_t n, int dt) {  // each element as the dtype would hold it
  switch (dt) {
    case kBF16: for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(c10::BFloat16(v[i])); break;
    case kF16: for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(c10::Half(v[i])); break;
    default: break;
  }
}

INL int64_t elem_offset(int64_t elements, int dt) { return elements * (dt == kF32 ? 4 : 2); }

struct NormArgs {
  const char* x; const char* delta; const char* w; char* sum; char* y;
  int64_t n, x_row, delta_row; float eps; int dt;
};

// sum = x + delta in the dtype (when delta is given); y = w * dtype(s * rsqrt(mean(s^2) + eps)), as HF's RMSNorm
template <int W>
INL void norm_row(const NormArgs& a, int64_t t, float* buf, float* tmp, const float* w) {
  const int64_t n = a.n;
  load_row(a.x + elem_offset(t * a.x_row, a.dt), n, a.dt, buf);
  if (a.delta != nullptr) {
    load_row(a.delta + elem_offset(t * a.delta_row, a.dt), n, a.dt, tmp);
    for (int64_t i = 0; i < n; ++i) buf[i] += tmp[i];
    round_row(buf, n, a.dt);
    store_row(a.sum + elem_offset(t * n, a.dt), n, a.dt, buf);
  }
  vf<W> acc = vf<W>::zero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf<W> v = vf<W>::load(buf + i);
    acc = fmadd(v, v, acc);
  }
  float ss = lane_sum(acc);
  for (; i < n; ++i) ss += buf[i] * buf[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + a.eps);
  for (int64_t j = 0; j < n; ++j) tmp[j] = buf[j] * r;
  round_row(tmp, n, a.dt);
  for (int64_t j = 0; j < n; ++j) tmp[j] *= w[j];
  store_row(a.y + elem_offset(t * n, a.dt), n, a.dt, tmp);
}

template <int W>
INL void norm_rows(const NormArgs& a, int64_t b, int64_t e) {
  std::vector<float> buf(3 * (a.n + kLanes));
  float* w = buf.data() + 2 * (a.n + kLanes);
  load_row(a.w, a.n, a.dt, w);
  for (int64_t t = b; t < e; ++t) norm_row<W>(a, t, buf.data(), buf.data() + a.n + kLanes, w);
}

struct RopeArgs {
  char* x; const float* cos; const float* sin;  // x [T, H, D] (rows strided); cos, signed sin [T, D] float32
  int64_t H, D, x_row, x_head; int dt;
};

// x = x * cos + roll(x, D/2) * signed_sin, in place, one rounding
template <int W>  // scalar loops, vectorized by the compiler for the caller's instruction set
INL void rope_rows(const RopeArgs& a, int64_t b, int64_t e) {
  std::vector<float> buf(2 * a.D);
  float* in = buf.data();
  float* out = in + a.D;
  const int64_t half = a.D / 2;
  for (int64_t t = b; t < e; ++t) {
    const float* cs = a.cos + t * a.D;
    const float* sn = a.sin + t * a.D;
    for (int64_t h = 0; h < a.H; ++h) {
      char* row = a.x + elem_offset(t * a.x_row + h * a.x_head, a.dt);
      load_row(row, a.D, a.dt, in);
      for (int64_t d = 0; d < half; ++d) out[d] = in[d] * cs[d] + in[d + half] * sn[d];
      for (int64_t d = half; d < a.D; ++d) out[d] = in[d] * cs[d] + in[d - half] * sn[d];
      store_row(row, a.D, a.dt, out);
    }
  }
}

struct SiluArgs {
  const char* x; char* y;  // x [T, 2I] (gate | up), y [T, I]
  int64_t I, x_row; int dt;
};

// y = silu(gate) * up, one rounding
template <int W>
INL void silu_rows(const SiluArgs& a, int64_t b, int64_t e) {
  std::vector<float> g(a.I + kLanes), u(a.I + kLanes);
  for (int64_t t = b; t < e; ++t) {
    load_row(a.x + elem_offset(t * a.x_row, a.dt), a.I, a.dt, g.data());
    load_row(a.x + elem_offset(t * a.x_row + a.I, a.dt), a.I, a.dt, u.data());
    int64_t i = 0;
    for (; i + kLanes <= a.I; i += kLanes) {
      typedef vf<W> F;
      const F gv = F::load(&g[i]);
      const F sig = F::set(1.0f) / (F::set(1.0f) + vexp(F::set(0.0f) - gv));
      (gv * sig * F::load(&u[i])).store(&g[i]);
    }
    for (; i < a.I; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    store_row(a.y + elem_offset(t * a.I, a.dt), a.I, a.dt, g.data());
  }
}

struct LseArgs {
  const float* x; float* lse;  // x [B, V] float32 rows, lse [B]
  int64_t V, x_row;
  const float* max = nullptr;  // each row's maximum as row_argmax_row gives it, where known (greedy_rows); else found here
};

void row_argmax_row(const float* row, int64_t V, int64_t* id, float* top);

// Each row's log-sum-exp, max + log(sum(exp(x - max))): what every logprob on the CPU is taken from (runner/sampler.py
// log_softmax_rows). A row is one thread's, in one order of operations, so its value is the same bits whatever else
// is in the batch. A row whose maximum is not finite (a NaN, +inf, or nothing above -inf) has none: NaN.
template <int W>
INL void lse_rows(const LseArgs& a, int64_t b, int64_t e) {
  typedef vf<W> F;
  for (int64_t r = b; r < e; ++r) {
    const float* row = a.x + r * a.x_row;
    int64_t id;
    float m;
    if (a.max != nullptr) m = a.max[r];
    else row_argmax_row(row, a.V, &id, &m);  // a NaN where the row has one
    if (!std::isfinite(m)) {
      a.lse[r] = NAN;
      continue;
    }
    const F mv = F::set(m);
    F acc = F::zero();
    int64_t i = 0;
    for (; i + kLanes <= a.V; i += kLanes) acc = acc + vexp(F::load(row + i) - mv);
    float sum = lane_sum(acc);
    for (; i < a.V; ++i) sum += std::exp(row[i] - m);
    a.lse[r] = m + std::log(sum);
  }
}

// The same bodies compiled per instruction set, as the attention's (vec.h SHOAL_ISA_VARIANTS).
SHOAL_ISA_VARIANTS(norm_rows, NormArgs)
SHOAL_ISA_VARIANTS(rope_rows, RopeArgs)
SHOAL_ISA_VARIANTS(silu_rows, SiluArgs)
SHOAL_ISA_VARIANTS(lse_rows, LseArgs)

int64_t best_isa() {  // 3 AVX-512, 2 AVX2 with FMA, 1 baseline x86-64
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) return 3;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 2;
  return 1;
}

std::atomic<int64_t> g_isa{0};  // 0 until first use: the best this CPU has

int64_t isa() {
  if (g_isa.load() == 0) g_isa.store(best_isa());
  return g_isa.load();
}

// Tests run every code path this CPU can: level 1..3, capped at what it has; 0 returns to the best.
int64_t use_isa(int64_t level) {
  g_isa.store(level <= 0 ? best_isa() : std::min(level, best_isa()));
  return g_isa.load();
}

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: TORCH_CHECK(false, "invariant attention: float32, bfloat16 or float16, not ", t.scalar_type());
  }
}

int cache_dtype_code(const at::Tensor& kv) { return kv.scalar_type() == at::kChar ? kI8 : dtype_code(kv); }

INL void store_float(char* p, int64_t i, int dt, float f) {
  switch (dt) {
    case kBF16: reinterpret_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(f); break;
    case kF16: reinterpret_cast<c10::Half*>(p)[i] = c10::Half(f); break;
    default: reinterpret_cast<float*>(p)[i] = f;
  }
}

// One token's key or value row of one head into the cache: elements at dst + i * stride (a key's go down its
// block's column, a value's along its row), as the cache's dtype; int8 codes with their scale into *scale.
INL void write_row(const char* src, int dt, char* dst, int64_t stride, int kvdt, int64_t D, float* scale, float* row) {
  for (int64_t d = 0; d < D; ++d) row[d] = to_float(src, d, dt);
  if (kvdt != kI8) {
    for (int64_t d = 0; d < D; ++d) store_float(dst, d * stride, kvdt, row[d]);
    return;
  }
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(row[d]));
  const float s = amax / 127.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float code = s > 0.0f ? std::nearbyint(row[d] / s) : 0.0f;
    reinterpret_cast<int8_t*>(dst)[d * stride] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));
  }
  *scale = s;
}

// f(i) for i in [0, n), the threads taking the next i as they free up (items in order of the caller's choosing)
template <typename F>
void take_in_turn(int64_t n, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(i);
  });
}

// A step of only short runs (decodes, and decodes verifying drafted tokens: at most kSplitRows rows each),
// fewer than kSplitBelowTasks tasks a thread, one of them seeing at least kSplitFromKeys keys: each run and
// head is a Split, run in the two passes above, each pass's work items taken by the threads as they free up.
constexpr int64_t kSplitRows = 16, kSplitBelowTasks = 4, kSplitFromKeys = 1024;

void split_decodes(const Ctx& c, const std::vector<Task>& runs, int64_t level) {
  thread_local std::vector<float> t_scores;  // the caller's: every split's scores
  std::vector<Split> splits;
  int64_t total = 0;
  for (const Task& run : runs) {
    const int64_t lo = first_key(c, c.row_pos[run.row0]), p1 = c.row_pos[run.row0 + run.rows - 1];
    for (int64_t h = 0; h < c.Hkv; ++h) {
      splits.push_back({{run.row0, run.rows, h}, nullptr, lo / kTile, p1 / kTile - lo / kTile + 1});
      total += splits.back().tiles * run.rows * c.G * kTile;
    }
  }
  float* scores = grown(t_scores, total);
  std::vector<std::pair<int64_t, int64_t>> first, second;  // (split, first tile) and (split, first lane)
  for (int64_t i = 0, at = 0; i < static_cast<int64_t>(splits.size()); ++i) {
    splits[i].S = scores + at;
    at += splits[i].tiles * splits[i].task.rows * c.G * kTile;
    for (int64_t t = 0; t < splits[i].tiles; t += kSplitTiles) first.push_back({i, t});
    for (int64_t d = 0; d < c.D16; d += kSplitLanes) second.push_back({i, d});
  }
  // the longest first in the second pass, whose items are whole rows
  std::stable_sort(second.begin(), second.end(), [&](const auto& x, const auto& y) { return splits[x.first].tiles > splits[y.first].tiles; });
  auto scores_of = level == 3 ? scores_avx512 : level == 2 ? scores_avx2 : scores_baseline;
  auto values_of = level == 3 ? values_avx512 : level == 2 ? values_avx2 : values_baseline;
  take_in_turn(first.size(), [&](int64_t i) {
    const Split& sp = splits[first[i].first];
    scores_of(c, sp, first[i].second, std::min(first[i].second + kSplitTiles, sp.tiles));
  });
  take_in_turn(second.size(), [&](int64_t i) {
    values_of(c, splits[second[i].first], second[i].second, std::min(kSplitLanes, c.D16 - second[i].second) / kLanes);
  });
}

// q [T, Hq, D], k/v [T, Hkv, D] or [0, ...] (rows and heads may be strided, D contiguous); kv [2, Hkv, NB, bs, D]
// contiguous (int8: [2, Hkv, NB, bs, D + 4], see the top of this file); slots [T] int64; tables [S, max_blocks]
// int32; row_seq, row_pos [T] int32.
at::Tensor invariant_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv,
                               const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& row_seq,
                               const at::Tensor& row_pos, double scale, int64_t window, int64_t group, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && kv.dim() == 5, "invariant attention: bad ranks");
  TORCH_CHECK(kv.is_contiguous() && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "invariant attention: layout");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "invariant attention: q, k and v must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && tables.scalar_type() == at::kInt && row_seq.scalar_type() == at::kInt &&
              row_pos.scalar_type() == at::kInt && tables.is_contiguous() && slots.is_contiguous() &&
              row_seq.is_contiguous() && row_pos.is_contiguous(), "invariant attention: index dtypes");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kv.size(1), NB = kv.size(2), bs = kv.size(3);
  const int kvdt = cache_dtype_code(kv);
  TORCH_CHECK(kv.size(4) == (kvdt == kI8 ? D + 4 : D) && Hq == Hkv * group, "invariant attention: shapes");
  TORCH_CHECK(k.size(0) == 0 || (k.size(0) == T && v.size(0) == T && k.size(1) == Hkv && v.size(1) == Hkv && slots.size(0) == T),
              "invariant attention: the keys and values to write");
  {  // every index the op will follow stays inside its tensor
    const int64_t S = tables.size(0), W = tables.size(1);
    const int32_t* tb = tables.data_ptr<int32_t>();
    const int32_t* rs = row_seq.data_ptr<int32_t>();
    const int32_t* rp = row_pos.data_ptr<int32_t>();
    TORCH_CHECK(row_seq.size(0) == T && row_pos.size(0) == T, "invariant attention: one sequence and position per row");
    for (int64_t i = 0; i < S * W; ++i) TORCH_CHECK(tb[i] >= 0 && tb[i] < NB, "invariant attention: a block id outside the cache");
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(rs[t] >= 0 && rs[t] < S && rp[t] >= 0 && rp[t] / bs < W, "invariant attention: a position past its block table");
    if (k.size(0) > 0) {
      const int64_t* sl = slots.data_ptr<int64_t>();
      for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < NB * bs, "invariant attention: a slot outside the cache");
    }
  }
  const int dt = dtype_code(q);
  const int64_t es = q.element_size(), kv_es = kv.element_size(), block_bytes = bs * kv.size(4) * kv_es;
  char* cache = static_cast<char*>(kv.data_ptr());
  // write the step's keys (transposed within their block) and values; none given: the cache is written
  if (k.size(0) > 0) {
    const char* kp = static_cast<const char*>(k.data_ptr());
    const char* vp = static_cast<const char*>(v.data_ptr());
    const int64_t* sl = slots.data_ptr<int64_t>();
    at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
      std::vector<float> row(D);
      for (int64_t t = b; t < e; ++t) {
        const int64_t block = sl[t] / bs, off = sl[t] % bs;
        for (int64_t h = 0; h < Hkv; ++h) {
          const char* ks = kp + (t * k.stride(0) + h * k.stride(1)) * es;
          const char* vs = vp + (t * v.stride(0) + h * v.stride(1)) * es;
          char* kb = cache + (h * NB + block) * block_bytes;
          char* vb = cache + ((Hkv + h) * NB + block) * block_bytes;
          if (kvdt == dt) {  // as they are
            for (int64_t d = 0; d < D; ++d) std::memcpy(kb + (d * bs + off) * es, ks + d * es, es);
            std::memcpy(vb + off * D * es, vs, D * es);
            continue;
          }
          const bool i8 = kvdt == kI8;
          float* scale_k = i8 ? reinterpret_cast<float*>(kb + bs * D) + off : nullptr;
          float* scale_v = i8 ? reinterpret_cast<float*>(vb + bs * D) + off : nullptr;
          write_row(ks, dt, kb + off * kv_es, bs, kvdt, D, scale_k, row.data());
          write_row(vs, dt, vb + off * D * kv_es, 1, kvdt, D, scale_v, row.data());
        }
      }
    });
  }
  at::Tensor out = at::empty({T, Hq, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
  Ctx c{static_cast<const char*>(q.data_ptr()), q.stride(0), q.stride(1), cache, Hkv, NB, bs, D, (D + kLanes - 1) / kLanes * kLanes,
        group, tables.data_ptr<int32_t>(), tables.size(1), row_seq.data_ptr<int32_t>(), row_pos.data_ptr<int32_t>(),
        static_cast<float>(scale), window, static_cast<float>(softcap), dt, es, kvdt, kv_es, block_bytes, static_cast<char*>(out.data_ptr())};
  // tasks: runs of rows of one sequence (a decode is a run of one), at most `positions` long, times KV heads
  const int64_t level = isa(), threads = at::get_num_threads();
  std::vector<Task> runs;
  for (const int64_t positions : kTaskPositions) {
    runs.clear();
    for (int64_t t = 0; t < T;) {
      int64_t e = t + 1;
      while (e < T && e - t < positions && c.row_seq[e] == c.row_seq[t]) ++e;
      runs.push_back({t, e - t, 0});
      t = e;
    }
    if (static_cast<int64_t>(runs.size()) * Hkv >= kTasksPerThread * threads) break;
  }
  const int64_t n = static_cast<int64_t>(runs.size()) * Hkv;
  int64_t longest = 0, widest = 0;
  for (const Task& r : runs) {
    longest = std::max<int64_t>(longest, c.row_pos[r.row0 + r.rows - 1] + 1);
    widest = std::max(widest, r.rows);
  }
  if (threads > 1 && widest <= kSplitRows && n < kSplitBelowTasks * threads && longest >= kSplitFromKeys) {
    split_decodes(c, runs, level);
    return out;
  }
  // The threads take runs as they free up, costliest first (rows times the keys they see). at::parallel_for's
  // contiguous halves put every task of a prefill chunk on one thread when decodes came first in the step: an
  // 80-row chunk at 7k of context beside 8 decodes took 2.2x the time per row of a 512-row one alone. Each
  // row is computed whole inside one task, so which thread takes it changes nothing in the bits.
  std::vector<int64_t> order(runs.size());
  std::iota(order.begin(), order.end(), 0);
  auto cost = [&](int64_t r) { return runs[r].rows * (c.row_pos[runs[r].row0 + runs[r].rows - 1] + 1); };
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost(x) > cost(y); });
  void (*run_task)(const Ctx&, const Task&) = level == 3 ? task_avx512 : level == 2 ? task_avx2 : task_baseline;
  take_in_turn(n, [&](int64_t i) {
    Task task = runs[order[i / Hkv]];
    task.head = i % Hkv;
    run_task(c, task);
  });
  return out;
}

int64_t row_stride(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rows of contiguous elements expected");
  return x.stride(0);
}

// y = RMSNorm(x) [T, N]; with delta [T, N], x is replaced by sum = x + delta first (a new tensor)
at::Tensor norm_impl(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps, at::Tensor* sum) {
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == N && weight.scalar_type() == x.scalar_type(), "rms norm: weight");
  if (delta != nullptr)
    TORCH_CHECK(delta->dim() == 2 && delta->size(0) == T && delta->size(1) == N && delta->scalar_type() == x.scalar_type(),
                "rms norm: delta");
  at::Tensor y = at::empty({T, N}, x.options());
  if (sum != nullptr) *sum = at::empty({T, N}, x.options());
  NormArgs a{static_cast<const char*>(x.data_ptr()), delta != nullptr ? static_cast<const char*>(delta->data_ptr()) : nullptr,
             static_cast<const char*>(weight.data_ptr()), sum != nullptr ? static_cast<char*>(sum->data_ptr()) : nullptr,
             static_cast<char*>(y.data_ptr()), N, row_stride(x), delta != nullptr ? row_stride(*delta) : 0,
             static_cast<float>(eps), dtype_code(x)};
  run_rows(norm_rows_avx512, norm_rows_avx2, norm_rows_baseline, a, T, 8);
  return y;
}

// x [T, N] -> HF's RMSNorm of x
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return norm_impl(x, nullptr, weight, eps, nullptr); }

// x, delta [T, N] -> (x + delta, RMSNorm(x + delta)): a residual add and the norm after it
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  at::Tensor sum;
  at::Tensor y = norm_impl(x, &delta, weight, eps, &sum);
  return {sum, y};
}

// x [T, H, D] rotated in place by its row's cos / signed sin [T, D] (float32), HF's rotate-half layout
at::Tensor rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rope: x [T, H, D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
              cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel(), "rope: float32 tables [T, D]");
  RopeArgs a{static_cast<char*>(x.data_ptr()), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(1), x.size(2),
             x.stride(0), x.stride(1), dtype_code(x)};
  run_rows(rope_rows_avx512, rope_rows_avx2, rope_rows_baseline, a, x.size(0), 8);
  return x;
}

// x [B, V] float32 -> (each row's argmax [B] int64, its maximum [B] float32), as torch's argmax and amax give them:
// the first index of the largest value; a row holding a NaN gives its first NaN, and NaN as its maximum. One op where
// the sampler ran five (torch's CPU argmax is a scalar loop, 3 ns an element): the maximum in one pass of SSE2 (every
// x86-64 CPU has it; a 49,152-wide row is 200 KB from L2 either way), then the first index holding it. A row is read
// on its own, so a row's answer does not depend on the others.
int64_t first_index_of(const float* row, int64_t V, float m) {
  const __m128 want = _mm_set1_ps(m);
  int64_t i = 0;
  for (; i + 4 <= V; i += 4) {
    const int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(row + i), want));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < V; ++i)
    if (row[i] == m) return i;
  return V;  // not reached: m is one of the row's values
}

void row_argmax_row(const float* row, int64_t V, int64_t* id, float* top) {
  __m128 m[4], nan = _mm_setzero_ps();
  for (int k = 0; k < 4; ++k) m[k] = _mm_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= V; i += 16)
    for (int k = 0; k < 4; ++k) {
      const __m128 v = _mm_loadu_ps(row + i + 4 * k);
      m[k] = _mm_max_ps(m[k], v);
      nan = _mm_or_ps(nan, _mm_cmpunord_ps(v, v));
    }
  float lanes[16];
  for (int k = 0; k < 4; ++k) _mm_storeu_ps(lanes + 4 * k, m[k]);
  float best = -INFINITY;
  bool any_nan = _mm_movemask_ps(nan) != 0;
  for (int k = 0; k < 16; ++k) best = lanes[k] > best ? lanes[k] : best;
  for (; i < V; ++i) {
    any_nan |= row[i] != row[i];
    best = row[i] > best ? row[i] : best;
  }
  if (any_nan) {
    int64_t at = 0;
    while (row[at] == row[at]) ++at;
    *id = at;
    *top = row[at];
    return;
  }
  *id = first_index_of(row, V, best);
  *top = best;
}

std::tuple<at::Tensor, at::Tensor> row_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "row_argmax: float32 rows [B, V]");
  const int64_t B = x.size(0), V = x.size(1), stride = x.stride(0);
  TORCH_CHECK(V > 0, "row_argmax: empty rows");
  at::Tensor ids = at::empty({B}, x.options().dtype(at::kLong)), top = at::empty({B}, x.options());
  const float* xp = x.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* tp = top.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) row_argmax_row(xp + r * stride, V, ip + r, tp + r);
  });
  return {ids, top};
}

// x [B, V] float32 rows -> each row's log-sum-exp [B] (lse_rows)
// max: each row's maximum where the caller has it (greedy_rows, from its argmax), else nullptr
at::Tensor logsumexp_rows(const at::Tensor& x, const float* max) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0, "row_logsumexp: float32 rows [B, V]");
  at::Tensor lse = at::empty({x.size(0)}, x.options());
  LseArgs a{x.data_ptr<float>(), lse.data_ptr<float>(), x.size(1), x.stride(0), max};
  run_rows(lse_rows_avx512, lse_rows_avx2, lse_rows_baseline, a, x.size(0), 1);
  return lse;
}

at::Tensor row_logsumexp(const at::Tensor& x) { return logsumexp_rows(x, nullptr); }

// The sampler's end for a batch of greedy rows (runner/sampler.py): raw [B, V] float32 logits, processed [B, V] the
// same after the logits processors (or raw itself) -> (token ids [B] int64, each the processed row's argmax or a
// negative code, their logprobs under raw [B] float32). A logprob is the raw logit less the row's log-sum-exp
// (row_logsumexp), the bits of the sampler's every other logprob. The codes, as the sampler's: -1 where raw's maximum
// is not finite (it has no log-sum-exp), else -2 where every processed logit is -inf (all banned).
// bans: where the only processor is a ban (ignore_eos, min_tokens, no_repeat_ngram_size), its flat indices into raw,
// with processed raw itself: the banned logits are set to -inf for the argmax and put back, bit for bit, so the
// processed copy of all the logits (6 MB a step at 32 rows of 49,152) is never made.
std::tuple<at::Tensor, at::Tensor> greedy_rows(const at::Tensor& raw, const at::Tensor& processed, const c10::optional<at::Tensor>& bans) {
  TORCH_CHECK(raw.sizes() == processed.sizes(), "greedy_rows: raw and processed logits of one shape");
  at::Tensor ids, top;
  if (bans.has_value()) {
    const at::Tensor& b = *bans;
    TORCH_CHECK(processed.is_same(raw) && raw.is_contiguous() && b.scalar_type() == at::kLong && b.dim() == 1 && b.is_contiguous(),
                "greedy_rows: bans are flat int64 indices into raw, which is its own processed");
    // everything row_argmax checks, before raw is touched: nothing may throw while its bans are in
    TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kFloat && raw.size(1) > 0, "greedy_rows: float32 rows [B, V]");
    float* rp = raw.data_ptr<float>();
    const int64_t* bp = b.data_ptr<int64_t>();
    const int64_t n = b.numel(), total = raw.numel();
    std::vector<float> saved(n);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(bp[i] >= 0 && bp[i] < total, "greedy_rows: a ban outside the logits");
      saved[i] = rp[bp[i]];
    }
    for (int64_t i = 0; i < n; ++i) rp[bp[i]] = -INFINITY;
    std::tie(ids, top) = row_argmax(raw);
    for (int64_t i = 0; i < n; ++i) rp[bp[i]] = saved[i];  // each saved before any was banned: duplicates put back alike
  } else {
    std::tie(ids, top) = row_argmax(processed);
  }
  // NaN where raw's maximum is not finite; where the argmax was raw's own, its maxima: one pass over the rows, not two
  const bool raw_maxima = processed.is_same(raw) && !bans.has_value();
  const at::Tensor lse = logsumexp_rows(raw, raw_maxima ? top.data_ptr<float>() : nullptr);
  at::Tensor logp = at::empty({ids.size(0)}, raw.options());
  int64_t* ip = ids.data_ptr<int64_t>();
  const float* tp = top.data_ptr<float>();
  const float* lp = lse.data_ptr<float>();
  const float* xp = raw.data_ptr<float>();
  float* op = logp.data_ptr<float>();
  for (int64_t r = 0; r < ids.size(0); ++r) {
    op[r] = xp[r * raw.stride(0) + ip[r]] - lp[r];  // log_softmax_rows' value at the pick, the same float op
    if (std::isnan(lp[r])) ip[r] = -1;
    else if (!(tp[r] > -INFINITY)) ip[r] = -2;
  }
  return {ids, logp};
}

// The logits head and greedy_rows in one call, for a step whose every row samples greedily with no logits processor
// but bans (runner/model_runner.py ModelRunner._sample_batch): x [B, K] the final hidden states, w the head's packed
// weight (kquants.cpp gguf_linear of type t, n rows), bans as greedy_rows takes them -> each row's token (or
// greedy_rows' negative code) and logprob, as lists: the bits of the head op, .float() and greedy_rows, with no
// dispatcher, logits tensor or host transfer between them in Python.
std::tuple<std::vector<int64_t>, std::vector<double>> greedy_head(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t t,
                                                                   const c10::optional<at::Tensor>& bans) {
  at::Tensor ids, logp;
  std::tie(ids, logp) = shoal_greedy_head(x, w, n, t, bans);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* lp = logp.data_ptr<float>();
  return {std::vector<int64_t>(ip, ip + ids.numel()), std::vector<double>(lp, lp + logp.numel())};
}

// The native attention op's row indices for a step (model/attention/invariant.py): spans [2S] int64, the S sequences'
// first positions and then their row counts, in the step's order; tables [S, W] int32, their block tables (padded with
// the null block `null`) -> slots [T] int64 (each row's cache slot: table[p / block_size] * block_size + p % block_size),
// row_seq [T] int32 (its sequence), row_pos [T] int32 (its position). One op where Python built three lists a token
// long and a tensor of each.
std::tuple<at::Tensor, at::Tensor, at::Tensor> step_rows(const at::Tensor& spans, const at::Tensor& tables, int64_t block_size,
                                                         int64_t null) {
  TORCH_CHECK(spans.dim() == 1 && spans.scalar_type() == at::kLong && spans.is_contiguous() && spans.size(0) % 2 == 0,
              "step_rows: spans [2S] int64");
  const int64_t S = spans.size(0) / 2;
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == S && tables.scalar_type() == at::kInt && tables.stride(1) == 1,
              "step_rows: tables [S, W] int32");
  TORCH_CHECK(block_size > 0, "step_rows: block_size > 0");
  const int64_t* start = spans.data_ptr<int64_t>();
  const int64_t* length = start + S;
  int64_t T = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(start[s] >= 0 && length[s] >= 0, "step_rows: negative positions or row counts");
    T += length[s];
  }
  at::Tensor slots = at::empty({T}, spans.options()), seq = at::empty({T}, tables.options()), pos = at::empty({T}, tables.options());
  int64_t* sp = slots.data_ptr<int64_t>();
  int32_t* qp = seq.data_ptr<int32_t>();
  int32_t* pp = pos.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t W = tables.size(1), ts = tables.stride(0);
  for (int64_t s = 0, t = 0; s < S; ++s) {
    for (int64_t p = start[s], end = start[s] + length[s]; p < end; ++p, ++t) {
      const int64_t b = p / block_size;
      TORCH_CHECK(b < W && tp[s * ts + b] != null, "step_rows: a position past its sequence's block table");
      sp[t] = static_cast<int64_t>(tp[s * ts + b]) * block_size + p % block_size;
      qp[t] = static_cast<int32_t>(s);
      pp[t] = static_cast<int32_t>(p);
    }
  }
  return {slots, seq, pos};
}

// gate_up [T, 2I] -> silu(gate) * up [T, I]
at::Tensor silu_mul(const at::Tensor& x) {
  const int64_t T = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_mul: [T, 2I]");
  at::Tensor y = at::empty({T, I}, x.options());
  SiluArgs a{static_cast<const char*>(x.data_ptr()), static_cast<char*>(y.data_ptr()), I, row_stride(x), dtype_code(x)};
  run_rows(silu_rows_avx512, silu_rows_avx2, silu_rows_baseline, a, T, 4);
  return y;
}

// A gather between the ranks of one machine through shared memory (executor/shm.py has the layout and
// why two sets of slots are enough). Copies this rank's part [T, widths[rank]] into its slot of set
// n % 2, publishes n in posted[rank], and waits up to `spin` polls for every rank to publish n; then
// returns the ranks' parts side by side, [T, sum(widths)]. Past `spin`: nothing, and the caller waits
// (with its timeouts and liveness checks) and calls again, which copies and publishes the same again.
// One op where the Python path makes about ten, at 120 gathers a step.
c10::optional<at::Tensor> shm_gather(const at::Tensor& part, const at::Tensor& slots, const at::Tensor& posted, int64_t rank,
                                     int64_t n, at::IntArrayRef widths, int64_t slot_bytes, int64_t spin) {
  const int64_t size = static_cast<int64_t>(widths.size()), rows = part.size(0), es = part.element_size();
  TORCH_CHECK(part.dim() == 2 && part.is_contiguous() && part.size(1) == widths[rank], "shm_gather: part [T, widths[rank]]");
  TORCH_CHECK(slots.scalar_type() == at::kByte && posted.scalar_type() == at::kLong && posted.numel() >= size &&
              slots.numel() >= 2 * size * slot_bytes, "shm_gather: the segment's slots and counters");
  int64_t total = 0;
  for (int64_t r = 0; r < size; ++r) {
    TORCH_CHECK(rows * widths[r] * es <= slot_bytes, "shm_gather: a part larger than a slot");
    total += widths[r];
  }
  uint8_t* set = slots.data_ptr<uint8_t>() + (n & 1) * size * slot_bytes;
  int64_t* flags = posted.data_ptr<int64_t>();
  std::memcpy(set + rank * slot_bytes, part.data_ptr(), rows * widths[rank] * es);
  __atomic_store_n(flags + rank, n, __ATOMIC_RELEASE);
  for (int64_t r = 0; r < size; ++r) {
    for (int64_t polls = 0; __atomic_load_n(flags + r, __ATOMIC_ACQUIRE) < n; ++polls) {
      if (polls >= spin) return c10::nullopt;
      _mm_pause();
    }
  }
  at::Tensor out = at::empty({rows, total}, part.options());
  char* o = static_cast<char*>(out.data_ptr());
  for (int64_t t = 0; t < rows; ++t) {
    int64_t at_col = 0;
    for (int64_t r = 0; r < size; ++r) {
      std::memcpy(o + (t * total + at_col) * es, set + r * slot_bytes + t * widths[r] * es, widths[r] * es);
      at_col += widths[r];
    }
  }
  return out;
}

// Memory for weights a step streams whole (ops.h shoal_weight_empty), on transparent huge pages where the host allows
// them (Debian's default setting, "madvise", does). A decode step reads every weight once; with 4 KiB pages a 1B Q4_0
// model's 600 MB are 150,000 translations a step, each a page-table walk once the TLB has moved on, and with 2 MiB
// pages 300. Measured (benchmarks/NOTES.md, thirty-sixth round): a one-stream step 3-5% faster.
// A tensor of kOwnMapping bytes or more gets an anonymous mapping of its own that starts on a 2 MiB boundary and ends
// where the tensor does (what is not a whole aligned 2 MiB keeps 4 KiB pages). Smaller ones (a 135M model's every
// projection) are laid end to end in arenas of kArena bytes, each freed when the last tensor in it is: the allocator
// holds only a weak reference to the arena it fills, and `weight_arena_end` (a model's load starts with it) starts a
// new one, so that models loaded one after another share none. Where a mapping fails, or with SHOAL_HUGE_PAGES=0
// (for comparisons), an ordinary allocation.
constexpr size_t kHugePage = size_t(2) << 20, kOwnMapping = size_t(8) << 20, kArena = size_t(32) << 20;

// `len` bytes (a multiple of 4 KiB) of an anonymous mapping starting on a huge page's boundary, advised MADV_HUGEPAGE;
// nullptr where the mapping fails
char* huge_mapping(size_t len) {
  void* raw = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  char* base = static_cast<char*>(raw);
  char* start = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHugePage - 1) / kHugePage * kHugePage);
  if (start > base) munmap(base, start - base);
  if (base + len + kHugePage > start + len) munmap(start + len, base + len + kHugePage - (start + len));
  madvise(start, len, MADV_HUGEPAGE);  // EINVAL where the kernel has no THP: 4 KiB pages, as before
  return start;
}

struct WeightArena {
  char* base;
  size_t used = 0;
  explicit WeightArena(char* b) : base(b) {}
  ~WeightArena() { munmap(base, kArena); }
};
std::mutex arena_lock;
std::weak_ptr<WeightArena> arena_now;

bool huge_pages_off() {
  static const bool off = [] { const char* v = std::getenv("SHOAL_HUGE_PAGES"); return v != nullptr && std::strcmp(v, "0") == 0; }();
  return off;
}

at::Tensor weight_empty(at::IntArrayRef shape) {
  const auto opts = at::TensorOptions().dtype(at::kByte);
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(shape));
  if (bytes == 0 || huge_pages_off()) return at::empty(shape, opts);
  if (bytes >= kOwnMapping) {
    const size_t len = (bytes + 4095) / 4096 * 4096;
    char* p = huge_mapping(len);
    if (p == nullptr) return at::empty(shape, opts);
    return at::from_blob(p, shape, [len](void* q) { munmap(q, len); }, opts);
  }
  const size_t need = (bytes + 63) / 64 * 64;  // each tensor on a cache line of its own
  std::lock_guard<std::mutex> hold(arena_lock);
  std::shared_ptr<WeightArena> arena = arena_now.lock();
  if (arena == nullptr || arena->used + need > kArena) {
    char* p = huge_mapping(kArena);
    if (p == nullptr) return at::empty(shape, opts);
    arena = std::make_shared<WeightArena>(p);
    arena_now = arena;
  }
  char* p = arena->base + arena->used;
  arena->used += need;
  return at::from_blob(p, shape, [arena](void*) {}, opts);  // the arena lives while a tensor in it does
}

// the next weight_empty starts a new arena (a model's load begins)
void weight_arena_end() {
  std::lock_guard<std::mutex> hold(arena_lock);
  arena_now.reset();
}

}  // namespace

TORCH_LIBRARY(shoal_kernels, m) {
  m.def("invariant_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv, Tensor slots, Tensor tables, Tensor row_seq, "
        "Tensor row_pos, float scale, int window, int group, float softcap=0.0) -> Tensor");
  m.def("isa() -> int", &isa);
  m.def("use_isa(int level) -> int", &use_isa);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("row_argmax(Tensor x) -> (Tensor, Tensor)");
  m.def("greedy_rows(Tensor raw, Tensor processed, Tensor? bans=None) -> (Tensor, Tensor)");
  m.def("row_logsumexp(Tensor x) -> Tensor");
  m.def("greedy_head(Tensor x, Tensor w, int n, int t, Tensor? bans=None) -> (int[], float[])");
  m.def("step_rows(Tensor spans, Tensor tables, int block_size, int null) -> (Tensor, Tensor, Tensor)");
  m.def("weight_empty(int[] shape) -> Tensor", &weight_empty);
  m.def("weight_arena_end() -> ()", &weight_arena_end);
  m.def("shm_gather(Tensor part, Tensor slots, Tensor posted, int rank, int n, int[] widths, int slot_bytes, int spin) -> Tensor?",
        &shm_gather);
}

TORCH_LIBRARY_IMPL(shoal_kernels, CPU, m) {
  m.impl("invariant_attention", &invariant_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("row_argmax", &row_argmax);
  m.impl("greedy_rows", &greedy_rows);
  m.impl("row_logsumexp", &row_logsumexp);
  m.impl("greedy_head", &greedy_head);
  m.impl("step_rows", &step_rows);
}

// the level the low-bit matmuls (lowbit.cpp) start from
int64_t shoal_isa_level() { return isa(); }

// ops.h: the ops above for decoder.cpp
at::Tensor shoal_invariant_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv,
                                     const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& row_seq,
                                     const at::Tensor& row_pos, double scale, int64_t window, int64_t group, double softcap) {
  return invariant_attention(q, k, v, kv, slots, tables, row_seq, row_pos, scale, window, group, softcap);
}
at::Tensor shoal_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return rms_norm(x, weight, eps); }
std::tuple<at::Tensor, at::Tensor> shoal_add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                      double eps) {
  return add_rms_norm(x, delta, weight, eps);
}
at::Tensor shoal_rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) { return rope_(x, cos, sin); }
at::Tensor shoal_silu_mul(const at::Tensor& x) { return silu_mul(x); }
at::Tensor shoal_weight_empty(at::IntArrayRef shape) { return weight_empty(shape); }
std::tuple<at::Tensor, at::Tensor, at::Tensor> shoal_step_rows(const at::Tensor& spans, const at::Tensor& tables, int64_t block_size,
                                                               int64_t null) {
  return step_rows(spans, tables, block_size, null);
}
std::tuple<at::Tensor, at::Tensor> shoal_greedy_head(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t t,
                                                     const c10::optional<at::Tensor>& bans) {
  const at::Tensor logits = shoal_gguf_linear(x, w, n, t).to(at::kFloat).contiguous();
  return greedy_rows(logits, logits, bans);
}
