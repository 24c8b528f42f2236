// A GGUF's weight types on shoal's kernels, whatever the mix a file holds (model/formats.py is the registry):
//   gguf_pack    a tensor's blocks as the file stores them -> panels of 16 outputs, once at load;
//   gguf_linear  y = x @ W.T on those panels;
//   gguf_rows    rows of W as float32, computed as gguf-py's `dequantize` computes them (an embedding's lookup,
//                and the tests' reference).
//
// Types of 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) run on lowbit.cpp's kernels, with activations
// rounded per block of 32 (ggml's Q8_0). The K-quants (Q4_K, Q5_K, Q6_K) run here, with activations rounded as
// ggml's Q8_K rounds them: one scale per 256 inputs, and the codes' sums per 16 (`bsums`). A K-quant
// super-block of 256 weights holds 8 blocks of 32 (Q6_K: 16 of 16), each with an integer scale (Q4_K, Q5_K:
// and an integer minimum, 6 bits each) under the super-block's float16 d (and dmin). Per output and
// super-block the kernels sum in int32, exactly:
//   Q4_K, Q5_K  isum = sum_j sc_j * sum(c * q_x over block j),  msum = sum_j mn_j * sum(q_x over block j)
//               y += (d * d_x) * isum, then y -= (dmin * d_x) * msum
//   Q6_K        isum = sum_j sc_j * (sum(c * q_x) - 32 * sum(q_x)) over the 16 blocks of 16 (codes are 32 above)
//               y += (d * d_x) * isum
// as llama.cpp's vec_dot_q*_K_q8_K do. The integers are exact and the float operations (one multiply and one
// fused multiply-add each) are the same on every path, so AVX-512 VNNI, AVX2 and SSE2 give the same bits, and
// one row's outputs do not depend on the other rows: the matmul is row-invariant.
//
// Packed K-quant layout, per (panel of 16 outputs, super-block), so a thread streams its panels in order:
//   8 blocks of 32, each: 4 lines of 64 bytes with the low 4 bits of every code, as lowbit.cpp's Q4 (line L:
//     byte 4o + i holds input 8L + i of output o in its low nibble and 8L + 4 + i in its high nibble), then
//     Q5_K: one line whose byte 4o + i holds the fifth bit of those 8 codes (bit 2L for the low nibble's, 2L + 1
//           for the high nibble's);
//     Q6_K: two lines holding the fifth and sixth bits, lines 0-1's codes in the first and 2-3's in the second,
//           two bits each (bits 4 (L % 2) .. for the low nibble's, 4 (L % 2) + 2 .. for the high nibble's);
//   256 bytes of scales: Q4_K, Q5_K: sc[8 blocks][16 outputs], then the minimums in pairs of blocks
//     mn[4][16 outputs][2] (what vpmaddwd multiplies with a pair of blocks' activation sums); Q6_K: sc[16][16],
//     signed;
//   d[16] as float16 (Q4_K, Q5_K: then dmin[16]).
// 4.63, 5.63 and 6.56 bits a weight, against the file's 4.5, 5.5 and 6.56: the scales are unpacked to bytes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "lowbit.h"
#include "ops.h"

at::Tensor shoal_block32_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, int kind);  // lowbit.cpp

namespace {

using lowbit::few_rows_one_stream;
using lowbit::half_to_float;
using lowbit::kBlock;
using lowbit::kPanel;
using lowbit::pair_sums;
using lowbit::shift_epi16;

constexpr int64_t kSuper = 256;  // QK_K
constexpr int64_t kRows = 4;     // rows of x sharing one pass over a panel
constexpr int64_t kPrefetch = 4096;

// ggml's type ids (gguf.GGMLQuantizationType)
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

bool is_k(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
int bits_of(int64_t t) { return t == Q4_K ? 4 : t == Q5_K ? 5 : 6; }

// the file's block: weights and bytes
int64_t file_block(int64_t t) { return is_k(t) ? kSuper : kBlock; }
int64_t file_bytes(int64_t t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
  }
  TORCH_CHECK(false, "GGUF type ", t, " has no packing on shoal's kernels");
}

// the packed layout of a K-quant (see the top of the file), per (panel, super-block)
struct KLayout {
  int64_t high, codes, scales, d, bytes;
};
constexpr KLayout k_layout(int bits) {
  const int64_t high = bits == 4 ? 0 : bits == 5 ? 64 : 128, codes = 256 + high, scales = 8 * codes;
  return {high, codes, scales, scales + 256, scales + 256 + (bits == 6 ? 32 : 64)};
}

// lowbit.cpp's packed (panel, block) of 32: its bytes, and where d and m lie (m < 0: none)
struct BLayout {
  int kind;  // lowbit.cpp's Kind
  int64_t bytes, d, m;
};
BLayout b_layout(int64_t t) {
  switch (t) {
    case Q4_0: case Q4_1: return {0, 320, 256, 288};
    case Q8_0: return {1, 544, 512, -1};
    case Q5_0: return {2, 352, 320, -1};
    default: return {3, 384, 320, 352};  // Q5_1
  }
}

int64_t packed_bytes(int64_t t) { return is_k(t) ? k_layout(bits_of(t)).bytes : b_layout(t).bytes; }

inline void put_half(uint8_t* p, float v) {
  const uint16_t h = c10::Half(v).x;
  std::memcpy(p, &h, 2);
}

// ---- packing: one (panel, unit) from 16 rows of the file's blocks ----

// Q4_K's and Q5_K's 6-bit scale and minimum of block j (ggml's get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& d, uint8_t& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// the 256 codes of a Q4_K or Q5_K super-block (0..15, 0..31), in input order (Q6_K's: pack_q6_k_codes)
void k_codes(int64_t t, const uint8_t* b, uint8_t* c) {
  const uint8_t* qs = b + (t == Q4_K ? 16 : 48);
  for (int chunk = 0; chunk < 4; ++chunk)  // 64 codes: 32 bytes' low nibbles, then their high nibbles
    for (int l = 0; l < 32; ++l) {
      c[64 * chunk + l] = qs[32 * chunk + l] & 0xF;
      c[64 * chunk + 32 + l] = qs[32 * chunk + l] >> 4;
    }
  if (t == Q5_K)  // the fifth bits: bit j of byte l for code 32 j + l
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) c[32 * j + l] |= ((b[16 + l] >> j) & 1) << 4;
}

