// A sparse MLP's own steps around its grouped expert matmuls (kquants.cpp gguf_grouped_linear), so a layer of
// experts is a few native calls, not some twenty torch ops on small tensors (model/layers.py MoE, Router):
//   row_linear   y = x @ W.T in float32: the router's logits. Each output is one 16-lane accumulation, lane l taking
//                inputs l, l + 16, ... by FMA in order, then vec.h's fixed lane tree: the same bits whatever the
//                batch (row-invariant) and the tiling, on AVX-512 and AVX2 alike (the baseline rounds twice);
//   moe_route    each token's top-k experts from its logits (the softmax, ties to the lower expert), their weights
//                (renormalized where asked), and the step's (token, expert) pairs grouped by expert: the rows to
//                gather, each expert's row count, each pair's weight, and where each token's pairs went;
//   moe_combine  each token's k expert outputs times their weights, added in ascending expert order: as torch adds
//                them (layers.MoE's reference path), one multiply and one add each, never fused.
// A row of any of them is computed by one thread in one order of operations, so nothing depends on the batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

// ---- row_linear ----

struct LinArgs {
  const float* x; const float* w; float* y;  // x [T, K] (rows x_row apart), w [N, K] contiguous, y [T, N]
  int64_t T, N, K, x_row;
};

// y for rows [r0, r0 + R) and outputs [n0, n0 + C): R x C accumulators over K, 16 inputs at a time; the last
// partial group of inputs from zero-padded copies (adding 0 * 0 changes no bit)
template <int W, int R, int C>
INL void linear_tile(const LinArgs& a, int64_t r0, int64_t n0) {
  typedef vf<W> F;
  F acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = F::zero();
  int64_t k = 0;
  for (; k + kLanes <= a.K; k += kLanes) {
    F xv[R], wv[C];
    for (int r = 0; r < R; ++r) xv[r] = F::load(a.x + (r0 + r) * a.x_row + k);
    for (int c = 0; c < C; ++c) wv[c] = F::load(a.w + (n0 + c) * a.K + k);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(xv[r], wv[c], acc[r][c]);
  }
  if (k < a.K) {
    float xt[R][kLanes] = {}, wt[C][kLanes] = {};
    for (int r = 0; r < R; ++r) std::copy(a.x + (r0 + r) * a.x_row + k, a.x + (r0 + r) * a.x_row + a.K, xt[r]);
    for (int c = 0; c < C; ++c) std::copy(a.w + (n0 + c) * a.K + k, a.w + (n0 + c) * a.K + a.K, wt[c]);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = fmadd(F::load(xt[r]), F::load(wt[c]), acc[r][c]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a.y[(r0 + r) * a.N + n0 + c] = lane_sum(acc[r][c]);
}

// The tile a register file holds: AVX-512 4 rows x 4 outputs (16 zmm sums), AVX2 2 x 2 (a vf is two ymm), the
// baseline 1 x 2 (four xmm each)
template <int W> constexpr int kTileRows = W == 64 ? 4 : W == 32 ? 2 : 1;
template <int W> constexpr int kTileCols = W == 16 ? 2 : kTileRows<W>;
constexpr int64_t kChunkRows = 64;  // rows a task takes over its outputs: 512 KB of a 2,048-wide x, in L2
constexpr int64_t kBlockCols = 4;   // outputs a task takes: whole tiles of every instruction set

// task i: rows [64 (i / blocks), ...) of x over the outputs of column block i % blocks, in tiles; the rows and
// outputs past the whole tiles one at a time
template <int W>
INL void linear_tasks(const LinArgs& a, int64_t i0, int64_t i1) {
  constexpr int R = kTileRows<W>, C = kTileCols<W>;
  const int64_t blocks = (a.N + kBlockCols - 1) / kBlockCols;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t n_begin = (i % blocks) * kBlockCols, n_end = std::min(a.N, n_begin + kBlockCols);
    const int64_t r_begin = (i / blocks) * kChunkRows, r_end = std::min(a.T, r_begin + kChunkRows);
    int64_t n = n_begin;
    for (; n + C <= n_end; n += C) {
      int64_t r = r_begin;
      for (; r + R <= r_end; r += R) linear_tile<W, R, C>(a, r, n);
      for (; r < r_end; ++r)
        for (int c = 0; c < C; ++c) linear_tile<W, 1, 1>(a, r, n + c);
    }
    for (; n < n_end; ++n)
      for (int64_t r = r_begin; r < r_end; ++r) linear_tile<W, 1, 1>(a, r, n);
  }
}

SHOAL_ISA_VARIANTS(linear_tasks, LinArgs)

// x [T, K] float32 (contiguous rows), w [N, K] float32 -> x @ w.T [T, N] float32, row-invariant
at::Tensor row_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "row_linear: x must be float32 [rows, inputs] with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x.size(1),
              "row_linear: w must be contiguous float32 [outputs, ", x.size(1), "]");
  const int64_t T = x.size(0), N = w.size(0), K = x.size(1);
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  const LinArgs a{x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), T, N, K, x.stride(0)};
  const int64_t tasks = (T + kChunkRows - 1) / kChunkRows * ((N + kBlockCols - 1) / kBlockCols);
  run_rows(linear_tasks_avx512, linear_tasks_avx2, linear_tasks_baseline, a, tasks, 1);
  return y;
}

