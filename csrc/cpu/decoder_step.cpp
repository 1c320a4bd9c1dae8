// fastgen_cpu.DecoderStep — one decode step of a BART-family decoder, run from C++.
//
// Why: on a small model the decode step's kernels are a minority of its time; the rest is the Python that
// calls them (module calls, the linear modes' dispatch, views). fastgen.models.lean_step already runs the
// step without the module tree; this class runs the same sequence of ops with no Python between them.
// Measured on an Intel Xeon (Emerald Rapids, one core), 7.9M-parameter BART, 64 rows, int8: the Python
// lean step ~4.4 ms, the same kernels called from a flat Python loop ~2.7 ms.
//
// The class holds a program built once per generate call (fastgen.models.compiled_step): the decoder's
// tensors and, for each linear, the op the call's mode runs for it: the int8 mode's AMX / VNNI op with the
// packed weight (or oneDNN's product between fastgen's row passes, where the weight's first product timed
// it faster), fast_gemm's oneDNN op with its packed weight, or in the exact mode ATen's linear or
// fastgen's ordered kernel with the summation order its calibration proved equal to F.linear. Attention is
// fastgen's CPU kernel in the fast modes and SDPA,
// called as Transformers' sdpa_attention_forward calls it, in the exact mode. step() computes exactly what
// the Python lean step computes, op for op and in the same order, with the same kernels (fastgen_cpu ops
// through the dispatcher, ATen for the rest), so the logits are the same bits
// (tests/models/test_compiled_step.py compares them, and the exact mode's with upstream).
//
// Per layer (post-norm: BART, Marian; pre-norm: mBART, Pegasus normalise each sublayer's input):
//   self-attention: q, k, v projections; K/V written in place at the step's position of the time-major
//   cache buffers (T, rows, heads, dim) (fastgen.models.growing_cache); attention over the filled prefix;
//   cross-attention over each input's cached K/V, an input's beams as extra query rows (beam-shared K/V);
//   feed-forward fc2(act(fc1(x))), the activation fused into fc1's int8 op in the int8 mode.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

// linear kinds
constexpr int64_t kAtenLinear = 0;  // F.linear (the exact mode where its calibration kept MKL)
constexpr int64_t kInt8Amx = 1;
constexpr int64_t kInt8Vnni = 2;
constexpr int64_t kOrdered = 3;  // fastgen_cpu::ordered_linear with the order the exact mode's calibration chose
constexpr int64_t kPacked = 4;   // mkldnn::_linear_pointwise with fast_gemm's packed weight
constexpr int64_t kInt8Onednn = 5;  // the int8 mode's oneDNN product between fastgen's row passes
constexpr int64_t kMklPacked = 6;   // fastgen_cpu::mkl_packed_linear with fast_gemm's MKL-packed weight

bool fuses_activation(int64_t kind) { return kind == kInt8Amx || kind == kInt8Vnni || kind == kInt8Onednn; }
// attention kinds
constexpr int64_t kSdpa = 0;    // SDPA, as Transformers' sdpa_attention_forward calls it (the exact mode)
constexpr int64_t kKernel = 1;  // fastgen_cpu::attention (the approximate modes)

using Int8Op = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
                          const std::optional<at::Tensor>&, int64_t);
using AttentionOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, double);

const c10::TypedOperatorHandle<Int8Op>& int8_op(bool amx) {
  static const auto amx_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fastgen_cpu::int8_linear_amx", "").typed<Int8Op>();
  static const auto vnni_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fastgen_cpu::int8_linear_vnni", "").typed<Int8Op>();
  return amx ? amx_op : vnni_op;
}

using OrderedOp = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t);

const c10::TypedOperatorHandle<OrderedOp>& ordered_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fastgen_cpu::ordered_linear", "").typed<OrderedOp>();
  return op;
}

using MklPackedOp =
    at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&, int64_t);

const c10::TypedOperatorHandle<MklPackedOp>& mkl_packed_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fastgen_cpu::mkl_packed_linear", "").typed<MklPackedOp>();
  return op;
}

const c10::OperatorHandle& packed_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

using QuantizeOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&);
using ScaleOp = at::Tensor&(at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<QuantizeOp>& quantize_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fastgen_cpu::quantize_rows_u8_zp", "").typed<QuantizeOp>();
  return op;
}

const c10::TypedOperatorHandle<ScaleOp>& scale_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fastgen_cpu::scale_rows_add_", "").typed<ScaleOp>();
  return op;
}

const c10::OperatorHandle& onednn_int8_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  return op;
}