// 32 codes of output o into a block's nibble lines (and with 5 bits its high line). Line L's byte 4o + i takes
// codes 8L + i (low nibble) and 8L + 4 + i (high); the high line's bits as the kernels read them. (Q6_K's two high
// lines, bits 4-5 of line L's codes at 4 (L % 2) in line L / 2: pack_q6_k_codes.)
template <int Bits>
void put_codes(uint8_t* blk, int o, const uint8_t* c) {
  for (int L = 0; L < 4; ++L)
    for (int i = 0; i < 4; ++i) {
      const uint8_t a = c[8 * L + i], b = c[8 * L + 4 + i];
      blk[64 * L + 4 * o + i] = static_cast<uint8_t>((a & 0xF) | (b << 4));
      if (Bits == 5) blk[256 + 4 * o + i] |= static_cast<uint8_t>((((a >> 4) & 1) | (((b >> 4) & 1) << 1)) << (2 * L));
    }
}

// a block's code for output o, input e (the inverse of put_codes)
inline int get_code(const uint8_t* blk, int o, int e, int bits) {
  const int L = e / 8, h = (e % 8) / 4, i = e % 4;
  int c = (blk[64 * L + 4 * o + i] >> (4 * h)) & 0xF;
  if (bits == 5) c |= ((blk[256 + 4 * o + i] >> (2 * L + h)) & 1) << 4;
  if (bits == 6) c |= ((blk[256 + 64 * (L / 2) + 4 * o + i] >> (2 * (2 * (L % 2) + h))) & 3) << 4;
  return c;
}

// a block of 32 weights of output o (the file's block b) into its unit `out`, a word of 4 codes at a time: the bytes
// put_codes would write (line L's byte 4o + i: codes 8L + i and 8L + 4 + i), each written whole, and d and m
void pack_b_block(int64_t t, const uint8_t* b, int o, uint8_t* out) {
  const BLayout lay = b_layout(t);
  std::memcpy(out + lay.d + 2 * o, b, 2);  // d as stored
  if (t == Q8_0) {  // the signed codes plus 128, four to a line's word
    for (int g = 0; g < 8; ++g) {
      uint32_t w;
      std::memcpy(&w, b + 2 + 4 * g, 4);
      w ^= 0x80808080u;
      std::memcpy(out + 64 * g + 4 * o, &w, 4);
    }
    return;
  }
  const bool has_m = t == Q4_1 || t == Q5_1, five = t == Q5_0 || t == Q5_1;
  const uint8_t* qs = b + (has_m ? 4 : 2) + (five ? 4 : 0);  // code e < 16: qs[e]'s low nibble, else qs[e - 16]'s high
  for (int L = 0; L < 4; ++L) {
    uint32_t lo, hi;
    std::memcpy(&lo, qs + 8 * (L & 1), 4);
    std::memcpy(&hi, qs + 8 * (L & 1) + 4, 4);
    const int s = L < 2 ? 0 : 4;
    const uint32_t w = ((lo >> s) & 0x0F0F0F0Fu) | (((hi >> s) & 0x0F0F0F0Fu) << 4);
    std::memcpy(out + 64 * L + 4 * o, &w, 4);
  }
  if (five) {  // the fifth bits: byte i of the high line holds codes 8L + i and 8L + 4 + i's at bits 2L and 2L + 1
    uint32_t qh;
    std::memcpy(&qh, b + (has_m ? 4 : 2), 4);
    for (int i = 0; i < 4; ++i) {  // qh's bits i, i + 4, ..., i + 28, gathered in order
      uint32_t x = (qh >> i) & 0x11111111u;
      x = (x | (x >> 3)) & 0x03030303u;
      x = (x | (x >> 6)) & 0x000F000Fu;
      out[256 + 4 * o + i] = static_cast<uint8_t>(x | (x >> 12));
    }
  }
  if (t == Q4_0) put_half(out + lay.m + 2 * o, -8.0f * half_to_float(b));  // -8 d, exact in float16
  else if (has_m) std::memcpy(out + lay.m + 2 * o, b + 2, 2);
}

// a Q6_K super-block of output o into its unit, a word of 4 codes at a time: what k_codes and put_codes<6> give
void pack_q6_k_codes(const uint8_t* b, int o, uint8_t* out) {
  constexpr KLayout lay = k_layout(6);
  const uint8_t *ql = b, *qh = b + 128;
  for (int j = 0; j < 8; ++j) {  // code 32 j + l: ql's nibble and qh's two bits, as k_codes reads them
    const int h = j / 4, q = j % 4, s = 4 * (q >> 1);
    const uint8_t *lo = ql + 64 * h + 32 * (q & 1), *hs = qh + 32 * h;
    uint8_t* blk = out + j * lay.codes;
    uint32_t high[2] = {0, 0};
    for (int L = 0; L < 4; ++L) {
      uint32_t a, c, ha, hb;
      std::memcpy(&a, lo + 8 * L, 4);
      std::memcpy(&c, lo + 8 * L + 4, 4);
      const uint32_t w = ((a >> s) & 0x0F0F0F0Fu) | (((c >> s) & 0x0F0F0F0Fu) << 4);
      std::memcpy(blk + 64 * L + 4 * o, &w, 4);
      std::memcpy(&ha, hs + 8 * L, 4);
      std::memcpy(&hb, hs + 8 * L + 4, 4);
      high[L / 2] |= (((ha >> (2 * q)) & 0x03030303u) | (((hb >> (2 * q)) & 0x03030303u) << 2)) << (4 * (L % 2));
    }
    std::memcpy(blk + 256 + 4 * o, &high[0], 4);
    std::memcpy(blk + 256 + 64 + 4 * o, &high[1], 4);
  }
}

