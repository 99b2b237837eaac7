// The Llama family's decoder layers run in one C++ call per forward (torch.classes.contbatch.
// DecoderStack, built by contbatch/models/native_decoder.py). Each layer calls the same CPU
// ops, in the same order, on the same tensors as the modules of contbatch/models/llama.py, so
// the results are bit for bit the same; what goes is the Python around them. With few tokens
// a step (decode), that Python was about as long as the ops themselves: ~60 us a layer of
// module calls, op dispatch and views against ~25 us of int8 kernels (SmolLM2, Zen 5).
//
// A stack holds references to the model's weights (PackedLinear: one projection in a kernel's
// layout, and the norms), which the modules own, and, once bound, to the runner's KV cache
// tensors; each forward gets the step's tokens, positions and attention metadata.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../ops.h"

namespace contbatch {
namespace {

// One projection, weight in the layout contbatch/layers/linear.py packed it in.
class PackedLinear : public torch::CustomClassHolder {
 public:
  // layout: "panels" (data: bf16_linear's panels), "int8" (data, scales: the int8
  // kernel's blocks, stored q + weight_offset) or "onednn" (data: oneDNN's blocked weight).
  PackedLinear(const std::string& layout, at::Tensor data, std::optional<at::Tensor> scales,
               std::optional<at::Tensor> bias, int64_t out_features, int64_t weight_offset)
      : layout_(parse_layout(layout)),
        data_(std::move(data)),
        scales_(std::move(scales)),
        bias_(std::move(bias)),
        out_features_(out_features),
        weight_offset_(weight_offset) {
    TORCH_CHECK_VALUE(layout_ != Layout::kInt8 || scales_.has_value(), "PackedLinear: the int8 layout needs its scales");
  }

  // rows: [tokens, in_features], contiguous rows (packed_linear's 2-D case).
  at::Tensor operator()(const at::Tensor& rows) const {
    if (layout_ == Layout::kOneDnn) return onednn_linear(rows);
    at::Tensor out = at::empty({rows.size(0), out_features_}, rows.options());
    if (layout_ == Layout::kInt8) {
      int8_quantize_linear_cpu(out, rows, data_, *scales_, bias_, weight_offset_);
    } else {
      bf16_linear_cpu(out, rows, data_, bias_);
    }
    return out;
  }

 private:
  enum class Layout { kPanels, kInt8, kOneDnn };

  static Layout parse_layout(const std::string& layout) {
    if (layout == "panels") return Layout::kPanels;
    if (layout == "int8") return Layout::kInt8;
    TORCH_CHECK_VALUE(layout == "onednn", "PackedLinear: layout must be panels, int8 or onednn, got ", layout);
    return Layout::kOneDnn;
  }

  // torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], None), as packed_linear
  // calls it. Boxed: the op's unboxed C++ signature is not part of torch's stable headers.
  at::Tensor onednn_linear(const at::Tensor& rows) const {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack{rows, data_, bias_.has_value() ? c10::IValue(*bias_) : c10::IValue(),
                                   c10::IValue(std::string("none")), c10::IValue(c10::List<std::optional<c10::Scalar>>()),
                                   c10::IValue()};
    op.callBoxed(&stack);
    return std::move(stack[0]).toTensor();
  }