// ---- moe_route ----

// logits [T, E] float32 -> (rows [T k] int64: each grouped pair's token; counts [E] int64; scales [T k] float32: each
// grouped pair's weight; back [T k] int64: token t's j-th expert (ascending) -> its pair's grouped position).
// Per token: the softmax of its logits (exp(l - max) / sum, summed in expert order), the k largest probabilities,
// ties to the lower expert, divided by their sum (in descending order) where `normalize`. The pairs are grouped by
// expert, stably: tokens in order within an expert, as a stable sort of every token's ascending experts gives.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t k, bool normalize) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "moe_route: logits must be float32 [tokens, experts] with contiguous rows");
  const int64_t T = logits.size(0), E = logits.size(1), P = T * k;
  TORCH_CHECK(k >= 1 && k <= E, "moe_route: top_k must be in [1, ", E, "], not ", k);
  const float* lp = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  std::vector<int64_t> chosen(P);
  std::vector<float> weight(P);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    std::vector<float> p(E);
    std::vector<char> used(E);
    for (int64_t t = b; t < e; ++t) {
      const float* row = lp + t * stride;
      float m = row[0];
      for (int64_t i = 1; i < E; ++i) m = row[i] > m ? row[i] : m;
      float sum = 0.0f;
      for (int64_t i = 0; i < E; ++i) sum += (p[i] = std::exp(row[i] - m));
      for (int64_t i = 0; i < E; ++i) p[i] = p[i] / sum;
      std::fill(used.begin(), used.end(), 0);
      int64_t* ex = chosen.data() + t * k;
      float* wt = weight.data() + t * k;
      for (int64_t j = 0; j < k; ++j) {  // the largest unused probability, the first of equals
        int64_t best = -1;
        for (int64_t i = 0; i < E; ++i)
          if (!used[i] && (best < 0 || p[i] > p[best])) best = i;
        used[best] = 1, ex[j] = best, wt[j] = p[best];
      }
      if (normalize) {
        float total = 0.0f;
        for (int64_t j = 0; j < k; ++j) total += wt[j];
        for (int64_t j = 0; j < k; ++j) wt[j] = wt[j] / total;
      }
      for (int64_t j = 1; j < k; ++j)  // the token's experts in ascending order, each with its weight
        for (int64_t i = j; i > 0 && ex[i] < ex[i - 1]; --i) std::swap(ex[i], ex[i - 1]), std::swap(wt[i], wt[i - 1]);
    }
  });
  const auto long_opts = logits.options().dtype(at::kLong);
  at::Tensor rows = at::empty({P}, long_opts), counts = at::zeros({E}, long_opts), back = at::empty({P}, long_opts);
  at::Tensor scales = at::empty({P}, logits.options());
  int64_t* cnt = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < P; ++i) ++cnt[chosen[i]];
  std::vector<int64_t> next(E);
  for (int64_t e = 0, start = 0; e < E; ++e) next[e] = start, start += cnt[e];
  int64_t* rp = rows.data_ptr<int64_t>();
  int64_t* bp = back.data_ptr<int64_t>();
  float* sp = scales.data_ptr<float>();
  for (int64_t i = 0; i < P; ++i) {
    const int64_t pos = next[chosen[i]]++;
    rp[pos] = i / k, sp[pos] = weight[i], bp[i] = pos;
  }
  return {rows, counts, scales, back};
}