void pack_unit(int64_t t, const uint8_t* raw, int64_t row_bytes, int64_t rows, int64_t p, int64_t u, uint8_t* out) {
  const int64_t bytes = packed_bytes(t);
  const bool full = (p + 1) * kPanel <= rows;
  if (!full || is_k(t)) {  // a block of 32 writes every byte of a full panel's unit; padded outputs read code 0
    std::memset(out, 0, bytes);
    if (t == Q8_0) std::memset(out, 0x80, 512);  // code 0 (stored plus 128)
  }
  for (int o = 0; o < kPanel && p * kPanel + o < rows; ++o) {
    const uint8_t* b = raw + (p * kPanel + o) * row_bytes + u * file_bytes(t);
    if (!is_k(t)) {
      pack_b_block(t, b, o, out);
      continue;
    }
    const int bits = bits_of(t);
    const KLayout lay = k_layout(bits);
    if (t == Q6_K) {
      pack_q6_k_codes(b, o, out);
      for (int s = 0; s < 16; ++s) out[lay.scales + 16 * s + o] = b[192 + s];
      std::memcpy(out + lay.d + 2 * o, b + 208, 2);
    } else {
      uint8_t c[kSuper];
      k_codes(t, b, c);
      for (int j = 0; j < 8; ++j) {
        if (bits == 5) put_codes<5>(out + j * lay.codes, o, c + 32 * j);
        else put_codes<4>(out + j * lay.codes, o, c + 32 * j);
      }
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, mn;
        scale_min_k4(j, b + 4, sc, mn);
        out[lay.scales + 16 * j + o] = sc;
        out[lay.scales + 128 + 32 * (j / 2) + 2 * o + j % 2] = mn;
      }
      std::memcpy(out + lay.d + 2 * o, b, 2);
      std::memcpy(out + lay.d + 32 + 2 * o, b + 2, 2);
    }
  }
}

// raw [rows, row_bytes] uint8, a tensor's blocks as the file holds them -> [panels, units, packed bytes]
// into: where to write the panels (gguf_pack_into: one expert's slice of a stacked tensor), else a new tensor
at::Tensor pack_panels(const at::Tensor& raw, int64_t t, int64_t cols, const at::Tensor* into) {
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "gguf_pack: contiguous uint8 rows expected");
  TORCH_CHECK(cols % file_block(t) == 0, "gguf_pack: ", cols, " inputs are not whole blocks of ", file_block(t));
  const int64_t rows = raw.size(0), U = cols / file_block(t), row_bytes = U * file_bytes(t);
  TORCH_CHECK(raw.size(1) == row_bytes, "gguf_pack: rows of ", row_bytes, " bytes expected, not ", raw.size(1));
  const int64_t P = (rows + kPanel - 1) / kPanel, bytes = packed_bytes(t);
  if (into != nullptr)
    TORCH_CHECK(into->scalar_type() == at::kByte && into->is_contiguous() && into->dim() == 3 && into->size(0) == P &&
                    into->size(1) == U && into->size(2) == bytes, "gguf_pack_into: contiguous uint8 panels [", P, ", ", U, ", ", bytes, "] expected");
  at::Tensor out = into != nullptr ? *into : shoal_weight_empty({P, U, bytes});
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t u = 0; u < U; ++u) pack_unit(t, src, row_bytes, rows, p, u, dst + (p * U + u) * bytes);
  });
  return out;
}

at::Tensor gguf_pack(const at::Tensor& raw, int64_t t, int64_t cols) { return pack_panels(raw, t, cols, nullptr); }
void gguf_pack_into(const at::Tensor& raw, int64_t t, int64_t cols, const at::Tensor& out) { pack_panels(raw, t, cols, &out); }

// Row r of the packed weights as float32, each weight computed as gguf-py's dequantize computes it (products
// rounded before the sum, so no contraction into a fused multiply-add).
__attribute__((optimize("fp-contract=off"))) void unpack_row(int64_t t, const uint8_t* w, int64_t U, int64_t r, float* y) {
  const int64_t p = r / kPanel, bytes = packed_bytes(t);
  const int o = static_cast<int>(r % kPanel);
  for (int64_t u = 0; u < U; ++u) {
    const uint8_t* blk = w + (p * U + u) * bytes;
    if (!is_k(t)) {
      const BLayout lay = b_layout(t);
      const float d = half_to_float(blk + lay.d + 2 * o);
      for (int e = 0; e < 32; ++e) {
        float& out = y[32 * u + e];
        if (t == Q8_0) {
          out = d * static_cast<float>(static_cast<int>(blk[64 * (e / 4) + 4 * o + e % 4]) - 128);
        } else {
          const int c = get_code(blk, o, e, t == Q5_0 || t == Q5_1 ? 5 : 4);
          if (t == Q4_0 || t == Q5_0) out = d * static_cast<float>(c - (t == Q4_0 ? 8 : 16));
          else out = d * static_cast<float>(c) + half_to_float(blk + lay.m + 2 * o);
        }
      }
      continue;
    }
    const int bits = bits_of(t);
    const KLayout lay = k_layout(bits);
    const float d = half_to_float(blk + lay.d + 2 * o);
    for (int e = 0; e < kSuper; ++e) {
      const int j = e / 32, c = get_code(blk + j * lay.codes, o, e % 32, bits);
      float& out = y[kSuper * u + e];
      if (t == Q6_K) {
        const float s = d * static_cast<float>(static_cast<int8_t>(blk[lay.scales + 16 * (e / 16) + o]));
        out = s * static_cast<float>(c - 32);
      } else {
        const float s = d * static_cast<float>(blk[lay.scales + 16 * j + o]);
        const float m = half_to_float(blk + lay.d + 32 + 2 * o) * static_cast<float>(blk[lay.scales + 128 + 32 * (j / 2) + 2 * o + j % 2]);
        out = s * static_cast<float>(c) - m;
      }
    }
  }
}

// rows `ids` of a packed [P, U, bytes] tensor with `cols` inputs -> [len(ids), cols] float32
at::Tensor gguf_rows(const at::Tensor& w, const at::Tensor& ids, int64_t t, int64_t cols) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() && w.size(2) == packed_bytes(t),
              "gguf_rows: packed weights of type ", t, " expected");
  const int64_t U = cols / file_block(t), P = w.size(0);
  TORCH_CHECK(w.size(1) == U, "gguf_rows: ", cols, " inputs do not match the packed weights");
  at::Tensor idx = ids.to(at::kLong).contiguous().view(-1);
  const int64_t n = idx.numel();
  at::Tensor y = at::empty({n, cols}, w.options().dtype(at::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < P * kPanel, "gguf_rows: row ", ip[i], " out of range");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) unpack_row(t, wp, U, ip[i], yp + i * cols);
  });
  return y;
}

// ---- activations rounded as ggml's Q8_K: per 256 inputs one scale, int8 codes, and the codes' sums per 16 ----

struct Q8K {
  const int8_t* q;       // [M, K]
  const float* d;        // [M, S]
  const int16_t* bs;     // [M, S, 16]
  const int32_t* pairs;  // [M, S, 4]: blocks 2k and 2k + 1's sums (of 32 codes) as two int16, for vpmaddwd
  const int32_t* m32;    // [M, S, 16]: per block of 16, -32 times the sums of the codes at inputs 4i, 4i + 1 and at
                         // 4i + 2, 4i + 3, as two int16 (where AVX2's Q6_K sums of an output's lane pair start)
  int64_t K, S;
};

