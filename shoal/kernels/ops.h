// The native ops that decoder.cpp strings together without the dispatcher: each is the function the torch op of
// the same name runs (cpu.cpp, kquants.cpp, moe.cpp), so a call here gives the bits the op gives.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

at::Tensor shoal_invariant_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv,
                                     const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& row_seq,
                                     const at::Tensor& row_pos, double scale, int64_t window, int64_t group, double softcap);
at::Tensor shoal_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> shoal_add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                      double eps);
at::Tensor shoal_rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor shoal_silu_mul(const at::Tensor& x);
at::Tensor shoal_gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t t);
at::Tensor shoal_gguf_rows(const at::Tensor& w, const at::Tensor& ids, int64_t t, int64_t cols);
at::Tensor shoal_gguf_grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts, int64_t n, int64_t t);
at::Tensor shoal_row_linear(const at::Tensor& x, const at::Tensor& w);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> shoal_moe_route(const at::Tensor& logits, int64_t k, bool normalize);
at::Tensor shoal_moe_combine(const at::Tensor& y, const at::Tensor& scales, const at::Tensor& back, int64_t k);
