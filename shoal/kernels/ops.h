// The native ops that decoder.cpp strings together without the dispatcher: each is the function the torch op of
// the same name runs (cpu.cpp, kquants.cpp, moe.cpp), so a call here gives the bits the op gives. And run_rows, how
// the row ops of cpu.cpp and moe.cpp run their instruction set's entry point over their rows.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <tuple>

int64_t shoal_isa_level();  // cpu.cpp: 3 AVX-512, 2 AVX2, 1 the x86-64 baseline (SHOAL_CPU_ISA may force it lower)

// rows [0, rows) in parallel, `grain` at least a task, each task through this process's instruction set's entry point
// (vec.h SHOAL_ISA_VARIANTS)
template <typename Args>
void run_rows(void (*avx512)(const Args&, int64_t, int64_t), void (*avx2)(const Args&, int64_t, int64_t),
              void (*baseline)(const Args&, int64_t, int64_t), const Args& a, int64_t rows, int64_t grain) {
  const int64_t level = shoal_isa_level();
  auto f = level == 3 ? avx512 : level == 2 ? avx2 : baseline;
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) { f(a, b, e); });
}

at::Tensor shoal_invariant_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv,
                                     const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& row_seq,
                                     const at::Tensor& row_pos, double scale, int64_t window, int64_t group, double softcap);
at::Tensor shoal_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> shoal_add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                      double eps);
at::Tensor shoal_rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor shoal_silu_mul(const at::Tensor& x);
at::Tensor shoal_weight_empty(at::IntArrayRef shape);  // uint8, on huge pages where it can (cpu.cpp weight_empty)
// cpu.cpp step_rows: a step's slots, rows' sequences and positions from its spans (first positions, then row counts)
std::tuple<at::Tensor, at::Tensor, at::Tensor> shoal_step_rows(const at::Tensor& spans, const at::Tensor& tables, int64_t block_size,
                                                               int64_t null);
// cpu.cpp greedy_head's tensors: each row's token (or greedy_rows' negative code) [B] int64 and logprob [B] float32
std::tuple<at::Tensor, at::Tensor> shoal_greedy_head(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t t,
                                                     const c10::optional<at::Tensor>& bans);
at::Tensor shoal_gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t t);
at::Tensor shoal_gguf_rows(const at::Tensor& w, const at::Tensor& ids, int64_t t, int64_t cols);
at::Tensor shoal_gguf_grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts, int64_t n, int64_t t);
at::Tensor shoal_row_linear(const at::Tensor& x, const at::Tensor& w);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> shoal_moe_route(const at::Tensor& logits, int64_t k, bool normalize);
at::Tensor shoal_moe_combine(const at::Tensor& y, const at::Tensor& scales, const at::Tensor& back, int64_t k);
