// Products of a few rows by linear weights, for the lean decoder's decode steps on x86 CPUs with AVX2 and FMA.
//
// y[m, n] = sum_k x[m, k] * w[n, k]: each output is the dot product of a row of x with a row of the weight, which
// stays in its nn.Linear layout [out, in] (no copy, nothing to repack when the weights change).  Several weights
// that read the same x (query, key and value; gate and up) write their outputs side by side.  A block of 4 rows
// of x and 2 weight rows keeps 8 running sums of 8 lanes in registers: per 8 values of k, 2 weight loads and 4
// loads of x feed 8 fused multiply-adds.  The weight's rows are split among the intra-op threads in chunks of
// 16 outputs, where there is enough work to pay for waking them (kMinTaskWork).  What comes before a product
// (Llama's RMS norm, its MLP's silu(gate) * up) can run in the kernel too, on x's few rows, in place of a chain of
// small tensor operations, and so can a decode step's attention (attend_one).  Built on first use by hpc_rlhf/engines/few_rows.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R rows of x (stride K) against C weight rows (w0, and w1 where C == 2): y[r * ldy + c].
template <int R, int C>
inline void dots(const float* x, int64_t K, const float* w0, const float* w1, float* y, int64_t ldy) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v0 = _mm256_loadu_ps(w0 + k);
    const __m256 v1 = C > 1 ? _mm256_loadu_ps(w1 + k) : v0;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(xv, v0, acc[r][0]);
      if constexpr (C > 1) acc[r][1] = _mm256_fmadd_ps(xv, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      const float* w = c == 0 ? w0 : w1;
      float s = lane_sum(acc[r][c]);
      for (int64_t t = k; t < K; ++t) s += x[r * K + t] * w[t];  // K's last K % 8 values
      y[r * ldy + c] = s;
    }
  }
}

// R rows of x against weight rows [n0, n1) of w (row n at w + n * K), into columns [n0, n1) of y.
template <int R>
void row_block(const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) dots<R, 2>(x, K, w + n * K, w + (n + 1) * K, y + n, ldy);
  if (n < n1) dots<R, 1>(x, K, w + n * K, nullptr, y + n, ldy);
}

void rows_against(const float* x, int64_t M, int64_t K, const float* w, int64_t n0, int64_t n1, float* y,
                  int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) row_block<4>(x + m * K, K, w, n0, n1, y + m * ldy, ldy);
  switch (M - m) {
    case 3: row_block<3>(x + m * K, K, w, n0, n1, y + m * ldy, ldy); break;
    case 2: row_block<2>(x + m * K, K, w, n0, n1, y + m * ldy, ldy); break;
    case 1: row_block<1>(x + m * K, K, w, n0, n1, y + m * ldy, ldy); break;
    default: break;
  }
}

constexpr int64_t kChunk = 16;  // outputs per task
// Multiply-adds a thread's share must reach before the work is split: waking another thread costs microseconds
// (more where ranks share the cores and OpenMP's threads sleep between regions), a few rows of a tiny model less.
constexpr int64_t kMinTaskWork = 1 << 17;

// at::parallel_for's grain (the fewest items a task takes) for items of `work` multiply-adds each.
inline int64_t grain_for(int64_t work) { return std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(work, 1)); }

}  // namespace

