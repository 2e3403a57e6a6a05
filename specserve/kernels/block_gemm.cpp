// fp32 products over weights stored in llama.cpp's block formats (Q4_1, Q8_0), exactly.
//
// A weight stored in such a format holds, per block of 32 values along the input dimension, fp16
// parameters and small integers: Q4_1 w = d * q + m (q in 0..15), Q8_0 w = d * q (q in -127..127).
// Such weights de-quantized to fp32 are what transformers loads from a GGUF file, and every one of
// them is computed here again, bit for bit: d * q is exact in fp32 (11 + 8 significant bits), so
// one rounding of d * q + m gives the loaded value whether or not the multiply-add is fused. The
// product then multiplies fp32 inputs by those fp32 weights and sums in fp32: only the order of the
// sums differs from another fp32 kernel, while the bytes read are 6/32 (Q4_1) or 9/32 (Q8_0) of fp32's.
//
// Layout (made by specserve/block_weights.py): outputs in tiles of kLanes (one vector register),
// and per tile and block of 32 inputs, the kLanes outputs' d (and m) widened to fp32, then their
// integers input by input: for Q4_1 one byte per output for each pair of inputs (the even input in
// the low nibble), for Q8_0 one byte per output for each input. So one vector load and a few
// conversions give the weights of kLanes outputs for one input, and each row's input is broadcast
// against them: no horizontal sums, and for many rows each de-quantized weight serves up to kRows.
//
// Row invariance: an output's sum is two chains over the inputs (even ones, odd ones), in input
// order, added at the end; the same for every row count, row tile and thread, so a row's bits never
// depend on how many rows share its call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
// kLanes bytes as fp32 lanes: unsigned (both nibbles), signed.
inline __m512i widen_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec low_nibbles(__m512i b) { return _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))); }
inline Vec high_nibbles(__m512i b) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)); }
inline Vec widen_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
constexpr int kRows = 10;  // rows a tile: 20 accumulators of 32 registers (8 to 14 measured alike, 2-4 slower)
#else
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline __m256i widen_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline Vec low_nibbles(__m256i b) { return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))); }
inline Vec high_nibbles(__m256i b) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }
inline Vec widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
constexpr int kRows = 4;  // rows a tile: 8 accumulators of 16 registers
#endif

// One tile's block: the kLanes outputs' parameters, then their integers input by input.
struct Q41 {
  static constexpr int64_t kBytes = 2 * kLanes * 4 + kBlock / 2 * kLanes;
  // Weights of the kLanes outputs for inputs 2j and 2j + 1, exactly as loaded in fp32.
  static inline void pair(const uint8_t* block, int j, Vec d, Vec m, Vec& even, Vec& odd) {
    const auto bytes = widen_u8(block + 2 * kLanes * 4 + j * kLanes);
    even = vfma(low_nibbles(bytes), d, m);
    odd = vfma(high_nibbles(bytes), d, m);
  }
  static inline Vec scale(const uint8_t* block) { return vload(reinterpret_cast<const float*>(block)); }
  static inline Vec offset(const uint8_t* block) { return vload(reinterpret_cast<const float*>(block) + kLanes); }
};

struct Q80 {
  static constexpr int64_t kBytes = kLanes * 4 + kBlock * kLanes;
  static inline void pair(const uint8_t* block, int j, Vec d, Vec, Vec& even, Vec& odd) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + kLanes * 4) + 2 * j * kLanes;
    even = vmul(widen_i8(q), d);
    odd = vmul(widen_i8(q + kLanes), d);
  }
  static inline Vec scale(const uint8_t* block) { return vload(reinterpret_cast<const float*>(block)); }
  static inline Vec offset(const uint8_t*) { return vzero(); }
};

// y[0 .. R) x [0 .. kLanes) for one output tile; every output's operations are the same whatever R.
template <typename F, int R>
inline void tile(const float* x, int64_t in, const uint8_t* w, float* y, int64_t out) {
  const int64_t blocks = in / kBlock;
  Vec even_sum[R], odd_sum[R];
  for (int r = 0; r < R; ++r) even_sum[r] = odd_sum[r] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * F::kBytes;
    const Vec d = F::scale(block), m = F::offset(block);
    for (int j = 0; j < kBlock / 2; ++j) {
      const int64_t k = b * kBlock + 2 * j;
      Vec even, odd;
      F::pair(block, j, d, m, even, odd);
      for (int r = 0; r < R; ++r) {
        even_sum[r] = vfma(vbroadcast(x + r * in + k), even, even_sum[r]);
        odd_sum[r] = vfma(vbroadcast(x + r * in + k + 1), odd, odd_sum[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) vstore(y + r * out, vadd(even_sum[r], odd_sum[r]));
}

// The last ``rows`` (< R) rows of one output tile, as one tile of that many rows.
template <typename F, int R>
inline void remainder(const float* x, int64_t rows, int64_t in, const uint8_t* w, float* y, int64_t out) {
  if constexpr (R > 1) {
    if (rows == R - 1) {
      tile<F, R - 1>(x, in, w, y, out);
    } else {
      remainder<F, R - 1>(x, rows, in, w, y, out);
    }
  }
}

template <typename F>
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& packed, int64_t out, int64_t in) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in, "x must be [rows, ", in, "]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
  TORCH_CHECK(in % kBlock == 0 && out % kLanes == 0, "in must be a multiple of 32, out of ", kLanes);
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kUInt8, "packed blocks: contiguous uint8");
  TORCH_CHECK(packed.numel() == out / kLanes * (in / kBlock) * F::kBytes, "packed blocks: wrong size");
  const torch::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0);
  torch::Tensor y = torch::empty({rows, out}, xc.options());
  if (rows == 0 || out == 0) return y;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t tile_bytes = in / kBlock * F::kBytes;
  // Threads split the output tiles, each reading its own weights once; each tile runs every row tile (of
  // kRows, the rest as one smaller tile) over its weights while they are in cache.
  at::parallel_for(0, out / kLanes, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* w = wp + t * tile_bytes;
      int64_t r = 0;
      for (; r + kRows <= rows; r += kRows) tile<F, kRows>(xp + r * in, in, w, yp + r * out + t * kLanes, out);
      if (r < rows) remainder<F, kRows>(xp + r * in, rows - r, in, w, yp + r * out + t * kLanes, out);
    }
  });
  return y;
}

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out, int64_t in) {
  return product<Q41>(x, packed, out, in);
}
torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out, int64_t in) {
  return product<Q80>(x, packed, out, in);
}
int64_t lanes() { return kLanes; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear, "x [rows, in] fp32 @ W.T for W [out, in] packed as Q4_1 tiles");
  m.def("q8_0_linear", &q8_0_linear, "x [rows, in] fp32 @ W.T for W [out, in] packed as Q8_0 tiles");
  m.def("lanes", &lanes, "outputs per tile: the fp32 lanes of this build's vector registers");
}
