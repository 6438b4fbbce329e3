// The lean decoder's products and decode steps on x86 CPUs with AVX2 and FMA.
//
// Products of a few rows (linear_rows): y[m, n] = sum_k x[m, k] * w[n, k], each output the dot product of a row of x
// with a row of the weight, which stays in its nn.Linear layout [out, in] (no copy, nothing to repack when the
// weights change).  Several weights that read the same x (query, key and value; gate and up) write their outputs
// side by side.  A block of 4 rows of x and 2 weight rows keeps 8 running sums of 8 lanes in registers: per 8 values
// of k, 2 weight loads and 4 loads of x feed 8 fused multiply-adds.  The weight's rows are split among the intra-op
// threads in chunks of 16 outputs, where there is enough work to pay for waking them (kMinTaskWork).  Products of
// more rows (linear_panels) read a copy of the weights packed in panels of 24 outputs (described there).  What
// comes before a product (Llama's RMS norm, its MLP's silu(gate) * up) runs in the kernel too, on x's rows, in
// place of a chain of small tensor operations, and a residual can start the sums.  A decode step's rotary embedding
// and cache write (rope_store) are one pass; its attention (attend_one), at any row count and over a shared prompt
// prefix too, takes a row's key/value head with all the query heads that read it in one task, so that its keys
// and values come from memory once (the other heads find them in cache).  Built on first use by
// hpc_rlhf/generation/lean/few_rows.py.
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

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = lane_sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
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

// exp(x) for x <= 0, 8 at a time, to about a unit in the last place: x = n ln 2 + r with |r| <= ln(2) / 2,
// exp(r) by Cephes' degree-7 polynomial (its expf coefficients), times 2^n built in the exponent's bits.  Below
// ln(FLT_MIN) (-inf included: the masked slots) the result is 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.3365447504f);  // ln(FLT_MIN)
  const __m256 below = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts, the first exact in float
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(bits)), _mm256_setzero_ps(), below);
}

// silu(gate) * up, 8 at a time: gate * sigmoid(gate), sigmoid(g) = 1 / (1 + e^-g) for g >= 0 and e^g / (1 + e^g)
// below, so that the exponential never exceeds 1.
inline __m256 silu_times(__m256 gate, __m256 up) {
  const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(_mm256_set1_ps(-0.f), gate)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, gate), _mm256_add_ps(one, e));  // e / (1 + e) if g < 0
  return _mm256_mul_ps(_mm256_mul_ps(gate, sig), up);
}

// A product's input: x [M, K] as it is (contiguous), RMS-normalised with a norm weight [K] as Llama's norm does it
// in float32 (x * rsqrt(mean(x^2) + eps) * norm_weight), or, with gated, x = [gate | up] [M, 2K] as silu(gate) * up
// [M, K].  `what` names the calling function in errors.
torch::Tensor product_input(const torch::Tensor& x_in, const std::optional<torch::Tensor>& norm_weight, double eps,
                            bool gated, const char* what) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32 && x_in.device().is_cpu(), what,
              ": x must be a 2-d float32 CPU tensor");
  TORCH_CHECK(!(gated && norm_weight.has_value()), what, ": gated and a norm weight exclude each other");
  torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0);
  if (gated) {
    TORCH_CHECK(x.size(1) % 2 == 0, what, ": a gated input has an even width, got ", x.size(1));
    const int64_t half = x.size(1) / 2;
    torch::Tensor act = torch::empty({M, half}, x.options());
    const float* src = x.data_ptr<float>();
    float* dst = act.data_ptr<float>();
    at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(half, 1)), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        const float* gate = src + m * 2 * half;
        const float* up = gate + half;
        float* out = dst + m * half;
        int64_t k = 0;
        for (; k + 8 <= half; k += 8)
          _mm256_storeu_ps(out + k, silu_times(_mm256_loadu_ps(gate + k), _mm256_loadu_ps(up + k)));
        for (; k < half; ++k) out[k] = gate[k] / (1.f + std::exp(-gate[k])) * up[k];
      }
    });
    return act;
  }
  if (!norm_weight.has_value()) return x;
  const int64_t K = x.size(1);
  const torch::Tensor& g = *norm_weight;
  TORCH_CHECK(g.dim() == 1 && g.size(0) == K && g.scalar_type() == torch::kFloat32 && g.is_contiguous() &&
                  g.device().is_cpu(),
              what, ": the norm weight must be a contiguous float32 CPU tensor [", K, "]");
  torch::Tensor normed = torch::empty_like(x);
  const float* src = x.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* dst = normed.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = src + m * K;
      const float scale = 1.f / std::sqrt(dot(row, row, K) / static_cast<float>(K) + static_cast<float>(eps));
      const __m256 sv = _mm256_set1_ps(scale);
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(dst + m * K + k,
                         _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + k), sv), _mm256_loadu_ps(gp + k)));
      for (; k < K; ++k) dst[m * K + k] = row[k] * scale * gp[k];
    }
  });
  return normed;
}

}  // namespace