// a row's 256 inputs from `from` as float32 (exact for every input dtype)
void widen_inputs(const char* row, int64_t from, at::ScalarType t, float* v) {
  if (t == at::kBFloat16) {
    const auto* x = reinterpret_cast<const c10::BFloat16*>(row) + from;
    for (int i = 0; i < kSuper; ++i) v[i] = static_cast<float>(x[i]);
  } else if (t == at::kHalf) {
    const auto* x = reinterpret_cast<const c10::Half*>(row) + from;
    for (int i = 0; i < kSuper; ++i) v[i] = static_cast<float>(x[i]);
  } else {
    std::memcpy(v, reinterpret_cast<const float*>(row) + from, kSuper * sizeof(float));
  }
}

// quantize_row_q8_K_ref with the sign of the scale taken from the largest magnitude rather than the value
// there: the codes and the scale both change sign where ggml's differ, so every product d * q and every sum
// of them is the same number. Compiled once for every CPU, so every path rounds the same codes; the loops are
// written in integers where they can be (the largest magnitude as the largest bit pattern of |v|, a NaN or an
// infinity as an exponent of all ones), so the compiler vectorizes them without changing a result.
__attribute__((optimize("fp-contract=off")))
void quantize_q8k(const char* x, int64_t stride, at::ScalarType t, int64_t r0, int64_t r1, int8_t* q, float* d, int16_t* bs,
                  int32_t* pairs, int32_t* m32, int64_t K) {
  const int64_t S = K / kSuper;
  alignas(64) float v[kSuper];
  for (int64_t r = r0; r < r1; ++r) {
    const char* row = x + r * stride;
    for (int64_t s = 0; s < S; ++s) {
      widen_inputs(row, s * kSuper, t, v);
      uint32_t top = 0, special = 0;
      for (int i = 0; i < kSuper; ++i) {
        uint32_t bits;
        std::memcpy(&bits, v + i, 4);
        bits &= 0x7fffffffu;
        top = std::max(top, bits);
        special |= (bits & 0x7f800000u) == 0x7f800000u;
      }
      float amax;
      std::memcpy(&amax, &top, 4);
      const int64_t i = r * S + s;
      int8_t* qs = q + r * K + s * kSuper;
      int16_t* sums = bs + i * 16;
      if (special || amax == 0.0f) {
        // zeros give zeros; a NaN or infinity reaches the scale, so the row's outputs are not finite and the
        // sampler fails that request alone (never laundered into codes)
        std::memset(qs, 0, kSuper);
        std::memset(sums, 0, 16 * sizeof(int16_t));
        std::memset(pairs + i * 4, 0, 4 * sizeof(int32_t));
        std::memset(m32 + i * 16, 0, 16 * sizeof(int32_t));
        d[i] = special ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
        continue;
      }
      const float iscale = 127.0f / amax;
      for (int g = 0; g < 16; ++g) {
        int sum = 0, even = 0;
        for (int e = 16 * g; e < 16 * g + 16; ++e) {
          const float f = iscale * v[e] + 12582912.0f;  // round to nearest even (ggml's nearest_int)
          int32_t bits;
          std::memcpy(&bits, &f, 4);
          const int c = std::min(127, (bits & 0x007fffff) - 0x00400000);
          qs[e] = static_cast<int8_t>(c);
          sum += c;
          even += (e & 2) ? 0 : c;
        }
        sums[g] = static_cast<int16_t>(sum);
        m32[i * 16 + g] = static_cast<int32_t>(static_cast<uint16_t>(-32 * even) |
                                               (static_cast<uint32_t>(static_cast<uint16_t>(-32 * (sum - even))) << 16));
      }
      for (int k = 0; k < 4; ++k) {
        const int lo = sums[4 * k] + sums[4 * k + 1], hi = sums[4 * k + 2] + sums[4 * k + 3];
        pairs[i * 4 + k] = static_cast<int32_t>(static_cast<uint16_t>(lo) | (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
      }
      d[i] = 1.0f / iscale;
    }
  }
}

struct KArgs {
  Q8K x;
  const uint8_t* w;
  float* y;
  int64_t M, N, P;
};

// ---- AVX-512 VNNI: a panel's 16 outputs in one vector; NP adjacent panels share each activation broadcast ----

template <int Bits, int R, int NP>
LOWBIT_VNNI void kpanel_vnni(const KArgs& a, int64_t p, int64_t r0) {
  constexpr KLayout lay = k_layout(Bits);
  const int64_t S = a.x.S, K = a.x.K;
  const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10), two = _mm512_set1_epi8(0x30);
  __m512 acc[NP][R];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < R; ++r) acc[q][r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* sb[NP];
    for (int q = 0; q < NP; ++q) sb[q] = a.w + ((p + q) * S + s) * lay.bytes;
    if (r0 == kRows)  // the second rows' pass, which reads from cache: bring the next panels to L2 (8 rows 13% faster)
      for (int q = 0; q < NP; ++q)
        for (int64_t l = 0; l < lay.bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(sb[q] + NP * S * lay.bytes + l), _MM_HINT_T1);
    __m512i isum[NP][R];
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < R; ++r) isum[q][r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i t[NP][R];
      for (int L = 0; L < 4; ++L) {
        if (Bits < 6 ? L == 0 : L % 2 == 0) {  // a block of 32 (Q6_K: of 16) starts: its sums start from zero
          for (int r = 0; r < R; ++r) {
            // Q6_K's codes are 32 above: start from -32 * sum(q_x) of the block of 16
            const int32_t start = Bits == 6 ? -32 * a.x.bs[((r0 + r) * S + s) * 16 + 2 * j + L / 2] : 0;
            for (int q = 0; q < NP; ++q) t[q][r] = _mm512_set1_epi32(start);
          }
        }
        __m512i lo[NP], hi[NP];
        for (int q = 0; q < NP; ++q) {
          const uint8_t* cb = sb[q] + j * lay.codes;
          if (L == 0 && r0 == 0)  // the first rows' pass asks for what comes next
            for (int64_t l = 0; l < lay.codes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(cb + kPrefetch + l), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(cb + 64 * L);
          lo[q] = _mm512_and_si512(v, low4);
          hi[q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if constexpr (Bits == 5) {
            const __m512i f = _mm512_loadu_si512(cb + 256);
            lo[q] = _mm512_or_si512(lo[q], _mm512_and_si512(shift_epi16(f, 4 - 2 * L), fifth));
            hi[q] = _mm512_or_si512(hi[q], _mm512_and_si512(shift_epi16(f, 3 - 2 * L), fifth));
          }
          if constexpr (Bits == 6) {
            const __m512i f = _mm512_loadu_si512(cb + 256 + 64 * (L / 2));
            lo[q] = _mm512_or_si512(lo[q], _mm512_and_si512(shift_epi16(f, 4 - 4 * (L % 2)), two));
            hi[q] = _mm512_or_si512(hi[q], _mm512_and_si512(shift_epi16(f, 2 - 4 * (L % 2)), two));
          }
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.x.q + (r0 + r) * K + s * kSuper + 32 * j + 8 * L;
          int32_t x0, x1;
          std::memcpy(&x0, xq, 4);
          std::memcpy(&x1, xq + 4, 4);
          const __m512i b0 = _mm512_set1_epi32(x0), b1 = _mm512_set1_epi32(x1);
          for (int q = 0; q < NP; ++q) {
            t[q][r] = _mm512_dpbusd_epi32(t[q][r], lo[q], b0);
            t[q][r] = _mm512_dpbusd_epi32(t[q][r], hi[q], b1);
          }
        }
        if (Bits < 6 ? L == 3 : L % 2 == 1) {  // the block ends: times its scales
          const int64_t sub = Bits < 6 ? j : 2 * j + L / 2;
          for (int q = 0; q < NP; ++q) {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb[q] + lay.scales + 16 * sub));
            const __m512i sc = Bits == 6 ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
            for (int r = 0; r < R; ++r) isum[q][r] = _mm512_add_epi32(isum[q][r], _mm512_mullo_epi32(t[q][r], sc));
          }
        }
      }
    }
    for (int q = 0; q < NP; ++q) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb[q] + lay.d)));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * S + s;
        const __m512 dx = _mm512_set1_ps(a.x.d[i]);
        acc[q][r] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[q][r]), acc[q][r]);
        if constexpr (Bits < 6) {
          __m512i msum = _mm512_setzero_si512();
          for (int k = 0; k < 4; ++k) {
            const __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb[q] + lay.scales + 128 + 32 * k)));
            msum = _mm512_add_epi32(msum, _mm512_madd_epi16(mn, _mm512_set1_epi32(a.x.pairs[i * 4 + k])));
          }
          const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb[q] + lay.d + 32)));
          acc[q][r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum), acc[q][r]);
        }
      }
    }
  }
  for (int q = 0; q < NP; ++q) {
    const int64_t n = std::min(kPanel, a.N - (p + q) * kPanel);
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(a.y + (r0 + r) * a.N + (p + q) * kPanel, static_cast<__mmask16>((1u << n) - 1), acc[q][r]);
  }
}

