// 16-lane float vectors (GCC vector extensions) for shoal's kernels, cpu.cpp and lowbit.cpp. A
// function using them compiles for whatever instruction set its caller was built for (AVX-512,
// AVX2 or the baseline), and the reductions here add lanes in one fixed order on all of them.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

#define INL static inline __attribute__((always_inline))

INL vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
INL void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// a broadcast, written as a shuffle: GCC turns a 16-element initializer into 16 masked inserts
INL vf vset(float x) { const vf v = {x}; return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0); }
INL vi viset(int32_t x) { const vi v = {x}; return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0); }
INL vf fmadd(vf a, vf b, vf c) { return a * b + c; }  // contracted to one FMA where the ISA has it
INL vf vmax(vf a, vf b) { return a > b ? a : b; }

// Across lanes by halves, always the same tree: lane i adds lane i + 8, then i + 4, i + 2, i + 1.
INL float lane_sum(vf v) {
  v = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v = v + __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v = v + __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  return v[0];
}

INL float lane_max(vf v) {  // exact in any order
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
  return v[0];
}

}  // namespace
