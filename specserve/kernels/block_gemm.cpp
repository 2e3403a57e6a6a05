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
// Row invariance: each output y[r][n] is computed by the same sequence of operations whatever the
// number of rows, the tile it falls in and the thread that runs it (per 32-value block, one fused
// multiply-add of each 16-lane half into a 16-lane accumulator, then one fixed horizontal sum), so a
// row's bits never depend on how many rows share its call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;

// Blocks as the kernel reads them: llama.cpp's, with the fp16 parameters widened to fp32 once at packing
// (exact; converting them at every block cost more than reading the 4 bytes more).
struct BlockQ41 {
  float d;
  float m;
  uint8_t qs[16];  // byte j: value j in the low nibble, value j + 16 in the high one (llama.cpp's order)
};
static_assert(sizeof(BlockQ41) == 24, "Q4_1 block is 24 bytes");

struct BlockQ80 {
  float d;
  int8_t qs[32];
};
static_assert(sizeof(BlockQ80) == 36, "Q8_0 block is 36 bytes");

#if defined(__AVX512F__)
// 16 fp32 lanes in one register.
struct Vec {
  __m512 v;
};
inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float vsum(Vec a) {
  // One fixed tree for every output: halves, quarters, pairs, then the last two lanes.
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
// Q4_1: the block's 16 possible weights d * q + m as a table, looked up by each nibble (vpermps reads
// the low 4 bits of each lane): two lookups and one multiply-add where widening costs four conversions.
inline void dequant(const BlockQ41& b, Vec& lo, Vec& hi) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(b.d), _mm512_set1_ps(b.m));
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs)));
  lo.v = _mm512_permutexvar_ps(bytes, table);
  hi.v = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
inline void dequant(const BlockQ80& b, Vec& lo, Vec& hi) {
  const __m512 d = _mm512_set1_ps(b.d);
  const __m128i* q = reinterpret_cast<const __m128i*>(b.qs);
  lo.v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
  hi.v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
}
constexpr int kFewOut = 4, kFewRows = 4;    // 16 accumulators, 8 weight registers of 32
constexpr int kManyOut = 2, kManyRows = 8;  // 16 accumulators, 4 weight registers
#else
// 16 fp32 lanes in two AVX2 registers.
struct Vec {
  __m256 lo, hi;
};
inline Vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, Vec a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float vsum(Vec a) {
  const __m256 h = _mm256_add_ps(a.lo, a.hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline Vec widen_u8(__m128i bytes) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))};
}
inline Vec widen_i8(__m128i bytes) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
}
inline void dequant(const BlockQ41& b, Vec& lo, Vec& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const Vec d = {_mm256_set1_ps(b.d), _mm256_set1_ps(b.d)}, m = {_mm256_set1_ps(b.m), _mm256_set1_ps(b.m)};
  lo = vfma(widen_u8(_mm_and_si128(bytes, mask)), d, m);
  hi = vfma(widen_u8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)), d, m);
}
inline void dequant(const BlockQ80& b, Vec& lo, Vec& hi) {
  const __m256 d = _mm256_set1_ps(b.d);
  const __m128i* q = reinterpret_cast<const __m128i*>(b.qs);
  const Vec a = widen_i8(_mm_loadu_si128(q)), c = widen_i8(_mm_loadu_si128(q + 1));
  lo = {_mm256_mul_ps(a.lo, d), _mm256_mul_ps(a.hi, d)};
  hi = {_mm256_mul_ps(c.lo, d), _mm256_mul_ps(c.hi, d)};
}
constexpr int kFewOut = 2, kFewRows = 2;  // 8 accumulators of two registers each, of 16
constexpr int kManyOut = 1, kManyRows = 4;
#endif