// ---- AVX2: both halves of 8 outputs per activation broadcast; vpmaddubsw, then vpmaddwd with the scales ----
// A pair sum of codes times activations is at most 2 * 15 * 127 = 3,810 (Q4_K) and 7,874 (Q5_K): an int16 sum
// holds 8 and 4 of them, so Q4_K widens once a block of 32 and Q5_K after every two lines. Q6_K's sums start from
// -32 times the sum of the activations they will meet (`m32`, from the rounding), so they hold sum((c - 32) * q_x),
// at most 8 * 32 * 127 = 32,512 in magnitude at every step of a block of 16 (two lines): it widens once a block,
// and needs no correction after. The widening multiplies by the block's scale, both lanes of an output's pair
// holding it.

// the scales of outputs 8h..8h+7 (8 bytes at p) as int16 pairs [s0, s0, s1, s1, ...]
LOWBIT_AVX2 inline __m256i scale_pairs(const uint8_t* p) {
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), dup));
}

// NH halves of the panel from half h0: both in one pass (each broadcast feeds two vpmaddubsw) or one (fewer
// registers: kpanel_avx2_rows says which type takes which).
template <int Bits, int R, int NH>
LOWBIT_AVX2 void kpanel_avx2(const KArgs& a, int64_t p, int64_t r0, int h0) {
  constexpr KLayout lay = k_layout(Bits);
  constexpr int kWiden = Bits == 4 ? 4 : 2;  // lines per int16 sum
  const int64_t S = a.x.S, K = a.x.K;
  const __m256i low4 = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10), two = _mm256_set1_epi8(0x30);
  __m256 acc[R][NH];
  for (int r = 0; r < R; ++r)
    for (int hh = 0; hh < NH; ++hh) acc[r][hh] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* sb = a.w + (p * S + s) * lay.bytes;
    if (h0 == 0 && r0 == 0 && R > 1)  // the first rows' pass: ask for all that comes next (one row: as fast without)
      for (int64_t l = 0; l < lay.bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(sb + kPrefetch + l), _MM_HINT_T0);
    if (h0 == 0 && r0 == kRows)  // the second rows' pass, which reads from cache: bring the next pair of panels to L2
      for (int64_t l = 0; l < lay.bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(sb + 2 * S * lay.bytes + l), _MM_HINT_T1);
    __m256i isum[R][NH];
    for (int r = 0; r < R; ++r)
      for (int hh = 0; hh < NH; ++hh) isum[r][hh] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const uint8_t* cb = sb + j * lay.codes;
      __m256i s16[R][NH];
      for (int L = 0; L < 4; ++L) {
        if (L % kWiden == 0)
          for (int r = 0; r < R; ++r) {
            const __m256i start = Bits == 6 ? _mm256_set1_epi32(a.x.m32[((r0 + r) * S + s) * 16 + 2 * j + L / 2]) : _mm256_setzero_si256();
            for (int hh = 0; hh < NH; ++hh) s16[r][hh] = start;
          }
        __m256i lo[NH], hi[NH];
        for (int hh = 0; hh < NH; ++hh) {
          const int h = h0 + hh;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 64 * L + 32 * h));
          lo[hh] = _mm256_and_si256(v, low4);
          hi[hh] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (Bits == 5) {
            const __m256i f = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 256 + 32 * h));
            lo[hh] = _mm256_or_si256(lo[hh], _mm256_and_si256(shift_epi16(f, 4 - 2 * L), fifth));
            hi[hh] = _mm256_or_si256(hi[hh], _mm256_and_si256(shift_epi16(f, 3 - 2 * L), fifth));
          }
          if constexpr (Bits == 6) {
            const __m256i f = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 256 + 64 * (L / 2) + 32 * h));
            lo[hh] = _mm256_or_si256(lo[hh], _mm256_and_si256(shift_epi16(f, 4 - 4 * (L % 2)), two));
            hi[hh] = _mm256_or_si256(hi[hh], _mm256_and_si256(shift_epi16(f, 2 - 4 * (L % 2)), two));
          }
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.x.q + (r0 + r) * K + s * kSuper + 32 * j + 8 * L;
          int32_t x0, x1;
          std::memcpy(&x0, xq, 4);
          std::memcpy(&x1, xq + 4, 4);
          const __m256i b0 = _mm256_set1_epi32(x0), b1 = _mm256_set1_epi32(x1);
          for (int hh = 0; hh < NH; ++hh) {
            s16[r][hh] = _mm256_add_epi16(s16[r][hh], _mm256_maddubs_epi16(lo[hh], b0));
            lowbit::in_register<R>(s16[r][hh]);
            s16[r][hh] = _mm256_add_epi16(s16[r][hh], _mm256_maddubs_epi16(hi[hh], b1));
            lowbit::in_register<R>(s16[r][hh]);
          }
        }
        if (L % kWiden == kWiden - 1) {
          const int64_t sub = Bits < 6 ? j : 2 * j + L / 2;
          for (int hh = 0; hh < NH; ++hh) {
            const __m256i sc = scale_pairs(sb + lay.scales + 16 * sub + 8 * (h0 + hh));
            for (int r = 0; r < R; ++r) isum[r][hh] = _mm256_add_epi32(isum[r][hh], _mm256_madd_epi16(s16[r][hh], sc));
          }
        }
      }
    }
    for (int hh = 0; hh < NH; ++hh) {
      const int h = h0 + hh;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + lay.d + 16 * h)));
      __m256i mn[4];
      __m256 dmin = _mm256_setzero_ps();
      if constexpr (Bits < 6) {  // the minimums of block pairs, read once for every row
        for (int k = 0; k < 4; ++k)
          mn[k] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + lay.scales + 128 + 32 * k + 16 * h)));
        dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + lay.d + 32 + 16 * h)));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * S + s;
        const __m256 dx = _mm256_set1_ps(a.x.d[i]);
        acc[r][hh] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum[r][hh]), acc[r][hh]);
        if constexpr (Bits < 6) {
          __m256i msum = _mm256_setzero_si256();
          for (int k = 0; k < 4; ++k) msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mn[k], _mm256_set1_epi32(a.x.pairs[i * 4 + k])));
          acc[r][hh] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(msum), acc[r][hh]);
        }
      }
    }
  }
  const int64_t n = std::min<int64_t>(8 * NH, a.N - p * kPanel - 8 * h0);  // the valid outputs of these halves
  for (int r = 0; r < R && n > 0; ++r) {
    float out[8 * NH];
    for (int hh = 0; hh < NH; ++hh) _mm256_storeu_ps(out + 8 * hh, acc[r][hh]);
    std::memcpy(a.y + (r0 + r) * a.N + p * kPanel + 8 * h0, out, n * sizeof(float));
  }
}