const c10::TypedOperatorHandle<AttentionOp>& attention_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("fastgen_cpu::attention", "").typed<AttentionOp>();
  return op;
}

struct Linear {
  int64_t kind = -1;
  at::Tensor weight;  // ATen: the (N, K) weight; int8: the packed codes
  std::optional<at::Tensor> bias;
  at::Tensor scale, col_sums;  // int8 only
  at::Tensor zero_points;      // oneDNN int8: the weight's zero points (all 0)
  int64_t out_features = 0, activation = 0;  // activation: the fused code (int8 kinds; MKL packed in fast_gemm)
  int64_t block = 0, bias_at = 0;            // ordered: the summation order
};

// per layer, in this order: self q, k, v, out; cross q, out; fc1, fc2 (the LM head follows the last layer)
constexpr int64_t kLinearsPerLayer = 8;
constexpr int64_t kNormsPerLayer = 3;  // self-attention, cross-attention, final (weight, bias each)

}  // namespace

class DecoderStep : public torch::CustomClassHolder {
 public:
  // shape: layers, heads, head_dim, pre_norm, layernorm_embedding, position_offset, attention kind, and the
  //        feed-forward activation applied after fc1 where fc1 does not fuse it (0 none, 1 GELU, 2 ReLU, 3 SiLU)
  // scalars: embed_scale, layer-norm eps, attention scaling
  // tensors: embedding, positions, [layernorm_embedding w, b], per layer 3 x (w, b), [final norm w, b],
  //          final_logits_bias
  DecoderStep(std::vector<int64_t> shape, std::vector<double> scalars, std::vector<at::Tensor> tensors) {
    TORCH_CHECK(shape.size() == 8 && scalars.size() == 3, "DecoderStep: 8 shape numbers and 3 scalars");
    layers_ = shape[0];
    heads_ = shape[1];
    head_dim_ = shape[2];
    pre_norm_ = shape[3] != 0;
    layernorm_embedding_ = shape[4] != 0;
    position_offset_ = shape[5];
    attention_kind_ = shape[6];
    activation_ = shape[7];
    TORCH_CHECK(activation_ >= 0 && activation_ <= 3, "DecoderStep: unknown activation");
    TORCH_CHECK(attention_kind_ == kKernel || attention_kind_ == kSdpa, "DecoderStep: unknown attention kind");
    embed_scale_ = scalars[0];
    eps_ = scalars[1];
    scaling_ = scalars[2];
    const size_t expected =
        3 + (layernorm_embedding_ ? 2 : 0) + layers_ * kNormsPerLayer * 2 + (pre_norm_ ? 2 : 0);
    TORCH_CHECK(tensors.size() == expected, "DecoderStep: expected ", expected, " tensors, got ", tensors.size());
    size_t i = 0;
    embedding_ = tensors[i++];
    positions_ = tensors[i++];
    if (layernorm_embedding_) {
      norm_embedding_ = {tensors[i], tensors[i + 1]};
      i += 2;
    }
    for (int64_t n = 0; n < layers_ * kNormsPerLayer; ++n, i += 2) norms_.push_back({tensors[i], tensors[i + 1]});
    if (pre_norm_) {
      norm_final_ = {tensors[i], tensors[i + 1]};
      i += 2;
    }
    final_logits_bias_ = tensors[i++];
    linears_.resize(static_cast<size_t>(layers_ * kLinearsPerLayer + 1));
  }