// x [M, K] times each weight [N_i, K] (float32, contiguous) transposed: [M, N_0 + N_1 + ...].  With a norm weight
// [K], x is first RMS-normalised as Llama's norm does it in float32: x * rsqrt(mean(x^2) + eps) * norm_weight.
// With gated, x is [M, 2K], gate and up side by side, and the product's input is silu(gate) * up.
torch::Tensor linear_rows(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                          const std::optional<torch::Tensor>& norm_weight, double eps, bool gated) {
  TORCH_CHECK(!weights.empty(), "linear_rows: no weights");
  const torch::Tensor x = product_input(x_in, norm_weight, eps, gated, "linear_rows");
  const int64_t M = x.size(0), K = x.size(1);
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

// Products of many rows (a decode step's dozens, a prefill's hundreds) by weights packed in panels: the weight's
// rows (the outputs) in groups of kPanel = 24, each group stored k-major, [K][24] (pack_panels), so that one step of
// k reads 24 consecutive weights, 3 vectors.  A tile of 4 rows of x keeps 4 x 24 running sums in 12 of the 16
// vector registers: per k, 3 weight loads and 4 broadcasts of x feed 12 fused multiply-adds, which the two FMA
// units take in 6 cycles.  A task takes whole panels; a panel is swept kDepth values of k at a time over the rows
// of a chunk of kRowChunk rows, so that the panel's slice (24 KB) stays in L1 while the rows' slices go by, and the
// chunk's rows (at most 64 x K floats) stay in L2 from one panel to the next.
constexpr int64_t kPanel = 24;
constexpr int64_t kDepth = 256;
constexpr int64_t kRowChunk = 64;

// One row's 24 running sums in three named vectors (an array of vectors indexed in a loop ends up on the stack).
#define PANEL_SUMS(r) __m256 s##r##0, s##r##1, s##r##2;
#define PANEL_LOAD(r)                                                                                   \
  if constexpr (R > r) {                                                                              \
    if (src) {                                                                                         \
      s##r##0 = _mm256_loadu_ps(src + r * ld);                                                         \
      s##r##1 = _mm256_loadu_ps(src + r * ld + 8);                                                     \
      s##r##2 = _mm256_loadu_ps(src + r * ld + 16);                                                    \
    } else {                                                                                           \
      s##r##0 = s##r##1 = s##r##2 = _mm256_setzero_ps();                                               \
    }                                                                                                  \
  }
#define PANEL_FMA(r)                                                                                    \
  if constexpr (R > r) {                                                                              \
    const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                                            \
    s##r##0 = _mm256_fmadd_ps(xb, w0, s##r##0);                                                        \
    s##r##1 = _mm256_fmadd_ps(xb, w1, s##r##1);                                                        \
    s##r##2 = _mm256_fmadd_ps(xb, w2, s##r##2);                                                        \
  }
#define PANEL_STORE(r)                                                                                  \
  if constexpr (R > r) {                                                                              \
    _mm256_storeu_ps(dst + r * ld, s##r##0);                                                           \
    _mm256_storeu_ps(dst + r * ld + 8, s##r##1);                                                       \
    _mm256_storeu_ps(dst + r * ld + 16, s##r##2);                                                      \
  }

// R (1 to 4) rows of x (row r at x + r * ldx) times kc steps of a panel (step k at p + k * kPanel): the sums start
// from src (row r at src + r * ld; zeros where src is null) and go to dst (same layout).
template <int R>
inline void panel_tile(const float* x, int64_t ldx, const float* p, int64_t kc, const float* src, float* dst,
                       int64_t ld) {
  PANEL_SUMS(0) PANEL_SUMS(1) PANEL_SUMS(2) PANEL_SUMS(3)
  PANEL_LOAD(0) PANEL_LOAD(1) PANEL_LOAD(2) PANEL_LOAD(3)
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(p + k * kPanel), w1 = _mm256_loadu_ps(p + k * kPanel + 8),
                 w2 = _mm256_loadu_ps(p + k * kPanel + 16);
    PANEL_FMA(0) PANEL_FMA(1) PANEL_FMA(2) PANEL_FMA(3)
  }
  PANEL_STORE(0) PANEL_STORE(1) PANEL_STORE(2) PANEL_STORE(3)
}
#undef PANEL_SUMS
#undef PANEL_LOAD
#undef PANEL_FMA
#undef PANEL_STORE

// The same into the first `cols` (< kPanel) columns of y's rows (stride ldy): the last panel of a weight whose
// output count is not a multiple of kPanel (its missing rows are zeros in the panel).
template <int R>
void panel_tile_part(const float* x, int64_t ldx, const float* p, int64_t kc, const float* src, float* y,
                     int64_t ldy, int64_t cols) {
  alignas(32) float sums[R * kPanel] = {};
  if (src)
    for (int r = 0; r < R; ++r) std::copy(src + r * ldy, src + r * ldy + cols, sums + r * kPanel);
  panel_tile<R>(x, ldx, p, kc, src ? sums : nullptr, sums, kPanel);
  for (int r = 0; r < R; ++r) std::copy(sums + r * kPanel, sums + r * kPanel + cols, y + r * ldy);
}

// R rows' sums over kc steps of a panel into y (stride ldy), starting from src (same layout; zeros where null).
template <int R>
inline void panel_rows(const float* x, int64_t ldx, const float* p, int64_t kc, const float* src, float* y,
                       int64_t ldy, int64_t cols) {
  if (cols == kPanel)
    panel_tile<R>(x, ldx, p, kc, src, y, ldy);
  else
    panel_tile_part<R>(x, ldx, p, kc, src, y, ldy, cols);
}

}  // namespace

// Weights [N_i, K] (float32, contiguous), their rows stacked (N = N_0 + N_1 + ...), in panels: [ceil(N / 24), K, 24],
// panel j's [k, c] the weight of output 24 j + c at input k; outputs past N are zeros.
torch::Tensor pack_panels(const std::vector<torch::Tensor>& weights) {
  TORCH_CHECK(!weights.empty(), "pack_panels: no weights");
  const int64_t K = weights[0].dim() == 2 ? weights[0].size(1) : -1;
  std::vector<const float*> row;  // output n's weights
  for (const auto& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == torch::kFloat32 && w.is_contiguous() &&
                    w.device().is_cpu(),
                "pack_panels: each weight must be a contiguous float32 CPU tensor [out, ", K, "]");
    for (int64_t i = 0; i < w.size(0); ++i) row.push_back(w.data_ptr<float>() + i * K);
  }
  const int64_t N = static_cast<int64_t>(row.size()), P = (N + kPanel - 1) / kPanel;
  torch::Tensor out = torch::zeros({P, K, kPanel}, weights[0].options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c) {
        const float* w = row[p * kPanel + c];
        for (int64_t k = 0; k < K; ++k) o[(p * K + k) * kPanel + c] = w[k];
      }
  });
  return out;
}

