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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

// Whether this thread runs the kernels' loops itself, without an OpenMP team (``set_serial``). A thread
// that is not the engine's (the draft head's, beside a verifier in the process or on the same cores) would
// otherwise start a team of its own on its first parallel loop: two teams in a process make libgomp's
// workers stop spinning in both, and the second team's spinning workers take the engine's cores.
thread_local bool serial = false;

template <typename Body>
void for_range(int64_t begin, int64_t end, int64_t grain, const Body& body) {
  if (serial) {
    if (begin < end) body(begin, end);
  } else {
    at::parallel_for(begin, end, grain, body);
  }
}

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
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vround(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vscale2(Vec a, Vec n) { return _mm512_scalef_ps(a, n); }  // a * 2^n, n integral
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
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vround(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vscale2(Vec a, Vec n) {  // a * 2^n, n integral and in fp32's normal exponents
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(a, _mm256_castsi256_ps(e));
}
inline __m256i widen_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline Vec low_nibbles(__m256i b) { return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))); }
inline Vec high_nibbles(__m256i b) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }
inline Vec widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
constexpr int kRows = 4;  // rows a tile: 8 accumulators of 16 registers (5 measured slower: 8 rows 46 ms against 38)
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
  for_range(0, out / kLanes, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* w = wp + t * tile_bytes;
      int64_t r = 0;
      for (; r + kRows <= rows; r += kRows) tile<F, kRows>(xp + r * in, in, w, yp + r * out + t * kLanes, out);
      if (r < rows) remainder<F, kRows>(xp + r * in, rows - r, in, w, yp + r * out + t * kLanes, out);
    }
  });
  return y;
}

