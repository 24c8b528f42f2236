// A decoder's layers in one native call: the native forward of model/native.py.
//
// The Python forward (model/layers.py DecoderModel._forward_fused) calls about nine native ops a layer (the
// projections, rotary, attention, SiLU-and-multiply, the residual adds fused into their norms), each through
// torch's dispatcher and a module's forward: on the default model that is 270 calls and some 0.8 ms of Python a
// token, a seventh of a one-stream decode step. Here a `DecoderPlan` holds every layer's weights, norms and KV
// cache once, and `forward` runs the same ops in the same order on the same tensors, calling the functions the
// torch ops run (ops.h), with nothing between them. So it gives the Python forward's bits, for every step:
// decodes, prefill chunks, drafts under verification; tests/test_native_decoder.py holds it to that.
//
// What a plan covers is what model/native.py builds one for: layers of two plain RMSNorms around attention and a
// gated SiLU MLP, dense or a mixture of experts (GGUF experts stacked, float32 activations), or Gemma 2's and 3's
// layers (four (1 + w) norms, a gated GELU MLP, an embedding scale, local and global layers over their own KV
// groups); projections of shoal's low-bit kernels (a GGUF's types, int8 and int4), full rotary, the invariant
// attention op. Anything else keeps the Python forward.
//
// Gemma's layers (`sandwich`) run torch's own ops where the Python forward does (RMSNorm(x) * (1 + w) in float32,
// rounded once; GELU's tanh form; the residual adds), called here as at:: functions: the same kernels, so the same
// bits. The (1 + w) weights come in float32, computed once as the Python forward computes them each step.
//
// The plan's description, from model/native.py (`ints`, `floats` and `tensors` read in this order):
//   model:  ints [layers, last, final norm (1 + w)], floats [final norm eps], tensors [final norm weight (when last)]
//   input:  ints [has embedding, (its GGUF type (-1: a float table), columns, has a scale), rope tables], tensors
//           [(its packed rows or the float table, an empty tensor of the model's dtype, (the scale, a 0-dim tensor of
//           that dtype)), (cos, signed sin) per rope table]: what `forward_ids` looks up
//   layer:  ints [heads, kv heads, head dim, window (-1: the backend's), rope table, has q/k norms, KV group (which
//           of the step's metadata), sandwich, gelu]
//           floats [input norm eps, pre-MLP norm eps, q/k norm eps, scale, softcap (0: none), (sandwich: the
//           attention's and the MLP's output norm eps)]
//           tensors [input norm, pre-MLP norm, (q norm, k norm), (sandwich: attention output norm, MLP output norm),
//           KV cache]
//           then its projections qkv and o, each: ints [runs, has bias, (rows, type) per run],
//           tensors [packed weights per run, (bias)];
//           then ints [experts (0: a dense MLP)], and a dense MLP's projections gate_up and down as above, or a
//           sparse one's ints [top k, normalize, gate_up rows, gate_up type, down rows, down type], tensors [router
//           weight float32 [experts, hidden], gate_up stacked, down stacked (formats.GroupedGGUF), expert counts
//           (layers.MoE.counts; an empty tensor where none)]

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"

namespace {

// y = x @ W.T (+ bias): the runs of packed weights side by side, as formats.GGUFLinear.forward computes it
struct Projection {
  std::vector<at::Tensor> packed;
  std::vector<int64_t> rows, types;
  at::Tensor bias;  // undefined: none

  at::Tensor operator()(const at::Tensor& x) const {
    const at::Tensor in = x.stride(-1) == 1 ? x : x.contiguous();
    at::Tensor y;
    if (packed.size() == 1) {
      y = shoal_gguf_linear(in, packed[0], rows[0], types[0]);
    } else {
      std::vector<at::Tensor> parts;
      for (size_t i = 0; i < packed.size(); ++i) parts.push_back(shoal_gguf_linear(in, packed[i], rows[i], types[i]));
      y = at::cat(parts, 1);
    }
    return bias.defined() ? y + bias : y;
  }
};

// A sparse MLP (layers.MoE.forward on the native ops): the router's logits, the routing, the rows gathered in expert
// order, both grouped projections with SiLU between, the weighted sum
struct Experts {
  int64_t top_k = 0, gate_up_rows = 0, gate_up_type = 0, down_rows = 0, down_type = 0;
  bool normalize = false;
  at::Tensor router, gate_up, down, counts;  // counts: undefined where the layer counts nothing