// x [M, K] (RMS-normalised first with a norm weight; silu(gate) * up of x = [gate | up] where gated, as linear_rows)
// times the N outputs of panels [P, K, 24] (pack_panels): [M, N]; plus residual [M, N] where one is given, the sums
// starting from it (a residual connection without a pass of its own).
torch::Tensor linear_panels(const torch::Tensor& x_in, const torch::Tensor& panels, int64_t N,
                            const std::optional<torch::Tensor>& norm_weight, double eps, bool gated,
                            const std::optional<torch::Tensor>& residual) {
  const torch::Tensor x = product_input(x_in, norm_weight, eps, gated, "linear_panels");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == K && panels.size(2) == kPanel &&
                  panels.scalar_type() == torch::kFloat32 && panels.is_contiguous() && panels.device().is_cpu(),
              "linear_panels: panels must be a contiguous float32 CPU tensor [P, ", K, ", ", kPanel, "]");
  const int64_t P = panels.size(0);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "linear_panels: ", P, " panels hold ", (P - 1) * kPanel + 1,
              " to ", P * kPanel, " outputs, not ", N);
  torch::Tensor res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == M && residual->size(1) == N &&
                    residual->scalar_type() == torch::kFloat32 && residual->device().is_cpu(),
                "linear_panels: the residual must be a float32 CPU tensor [", M, ", ", N, "]");
    res = residual->contiguous();
  }
  const float* rp = residual.has_value() ? res.data_ptr<float>() : nullptr;
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, grain_for(M * K * kPanel), [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
          const int64_t kc = std::min(kDepth, K - k0);
          const float* slice = pp + (p * K + k0) * kPanel;
          float* out = yp + p * kPanel;
          // the first steps start from the residual (or zeros), the others from the sums so far
          const float* from = k0 > 0 ? out : rp ? rp + p * kPanel : nullptr;
          int64_t m = m0;
          for (; m + 4 <= m1; m += 4)
            panel_rows<4>(xp + m * K + k0, K, slice, kc, from ? from + m * N : nullptr, out + m * N, N, cols);
          const float* rest = from ? from + m * N : nullptr;
          switch (m1 - m) {
            case 3: panel_rows<3>(xp + m * K + k0, K, slice, kc, rest, out + m * N, N, cols); break;
            case 2: panel_rows<2>(xp + m * K + k0, K, slice, kc, rest, out + m * N, N, cols); break;
            case 1: panel_rows<1>(xp + m * K + k0, K, slice, kc, rest, out + m * N, N, cols); break;
            default: break;
          }
        }
      }
    }
  });
  return y;
}

