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
}

TORCH_LIBRARY_IMPL(contbatch, CPU, m) {
  m.impl("reshape_and_cache", &contbatch::reshape_and_cache_cpu);
  m.impl("paged_attention", &contbatch::paged_attention_cpu);
  m.impl("copy_blocks", &contbatch::copy_blocks_cpu);
}

PyMODINIT_FUNC PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "contbatch's compiled ops (see torch.ops.contbatch)",
                               -1, nullptr};
  return PyModule_Create(&module);
}