// vsum: one vector's lanes summed. vsum_lanes: kLanes vectors' sums at once, lane j of the result the sum of
// a[j]'s lanes: halves, then quarters ... of pairs of vectors added, the same tree of sums for every lane and
// whatever the other vectors hold, then the lanes put back in order (about 3 instructions a sum where vsum
// takes 8).
#if defined(__AVX512F__)
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
inline Vec vsum_lanes(Vec* a) {
  for (int i = 0; i < 8; ++i) {  // a[2i] in the low 256 bits, a[2i + 1] in the high
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit quarter m: vector 4i + m
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int i = 0; i < 2; ++i) {  // quarter m, lanes 0-1: vector 8i + m; lanes 2-3: vector 8i + 4 + m
    a[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const Vec sums = _mm512_add_ps(_mm512_shuffle_ps(a[0], a[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(a[0], a[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4m + t holds vector m + 4t: vector j is at lane 4 (j % 4) + j / 4.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}
#else
inline float vsum(Vec a) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline Vec vsum_lanes(Vec* a) {
  for (int i = 0; i < 4; ++i) {  // a[2i] in the low 128 bits, a[2i + 1] in the high
    a[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  }
  for (int i = 0; i < 2; ++i) {  // half m, lanes 0-1: vector 4i + m; lanes 2-3: vector 4i + 2 + m
    a[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const Vec sums = _mm256_add_ps(_mm256_shuffle_ps(a[0], a[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(a[0], a[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4m + t holds vector m + 2t: vector j is at lane 4 (j % 2) + j / 2.
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

// transformers' RMSNorm of fp32 rows, w * (x * rsqrt(mean(x^2) + eps)), in one call where torch's eager form
// is eight (on a one-token step of SmolLM2 their dispatch cost more than the arithmetic). Each row alone,
// in the same order whatever the row count.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "rms_norm takes fp32 rows and weights");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.numel() == hidden && hidden % kLanes == 0, "rms_norm: hidden size a multiple of ", kLanes);
  const torch::Tensor xc = x.contiguous(), wc = weight.contiguous();
  torch::Tensor y = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xp + r * hidden;
    Vec squares = vzero();
    for (int64_t i = 0; i < hidden; i += kLanes) squares = vfma(vload(row + i), vload(row + i), squares);
    const float scale = 1.0f / std::sqrt(vsum(squares) / static_cast<float>(hidden) + static_cast<float>(eps));
    const Vec s = vbroadcast(&scale);
    for (int64_t i = 0; i < hidden; i += kLanes) vstore(yp + r * hidden + i, vmul(vload(wp + i), vmul(vload(row + i), s)));
  }
  return y;
}

// llama_ops.apply_rotary in one call: x [T, heads, d] (rows may be strided, as a view of the fused QKV
// product's output) times cos [T, 1, d], plus x rolled by d/2 times the sign-folded sin; a multiply, a
// multiply and an add per value, unfused, so the bits are the eager form's.
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32, "rotary takes fp32 [rows, heads, head_dim]");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == dim && half % kLanes == 0, "rotary: contiguous heads, a multiple of ",
              2 * kLanes, " values");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * dim && sin.numel() == rows * dim,
              "rotary: cos and sin [rows, 1, head_dim]");
  torch::Tensor y = torch::empty({rows, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cp + r * dim;
    const float* sn = sp + r * dim;
    for (int64_t h = 0; h < heads; ++h) {
      const float* in = xp + r * x.stride(0) + h * dim;
      float* out = yp + (r * heads + h) * dim;
      for (int64_t i = 0; i < dim; i += kLanes) {
        const int64_t rolled = (i + half) % dim;
        vstore(out + i, vadd(vmul(vload(in + i), vload(c + i)), vmul(vload(in + rolled), vload(sn + i))));
      }
    }
  }
  return y;
}

// e^x for x <= 0 (softmax's shifted scores), Cephes' single-precision form: x = n ln2 + r, |r| <= ln2 / 2,
// e^r by a degree-6 polynomial, times 2^n; within 2 ulp of e^x, and 0 below -87.
inline Vec vexp(Vec x) {
  const float lowest = -87.0f, log2e = 1.44269504088896341f, ln2_hi = -0.693359375f, ln2_lo = 2.12194440e-4f;
  const float one = 1.0f, c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  x = vmax(x, vbroadcast(&lowest));
  const Vec n = vround(vmul(x, vbroadcast(&log2e)));
  const Vec r = vfma(n, vbroadcast(&ln2_lo), vfma(n, vbroadcast(&ln2_hi), x));  // x - n ln2, in two parts
  Vec p = vbroadcast(&c[0]);
  for (int i = 1; i < 6; ++i) p = vfma(p, r, vbroadcast(&c[i]));
  return vscale2(vfma(p, vmul(r, r), vadd(r, vbroadcast(&one))), n);
}

// Attention is read in blocks of this many key (and value) slots: a block, 16 KB at most, stays in L1 while
// every query of a group uses it, where one query at a time read each key and value from L2 once per query.
constexpr int64_t kKeyBlock = 32;
// Most queries (rows x query heads sharing one key-value head) a work item attends together: more share each
// block read; fewer split a step's work more evenly between the threads.
constexpr int64_t kGroupQueries = 8;

// kLanes keys' scores for one query ``q`` (kChunks vectors): each key's dot product as kChunks FMAs, the keys'
// sums at once (vsum_lanes, the same tree of sums in every lane, so a key's score does not depend on its lane),
// times ``scaling``; lanes past ``count`` keys -inf (no key, no weight). ``key(t)``: the t-th key's values.
template <int kChunks, typename Key>
inline Vec score_keys(const Vec* q, int64_t count, const Key& key, Vec scaling) {
  Vec acc[kLanes];
  for (int64_t t = 0; t < kLanes; ++t) {
    acc[t] = vzero();
    if (t >= count) continue;
    const float* k = key(t);
    for (int c = 0; c < kChunks; ++c) acc[t] = vfma(q[c], vload(k + c * kLanes), acc[t]);
  }
  Vec block = vmul(vsum_lanes(acc), scaling);
  if (count < kLanes) {
    alignas(64) float lanes[kLanes];
    vstore(lanes, block);
    for (int64_t t = count; t < kLanes; ++t) lanes[t] = -INFINITY;
    block = vload(lanes);
  }
  return block;
}

// One query of a group: where it reads and writes, and the new rows its mask lets it see after the cached
// tokens (slots from the region's start, in order).
struct Query {
  const float* q;
  float* out;
  std::vector<int64_t> fresh;
};

// A work item's scratch, kept by its thread across items.
struct GroupScratch {
  std::vector<Query> queries;
  std::vector<float> scores;  // per query: its run's scores, then weights, padded to whole vectors
  std::vector<float> sums;    // per query: kChunks vectors of weighted values
};

// Queries that share one key-value head and one region's ``cached`` tokens (a segment's rows, each with some of
// the query heads of that key-value head): each attends over the cached tokens, then the new rows its mask
// allows, in slot order. Per query the operations and their order are attend-one-query-alone's, whatever the
// group: every key scored by score_keys into the run's scores, one pass of maxima over them, one of exponentials
// and their sum in whole vectors along the run, then the values weighted along the run, one FMA chain per
// vector of the output. So a row's bits do not depend on the rows beside it; only the reads are shared: the
// cached keys and values come in blocks of kKeyBlock slots, each used by every query of the group in turn.
template <int kChunks>
void attend_group(GroupScratch& s, int64_t cached, const float* keys, const float* values, float scale) {
  constexpr int64_t dim = kChunks * kLanes;
  const int64_t count = static_cast<int64_t>(s.queries.size());
  int64_t stride = 0;  // per query's scores: its longest run, padded to whole vectors, and one vector more
  for (const Query& query : s.queries) stride = std::max(stride, cached + static_cast<int64_t>(query.fresh.size()));
  stride = (stride + kLanes - 1) / kLanes * kLanes + kLanes;
  s.scores.resize(static_cast<size_t>(count * stride));
  s.sums.resize(static_cast<size_t>(count * dim));
  const Vec scaling = vbroadcast(&scale);
  const float lowest = -INFINITY;
  std::vector<Vec> tops(static_cast<size_t>(count), vbroadcast(&lowest));
  // Scores: the cached keys block by block (each block's keys serving every query), then each query's new rows.
  for (int64_t block = 0; block < cached; block += kKeyBlock) {
    const int64_t end = std::min(block + kKeyBlock, cached);
    for (int64_t g = 0; g < count; ++g) {
      Vec q[kChunks];
      for (int c = 0; c < kChunks; ++c) q[c] = vload(s.queries[g].q + c * kLanes);
      float* scores = s.scores.data() + g * stride;
      for (int64_t j0 = block; j0 < end; j0 += kLanes) {
        const Vec b = score_keys<kChunks>(q, std::min<int64_t>(kLanes, end - j0),
                                          [&](int64_t t) { return keys + (j0 + t) * dim; }, scaling);
        vstore(scores + j0, b);
        tops[g] = vmax(tops[g], b);
      }
    }
  }
  for (int64_t g = 0; g < count; ++g) {
    const Query& query = s.queries[g];
    const int64_t fresh = static_cast<int64_t>(query.fresh.size()), length = cached + fresh;
    Vec q[kChunks];
    for (int c = 0; c < kChunks; ++c) q[c] = vload(query.q + c * kLanes);
    float* scores = s.scores.data() + g * stride;
    for (int64_t i0 = 0; i0 < fresh; i0 += kLanes) {
      const Vec b = score_keys<kChunks>(q, std::min<int64_t>(kLanes, fresh - i0),
                                        [&](int64_t t) { return keys + query.fresh[i0 + t] * dim; }, scaling);
      vstore(scores + cached + i0, b);
      tops[g] = vmax(tops[g], b);
    }
    for (int64_t j = length; j < (length + kLanes - 1) / kLanes * kLanes; ++j) scores[j] = -INFINITY;
    // Weights: e^(score - the run's highest), summed in whole vectors along the run (padding lanes included).
    alignas(64) float lanes[kLanes];
    vstore(lanes, tops[g]);
    const float highest = *std::max_element(lanes, lanes + kLanes);
    const Vec shift = vbroadcast(&highest);
    Vec total = vzero();
    for (int64_t j0 = 0; j0 < length; j0 += kLanes) {
      const Vec e = vexp(vsub(vload(scores + j0), shift));
      vstore(scores + j0, e);
      total = vadd(total, e);
    }
    scores[stride - 1] = 1.0f / vsum(total);  // the norm, past the padded run
  }
  // Values: the cached ones block by block, every query's chains going on where the last block left them, then
  // each query's new rows, and the norm.
  for (int64_t block = 0; block < cached; block += kKeyBlock) {
    const int64_t end = std::min(block + kKeyBlock, cached);
    for (int64_t g = 0; g < count; ++g) {
      float* sum = s.sums.data() + g * dim;
      const float* weights = s.scores.data() + g * stride;
      Vec acc[kChunks];
      for (int c = 0; c < kChunks; ++c) acc[c] = block == 0 ? vzero() : vload(sum + c * kLanes);
      for (int64_t j = block; j < end; ++j) {
        const Vec p = vbroadcast(weights + j);
        const float* value = values + j * dim;
        for (int c = 0; c < kChunks; ++c) acc[c] = vfma(p, vload(value + c * kLanes), acc[c]);
      }
      for (int c = 0; c < kChunks; ++c) vstore(sum + c * kLanes, acc[c]);
    }
  }
  for (int64_t g = 0; g < count; ++g) {
    const Query& query = s.queries[g];
    const float* sum = s.sums.data() + g * dim;
    const float* weights = s.scores.data() + g * stride;
    Vec acc[kChunks];
    for (int c = 0; c < kChunks; ++c) acc[c] = cached == 0 ? vzero() : vload(sum + c * kLanes);
    for (int64_t i = 0; i < static_cast<int64_t>(query.fresh.size()); ++i) {
      const Vec p = vbroadcast(weights + cached + i);
      const float* value = values + query.fresh[i] * dim;
      for (int c = 0; c < kChunks; ++c) acc[c] = vfma(p, vload(value + c * kLanes), acc[c]);
    }
    const Vec n = vbroadcast(weights + stride - 1);
    for (int c = 0; c < kChunks; ++c) vstore(query.out + c * kLanes, vmul(acc[c], n));
  }
}

// Verify segments' attention over the KV arena, every segment of a step in one call a layer (plain
// decoding's one-row segments and trees of draft nodes; ragged_attention.attend_segments runs SDPA for the
// others). Each segment is (first row, rows, region start, cached tokens) with a rows x rows mask over its
// new rows (``allowed``, row-major, the segments' masks one after another): its key and value rows are
// written into the arena at region start + cached + i, then each query head of row i attends over the
// region's cached tokens and the new rows its mask allows, in slot order.
//
// Each row alone, in the same order whatever the other rows (attend_group): the keys a row may see are its
// region's cached ones, then the allowed new ones in slot order. A tree lists parents before children, so a
// draft node sees its context and ancestors in position order: the run plain decoding of that path would
// see, and the row comes out with plain decoding's bits.
void attend_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& keys,
                 torch::Tensor& values, const torch::Tensor& segments, const torch::Tensor& allowed, double scaling,
                 torch::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && keys.scalar_type() == torch::kFloat32, "fp32 attention");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && keys.dim() == 3 && out.is_contiguous(), "attention shapes");
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2), slots = keys.size(1);
  TORCH_CHECK(dim % kLanes == 0 && heads % kv_heads == 0 && keys.is_contiguous() && values.is_contiguous(),
              "attention: head_dim a multiple of ", kLanes);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "attention: contiguous head rows");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 4 && segments.scalar_type() == torch::kInt64,
              "attention: segments as int64 [n, 4]");
  TORCH_CHECK(allowed.scalar_type() == torch::kBool, "attention: a bool mask");
  const torch::Tensor seg = segments.contiguous(), mask = allowed.contiguous();
  const int64_t* sp = seg.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  const int64_t count = seg.size(0), group = heads / kv_heads;
  // One work item per segment, key-value head and run of at most kGroupQueries of its queries (a query: a new
  // row and one of the query heads sharing that key-value head, row by row): (segment, key-value head, where
  // the segment's mask starts, first query, queries).
  std::vector<int64_t> items;
  int64_t mask_at = 0;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t rows = sp[4 * s + 1], slot = sp[4 * s + 2] + sp[4 * s + 3];
    TORCH_CHECK(rows > 0 && slot + rows <= slots && sp[4 * s] + rows <= q.size(0), "attention: rows past the arena");
    // At least two items a thread where the queries allow (one row's few query heads): a thread's last item
    // then waits less for the other's.
    const int64_t queries = rows * group, threads = serial ? 1 : at::get_num_threads();
    const int64_t parts = std::min(queries, std::max((queries + kGroupQueries - 1) / kGroupQueries,
                                                     (2 * threads + kv_heads * count - 1) / (kv_heads * count)));
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      for (int64_t p = 0; p < parts; ++p) {  // as even as whole queries allow
        const int64_t first = queries * p / parts, next = queries * (p + 1) / parts;
        items.insert(items.end(), {s, kvh, mask_at, first, next - first});
      }
    }
    mask_at += rows * rows;
  }
  TORCH_CHECK(mask_at == mask.numel(), "attention: the masks hold ", mask.numel(), " values, the segments ", mask_at);
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  for (int64_t s = 0; s < count; ++s) {  // the new key and value rows first: every head reads them
    const int64_t first = sp[4 * s], rows = sp[4 * s + 1], slot = sp[4 * s + 2] + sp[4 * s + 3];
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = (h * slots + slot + i) * dim;
        std::memcpy(kp + at, k.data_ptr<float>() + (first + i) * k.stride(0) + h * k.stride(1), dim * sizeof(float));
        std::memcpy(vp + at, v.data_ptr<float>() + (first + i) * v.stride(0) + h * v.stride(1), dim * sizeof(float));
      }
    }
  }
  const float scale = static_cast<float>(scaling);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t chunks = dim / kLanes;
  for_range(0, static_cast<int64_t>(items.size()) / 5, 1, [&](int64_t begin, int64_t end) {
    GroupScratch scratch;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t* item = items.data() + 5 * w;
      const int64_t s = item[0], kvh = item[1], mask_row0 = item[2];
      const int64_t first = sp[4 * s], rows = sp[4 * s + 1], start = sp[4 * s + 2], cached = sp[4 * s + 3];
      scratch.queries.resize(static_cast<size_t>(item[4]));
      for (int64_t n = 0; n < item[4]; ++n) {
        const int64_t query = item[3] + n, i = query / group, h = kvh * group + query % group;
        Query& entry = scratch.queries[n];
        entry.q = qp + (first + i) * q.stride(0) + h * q.stride(1);
        entry.out = op + ((first + i) * heads + h) * dim;
        entry.fresh.clear();
        for (int64_t j = 0; j < rows; ++j) {
          if (mp[mask_row0 + i * rows + j]) entry.fresh.push_back(cached + j);
        }
      }
      const int64_t base = (kvh * slots + start) * dim;
      switch (chunks) {
        case 2: attend_group<2>(scratch, cached, kp + base, vp + base, scale); break;
        case 4: attend_group<4>(scratch, cached, kp + base, vp + base, scale); break;
        case 8: attend_group<8>(scratch, cached, kp + base, vp + base, scale); break;
        case 16: attend_group<16>(scratch, cached, kp + base, vp + base, scale); break;
        default: TORCH_CHECK(false, "attention: head_dim of ", chunks, " vectors");
      }
    }
  });
}