namespace {

// Dot products of one query with 8 keys (key i at k + i * ks), D values each: the 8 scores in one vector.  Each key
// keeps a running sum of 8 lanes; the 8 sums are then folded lane-wise into one vector (two rounds of pairwise
// additions and one of halves).  D % 8 values left over are added one by one.
inline __m256 dots8(const float* q, const float* k, int64_t ks, int64_t D) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(k + i * ks + d), qv, acc[i]);
  }
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // halves: keys 0-3 | keys 4-7
  __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  if (d < D) {
    alignas(32) float tail[8];
    for (int i = 0; i < 8; ++i) {
      float t = 0.f;
      for (int64_t r = d; r < D; ++r) t += q[r] * k[i * ks + r];
      tail[i] = t;
    }
    s = _mm256_add_ps(s, _mm256_load_ps(tail));
  }
  return s;
}

// A run of cache slots one row reads for one key/value head: n slots, slot s's key at k + s * ks, its value at
// v + s * vs, attended where ok[s].
struct Slots {
  const float* k;
  const float* v;
  int64_t ks, vs, n;
  const bool* ok;
};

// Columns [d, d + 8W) of one head's output: sum over the runs' slots of weight p[s] times value row s, times
// `scale`, the 8W sums kept in registers.  Slots of weight 0 (masked) are skipped.
template <int W>
inline void weigh_values(const float* p, const Slots* runs, int nruns, int64_t d, float scale, float* o) {
  __m256 acc[W];
  for (int c = 0; c < W; ++c) acc[c] = _mm256_setzero_ps();
  int64_t at = 0;
  for (int r = 0; r < nruns; ++r) {
    const Slots& run = runs[r];
    for (int64_t s = 0; s < run.n; ++s) {
      if (p[at + s] == 0.f) continue;
      const __m256 w = _mm256_set1_ps(p[at + s]);
      const float* vrow = run.v + s * run.vs + d;
#pragma GCC unroll 8
      for (int c = 0; c < W; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vrow + 8 * c), acc[c]);
    }
    at += run.n;
  }
  const __m256 f = _mm256_set1_ps(scale);
  for (int c = 0; c < W; ++c) _mm256_storeu_ps(o + d + 8 * c, _mm256_mul_ps(acc[c], f));
}