  at::Tensor operator()(const at::Tensor& x) const {
    auto [rows, cnt, scales, back] = shoal_moe_route(shoal_row_linear(x, router), top_k, normalize);
    if (counts.defined()) counts.add_(cnt);
    const at::Tensor h = shoal_silu_mul(shoal_gguf_grouped_linear(x.index_select(0, rows), gate_up, cnt, gate_up_rows, gate_up_type));
    return shoal_moe_combine(shoal_gguf_grouped_linear(h, down, cnt, down_rows, down_type), scales, back, top_k);
  }
};

// Gemma's RMSNorm (layers.RMSNorm with unit_offset): float32 activations take shoal's op with (1 + w) (nothing
// rounds between the products); others torch's rms_norm in float32, times (1 + w), rounded once
at::Tensor unit_norm(const at::Tensor& x, const at::Tensor& one_plus_w, double eps) {
  if (x.scalar_type() == at::kFloat) return shoal_rms_norm(x.reshape({-1, x.size(-1)}), one_plus_w, eps).view(x.sizes());
  return (at::rms_norm(x.to(at::kFloat), {x.size(-1)}, std::nullopt, eps) * one_plus_w).to(x.scalar_type());
}

struct Layer {
  int64_t heads, kv_heads, head_dim, window, rope, group;
  bool qk_norm, sandwich, gelu;
  double in_eps, post_eps, qk_eps, scale, softcap, attn_out_eps = 0, mlp_out_eps = 0;
  at::Tensor in_norm, post_norm, q_norm, k_norm, attn_out_norm, mlp_out_norm, kv;  // sandwich: (1 + w), float32
  Projection qkv, o, gate_up, down;  // gate_up and down: a dense MLP's
  Experts experts;                   // a sparse one's (top_k 0: none)
};

// reads the description in order (see the top of the file)
struct Reader {
  const std::vector<at::Tensor>& tensors;
  const std::vector<int64_t>& ints;
  const std::vector<double>& floats;
  size_t t = 0, i = 0, f = 0;

  at::Tensor tensor() {
    TORCH_CHECK(t < tensors.size(), "decoder plan: too few tensors");
    return tensors[t++];
  }
  int64_t integer() {
    TORCH_CHECK(i < ints.size(), "decoder plan: too few integers");
    return ints[i++];
  }
  double real() {
    TORCH_CHECK(f < floats.size(), "decoder plan: too few floats");
    return floats[f++];
  }
  Projection projection() {
    Projection p;
    const int64_t runs = integer();
    const bool bias = integer() != 0;
    TORCH_CHECK(runs >= 1, "decoder plan: a projection without weights");
    for (int64_t r = 0; r < runs; ++r) {
      p.rows.push_back(integer());
      p.types.push_back(integer());
    }
    for (int64_t r = 0; r < runs; ++r) p.packed.push_back(tensor());
    if (bias) p.bias = tensor();
    return p;
  }
};

}  // namespace

struct DecoderPlan : torch::CustomClassHolder {
  std::vector<Layer> layers;
  bool last = true, final_unit = false;
  double final_eps = 0;
  at::Tensor final_norm;
  at::Tensor embedding;  // packed rows of a GGUF embedding table (undefined: the caller embeds)
  at::Tensor embed_scale;  // Gemma's: a 0-dim tensor of the model's dtype the embeddings are multiplied by (undefined: none)
  int64_t embedding_type = 0, embedding_cols = 0;
  at::ScalarType dtype = at::kFloat;  // the model's activations
  std::vector<at::Tensor> cos_tables, sin_tables;  // per rope: [positions, rotated dims] float32, the sin signed
  int64_t groups = 1;  // the step metadata's count: one more than the layers' highest KV group index