// ---- x86-64 baseline (SSE2): 16-bit products summed in pairs by pmaddwd, the scales in scalar code ----

template <int Bits, int R>
void kpanel_sse2(const KArgs& a, int64_t p, int64_t r0) {
  constexpr KLayout lay = k_layout(Bits);
  const int64_t S = a.x.S, K = a.x.K;
  const __m128i low4 = _mm_set1_epi8(0x0F), zero = _mm_setzero_si128();
  const __m128i mask = _mm_set1_epi8(Bits == 5 ? 0x10 : 0x30);
  float acc[R][kPanel] = {};
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* sb = a.w + (p * S + s) * lay.bytes;
    int32_t isum[R][kPanel] = {};
    for (int j = 0; j < 8; ++j) {
      const uint8_t* cb = sb + j * lay.codes;
      __m128i xs[R][8];  // per row, inputs 4k..4k+3 of the block as int16, twice: what one output's four codes meet
      for (int r = 0; r < R; ++r) lowbit::widen_block(a.x.q + (r0 + r) * K + s * kSuper + 32 * j, xs[r]);
      for (int g = 0; g < 4; ++g) {  // outputs 4g..4g+3: bytes 16g..16g+15 of every line
        __m128i s01[R][2], s23[R][2];  // per block of 16 (one for Q4_K and Q5_K's blocks of 32)
        for (int r = 0; r < R; ++r) s01[r][0] = s01[r][1] = s23[r][0] = s23[r][1] = zero;
        for (int L = 0; L < 4; ++L) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + 64 * L + 16 * g));
          __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
          if (Bits == 5) {
            const __m128i f = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + 256 + 16 * g));
            lo = _mm_or_si128(lo, _mm_and_si128(shift_epi16(f, 4 - 2 * L), mask));
            hi = _mm_or_si128(hi, _mm_and_si128(shift_epi16(f, 3 - 2 * L), mask));
          }
          if (Bits == 6) {
            const __m128i f = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + 256 + 64 * (L / 2) + 16 * g));
            lo = _mm_or_si128(lo, _mm_and_si128(shift_epi16(f, 4 - 4 * (L % 2)), mask));
            hi = _mm_or_si128(hi, _mm_and_si128(shift_epi16(f, 2 - 4 * (L % 2)), mask));
          }
          const __m128i lo01 = _mm_unpacklo_epi8(lo, zero), lo23 = _mm_unpackhi_epi8(lo, zero);
          const __m128i hi01 = _mm_unpacklo_epi8(hi, zero), hi23 = _mm_unpackhi_epi8(hi, zero);
          const int k = Bits == 6 ? L / 2 : 0;
          for (int r = 0; r < R; ++r) {
            s01[r][k] = _mm_add_epi32(s01[r][k], _mm_add_epi32(_mm_madd_epi16(lo01, xs[r][2 * L]), _mm_madd_epi16(hi01, xs[r][2 * L + 1])));
            s23[r][k] = _mm_add_epi32(s23[r][k], _mm_add_epi32(_mm_madd_epi16(lo23, xs[r][2 * L]), _mm_madd_epi16(hi23, xs[r][2 * L + 1])));
          }
        }
        for (int r = 0; r < R; ++r)
          for (int k = 0; k < (Bits == 6 ? 2 : 1); ++k) {
            int32_t dot[4];
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dot), pair_sums(s01[r][k], s23[r][k]));
            const int64_t sub = Bits == 6 ? 2 * j + k : j;
            const int32_t off = Bits == 6 ? 32 * a.x.bs[((r0 + r) * S + s) * 16 + sub] : 0;
            for (int o = 0; o < 4; ++o) {
              const uint8_t raw = sb[lay.scales + 16 * sub + 4 * g + o];
              const int32_t sc = Bits == 6 ? static_cast<int8_t>(raw) : raw;
              isum[r][4 * g + o] += sc * (dot[o] - off);
            }
          }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * S + s;
      const float dx = a.x.d[i];
      for (int o = 0; o < kPanel; ++o) {
        const float d = half_to_float(sb + lay.d + 2 * o);
        acc[r][o] = std::fma(d * dx, static_cast<float>(isum[r][o]), acc[r][o]);
        if (Bits < 6) {
          int32_t msum = 0;
          for (int jj = 0; jj < 8; ++jj) {
            const int16_t* b = a.x.bs + i * 16 + 2 * jj;
            msum += sb[lay.scales + 128 + 32 * (jj / 2) + 2 * o + jj % 2] * (b[0] + b[1]);
          }
          const float dmin = half_to_float(sb + lay.d + 32 + 2 * o);
          acc[r][o] = std::fma(-(dmin * dx), static_cast<float>(msum), acc[r][o]);
        }
      }
    }
  }
  const int64_t n = std::min(kPanel, a.N - p * kPanel);
  for (int r = 0; r < R; ++r) std::memcpy(a.y + (r0 + r) * a.N + p * kPanel, acc[r], n * sizeof(float));
}