// The g query heads q + j * qs (j < g) of one row over its runs of slots, one softmax over all of them: outputs at
// o + j * D.  `score` is scratch for g * (sum of n, rounded up to 8) values.
void attend_heads(const float* q, int64_t qs, int64_t g, int64_t D, const Slots* runs, int nruns, float scale,
                  std::vector<float>& score, float* o) {
  int64_t L = 0;
  for (int r = 0; r < nruns; ++r) L += runs[r].n;
  const int64_t padded = (L + 7) / 8 * 8;
  score.resize(g * padded);
  for (int64_t j = 0; j < g; ++j) {
    float* sc = score.data() + j * padded;
    const float* qj = q + j * qs;
    int64_t at = 0;
    for (int r = 0; r < nruns; ++r) {
      const Slots& run = runs[r];
      int64_t s = 0;
      for (; s + 8 <= run.n; s += 8) _mm256_storeu_ps(sc + at + s, dots8(qj, run.k + s * run.ks, run.ks, D));
      for (; s < run.n; ++s) sc[at + s] = dot(qj, run.k + s * run.ks, D);
      for (s = 0; s < run.n; ++s) sc[at + s] = run.ok[s] ? sc[at + s] * scale : -INFINITY;
      at += run.n;
    }
    for (int64_t s = L; s < padded; ++s) sc[s] = -INFINITY;
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (int64_t s = 0; s < padded; s += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sc + s));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top8);
    const float top = *std::max_element(lanes, lanes + 8);
    float* oj = o + j * D;
    std::fill(oj, oj + D, 0.f);
    if (top == -INFINITY) continue;  // no slot to attend: zeros
    __m256 total8 = _mm256_setzero_ps();
    const __m256 shift = _mm256_set1_ps(top);
    for (int64_t s = 0; s < padded; s += 8) {
      const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + s), shift));
      _mm256_storeu_ps(sc + s, p);
      total8 = _mm256_add_ps(total8, p);
    }
    const float inv = 1.f / lane_sum(total8);
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) weigh_values<8>(sc, runs, nruns, d, inv, oj);
    switch ((D - d) / 8) {
      case 7: weigh_values<7>(sc, runs, nruns, d, inv, oj); break;
      case 6: weigh_values<6>(sc, runs, nruns, d, inv, oj); break;
      case 5: weigh_values<5>(sc, runs, nruns, d, inv, oj); break;
      case 4: weigh_values<4>(sc, runs, nruns, d, inv, oj); break;
      case 3: weigh_values<3>(sc, runs, nruns, d, inv, oj); break;
      case 2: weigh_values<2>(sc, runs, nruns, d, inv, oj); break;
      case 1: weigh_values<1>(sc, runs, nruns, d, inv, oj); break;
      default: break;
    }
    d += (D - d) / 8 * 8;
    if (d < D) {  // D % 8 values left over, masked slots skipped as in weigh_values
      at = 0;
      for (int r = 0; r < nruns; ++r) {
        for (int64_t s = 0; s < runs[r].n; ++s) {
          if (sc[at + s] == 0.f) continue;
          for (int64_t t = d; t < D; ++t) oj[t] += sc[at + s] * runs[r].v[s * runs[r].vs + t];
        }
        at += runs[r].n;
      }
      for (int64_t t = d; t < D; ++t) oj[t] *= inv;
    }
  }
}

void check_cache(const torch::Tensor& k, const torch::Tensor& v, int64_t nkv, int64_t D, const char* fn,
                 const char* what) {
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(1) == nkv && k.size(3) == D,
              fn, ": ", what, " keys and values must be [rows, ", nkv, ", slots, ", D, "]");
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->device().is_cpu() && t->stride(-1) == 1,
                fn, ": ", what, " keys and values must be float32 CPU tensors with a contiguous last "
                "dimension");
}

}  // namespace