// x [M, K] times each weight [N_i, K] (float32, contiguous) transposed: [M, N_0 + N_1 + ...].  With a norm weight
// [K], x is first RMS-normalised as Llama's norm does it in float32: x * rsqrt(mean(x^2) + eps) * norm_weight.
// With gated, x is [M, 2K], gate and up side by side, and the product's input is silu(gate) * up.
torch::Tensor linear_rows(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                          const std::optional<torch::Tensor>& norm_weight, double eps, bool gated) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32 && x_in.device().is_cpu(),
              "linear_rows: x must be a 2-d float32 CPU tensor");
  TORCH_CHECK(!weights.empty(), "linear_rows: no weights");
  TORCH_CHECK(!(gated && norm_weight.has_value()), "linear_rows: gated and a norm weight exclude each other");
  torch::Tensor x = x_in.contiguous();
  if (gated) {  // x = [gate | up]: the product's input is silu(gate) * up, as Llama's MLP computes it
    TORCH_CHECK(x.size(1) % 2 == 0, "linear_rows: a gated input has an even width, got ", x.size(1));
    const int64_t rows = x.size(0), half = x.size(1) / 2;
    torch::Tensor act = torch::empty({rows, half}, x.options());
    const float* src = x.data_ptr<float>();
    float* dst = act.data_ptr<float>();
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < half; ++k) {
        const float gate = src[m * 2 * half + k];
        dst[m * half + k] = gate / (1.f + std::exp(-gate)) * src[m * 2 * half + half + k];
      }
    x = act;
  }
  const int64_t M = x.size(0), K = x.size(1);
  if (norm_weight.has_value()) {
    const torch::Tensor& g = *norm_weight;
    TORCH_CHECK(g.dim() == 1 && g.size(0) == K && g.scalar_type() == torch::kFloat32 && g.is_contiguous() &&
                    g.device().is_cpu(),
                "linear_rows: the norm weight must be a contiguous float32 CPU tensor [", K, "]");
    torch::Tensor normed = torch::empty_like(x);
    const float* src = x.data_ptr<float>();
    const float* gp = g.data_ptr<float>();
    float* dst = normed.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      const float* row = src + m * K;
      float squares = 0.f;
      for (int64_t k = 0; k < K; ++k) squares += row[k] * row[k];
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(K) + static_cast<float>(eps));
      for (int64_t k = 0; k < K; ++k) dst[m * K + k] = row[k] * scale * gp[k];
    }
    x = normed;
  }
  std::vector<int64_t> start;
  int64_t total = 0;
  for (const auto& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == torch::kFloat32 && w.is_contiguous() &&
                    w.device().is_cpu(),
                "linear_rows: each weight must be a contiguous float32 CPU tensor [out, ", K, "]");
    start.push_back(total);
    total += w.size(0);
  }
  torch::Tensor y = torch::empty({M, total}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (total + kChunk - 1) / kChunk, grain_for(M * K * kChunk), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t g0 = c * kChunk, g1 = std::min(total, g0 + kChunk);  // global output columns
      for (size_t i = 0; i < weights.size(); ++i) {
        const int64_t lo = std::max(g0, start[i]), hi = std::min(g1, start[i] + weights[i].size(0));
        if (lo >= hi) continue;
        // weight i's rows [lo, hi) - start[i] are the output's columns [lo, hi)
        rows_against(xp, M, K, weights[i].data_ptr<float>(), lo - start[i], hi - start[i], yp + start[i], total);
      }
    }
  });
  return y;
}

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = lane_sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

// One decode step's attention: query q [B, nq, D] of each row over its keys and values k, v [B, nkv, S, D] (the
// last dimension contiguous, any strides before it), the slots where valid [B, S] is false left out; query head h
// reads key/value head h / (nq / nkv).  softmax(scale * q . k) . v per row and head: [B, nq * D], heads side by
// side (the output projection's input).  A row with no valid slot gets zeros.
torch::Tensor attend_one(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& valid, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4 && valid.dim() == 2, "attend_one: q [B, nq, D], "
              "k and v [B, nkv, S, D], valid [B, S]");
  const int64_t B = q.size(0), nq = q.size(1), D = q.size(2), nkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && nkv > 0 && nq % nkv == 0 &&
                  valid.size(0) == B && valid.size(1) == S,
              "attend_one: shapes do not match");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->device().is_cpu() && t->stride(-1) == 1,
                "attend_one: q, k and v must be float32 CPU tensors with a contiguous last dimension");
  TORCH_CHECK(valid.scalar_type() == torch::kBool, "attend_one: valid must be boolean");
  const torch::Tensor ok = valid.contiguous();
  torch::Tensor out = torch::empty({B, nq * D}, q.options());
  const int64_t group = nq / nkv;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* okp = ok.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * nq, grain_for(2 * S * D), [&](int64_t i0, int64_t i1) {
    std::vector<float> weight(S);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nq, h = i % nq, kh = h / group;
      const float* qrow = qp + b * q.stride(0) + h * q.stride(1);
      const float* kbase = kp + b * k.stride(0) + kh * k.stride(1);
      const float* vbase = vp + b * v.stride(0) + kh * v.stride(1);
      float top = -INFINITY;
      for (int64_t s = 0; s < S; ++s) {
        weight[s] = okp[b * S + s] ? static_cast<float>(scale) * dot(qrow, kbase + s * k.stride(2), D) : -INFINITY;
        top = std::max(top, weight[s]);
      }
      float* o = op + b * nq * D + h * D;
      std::fill(o, o + D, 0.f);
      if (top == -INFINITY) continue;
      float total = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        if (weight[s] == -INFINITY) continue;
        const float p = std::exp(weight[s] - top);
        total += p;
        const float* vrow = vbase + s * v.stride(2);
        for (int64_t d = 0; d < D; ++d) o[d] += p * vrow[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= total;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_one", &attend_one, "one decode step's attention: q [B, nq, D] over k, v [B, nkv, S, D] where "
        "valid [B, S]: [B, nq * D]");
  m.def("linear_rows", &linear_rows, "x [M, K] (RMS-normalised first with a norm weight; silu(gate) * up if gated) times weights [N_i, K] "
        "transposed, side by side", py::arg("x"), py::arg("weights"), py::arg("norm_weight") = py::none(),
        py::arg("eps") = 0.0, py::arg("gated") = false);
}