// y[0 .. R) x [0 .. N) of one tile; every output's operations are the same whatever R and N.
template <typename Block, int N, int R>
inline void tile(const float* x, int64_t in, const Block* w, float* y, int64_t out) {
  const int64_t blocks = in / kBlock;
  Vec acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    Vec lo[N], hi[N];
    for (int n = 0; n < N; ++n) dequant(w[n * blocks + b], lo[n], hi[n]);
    for (int r = 0; r < R; ++r) {
      const Vec xlo = vload(x + r * in + b * kBlock);
      const Vec xhi = vload(x + r * in + b * kBlock + 16);
      for (int n = 0; n < N; ++n) acc[r][n] = vfma(xhi, hi[n], vfma(xlo, lo[n], acc[r][n]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) y[r * out + n] = vsum(acc[r][n]);
}

// The last ``rows`` (< R) rows of N outputs, as one tile of that many rows.
template <typename Block, int N, int R>
inline void remainder(const float* x, int64_t rows, int64_t in, const Block* w, float* y, int64_t out) {
  if constexpr (R > 1) {
    if (rows == R - 1) {
      tile<Block, N, R - 1>(x, in, w, y, out);
    } else {
      remainder<Block, N, R - 1>(x, rows, in, w, y, out);
    }
  }
}

// N outputs, all rows, in tiles of R rows; each tile reads (and de-quantizes) the N outputs' blocks again.
template <typename Block, int N, int R>
void outputs(const float* x, int64_t rows, int64_t in, const Block* w, float* y, int64_t out) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) tile<Block, N, R>(x + r * in, in, w, y + r * out, out);
  if (r < rows) remainder<Block, N, R>(x + r * in, rows - r, in, w, y + r * out, out);
}

// Few rows: more outputs a tile (each block de-quantized once serves every row); many rows: more rows a
// tile (each de-quantized block serves more of them, each input load more outputs).
template <typename Block, int N, int R>
void all_outputs(const float* x, int64_t rows, int64_t in, const Block* wp, float* y, int64_t out) {
  const int64_t blocks = in / kBlock;
  const int64_t tiles = (out + N - 1) / N;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {  // each thread reads its own weights once
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * N;
      const Block* w = wp + n0 * blocks;
      if (n0 + N <= out) {
        outputs<Block, N, R>(x, rows, in, w, y + n0, out);
      } else {
        for (int64_t i = n0; i < out; ++i) outputs<Block, 1, R>(x, rows, in, wp + i * blocks, y + i, out);
      }
    }
  });
}

template <typename Block>
void check(const torch::Tensor& packed, int64_t out, int64_t in) {
  TORCH_CHECK(in % kBlock == 0, "the input dimension must be a multiple of 32");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kUInt8, "packed blocks: contiguous uint8");
  TORCH_CHECK(packed.numel() == out * (in / kBlock) * static_cast<int64_t>(sizeof(Block)), "packed size");
}

template <typename Block>
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& packed, int64_t out, int64_t in) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in, "x must be [rows, ", in, "]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
  check<Block>(packed, out, in);
  const torch::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0);
  torch::Tensor y = torch::empty({rows, out}, xc.options());
  if (rows == 0 || out == 0) return y;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Block* wp = reinterpret_cast<const Block*>(packed.data_ptr<uint8_t>());
  if (rows <= kFewRows) {
    all_outputs<Block, kFewOut, kFewRows>(xp, rows, in, wp, yp, out);
  } else {
    all_outputs<Block, kManyOut, kManyRows>(xp, rows, in, wp, yp, out);
  }
  return y;
}

template <typename Block>
torch::Tensor dequantize(const torch::Tensor& packed, int64_t out, int64_t in) {
  check<Block>(packed, out, in);
  torch::Tensor w = torch::empty({out, in}, torch::TensorOptions().dtype(torch::kFloat32));
  const Block* wp = reinterpret_cast<const Block*>(packed.data_ptr<uint8_t>());
  float* dst = w.data_ptr<float>();
  at::parallel_for(0, out * (in / kBlock), 1024, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      Vec lo, hi;
      dequant(wp[b], lo, hi);
      vstore(dst + b * kBlock, lo);
      vstore(dst + b * kBlock + 16, hi);
    }
  });
  return w;
}

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out, int64_t in) {
  return product<BlockQ41>(x, packed, out, in);
}
torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out, int64_t in) {
  return product<BlockQ80>(x, packed, out, in);
}
torch::Tensor q4_1_dequantize(const torch::Tensor& packed, int64_t out, int64_t in) {
  return dequantize<BlockQ41>(packed, out, in);
}
torch::Tensor q8_0_dequantize(const torch::Tensor& packed, int64_t out, int64_t in) {
  return dequantize<BlockQ80>(packed, out, in);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear, "x [rows, in] fp32 @ W.T for W [out, in] packed as Q4_1 blocks");
  m.def("q8_0_linear", &q8_0_linear, "x [rows, in] fp32 @ W.T for W [out, in] packed as Q8_0 blocks");
  m.def("q4_1_dequantize", &q4_1_dequantize, "W [out, in] fp32 from its Q4_1 blocks");
  m.def("q8_0_dequantize", &q8_0_dequantize, "W [out, in] fp32 from its Q8_0 blocks");
}