template <int Bits, int NP>
void kpanels_vnni(const KArgs& a, int64_t p, int64_t r0, int64_t nr) {
  switch (nr) {
    case 4: return kpanel_vnni<Bits, 4, NP>(a, p, r0);
    case 3: return kpanel_vnni<Bits, 3, NP>(a, p, r0);
    case 2: return kpanel_vnni<Bits, 2, NP>(a, p, r0);
    default: return kpanel_vnni<Bits, 1, NP>(a, p, r0);
  }
}

// AVX2 at several rows: Q4_K and Q6_K take both halves in one pass (each activation broadcast feeds two
// vpmaddubsw: 1.3-1.7x and 1.1-1.3x a half at a time, from 8 to 128 rows); Q5_K, whose fifth-bit lines need two
// more registers a half, a half at a time (as fast or 10% faster). benchmarks/NOTES.md, twenty-ninth round.
template <int Bits, int R>
void kpanel_avx2_rows(const KArgs& a, int64_t p, int64_t r0) {
  if constexpr (Bits == 5) return kpanel_avx2<Bits, R, 1>(a, p, r0, 0), kpanel_avx2<Bits, R, 1>(a, p, r0, 1);
  else return kpanel_avx2<Bits, R, 2>(a, p, r0, 0);
}

template <int Bits>
void kpanel(const KArgs& a, int64_t p, int64_t r0, int64_t nr, int path) {
  if (path == 2) {
    switch (nr) {
      case 4: return kpanel_avx2_rows<Bits, 4>(a, p, r0);
      case 3: return kpanel_avx2_rows<Bits, 3>(a, p, r0);
      case 2: return kpanel_avx2_rows<Bits, 2>(a, p, r0);
      default: return kpanel_avx2<Bits, 1, 2>(a, p, r0, 0);
    }
  }
  switch (nr) {
    case 4: return kpanel_sse2<Bits, 4>(a, p, r0);
    case 3: return kpanel_sse2<Bits, 3>(a, p, r0);
    case 2: return kpanel_sse2<Bits, 2>(a, p, r0);
    default: return kpanel_sse2<Bits, 1>(a, p, r0);
  }
}

// panels [p, p + np), np 1 or 2, for rows [r0, r0 + nr). On VNNI, both panels in one pass (each activation broadcast
// feeds both); on an AMD CPU (lowbit.h few_rows_one_stream) one or two rows, which wait on memory, not on the
// multiplies, take a panel at a time, so the weights come in one stream: on a Zen 4 15-25% faster for a decode's
// one-row experts, 10-15% for one row's dense Q4_K projections (benchmarks/NOTES.md, thirty-third round). The bits
// are the same: panels never mix.
template <int Bits>
void kpanels(const KArgs& a, int64_t p, int64_t np, int64_t r0, int64_t nr, int path) {
  if (path == 3 && (np == 1 || (nr <= 2 && few_rows_one_stream()))) {
    for (int64_t q = 0; q < np; ++q) kpanels_vnni<Bits, 1>(a, p + q, r0, nr);
    return;
  }
  if (path == 3) return kpanels_vnni<Bits, 2>(a, p, r0, nr);
  for (int64_t q = 0; q < np; ++q) kpanel<Bits>(a, p + q, r0, nr, path);
}

// Every row of x [M, K] rounded as ggml's Q8_K (quantize_q8k), into `scratch` (allocated here, kept by the caller)
Q8K rounded_rows(const at::Tensor& x, at::Tensor& scratch) {
  const int64_t M = x.size(0), K = x.size(1), S = K / kSuper;
  scratch = at::empty({M * S * (4 + 16 + 64 + 32) + M * K}, x.options().dtype(at::kByte));
  float* xd = reinterpret_cast<float*>(scratch.data_ptr<uint8_t>());
  int32_t* xpairs = reinterpret_cast<int32_t*>(xd + M * S);
  int32_t* xm32 = xpairs + M * S * 4;
  int16_t* xbs = reinterpret_cast<int16_t*>(xm32 + M * S * 16);
  int8_t* xq = reinterpret_cast<int8_t*>(xbs + M * S * 16);
  const char* xp = static_cast<const char*>(x.data_ptr());
  const int64_t stride = x.stride(0) * x.element_size();
  const at::ScalarType st = x.scalar_type();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) { quantize_q8k(xp, stride, st, r0, r1, xq, xd, xbs, xpairs, xm32, K); });
  return {xq, xd, xbs, xpairs, xm32, K, S};
}

// Rows from r of rounded rows
Q8K rows_from(const Q8K& x, int64_t r) {
  return {x.q + r * x.K, x.d + r * x.S, x.bs + r * x.S * 16, x.pairs + r * x.S * 4, x.m32 + r * x.S * 16, x.K, x.S};
}

