// Python bindings of fastgen._C: checks tensors, then calls the plain-CUDA launchers on the
// current stream. Compiled by the host compiler (the only file here that includes torch).

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <optional>
#include <string>

#include "beam_topk.h"
#include "ngram.h"

namespace {

fastgen::ScoreType score_type_of(const at::Tensor& scores) {
  switch (scores.scalar_type()) {
    case at::kFloat:
      return fastgen::ScoreType::kFloat32;
    case at::kHalf:
      return fastgen::ScoreType::kFloat16;
    case at::kBFloat16:
      return fastgen::ScoreType::kBFloat16;
    default:
      TORCH_CHECK(false, "fastgen: scores/logits must be float32, float16 or bfloat16, got ", scores.scalar_type());
  }
}

at::Tensor rows_contiguous(const at::Tensor& t) { return t.size(1) <= 1 || t.stride(1) == 1 ? t : t.contiguous(); }

// Bans in place; semantics in fastgen/ops/ngram.py. `hay` is `tokens` for the decoder variant.
void ngram_ban(const at::Tensor& hay, const at::Tensor& tokens, const std::optional<at::Tensor>& lengths,
               int64_t length_scalar, at::Tensor scores, int64_t n, int64_t beams, bool decoder) {
  TORCH_CHECK(hay.is_cuda() && tokens.is_cuda() && scores.is_cuda(), "ngram_ban: tensors must be on CUDA");
  TORCH_CHECK(hay.device() == scores.device() && tokens.device() == scores.device(),
              "ngram_ban: tensors must be on one device");
  TORCH_CHECK(hay.dim() == 2 && tokens.dim() == 2 && scores.dim() == 2, "ngram_ban: expected 2-D tensors");
  TORCH_CHECK(tokens.size(0) == scores.size(0), "ngram_ban: tokens and scores differ in rows");
  TORCH_CHECK(hay.scalar_type() == tokens.scalar_type() &&
                  (tokens.scalar_type() == at::kInt || tokens.scalar_type() == at::kLong),
              "ngram_ban: token ids must be int32 or int64 (both inputs alike)");
  TORCH_CHECK(scores.size(1) <= 1 || scores.stride(1) == 1, "ngram_ban: score rows must be contiguous");
  TORCH_CHECK(n >= 1 && n <= INT32_MAX, "ngram_ban: n must be >= 1");
  TORCH_CHECK(beams >= 1 && hay.size(0) * beams == tokens.size(0), "ngram_ban: rows must be inputs x beams");
  const fastgen::ScoreType score_type = score_type_of(scores);
  const at::Tensor tokens_c = rows_contiguous(tokens);
  const at::Tensor hay_c = decoder ? tokens_c : rows_contiguous(hay);
  at::Tensor lengths_c;
  if (lengths.has_value()) {
    lengths_c = lengths->contiguous();
    TORCH_CHECK(lengths_c.scalar_type() == at::kLong && lengths_c.device() == scores.device() &&
                    lengths_c.numel() == tokens.size(0),
                "ngram_ban: lengths must be int64 on the scores' device, one per row");
  }

  const c10::cuda::OptionalCUDAGuard guard(scores.device());
  fastgen::NgramBanArgs args{};
  args.hay = hay_c.data_ptr();
  args.hay_stride = hay_c.stride(0);
  args.hay_width = hay_c.size(1);
  args.tokens = tokens_c.data_ptr();
  args.tokens_stride = tokens_c.stride(0);
  args.tokens_width = tokens_c.size(1);
  args.token_bytes = static_cast<int>(tokens_c.element_size());
  args.lengths = lengths.has_value() ? lengths_c.data_ptr<int64_t>() : nullptr;
  args.length_scalar = length_scalar;
  args.scores = scores.data_ptr();
  args.scores_stride = scores.stride(0);
  args.vocab = scores.size(1);
  args.score_type = score_type;
  args.rows = tokens.size(0);
  args.n = static_cast<int>(n);
  args.beams = beams;
  args.decoder = decoder;
  const cudaError_t err = fastgen::ngram_ban_launch(args, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "ngram_ban: kernel launch failed: ", cudaGetErrorString(err));
}

// Per (row, chunk) candidates and (max, sum of exp); layouts and semantics in fastgen/ops/beam_topk.py.
void beam_topk_retrieve(const at::Tensor& logits, const std::optional<at::Tensor>& mask, int64_t k, int64_t chunk,
                        at::Tensor cand_values, at::Tensor cand_tokens, at::Tensor chunk_max, at::Tensor chunk_sum) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2, "beam_topk_retrieve: logits must be a 2-D CUDA tensor");
  TORCH_CHECK(logits.size(1) <= 1 || logits.stride(1) == 1, "beam_topk_retrieve: logits rows must be contiguous");
  TORCH_CHECK(k >= 1 && k <= 4096 && chunk >= 1, "beam_topk_retrieve: bad k or chunk");
  const int64_t rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  const int64_t num_chunks = (vocab + chunk - 1) / chunk;
  for (const at::Tensor* t : {&cand_values, &chunk_max, &chunk_sum}) {
    TORCH_CHECK(t->device() == logits.device() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "beam_topk_retrieve: outputs must be contiguous float32 on the logits' device");
  }
  TORCH_CHECK(cand_tokens.device() == logits.device() && cand_tokens.scalar_type() == at::kLong &&
                  cand_tokens.is_contiguous(),
              "beam_topk_retrieve: cand_tokens must be contiguous int64 on the logits' device");
  TORCH_CHECK(cand_values.numel() == rows * num_chunks * k && cand_tokens.numel() == rows * num_chunks * k &&
                  chunk_max.numel() == rows * num_chunks && chunk_sum.numel() == rows * num_chunks,
              "beam_topk_retrieve: output sizes do not match rows x chunks x k");
  at::Tensor mask_c;
  if (mask.has_value()) {
    mask_c = *mask;
    TORCH_CHECK(mask_c.device() == logits.device() && mask_c.scalar_type() == at::kByte && mask_c.dim() == 2 &&
                    mask_c.size(1) == vocab && (mask_c.size(0) == 1 || mask_c.size(0) == rows) &&
                    mask_c.stride(1) == 1,
                "beam_topk_retrieve: mask must be uint8 1xV or NxV with contiguous rows");
  }
  const c10::cuda::OptionalCUDAGuard guard(logits.device());
  fastgen::BeamTopkArgs args{};
  args.logits = logits.data_ptr();
  args.logits_stride = logits.stride(0);
  args.logits_type = score_type_of(logits);
  args.mask = mask.has_value() ? mask_c.data_ptr<uint8_t>() : nullptr;
  args.mask_stride = mask.has_value() && mask_c.size(0) == rows && rows > 1 ? mask_c.stride(0) : 0;
  args.rows = rows;
  args.vocab = vocab;
  args.k = static_cast<int>(k);
  args.chunk = static_cast<int>(chunk);
  args.num_chunks = num_chunks;
  args.cand_values = cand_values.data_ptr<float>();
  args.cand_tokens = cand_tokens.data_ptr<int64_t>();
  args.chunk_max = chunk_max.data_ptr<float>();
  args.chunk_sum = chunk_sum.data_ptr<float>();
  const cudaError_t err = fastgen::beam_topk_retrieve_launch(args, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "beam_topk_retrieve: kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastgen CUDA kernels (see fastgen/ops/_ext.py)";
  m.def("ngram_ban", &ngram_ban, "Ban repeated n-grams in place (fastgen.ops.ngram)", py::arg("hay"),
        py::arg("tokens"), py::arg("lengths"), py::arg("length_scalar"), py::arg("scores"), py::arg("n"),
        py::arg("beams"), py::arg("decoder"));
  m.def("beam_topk_retrieve", &beam_topk_retrieve, "Beam top-k retrieval (fastgen.ops.beam_topk)", py::arg("logits"),
        py::arg("mask"), py::arg("k"), py::arg("chunk"), py::arg("cand_values"), py::arg("cand_tokens"),
        py::arg("chunk_max"), py::arg("chunk_sum"));
  m.attr("torch_version") = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                            std::to_string(TORCH_VERSION_PATCH);
  m.attr("cuda_runtime_version") = fastgen::ngram_cuda_runtime_version();
}
