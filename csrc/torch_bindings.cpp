// Registers the contbatch ops with torch (torch.ops.contbatch.*) and makes this library
// importable as the Python module contbatch._C; importing it is what registers the ops.
// Schemas follow contbatch/ops/reference.py argument for argument.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(contbatch, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window=-1) -> ()");
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
  m.def(
      "sample_rows(Tensor(a!) out, Tensor logits, Tensor temperatures, Tensor top_k, Tensor top_p, Tensor min_p, "
      "Tensor uniform) -> ()");
  m.def("bf16_linear(Tensor(a!) out, Tensor input, Tensor packed_weight, Tensor? bias) -> ()");
  m.def("int8_quantize_rows(Tensor input, int block) -> (Tensor, Tensor)");
  m.def(
      "int8_linear(Tensor(a!) out, Tensor x_values, Tensor x_scales, Tensor values, Tensor scales, "
      "Tensor? bias, int weight_offset=128) -> ()");
  m.def(
      "int8_quantize_linear(Tensor(a!) out, Tensor input, Tensor values, Tensor scales, Tensor? bias, "
      "int weight_offset=128) -> ()");
  m.def("int8_kernel_isa() -> str", &contbatch::int8_kernel_isa);
  m.def("set_int8_kernel(str name) -> str", &contbatch::set_int8_kernel);
  m.def("supported_int8_kernels() -> str[]", &contbatch::supported_int8_kernels);
  m.def("cpu_kernel_isa() -> str", &contbatch::cpu_kernel_isa);
  m.def("set_cpu_isa(str isa) -> ()", &contbatch::set_cpu_isa);
  m.def("supported_cpu_isas() -> str[]", &contbatch::supported_cpu_isas);
  m.def("best_cpu_isa() -> str", &contbatch::best_cpu_isa);
  m.def("amx_linears() -> bool", &contbatch::amx_linears);
  m.def("set_amx_linears(bool on) -> bool", &contbatch::set_amx_linears);
  m.def("amx_int8_linears() -> bool", &contbatch::amx_int8_linears);
  m.def("widened_linears() -> bool", &contbatch::widened_linears);
  m.def("set_widened_linears(bool on) -> bool", &contbatch::set_widened_linears);
}

TORCH_LIBRARY_IMPL(contbatch, CPU, m) {
  m.impl("reshape_and_cache", &contbatch::reshape_and_cache_cpu);
  m.impl("paged_attention", &contbatch::paged_attention_cpu);
  m.impl("copy_blocks", &contbatch::copy_blocks_cpu);
  m.impl("rms_norm", &contbatch::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &contbatch::fused_add_rms_norm_cpu);
  m.impl("silu_and_mul", &contbatch::silu_and_mul_cpu);
  m.impl("rotary_embedding", &contbatch::rotary_embedding_cpu);
  m.impl("argmax_rows", &contbatch::argmax_rows_cpu);
  m.impl("sample_rows", &contbatch::sample_rows_cpu);
  m.impl("bf16_linear", &contbatch::bf16_linear_cpu);
  m.impl("int8_quantize_rows", &contbatch::int8_quantize_rows_cpu);
  m.impl("int8_linear", &contbatch::int8_linear_cpu);
  m.impl("int8_quantize_linear", &contbatch::int8_quantize_linear_cpu);
}

PyMODINIT_FUNC PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "contbatch's compiled ops (see torch.ops.contbatch)",
                               -1, nullptr};
  return PyModule_Create(&module);
}