  // int8: weight = packed codes, activation = fused code; ordered: (block, bias_at) in (scale_or_block, activation)
  void set_linear(int64_t index, int64_t kind, at::Tensor weight, std::optional<at::Tensor> bias,
                  std::optional<at::Tensor> scale, std::optional<at::Tensor> col_sums, int64_t out_features,
                  int64_t activation, int64_t block, int64_t bias_at) {
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(linears_.size()), "DecoderStep: linear index");
    TORCH_CHECK(kind >= kAtenLinear && kind <= kMklPacked, "DecoderStep: unknown linear kind");
    Linear& l = linears_[static_cast<size_t>(index)];
    l.kind = kind;
    l.weight = weight;
    l.bias = bias;
    if (fuses_activation(kind)) {
      TORCH_CHECK(scale.has_value() && col_sums.has_value(), "DecoderStep: an int8 linear needs scales and sums");
      l.scale = *scale;
      l.col_sums = *col_sums;
      if (kind == kInt8Onednn) l.zero_points = at::zeros(l.scale.sizes(), l.scale.options().dtype(at::kLong));
    }
    l.out_features = out_features;
    l.activation = activation;
    l.block = block;
    l.bias_at = bias_at;
  }

  bool ready() const {
    for (const Linear& l : linears_)
      if (l.kind < 0) return false;
    return true;
  }

  // ids (rows, 1); the caches' filled length before this step; self_k / self_v: per layer the time-major
  // buffers (T, rows, heads, dim) with room at `length`; cross_k / cross_v: per layer (inputs, heads, S, dim);
  // cross_mask: None or (1 | inputs, 1 | heads, 1, S). Returns the logits (rows, 1, vocab).
  at::Tensor step(const at::Tensor& ids, int64_t length, const std::vector<at::Tensor>& self_k,
                  const std::vector<at::Tensor>& self_v, const std::vector<at::Tensor>& cross_k,
                  const std::vector<at::Tensor>& cross_v, const std::optional<at::Tensor>& cross_mask) {
    check_inputs(ids, self_k, self_v, cross_k, cross_v);
    const int64_t rows = ids.size(0);
    // embeddings: the scale always multiplies (BART's scaled embedding and Marian's decoder both do)
    at::Tensor embeds = at::embedding(embedding_, ids).mul(embed_scale_);
    at::Tensor hidden = embeds.add(positions_.select(0, length + position_offset_));
    if (layernorm_embedding_) hidden = norm(hidden, norm_embedding_);
    for (int64_t layer = 0; layer < layers_; ++layer) {
      const Linear* lin = &linears_[static_cast<size_t>(layer * kLinearsPerLayer)];
      const std::pair<at::Tensor, at::Tensor>* norms = &norms_[static_cast<size_t>(layer * kNormsPerLayer)];
      // self-attention
      at::Tensor x = pre_norm_ ? norm(hidden, norms[0]) : hidden;
      at::Tensor query = linear(x, lin[0]).view({rows, 1, heads_, head_dim_}).transpose(1, 2);
      const at::Tensor& kbuf = self_k[static_cast<size_t>(layer)];
      const at::Tensor& vbuf = self_v[static_cast<size_t>(layer)];
      TORCH_CHECK(kbuf.size(0) > length && kbuf.size(1) == rows && vbuf.sizes() == kbuf.sizes(),
                  "DecoderStep: a self-attention buffer without room or of another width");
      kbuf.select(0, length).copy_(linear(x, lin[1]).view({rows, heads_, head_dim_}));
      vbuf.select(0, length).copy_(linear(x, lin[2]).view({rows, heads_, head_dim_}));
      const at::Tensor keys = kbuf.narrow(0, 0, length + 1).permute({1, 2, 0, 3});
      const at::Tensor values = vbuf.narrow(0, 0, length + 1).permute({1, 2, 0, 3});
      at::Tensor out = attend(query, keys, values, std::nullopt);
      hidden = sublayer(hidden, linear(out.reshape({rows, 1, -1}), lin[3]), norms[0]);
      hidden = cross_and_feed_forward(hidden, layer, cross_k, cross_v, cross_mask);
    }
    return logits(hidden);
  }

  // Continuous batching (fastgen.continuous.lean): every row at its own position, what the Python step of a
  // continuous batch computes, op for op. ids (rows, 1); positions (rows,) int64: each row's position, where its
  // K/V are written and its position embedding is read; width: the slots the self-attention reads; self_k /
  // self_v: per layer the row-major slot buffers (capacity >= rows, slots >= width, heads * dim)
  // (fastgen.continuous.cache.SlotLayer); self_mask: the 4-D mask the Python step gives the self-attention
  // (None: none); cross_k / cross_v / cross_mask as in step(). Returns the logits (rows, 1, vocab).
  at::Tensor step_rows(const at::Tensor& ids, const at::Tensor& positions, int64_t width,
                       const std::vector<at::Tensor>& self_k, const std::vector<at::Tensor>& self_v,
                       const std::optional<at::Tensor>& self_mask, const std::vector<at::Tensor>& cross_k,
                       const std::vector<at::Tensor>& cross_v, const std::optional<at::Tensor>& cross_mask) {
    check_inputs(ids, self_k, self_v, cross_k, cross_v);
    const int64_t rows = ids.size(0);
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows && positions.scalar_type() == at::kLong,
                "DecoderStep: one int64 position per row");
    const at::Tensor row_index = at::arange(rows, positions.options());
    // the row-major slot write and the (rows, heads, width, dim) view of the slots in use, as SlotLayer.update
    const auto write_and_view = [&](const at::Tensor& buffer, const at::Tensor& states) {
      TORCH_CHECK(buffer.dim() == 3 && buffer.size(0) >= rows && buffer.size(1) >= width &&
                      buffer.size(2) == heads_ * head_dim_,
                  "DecoderStep: a slot buffer without room");
      buffer.index_put_({row_index, positions}, states.reshape({rows, -1}));
      return buffer.narrow(0, 0, rows).narrow(1, 0, width).unflatten(-1, {heads_, head_dim_}).transpose(1, 2);
    };
    at::Tensor embeds = at::embedding(embedding_, ids).mul(embed_scale_);
    at::Tensor hidden = embeds.add(at::embedding(positions_, positions.unsqueeze(1).add(position_offset_)));
    if (layernorm_embedding_) hidden = norm(hidden, norm_embedding_);
    for (int64_t layer = 0; layer < layers_; ++layer) {
      const Linear* lin = &linears_[static_cast<size_t>(layer * kLinearsPerLayer)];
      const std::pair<at::Tensor, at::Tensor>* norms = &norms_[static_cast<size_t>(layer * kNormsPerLayer)];
      // self-attention over each row's own slots
      at::Tensor x = pre_norm_ ? norm(hidden, norms[0]) : hidden;
      at::Tensor query = linear(x, lin[0]).view({rows, 1, heads_, head_dim_}).transpose(1, 2);
      const at::Tensor keys = write_and_view(self_k[static_cast<size_t>(layer)], linear(x, lin[1]));
      const at::Tensor values = write_and_view(self_v[static_cast<size_t>(layer)], linear(x, lin[2]));
      at::Tensor out = attend(query, keys, values, self_mask);
      hidden = sublayer(hidden, linear(out.reshape({rows, 1, -1}), lin[3]), norms[0]);
      hidden = cross_and_feed_forward(hidden, layer, cross_k, cross_v, cross_mask);
    }
    return logits(hidden);
  }

 private:
  void check_inputs(const at::Tensor& ids, const std::vector<at::Tensor>& self_k, const std::vector<at::Tensor>& self_v,
                    const std::vector<at::Tensor>& cross_k, const std::vector<at::Tensor>& cross_v) const {
    TORCH_CHECK(ready(), "DecoderStep: a linear has no op yet");
    TORCH_CHECK(static_cast<int64_t>(self_k.size()) == layers_ && static_cast<int64_t>(self_v.size()) == layers_ &&
                    static_cast<int64_t>(cross_k.size()) == layers_ && static_cast<int64_t>(cross_v.size()) == layers_,
                "DecoderStep: one cache tensor per layer");
    TORCH_CHECK(ids.dim() == 2 && ids.size(1) == 1, "DecoderStep: ids must be (rows, 1)");
  }

  // a layer's cross-attention (an input's hypotheses as query rows of its cached K/V) and feed-forward
  at::Tensor cross_and_feed_forward(at::Tensor hidden, int64_t layer, const std::vector<at::Tensor>& cross_k,
                                    const std::vector<at::Tensor>& cross_v,
                                    const std::optional<at::Tensor>& cross_mask) const {
    const Linear* lin = &linears_[static_cast<size_t>(layer * kLinearsPerLayer)];
    const std::pair<at::Tensor, at::Tensor>* norms = &norms_[static_cast<size_t>(layer * kNormsPerLayer)];
    const int64_t rows = hidden.size(0);
    at::Tensor x = pre_norm_ ? norm(hidden, norms[1]) : hidden;
    const at::Tensor& ck = cross_k[static_cast<size_t>(layer)];
    const int64_t inputs = ck.size(0);
    TORCH_CHECK(inputs > 0 && rows % inputs == 0, "DecoderStep: rows must be a multiple of the inputs");
    const int64_t group = rows / inputs;
    at::Tensor query = linear(x, lin[4]).view({rows, 1, heads_, head_dim_}).transpose(1, 2);
    if (group > 1) query = query.reshape({inputs, group, heads_, 1, head_dim_}).transpose(1, 2).reshape(
                               {inputs, heads_, group, head_dim_});
    at::Tensor out = attend(query, ck, cross_v[static_cast<size_t>(layer)], cross_mask);
    hidden = sublayer(hidden, linear(out.reshape({rows, 1, -1}), lin[5]), norms[1]);
    // feed-forward
    x = pre_norm_ ? norm(hidden, norms[2]) : hidden;
    at::Tensor inner = linear(x, lin[6]);
    const bool fused = fuses_activation(lin[6].kind) || (lin[6].kind == kMklPacked && lin[6].activation != 0);
    if (!fused) inner = activate(inner);
    return sublayer(hidden, linear(inner, lin[7]), norms[2]);
  }

  at::Tensor logits(at::Tensor hidden) const {
    if (pre_norm_) hidden = norm(hidden, norm_final_);
    return linear(hidden, linears_.back()).add_(final_logits_bias_);  // in place: the same bits, no rows x vocab buffer
  }

  at::Tensor norm(const at::Tensor& x, const std::pair<at::Tensor, at::Tensor>& wb) const {
    return at::layer_norm(x, {x.size(-1)}, wb.first, wb.second, eps_);
  }

  // residual + sublayer output, normalised after the sum where the layer is post-norm
  at::Tensor sublayer(const at::Tensor& hidden, const at::Tensor& out,
                      const std::pair<at::Tensor, at::Tensor>& wb) const {
    at::Tensor sum = hidden.add(out);
    return pre_norm_ ? sum : norm(sum, wb);
  }

  at::Tensor activate(const at::Tensor& x) const {
    switch (activation_) {
      case 1:
        return at::gelu(x);
      case 2:
        return at::relu(x);
      case 3:
        return at::silu(x);
      default:
        return x;
    }
  }

  // (B, H, M, D) queries -> (B, M, H, D), as fastgen's CPU attention returns and sdpa_attention_forward does
  at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const std::optional<at::Tensor>& mask) const {
    if (attention_kind_ == kKernel) return attention_op().call(query, key, value, mask, scaling_);
    at::Tensor out = at::scaled_dot_product_attention(query, key, value, mask, 0.0, false, scaling_, false);
    return out.reshape({out.size(0), -1, query.size(2), value.size(-1)}).transpose(1, 2).contiguous();
  }

  static at::Tensor linear(const at::Tensor& x, const Linear& l) {
    if (l.kind == kAtenLinear) return at::linear(x, l.weight, l.bias);
    if (l.kind == kMklPacked) return mkl_packed_op().call(x, l.weight, l.out_features, l.bias, l.activation);
    if (l.kind == kPacked) {  // as fast_gemm calls it: the input as it is, no activation, no algorithm
      torch::jit::Stack stack{x, l.weight, l.bias, std::string("none"), c10::List<std::optional<c10::Scalar>>(),
                              std::optional<std::string>(std::string())};
      packed_op().callBoxed(&stack);
      return stack.back().toTensor();
    }
    at::Tensor x2 = x.reshape({-1, x.size(-1)});
    at::Tensor y;
    if (l.kind == kOrdered) {
      y = ordered_op().call(x2, l.weight, l.bias, l.block, l.bias_at);
    } else if (l.kind == kInt8Onednn) {  // Int8Weight._asymmetric's fused path: the same three ops
      if (!x2.is_contiguous()) x2 = x2.contiguous();
      auto [codes, row_scale, row_zero] = quantize_op().call(x2);
      torch::jit::Stack stack{codes, 1.0, int64_t{0}, l.weight, l.scale, l.zero_points, std::optional<at::Tensor>(),
                              1.0, int64_t{0}, std::optional<at::ScalarType>(at::kFloat), std::string("none"),
                              c10::List<std::optional<c10::Scalar>>(), std::string()};
      onednn_int8_op().callBoxed(&stack);
      y = stack.back().toTensor();
      scale_op().call(y, row_scale, l.bias, l.activation, row_zero, l.col_sums);
    } else {
      if (!x2.is_contiguous()) x2 = x2.contiguous();
      y = int8_op(l.kind == kInt8Amx).call(x2, l.weight, l.out_features, l.scale, l.col_sums, l.bias, l.activation);
    }
    auto shape = x.sizes().vec();
    shape.back() = l.out_features;
    return y.view(shape);
  }

  int64_t layers_ = 0, heads_ = 0, head_dim_ = 0, position_offset_ = 0, attention_kind_ = 0, activation_ = 0;
  bool pre_norm_ = false, layernorm_embedding_ = false;
  double embed_scale_ = 1.0, eps_ = 1e-5, scaling_ = 1.0;
  at::Tensor embedding_, positions_, final_logits_bias_;
  std::pair<at::Tensor, at::Tensor> norm_embedding_, norm_final_;
  std::vector<std::pair<at::Tensor, at::Tensor>> norms_;
  std::vector<Linear> linears_;
};

TORCH_LIBRARY_FRAGMENT(fastgen_cpu, lib) {
  lib.class_<DecoderStep>("DecoderStep")
      .def(torch::init<std::vector<int64_t>, std::vector<double>, std::vector<at::Tensor>>())
      .def("set_linear", &DecoderStep::set_linear)
      .def("ready", &DecoderStep::ready)
      .def("step", &DecoderStep::step)
      .def("step_rows", &DecoderStep::step_rows);
}