// ---- moe_combine ----

struct CombineArgs {
  const float* y; const float* scales; const int64_t* back; float* out;  // y [P, H] (rows y_row apart), out [P / k, H]
  int64_t k, H, y_row;
};

// A value no later operation may fuse with: y * s rounded on its own, as torch's multiply rounds it, before the add
// that follows (the build contracts a * b + c into an FMA wherever it can: kernels/__init__.py)
template <class V>
INL V rounded(V v) {
  __asm__("" : "+v"(v));
  return v;
}

template <int W>
INL void combine_rows(const CombineArgs& a, int64_t t0, int64_t t1) {
  typedef vf<W> F;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t* pos = a.back + t * a.k;
    float* out = a.out + t * a.H;
    int64_t h = 0;
    for (; h + kLanes <= a.H; h += kLanes) {
      F acc;
      for (int64_t j = 0; j < a.k; ++j) {
        F prod = F::load(a.y + pos[j] * a.y_row + h) * F::set(a.scales[pos[j]]);
        for (int q = 0; q < F::kParts; ++q) prod.p[q] = rounded(prod.p[q]);
        if (j == 0) acc = prod;
        else acc = acc + prod;
      }
      acc.store(out + h);
    }
    for (; h < a.H; ++h) {
      float acc = 0.0f;
      for (int64_t j = 0; j < a.k; ++j) {
        const float prod = rounded(a.y[pos[j] * a.y_row + h] * a.scales[pos[j]]);
        acc = j == 0 ? prod : acc + prod;
      }
      out[h] = acc;
    }
  }
}

SHOAL_ISA_VARIANTS(combine_rows, CombineArgs)

// y [T k, H] float32 grouped by expert (the experts' outputs), scales and back from moe_route -> [T, H]: token t's
// sum over j of y[back[t k + j]] * scales[back[t k + j]], j in ascending expert order
at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& scales, const at::Tensor& back, int64_t k) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.stride(1) == 1, "moe_combine: y must be float32 [pairs, width] with contiguous rows");
  const int64_t P = y.size(0), H = y.size(1);
  TORCH_CHECK(k >= 1 && P % k == 0, "moe_combine: ", P, " rows are not whole tokens of ", k, " experts");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == P, "moe_combine: one float32 scale per row");
  TORCH_CHECK(back.scalar_type() == at::kLong && back.is_contiguous() && back.numel() == P, "moe_combine: one int64 position per pair");
  const int64_t* bp = back.data_ptr<int64_t>();
  for (int64_t i = 0; i < P; ++i) TORCH_CHECK(bp[i] >= 0 && bp[i] < P, "moe_combine: a position outside y's rows");
  at::Tensor out = at::empty({P / k, H}, y.options());
  const CombineArgs a{y.data_ptr<float>(), scales.data_ptr<float>(), bp, out.data_ptr<float>(), k, H, y.stride(0)};
  run_rows(combine_rows_avx512, combine_rows_avx2, combine_rows_baseline, a, P / k, 4);
  return out;
}

}  // namespace

// ops.h: the ops above for decoder.cpp
at::Tensor shoal_row_linear(const at::Tensor& x, const at::Tensor& w) { return row_linear(x, w); }
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> shoal_moe_route(const at::Tensor& logits, int64_t k, bool normalize) {
  return moe_route(logits, k, normalize);
}
at::Tensor shoal_moe_combine(const at::Tensor& y, const at::Tensor& scales, const at::Tensor& back, int64_t k) {
  return moe_combine(y, scales, back, k);
}

TORCH_LIBRARY_FRAGMENT(shoal_kernels, m) {
  m.def("row_linear(Tensor x, Tensor w) -> Tensor");
  m.def("moe_route(Tensor logits, int k, bool normalize) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_combine(Tensor y, Tensor scales, Tensor back, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(shoal_kernels, CPU, m) {
  m.impl("row_linear", &row_linear);
  m.impl("moe_route", &moe_route);
  m.impl("moe_combine", &moe_combine);
}