  DecoderPlan(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, std::vector<double> floats) {
    Reader r{tensors, ints, floats};
    const int64_t n = r.integer();
    last = r.integer() != 0;
    final_unit = r.integer() != 0;
    final_eps = r.real();
    if (last) final_norm = r.tensor();
    if (r.integer() != 0) {
      embedding_type = r.integer(), embedding_cols = r.integer();
      const bool scaled = r.integer() != 0;
      embedding = r.tensor();
      dtype = r.tensor().scalar_type();
      if (scaled) embed_scale = r.tensor();
    }
    const int64_t ropes = r.integer();
    for (int64_t k = 0; k < ropes; ++k) cos_tables.push_back(r.tensor()), sin_tables.push_back(r.tensor());
    for (int64_t l = 0; l < n; ++l) {
      Layer y;
      y.heads = r.integer(), y.kv_heads = r.integer(), y.head_dim = r.integer(), y.window = r.integer(), y.rope = r.integer();
      y.qk_norm = r.integer() != 0;
      y.group = r.integer(), y.sandwich = r.integer() != 0, y.gelu = r.integer() != 0;
      y.in_eps = r.real(), y.post_eps = r.real(), y.qk_eps = r.real(), y.scale = r.real(), y.softcap = r.real();
      if (y.sandwich) y.attn_out_eps = r.real(), y.mlp_out_eps = r.real();
      y.in_norm = r.tensor(), y.post_norm = r.tensor();
      if (y.qk_norm) y.q_norm = r.tensor(), y.k_norm = r.tensor();
      if (y.sandwich) y.attn_out_norm = r.tensor(), y.mlp_out_norm = r.tensor();
      y.kv = r.tensor();
      y.qkv = r.projection(), y.o = r.projection();
      if (const int64_t experts = r.integer(); experts == 0) {
        y.gate_up = r.projection(), y.down = r.projection();
      } else {
        Experts& e = y.experts;
        e.top_k = r.integer(), e.normalize = r.integer() != 0;
        e.gate_up_rows = r.integer(), e.gate_up_type = r.integer(), e.down_rows = r.integer(), e.down_type = r.integer();
        e.router = r.tensor(), e.gate_up = r.tensor(), e.down = r.tensor();
        const at::Tensor counts = r.tensor();
        if (counts.numel() > 0) e.counts = counts;
        TORCH_CHECK(e.top_k >= 1 && e.top_k <= experts && e.router.scalar_type() == at::kFloat && e.router.dim() == 2 &&
                        e.router.size(0) == experts && e.gate_up.size(0) == experts && e.down.size(0) == experts,
                    "decoder plan: a sparse MLP needs 1 <= top_k <= experts, a float32 router and stacked weights of its experts");
      }
      TORCH_CHECK(y.heads % y.kv_heads == 0, "decoder plan: query heads not a multiple of KV heads");
      TORCH_CHECK(y.group >= 0, "decoder plan: a layer's KV group");
      groups = std::max(groups, y.group + 1);
      TORCH_CHECK(!y.sandwich || y.experts.top_k == 0, "decoder plan: a sandwich layer with experts");
      TORCH_CHECK(layers.empty() || layers[0].sandwich == y.sandwich, "decoder plan: sandwich and plain layers mixed");
      layers.push_back(std::move(y));
    }
    TORCH_CHECK(r.t == tensors.size() && r.i == ints.size() && r.f == floats.size(), "decoder plan: a description longer than its layers");
  }

