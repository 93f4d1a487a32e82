// The Python module (kernels/cpu_kernels.py wraps it): the functions and RowsStack of the other
// files, the heavy ones called without the GIL.
#include <torch/extension.h>

#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace cpu_kernels;
  // The kernels touch no Python object: they run without the GIL, so the replica's other Python
  // threads (Ray Serve's event loops, gRPC, metrics) run on another core meanwhile instead of
  // waiting for a decoder layer, and the engine thread never waits for them to hand the GIL back.
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("rows_linear", &rows_linear, "row-invariant small-batch x @ w.T + b (weights packed per call)", nogil());
  m.def("rows_attention", &rows_attention, "row-invariant paged attention of a few query tokens", nogil());
  m.def("pack_rows", &pack_rows, "weights [N, K] -> the packed layout of packed_linear / rows_layer",
        py::arg("w"), py::arg("dot_bf16") = false, nogil());
  m.def("pack_rows_int8", &pack_rows_int8, "weights [N, K] -> int8 with a scale per row (a drafter's products)",
        nogil());
  m.def("pack_rows_int4", &pack_rows_int4,
        "weights [N, K] (K % 32 == 0) -> int4 with a bfloat16 scale per row and group of 32 k (a drafter's products)",
        nogil());
  m.def("pack_rows_gguf", &pack_rows_gguf,
        "a GGUF tensor's raw Q4_0/Q4_1/Q8_0 blocks [N, K / 32 * block bytes] -> the GGUF products' layout",
        py::arg("raw"), py::arg("ggml_type"), py::arg("k"), nogil());
  m.def("set_gguf_avx512", &set_gguf_avx512,
        "run the GGUF products' 512-bit kernel where the CPU has AVX512-VNNI (default on; the same bits as the "
        "256-bit one); returns the previous setting");
  m.def("has_vnni", &cpu_has_vnni, "whether this CPU runs the int8 products (AVX512-VNNI)");
  m.def("exp_f32", &exp_f32, "the kernels' vectorized exp (softmax, SiLU), element-wise", nogil());
  m.def("set_amx_attention", &set_amx_attention,
        "bfloat16 caches' rows attention on AMX tiles where it can run (default on; other bits than the dot-product "
        "kernel: never switch while an engine runs); returns the previous setting");
  m.def("set_dot_attention", &set_dot_attention,
        "bfloat16 caches' attention by AVX512-BF16 dot products where the CPU has them (default on); returns the previous setting");
  m.def("set_wide_attention", &set_wide_attention,
        "use the 512-bit attention kernel where the CPU has AVX-512 (default on; the same bits as the 256-bit one); "
        "returns the previous setting");
  m.def("has_avx512", &cpu_has_avx512, "whether this CPU has AVX-512 F/BW/VL (the 512-bit attention kernel)");
  m.def("has_amx", &cpu_has_amx_bf16, "whether this CPU (and the OS) run the dp-packed products on AMX tiles");
  m.def("amx_on", &amx_products, "whether the dp-packed products run on AMX tiles now (has_amx and set_amx)");
  m.def("set_amx", &set_amx,
        "run the dp-packed products on AMX tiles where the CPU has them (default on; other bits than vdpbf16ps); "
        "returns the previous setting");
  m.def("has_dot_bf16", &cpu_has_dot_bf16, "whether this CPU runs the AVX512-BF16 products (dot_bf16 layout)");
  m.def("packed_linear", &packed_linear, "rows_linear with packed weights (bit-identical results)", nogil());
  m.def("packed_linear_rows", &packed_linear_rows, "packed_linear over some rows of x (float32 or bfloat16), no bias",
        nogil());
  m.def("rows_layer", &rows_layer, "one row-invariant pre-norm decoder layer for a few tokens", nogil());
  py::class_<RowsStack>(m, "RowsStack", py::module_local())  // (two builds of these sources can be loaded at once)
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    int64_t, int64_t, int64_t, double, double, std::vector<int64_t>>())
      .def("set_ends", &RowsStack::set_ends, "the embedding, rope tables and final norm forward_tokens uses")
      .def("forward_tokens", &RowsStack::forward_tokens,
           "a few-token step from token ids to final-norm hidden rows (and aux features), model dtype", nogil())
      .def("forward", &RowsStack::forward, "every layer through rows_layer: (last residual stream, aux streams)", nogil());
  m.def("prefill_attention", &prefill_attention,
        "causal paged attention of long query chunks (prefill), bfloat16, AVX512-BF16; row-invariant", nogil());
  m.def("draft_chain", &draft_chain, "chain drafting of an EAGLE-3 head (greedy or sampled): catch-up and every draft in one call",
        nogil());
  m.def("move_slots", &move_slots, "copy rows between slots of paged caches (sources read first)", nogil());
  m.def("stack_tree", &stack_tree, "draft_tree for a draft model's RowsStack and LM head", nogil());
  m.def("feature_tree", &feature_tree, "draft_tree for a one-module feature drafter (native MTP, EAGLE-1)", nogil());
  m.def("draft_tree", &draft_tree, "dynamic trees (greedy or sampled) of an EAGLE-3 head: catch-up and every level in one call",
        nogil());
}