// One decode step's attention: query q [B, nq, D] of each row over its keys and values k, v [B, nkv, S, D] (the
// last dimension contiguous, any strides before it), the slots where valid [B, S] is false left out; query head h
// reads key/value head h / (nq / nkv).  softmax(scale * q . k) . v per row and head: [B, nq * D], heads side by
// side (the output projection's input).  A row with no valid slot gets zeros.
// With a shared prefix (prefix_keys, prefix_values [U, nkv, P, D], prefix_valid [U, P], prefix_row [B] long), row
// b first reads prefix prefix_row[b]'s slots, then its own, under one softmax.  One task is a row and key/value
// head: its nq / nkv query heads read the same keys and values.
torch::Tensor attend_one(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& valid, double scale, const std::optional<torch::Tensor>& prefix_keys,
                         const std::optional<torch::Tensor>& prefix_values,
                         const std::optional<torch::Tensor>& prefix_valid,
                         const std::optional<torch::Tensor>& prefix_row) {
  TORCH_CHECK(q.dim() == 3 && valid.dim() == 2, "attend_one: q [B, nq, D], k and v [B, nkv, S, D], valid [B, S]");
  const int64_t B = q.size(0), nq = q.size(1), D = q.size(2), nkv = k.dim() == 4 ? k.size(1) : 0,
                S = k.dim() == 4 ? k.size(2) : 0;
  TORCH_CHECK(k.dim() == 4 && k.size(0) == B && nkv > 0 && nq % nkv == 0 && valid.size(0) == B &&
                  valid.size(1) == S,
              "attend_one: shapes do not match");
  check_cache(k, v, nkv, D, "attend_one", "the rows'");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.device().is_cpu() && q.stride(-1) == 1,
              "attend_one: q must be a float32 CPU tensor with a contiguous last dimension");
  TORCH_CHECK(valid.scalar_type() == torch::kBool, "attend_one: valid must be boolean");
  const bool shared = prefix_keys.has_value();
  TORCH_CHECK(shared == prefix_values.has_value() && shared == prefix_valid.has_value() &&
                  shared == prefix_row.has_value(),
              "attend_one: a prefix takes its keys, values, valid and row together");
  torch::Tensor pvalid, prow;
  int64_t U = 0, P = 0;
  if (shared) {
    check_cache(*prefix_keys, *prefix_values, nkv, D, "attend_one", "the prefix's");
    U = prefix_keys->size(0), P = prefix_keys->size(2);
    pvalid = prefix_valid->contiguous();
    prow = prefix_row->contiguous();
    TORCH_CHECK(pvalid.scalar_type() == torch::kBool && pvalid.dim() == 2 && pvalid.size(0) == U &&
                    pvalid.size(1) == P,
                "attend_one: prefix_valid must be boolean [", U, ", ", P, "]");
    TORCH_CHECK(prow.scalar_type() == torch::kLong && prow.dim() == 1 && prow.size(0) == B,
                "attend_one: prefix_row must be long [", B, "]");
    const int64_t* rp = prow.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(rp[b] >= 0 && rp[b] < U, "attend_one: prefix_row[", b, "] = ", rp[b], " is not a prefix (", U, ")");
  }
  const torch::Tensor ok = valid.contiguous();
  torch::Tensor out = torch::empty({B, nq * D}, q.options());
  const int64_t group = nq / nkv;
  const float* qp = q.data_ptr<float>();
  const bool* okp = ok.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * nkv, grain_for(4 * group * (S + P) * D), [&](int64_t i0, int64_t i1) {
    std::vector<float> score;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nkv, kh = i % nkv;
      Slots runs[2];
      int nruns = 0;
      if (shared) {
        const int64_t u = prow.data_ptr<int64_t>()[b];
        const torch::Tensor& pk = *prefix_keys;
        const torch::Tensor& pv = *prefix_values;
        runs[nruns++] = {pk.data_ptr<float>() + u * pk.stride(0) + kh * pk.stride(1),
                         pv.data_ptr<float>() + u * pv.stride(0) + kh * pv.stride(1), pk.stride(2), pv.stride(2), P,
                         pvalid.data_ptr<bool>() + u * P};
      }
      runs[nruns++] = {k.data_ptr<float>() + b * k.stride(0) + kh * k.stride(1),
                       v.data_ptr<float>() + b * v.stride(0) + kh * v.stride(1), k.stride(2), v.stride(2), S,
                       okp + b * S};
      attend_heads(qp + b * q.stride(0) + kh * group * q.stride(1), q.stride(1), group, D, runs, nruns,
                   static_cast<float>(scale), score, op + b * nq * D + kh * group * D);
    }
  });
  return out;
}