  // ids, positions [T] int64 -> forward's output: the tokens' rows of the embedding table in the model's dtype (times
  // Gemma's scale), and each rope's rows of cos and signed sin, looked up as the Python forward looks them up
  // (GGUFEmbedding, DecoderModel.forward, Rotary)
  at::Tensor forward_ids(at::Tensor ids, at::Tensor positions, std::vector<at::Tensor> slots, std::vector<at::Tensor> tables,
                         std::vector<at::Tensor> row_seq, std::vector<at::Tensor> row_pos, int64_t window) {
    TORCH_CHECK(embedding.defined(), "decoder plan: no embedding table: call forward with the embeddings");
    TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && ids.size(0) == positions.size(0), "decoder plan: ids and positions [T]");
    at::Tensor x = embedding_type < 0 ? embedding.index_select(0, ids)  // a float table: nn.Embedding's rows
                                      : shoal_gguf_rows(embedding, ids, embedding_type, embedding_cols).to(dtype);
    if (embed_scale.defined()) x = x * embed_scale;
    std::vector<at::Tensor> cos, sin;
    for (size_t k = 0; k < cos_tables.size(); ++k) {
      cos.push_back(cos_tables[k].index_select(0, positions));
      sin.push_back(sin_tables[k].index_select(0, positions));
    }
    return forward(x, cos, sin, slots, tables, row_seq, row_pos, window);
  }

  // Greedy decode runs (runner/model_runner.py ModelRunner._native_run) in one call: S sequences of one KV group,
  // each from token ids[s] at position positions[s], run up to steps[s] one-token forwards, each forward followed by
  // the head and the greedy pick (cpu.cpp greedy_head) and fed the token it picked, as a step of its own would: the
  // same forward of the same rows (forward_ids), the rows' cache slots and positions by step_rows from `tables` [S, W]
  // (the sequences' block tables, the run's blocks in them), the bans of the sequences still running (`bans`: flat
  // indices s * head_rows + token into the S rows' logits, as greedy_rows takes them). A sequence stops after a pick
  // that ends it: a negative code (a failed row), or one of its stop ids (stop_ids[stop_ends[s - 1] .. stop_ends[s]):
  // its end tokens and stop ids); the runs stop before a forward where interrupt[0] (int32) is not 0 (another thread
  // sets it: something waits for the engine), except the first `own` (a step's own forward). -> each pick's sequence,
  // token (or negative code) and logprob, in the order they were made.
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<double>> greedy_run(
      at::Tensor ids, at::Tensor positions, std::vector<int64_t> steps, at::Tensor tables, int64_t block_size, int64_t null,
      int64_t window, at::Tensor head, int64_t head_rows, int64_t head_type, c10::optional<at::Tensor> bans,
      std::vector<int64_t> stop_ids, std::vector<int64_t> stop_ends, at::Tensor interrupt, int64_t own) {
    TORCH_CHECK(last && embedding.defined(), "decoder plan: a run needs the last stage's plan, with the embedding table");
    TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
                "decoder plan: a run's ids and positions, int64 [S]");
    const int64_t S = ids.size(0);
    TORCH_CHECK(positions.size(0) == S && static_cast<int64_t>(steps.size()) == S && static_cast<int64_t>(stop_ends.size()) == S,
                "decoder plan: a run's ids, positions, steps and stop ends, one of each a sequence");
    TORCH_CHECK(interrupt.scalar_type() == at::kInt && interrupt.numel() == 1, "decoder plan: a run's interrupt flag, int32 [1]");
    TORCH_CHECK(ids.is_cpu() && positions.is_cpu() && tables.is_cpu() && interrupt.is_cpu() && (!bans.has_value() || bans->is_cpu()),
                "decoder plan: a run's tensors on the CPU");
    TORCH_CHECK(head_rows > 0, "decoder plan: a run's head rows");  // (step_rows checks the tables and block size)
    ids = ids.contiguous();
    positions = positions.contiguous();
    for (int64_t s = 0; s < S; ++s)
      TORCH_CHECK(stop_ends[s] >= (s > 0 ? stop_ends[s - 1] : 0) && stop_ends[s] <= static_cast<int64_t>(stop_ids.size()),
                  "decoder plan: a run's stop ends, rising, within its stop ids");
    std::vector<std::vector<int64_t>> banned(S);  // each sequence's banned tokens
    if (bans.has_value()) {
      const at::Tensor b = bans->contiguous();
      TORCH_CHECK(b.scalar_type() == at::kLong && b.dim() == 1, "decoder plan: a run's bans, flat int64");
      const int64_t* bp = b.data_ptr<int64_t>();
      for (int64_t i = 0; i < b.numel(); ++i) {
        TORCH_CHECK(bp[i] >= 0 && bp[i] < S * head_rows, "decoder plan: a ban outside the run's logits");
        banned[bp[i] / head_rows].push_back(bp[i] % head_rows);
      }
    }
    const int64_t* idp = ids.data_ptr<int64_t>();
    const int64_t* posp = positions.data_ptr<int64_t>();
    std::vector<int64_t> token(idp, idp + S), pos(posp, posp + S), live;
    for (int64_t s = 0; s < S; ++s)
      if (steps[s] > 0) live.push_back(s);
    const int32_t* flag = interrupt.data_ptr<int32_t>();
    const at::TensorOptions longs = at::TensorOptions().dtype(at::kLong);
    std::vector<int64_t> rows, picks;
    std::vector<double> logprobs;
    for (int64_t i = 0; !live.empty() && (i < own || __atomic_load_n(flag, __ATOMIC_RELAXED) == 0); ++i) {
      const int64_t A = static_cast<int64_t>(live.size());
      // the live sequences' rows, as a step of them alone: a row each (step_rows: slots, rows' sequences in `tables`,
      // positions, each checked against its table)
      at::Tensor ids_t = at::empty({A}, longs), pos_t = at::empty({A}, longs), spans = at::zeros({2 * S}, longs);
      int64_t* sp = spans.data_ptr<int64_t>();
      std::vector<int64_t> ban_flat;
      for (int64_t a = 0; a < A; ++a) {
        const int64_t s = live[a];
        ids_t.data_ptr<int64_t>()[a] = token[s];
        pos_t.data_ptr<int64_t>()[a] = sp[s] = pos[s];
        sp[S + s] = 1;
        for (const int64_t t : banned[s]) ban_flat.push_back(a * head_rows + t);
      }
      const auto [slots, row_seq, row_pos] = shoal_step_rows(spans, tables, block_size, null);
      // one KV group: every layer's group index (its window's, in the plan) reads the same metadata
      const size_t g = static_cast<size_t>(groups);
      const at::Tensor h = forward_ids(ids_t, pos_t, std::vector<at::Tensor>(g, slots), std::vector<at::Tensor>(g, tables),
                                       std::vector<at::Tensor>(g, row_seq), std::vector<at::Tensor>(g, row_pos), window);
      c10::optional<at::Tensor> ban_t;
      if (!ban_flat.empty()) ban_t = at::tensor(ban_flat, longs);
      auto [got, logp] = shoal_greedy_head(h, head, head_rows, head_type, ban_t);
      const int64_t* gp = got.data_ptr<int64_t>();
      const float* lp = logp.data_ptr<float>();
      std::vector<int64_t> next;
      for (int64_t a = 0; a < A; ++a) {
        const int64_t s = live[a], t = gp[a];
        rows.push_back(s), picks.push_back(t), logprobs.push_back(lp[a]);
        token[s] = t, pos[s] += 1;
        const int64_t* first = stop_ids.data() + (s > 0 ? stop_ends[s - 1] : 0);
        const int64_t* end = stop_ids.data() + stop_ends[s];
        if (t >= 0 && i + 1 < steps[s] && std::find(first, end, t) == end) next.push_back(s);
      }
      live = std::move(next);
    }
    return {rows, picks, logprobs};
  }

  // x [T, hidden] (the embeddings, or a previous stage's output) -> the last layer's normed output [T, hidden]
  // (a stage before the last: its residual stream). cos, sin: the step's tables per rope (layers.RopeTables,
  // native); slots .. row_pos: attention.invariant.NativeMetadata's, one per KV group (a layer reads its group's);
  // window: the backend's (0: none).
  at::Tensor forward(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, std::vector<at::Tensor> slots,
                     std::vector<at::Tensor> tables, std::vector<at::Tensor> row_seq, std::vector<at::Tensor> row_pos,
                     int64_t window) {
    TORCH_CHECK(x.dim() == 2 && !layers.empty(), "decoder plan: x [tokens, hidden]");
    TORCH_CHECK(cos.size() == sin.size(), "decoder plan: a cos and a sin table per rope");
    TORCH_CHECK(tables.size() == slots.size() && row_seq.size() == slots.size() && row_pos.size() == slots.size(),
                "decoder plan: the same KV groups' slots, tables and rows");
    for (const Layer& y : layers) {
      TORCH_CHECK(y.rope >= 0 && y.rope < static_cast<int64_t>(cos.size()), "decoder plan: a layer's rope table missing");
      TORCH_CHECK(y.group < static_cast<int64_t>(slots.size()), "decoder plan: a layer's KV group's metadata missing");
    }
    if (layers[0].sandwich) return sandwiches(x, cos, sin, slots, tables, row_seq, row_pos, window);
    const int64_t T = x.size(0);
    at::Tensor h = shoal_rms_norm(x, layers[0].in_norm, layers[0].in_eps);
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& y = layers[l];
      const at::Tensor attn = attention(y, h, cos, sin, slots, tables, row_seq, row_pos, window);
      auto [sum, normed] = shoal_add_rms_norm(x, y.o(attn.reshape({T, y.heads * y.head_dim})), y.post_norm, y.post_eps);
      // the MLP (layers.MLP, gated SiLU; or layers.MoE)
      const at::Tensor delta = y.experts.top_k > 0 ? y.experts(normed) : y.down(shoal_silu_mul(y.gate_up(normed)));
      const bool final_layer = l + 1 == layers.size();
      if (final_layer && !last) return sum + delta;
      const at::Tensor& w = final_layer ? final_norm : layers[l + 1].in_norm;
      std::tie(x, h) = shoal_add_rms_norm(sum, delta, w, final_layer ? final_eps : layers[l + 1].in_eps);
    }
    return h;
  }

 private:
  // a layer's attention from its normed input h (layers.Attention.forward): [T, heads, head dim]
  at::Tensor attention(const Layer& y, const at::Tensor& h, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                       const std::vector<at::Tensor>& slots, const std::vector<at::Tensor>& tables,
                       const std::vector<at::Tensor>& row_seq, const std::vector<at::Tensor>& row_pos, int64_t window) const {
    const int64_t T = h.size(0), D = y.head_dim, q_size = y.heads * D, kv_size = y.kv_heads * D;
    const at::Tensor qkv = y.qkv(h);
    at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({T, y.heads + y.kv_heads, D});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, y.kv_heads, D});
    if (y.qk_norm) {
      const at::Tensor q = qk.narrow(1, 0, y.heads), k = qk.narrow(1, y.heads, y.kv_heads);
      if (y.sandwich)
        qk = at::cat({unit_norm(q, y.q_norm, y.qk_eps), unit_norm(k, y.k_norm, y.qk_eps)}, 1);
      else
        qk = at::cat({shoal_rms_norm(q.reshape({-1, D}), y.q_norm, y.qk_eps).view(q.sizes()),
                      shoal_rms_norm(k.reshape({-1, D}), y.k_norm, y.qk_eps).view(k.sizes())}, 1);
    }
    shoal_rope_(qk, cos[y.rope], sin[y.rope]);
    const size_t g = static_cast<size_t>(y.group);
    return shoal_invariant_attention(qk.narrow(1, 0, y.heads), qk.narrow(1, y.heads, y.kv_heads), v, y.kv, slots[g], tables[g],
                                     row_seq[g], row_pos[g], y.scale, y.window < 0 ? window : y.window, y.heads / y.kv_heads,
                                     y.softcap);
  }

  // Gemma's layers (layers.DecoderLayer.forward with four norms): each norm and residual add as its own op
  at::Tensor sandwiches(at::Tensor x, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                        const std::vector<at::Tensor>& slots, const std::vector<at::Tensor>& tables,
                        const std::vector<at::Tensor>& row_seq, const std::vector<at::Tensor>& row_pos, int64_t window) const {
    const int64_t T = x.size(0);
    for (const Layer& y : layers) {
      const at::Tensor attn = attention(y, unit_norm(x, y.in_norm, y.in_eps), cos, sin, slots, tables, row_seq, row_pos, window);
      x = x + unit_norm(y.o(attn.reshape({T, y.heads * y.head_dim})), y.attn_out_norm, y.attn_out_eps);
      const at::Tensor gate_up = y.gate_up(unit_norm(x, y.post_norm, y.post_eps));
      const int64_t width = gate_up.size(1) / 2;  // layers.gated: GELU's tanh form by torch, SiLU by the native op
      const at::Tensor act = y.gelu ? at::gelu(gate_up.narrow(1, 0, width), "tanh") * gate_up.narrow(1, width, width)
                                    : shoal_silu_mul(gate_up);
      x = x + unit_norm(y.down(act), y.mlp_out_norm, y.mlp_out_eps);
    }
    if (!last) return x;
    return final_unit ? unit_norm(x, final_norm, final_eps) : shoal_rms_norm(x, final_norm, final_eps);
  }
};

TORCH_LIBRARY_FRAGMENT(shoal_kernels, m) {
  m.class_<DecoderPlan>("DecoderPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("forward", &DecoderPlan::forward)
      .def("forward_ids", &DecoderPlan::forward_ids)
      .def("greedy_run", &DecoderPlan::greedy_run);
}