// panels [p, p + 2) (or the last one) for every row of a.x, kRows at a time
void panel_pair(const KArgs& a, int64_t p, int bits, int path) {
  for (int64_t r = 0; r < a.M; r += kRows) {
    const int64_t nr = std::min(kRows, a.M - r), np = std::min<int64_t>(2, a.P - p);
    if (bits == 4) kpanels<4>(a, p, np, r, nr, path);
    else if (bits == 5) kpanels<5>(a, p, np, r, nr, path);
    else kpanels<6>(a, p, np, r, nr, path);
  }
}

at::Tensor k_linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t t) {
  const at::ScalarType st = x.scalar_type();
  const int64_t M = x.size(0), K = x.size(1), S = K / kSuper, P = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(K % kSuper == 0, "gguf_linear: a K-quant's inputs must be a multiple of ", kSuper, ", not ", K);
  TORCH_CHECK(w.size(1) == S, "gguf_linear: packed weights [", P, ", ", S, ", ", packed_bytes(t), "] expected");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y.to(st);
  at::Tensor scratch;
  const KArgs a{rounded_rows(x, scratch), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, P};
  const int path = lowbit::matmul_path(), bits = bits_of(t);
  // threads take pairs of panels (a thread's share stays contiguous in memory, so on AVX2 the second group of rows
  // over a pair can fetch the thread's next pair while it computes from cache: 8 rows 22% faster from memory)
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t p = 2 * q0; p < std::min(P, 2 * q1); p += 2) panel_pair(a, p, bits, path);
  });
  return st == at::kFloat ? y : y.to(st);
}

// x [M, K] (contiguous rows; float32, bfloat16 or float16), w packed by gguf_pack from GGUF type t -> [M, n] in x's dtype
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t t) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gguf_linear: x must be [rows, inputs] with contiguous rows");
  const at::ScalarType st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "gguf_linear: float32, bfloat16 or float16 inputs, not ", st);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 && w.size(0) == (n + kPanel - 1) / kPanel &&
                  w.size(2) == packed_bytes(t), "gguf_linear: packed weights of type ", t, " for ", n, " outputs expected");
  if (is_k(t)) return k_linear(x, w, n, t);
  return shoal_block32_linear(x, w, n, b_layout(t).kind);
}

// A sparse MLP's experts in one call: x [M, K] holds counts[e] rows for expert e, in expert order; w [E, P, S, bytes]
// every expert's panels of type t, stacked -> y [M, n], each row multiplied by its expert's weights, as gguf_linear
// would multiply it (the same rounding of each row, the same kernels: the same bits). K-quants round every row once
// and share one parallel region over (expert, pair of panels); the 32-weight types call their kernel per expert.
at::Tensor gguf_grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts, int64_t N, int64_t t) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gguf_grouped_linear: x must be [rows, inputs] with contiguous rows");
  const at::ScalarType st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "gguf_grouped_linear: float32, bfloat16 or float16 inputs, not ", st);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 4 && w.size(1) == (N + kPanel - 1) / kPanel &&
                  w.size(3) == packed_bytes(t), "gguf_grouped_linear: stacked packed weights of type ", t, " for ", N, " outputs expected");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 1 && counts.size(0) == w.size(0) && counts.is_contiguous(),
              "gguf_grouped_linear: one row count per expert expected");
  const int64_t E = w.size(0), M = x.size(0), K = x.size(1), P = w.size(1);
  const int64_t* cnt = counts.data_ptr<int64_t>();
  std::vector<int64_t> experts, starts;  // the experts with rows, and where their rows start
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(cnt[e] >= 0, "gguf_grouped_linear: a negative row count");
    if (cnt[e] > 0) experts.push_back(e), starts.push_back(total);
    total += cnt[e];
  }
  TORCH_CHECK(total == M, "gguf_grouped_linear: the counts add up to ", total, " rows, x has ", M);
  const int64_t expert_bytes = w.numel() / E;
  if (!is_k(t)) {
    at::Tensor y = at::empty({M, N}, x.options());
    for (size_t i = 0; i < experts.size(); ++i) {
      const int64_t e = experts[i], n = cnt[e];
      y.narrow(0, starts[i], n).copy_(shoal_block32_linear(x.narrow(0, starts[i], n), w.select(0, e), N, b_layout(t).kind));
    }
    return y;
  }
  const int64_t S = K / kSuper;
  TORCH_CHECK(K % kSuper == 0 && w.size(2) == S, "gguf_grouped_linear: a K-quant's inputs must be a multiple of ", kSuper);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y.to(st);
  at::Tensor scratch;
  const Q8K xr = rounded_rows(x, scratch);
  const int path = lowbit::matmul_path(), bits = bits_of(t);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t Q = (P + 1) / 2, items = static_cast<int64_t>(experts.size()) * Q;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t j = i / Q, e = experts[j], r0 = starts[j];
      panel_pair(KArgs{rows_from(xr, r0), wp + e * expert_bytes, yp + r0 * N, cnt[e], N, P}, 2 * (i % Q), bits, path);
    }
  });
  return st == at::kFloat ? y : y.to(st);
}

int64_t gguf_packed_bytes(int64_t t) { return packed_bytes(t); }

}  // namespace

at::Tensor shoal_gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t t) { return gguf_linear(x, w, n, t); }
at::Tensor shoal_gguf_rows(const at::Tensor& w, const at::Tensor& ids, int64_t t, int64_t cols) { return gguf_rows(w, ids, t, cols); }
at::Tensor shoal_gguf_grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts, int64_t n, int64_t t) {
  return gguf_grouped_linear(x, w, counts, n, t);
}

TORCH_LIBRARY_FRAGMENT(shoal_kernels, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int n, int type) -> Tensor");
  m.def("gguf_grouped_linear(Tensor x, Tensor w, Tensor counts, int n, int type) -> Tensor");
  m.def("gguf_pack(Tensor raw, int type, int cols) -> Tensor");
  m.def("gguf_pack_into(Tensor raw, int type, int cols, Tensor(a!) out) -> ()");
  m.def("gguf_rows(Tensor w, Tensor ids, int type, int cols) -> Tensor");
  m.def("gguf_packed_bytes(int type) -> int", &gguf_packed_bytes);
}

TORCH_LIBRARY_IMPL(shoal_kernels, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_grouped_linear", &gguf_grouped_linear);
  m.impl("gguf_pack", &gguf_pack);
  m.impl("gguf_pack_into", &gguf_pack_into);
  m.impl("gguf_rows", &gguf_rows);
}