// One block product, as the Python side's BlockWeight computes it: format 0 Q4_1, 1 Q8_0; ``padded`` outputs
// (whole tiles), the first ``out`` kept.
torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t format, int64_t out,
                           int64_t padded, int64_t in) {
  torch::Tensor y = format == 0 ? product<Q41>(x, packed, padded, in) : product<Q80>(x, packed, padded, in);
  return padded == out ? y : y.narrow(1, 0, out).contiguous();
}

// One Llama decoder layer over block products, what llama_forward.LlamaForward runs for a layer when every
// segment of the step attends in the kernel: the same operations in the same order (so the same bits), from
// one call instead of some fifteen dispatches from Python. ``weights``: the attention norm, the QKV, O,
// gate-up and down products' packed blocks, the MLP norm; ``shapes``: per product (format, out, padded, in).
// Writes the rows' keys and values into the layer's arena ``keys`` / ``values``; returns the residual stream.
torch::Tensor layer_step(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                         const std::vector<int64_t>& shapes, double eps, const torch::Tensor& cos,
                         const torch::Tensor& sin, torch::Tensor keys, torch::Tensor values,
                         const torch::Tensor& table, const torch::Tensor& allowed, double scaling, int64_t heads,
                         int64_t kv_heads, int64_t head_dim) {
  TORCH_CHECK(weights.size() == 6 && shapes.size() == 16, "layer_step: 6 weights, 4 products' shapes");
  auto linear = [&](const torch::Tensor& in, int i) {
    return block_linear(in, weights[1 + i], shapes[4 * i], shapes[4 * i + 1], shapes[4 * i + 2], shapes[4 * i + 3]);
  };
  const int64_t rows = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const torch::Tensor qkv = linear(rms_norm(x, weights[0], eps), 0);
  const torch::Tensor qk = rotary(qkv.narrow(1, 0, q_size + kv_size).view({rows, heads + kv_heads, head_dim}), cos, sin);
  const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
  torch::Tensor attended = torch::zeros({rows, heads, head_dim}, x.options());
  attend_rows(qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads), v, keys, values, table, allowed, scaling,
              attended);
  const torch::Tensor h = x + linear(attended.view({rows, q_size}), 1);
  const torch::Tensor gate_up = linear(rms_norm(h, weights[5], eps), 2);
  const int64_t intermediate = gate_up.size(1) / 2;
  return h + linear(at::silu(gate_up.narrow(1, 0, intermediate)) * gate_up.narrow(1, intermediate, intermediate), 3);
}

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out, int64_t in) {
  return product<Q41>(x, packed, out, in);
}
torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out, int64_t in) {
  return product<Q80>(x, packed, out, in);
}
int64_t lanes() { return kLanes; }
bool set_serial(bool on) {
  const bool before = serial;
  serial = on;
  return before;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &q4_1_linear, "x [rows, in] fp32 @ W.T for W [out, in] packed as Q4_1 tiles");
  m.def("q8_0_linear", &q8_0_linear, "x [rows, in] fp32 @ W.T for W [out, in] packed as Q8_0 tiles");
  m.def("rms_norm", &rms_norm, "transformers' RMSNorm of fp32 rows [rows, hidden], one call");
  m.def("rotary", &rotary, "llama_ops.apply_rotary of fp32 [rows, heads, head_dim], one call");
  m.def("attend_rows", &attend_rows, "verify segments' attention over the KV arena, with their masks, in place");
  m.def("layer_step", &layer_step, "one Llama decoder layer over block products, its attention in the kernel");
  m.def("set_serial", &set_serial, "this thread runs the kernels' loops itself (True) or on its team; returns before");
  m.def("lanes", &lanes, "outputs per tile: the fp32 lanes of this build's vector registers");
}