  Layout layout_;
  at::Tensor data_;
  std::optional<at::Tensor> scales_, bias_;
  int64_t out_features_;
  int64_t weight_offset_;  // the int8 layout's (int8_kernel_api.h)
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  std::optional<at::Tensor> q_norm, k_norm;  // per head (Qwen3)
  int64_t sliding_window;  // -1: none
  c10::intrusive_ptr<PackedLinear> qkv, o, gate_up, down;
};

// Per step: where the tokens' K/V go and what each sequence attends to (AttentionMetadata).
// The stack serves models whose layers share one KV-cache group, so one of each.
struct StepMetadata {
  const at::Tensor& slot_mapping;
  const at::Tensor& block_tables;
  const at::Tensor& seq_lens;
  const at::Tensor& query_start_loc;
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  // cos, sin: the rotary tables [max_positions, rotary_dim]; final_norm: the model's last
  // RMSNorm; scale multiplies q.k.
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, double eps,
               double scale, at::Tensor cos, at::Tensor sin, at::Tensor final_norm)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        rotary_dim_(rotary_dim),
        eps_(eps),
        scale_(scale),
        cos_(std::move(cos)),
        sin_(std::move(sin)),
        final_norm_(std::move(final_norm)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, int64_t sliding_window, c10::intrusive_ptr<PackedLinear> qkv,
                 c10::intrusive_ptr<PackedLinear> o, c10::intrusive_ptr<PackedLinear> gate_up,
                 c10::intrusive_ptr<PackedLinear> down) {
    TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(), "DecoderStack: q_norm and k_norm come together");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_attention_norm), std::move(q_norm),
                            std::move(k_norm), sliding_window, std::move(qkv), std::move(o), std::move(gate_up),
                            std::move(down)});
  }

  // The KV cache of each layer, in layer order; kept until bound again.
  void bind_caches(std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches) {
    const size_t layers = layers_.size();
    TORCH_CHECK_VALUE(key_caches.size() == layers && value_caches.size() == layers, "DecoderStack.bind_caches: ",
                      layers, " layers, got ", key_caches.size(), " key and ", value_caches.size(), " value caches");
    key_caches_ = std::move(key_caches);
    value_caches_ = std::move(value_caches);
  }

  // The final norm's output [tokens, hidden] for the embedded tokens `hidden` (modified in
  // place, as the Python layers modify it).
  at::Tensor forward(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc) {
    TORCH_CHECK_VALUE(key_caches_.size() == layers_.size(), "DecoderStack.forward: bind_caches first");
    const StepMetadata metadata{slot_mapping, block_tables, seq_lens, query_start_loc};
    at::Tensor residual;
    for (size_t l = 0; l < layers_.size(); ++l) {
      hidden = run_layer(layers_[l], hidden, residual, positions, key_caches_[l], value_caches_[l], metadata);
    }
    fused_add_rms_norm_cpu(hidden, residual, final_norm_, eps_);
    return hidden;
  }

 private:
  // DecoderLayer.forward: returns the MLP's output; `residual` becomes the stream before it.
  at::Tensor run_layer(const Layer& layer, at::Tensor& hidden, at::Tensor& residual, const at::Tensor& positions,
                       at::Tensor& key_cache, at::Tensor& value_cache, const StepMetadata& metadata) const {
    if (!residual.defined()) {
      residual = hidden;
      hidden = at::empty_like(residual);
      rms_norm_cpu(hidden, residual, layer.input_norm, eps_);
    } else {
      fused_add_rms_norm_cpu(hidden, residual, layer.input_norm, eps_);
    }
    at::Tensor attention_out = attention(layer, hidden, positions, key_cache, value_cache, metadata);
    fused_add_rms_norm_cpu(attention_out, residual, layer.post_attention_norm, eps_);
    const at::Tensor gate_up = (*layer.gate_up)(attention_out);
    at::Tensor activated = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul_cpu(activated, gate_up);
    return (*layer.down)(activated);
  }

  // Attention.forward and PagedAttention.forward.
  at::Tensor attention(const Layer& layer, const at::Tensor& hidden, const at::Tensor& positions, at::Tensor& key_cache,
                       at::Tensor& value_cache, const StepMetadata& metadata) const {
    const int64_t tokens = hidden.size(0);
    const at::Tensor heads = (*layer.qkv)(hidden).view({tokens, num_heads_ + 2 * num_kv_heads_, head_dim_});
    at::Tensor q = heads.narrow(1, 0, num_heads_);
    at::Tensor k = heads.narrow(1, num_heads_, num_kv_heads_);
    const at::Tensor v = heads.narrow(1, num_heads_ + num_kv_heads_, num_kv_heads_);
    if (layer.q_norm.has_value()) {
      q = head_norm(q, *layer.q_norm);
      k = head_norm(k, *layer.k_norm);
    }
    if (rotary_dim_ == head_dim_) {
      rotary_embedding_cpu(positions, q, k, cos_, sin_);
    } else {
      at::Tensor q_rotated = q.narrow(2, 0, rotary_dim_), k_rotated = k.narrow(2, 0, rotary_dim_);
      rotary_embedding_cpu(positions, q_rotated, k_rotated, cos_, sin_);
    }
    reshape_and_cache_cpu(k, v, key_cache, value_cache, metadata.slot_mapping);
    at::Tensor out = at::empty({tokens, num_heads_, head_dim_}, q.options());
    paged_attention_cpu(out, q, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                        metadata.query_start_loc, scale_, layer.sliding_window);
    return (*layer.o)(out.view({tokens, num_heads_ * head_dim_}));
  }

  // RMSNorm.forward over each head of x [tokens, heads, head_dim]: a new contiguous tensor.
  at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight) const {
    const at::Tensor rows = x.reshape({-1, head_dim_});
    at::Tensor out = at::empty_like(rows);
    rms_norm_cpu(out, rows, weight, eps_);
    return out.view(x.sizes());
  }

  int64_t num_heads_, num_kv_heads_, head_dim_, rotary_dim_;
  double eps_, scale_;
  at::Tensor cos_, sin_, final_norm_;
  std::vector<Layer> layers_;
  std::vector<at::Tensor> key_caches_, value_caches_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(contbatch, m) {
  m.class_<PackedLinear>("PackedLinear")
      .def(torch::init<const std::string&, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
                       int64_t, int64_t>());
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("bind_caches", &DecoderStack::bind_caches)
      .def("forward", &DecoderStack::forward);
}

}  // namespace contbatch