// A decode step's rotary embedding and cache write, one pass: qkv [B, (nq + 2 nkv) D] holds each row's query heads,
// key heads and value heads side by side; cos and signed_sin [B, D] the row's rotation (signed_sin's first half
// negated: x * cos + rotate_half(x) * sin = x * cos + roll(x, D / 2) * signed_sin).  The rotated keys and the values
// go to cache slot `slot` of keys and values [B, nkv, S, D] (last dimension contiguous); the rotated queries are
// returned, [B, nq, D].
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                         torch::Tensor& keys, torch::Tensor& values, int64_t slot, int64_t nq) {
  TORCH_CHECK(keys.dim() == 4, "rope_store: keys and values must be [rows, kv heads, slots, head size]");
  check_cache(keys, values, keys.size(1), keys.size(3), "rope_store", "the cache's");
  const int64_t B = keys.size(0), nkv = keys.size(1), S = keys.size(2), D = keys.size(3), h = D / 2;
  TORCH_CHECK(D % 2 == 0 && nkv > 0 && nq > 0, "rope_store: the head size must be even");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == B && qkv.size(1) == (nq + 2 * nkv) * D &&
                  qkv.scalar_type() == torch::kFloat32 && qkv.device().is_cpu() && qkv.stride(1) == 1,
              "rope_store: qkv must be float32 [", B, ", ", (nq + 2 * nkv) * D, "] with contiguous rows");
  for (const auto* t : {&cos, &signed_sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == B && t->size(1) == D && t->scalar_type() == torch::kFloat32 &&
                    t->is_contiguous() && t->device().is_cpu(),
                "rope_store: cos and signed_sin must be contiguous float32 [", B, ", ", D, "]");
  TORCH_CHECK(slot >= 0 && slot < S, "rope_store: slot ", slot, " is outside the cache's ", S, " slots");
  torch::Tensor q = torch::empty({B, nq, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = signed_sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  at::parallel_for(0, B, grain_for(4 * (nq + 2 * nkv) * D), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = src + b * qkv.stride(0);
      const float* c = cp + b * D;
      const float* sn = sp + b * D;
      for (int64_t j = 0; j < nq + nkv; ++j) {
        const float* x = row + j * D;
        float* out = j < nq ? qp + (b * nq + j) * D
                            : kp + b * keys.stride(0) + (j - nq) * keys.stride(1) + slot * keys.stride(2);
        for (int64_t i = 0; i < h; ++i) out[i] = x[i] * c[i] + x[i + h] * sn[i];
        for (int64_t i = h; i < D; ++i) out[i] = x[i] * c[i] + x[i - h] * sn[i];
      }
      for (int64_t j = 0; j < nkv; ++j)
        std::copy(row + (nq + nkv + j) * D, row + (nq + nkv + j + 1) * D,
                  vp + b * values.stride(0) + j * values.stride(1) + slot * values.stride(2));
    }
  });
  return q;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_one", &attend_one, "one decode step's attention: q [B, nq, D] over k, v [B, nkv, S, D] where "
        "valid [B, S], after a shared prefix's slots where one is given: [B, nq * D]", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("valid"), py::arg("scale"), py::arg("prefix_keys") = py::none(),
        py::arg("prefix_values") = py::none(), py::arg("prefix_valid") = py::none(),
        py::arg("prefix_row") = py::none());
  m.def("rope_store", &rope_store, "a decode step's rotary embedding of qkv [B, (nq + 2 nkv) D] with cos and "
        "signed_sin [B, D], its keys and values written to cache slot `slot` of keys, values [B, nkv, S, D]: the "
        "rotated queries [B, nq, D]", py::arg("qkv"), py::arg("cos"), py::arg("signed_sin"), py::arg("keys"),
        py::arg("values"), py::arg("slot"), py::arg("nq"));
  m.def("pack_panels", &pack_panels, "weights [N_i, K] stacked, in panels of 24 outputs: [ceil(N / 24), K, 24]",
        py::arg("weights"));
  m.def("linear_panels", &linear_panels, "x [M, K] (RMS-normalised first with a norm weight; silu(gate) * up if "
        "gated) times the N outputs of pack_panels' panels, plus residual [M, N] if given: [M, N]", py::arg("x"), py::arg("panels"), py::arg("n"),
        py::arg("norm_weight") = py::none(), py::arg("eps") = 0.0, py::arg("gated") = false,
        py::arg("residual") = py::none());
  m.def("linear_rows", &linear_rows, "x [M, K] (RMS-normalised first with a norm weight; silu(gate) * up if gated) times weights [N_i, K] "
        "transposed, side by side", py::arg("x"), py::arg("weights"), py::arg("norm_weight") = py::none(),
        py::arg("eps") = 0.0, py::arg("gated") = false);
}
