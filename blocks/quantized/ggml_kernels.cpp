// The CPU products of the 32-weight GGUF block formats; compiled on first use by cpu_kernels.py (read its
// docstring for why and how).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// The weights are read as one stream, prefetched twice: into L2 far ahead (L2 keeps more misses in flight than L1,
// which is what one core's bandwidth depends on) and into L1 shortly before use. Measured on the SmolLM2-135M shapes
// (one thread, the whole model's weights per pass): 20% faster than one L1 prefetch 4 KiB ahead, 35% than none.
#ifndef PREFETCH_L1
#define PREFETCH_L1 1024
#endif
#ifndef PREFETCH_L2
#define PREFETCH_L2 8192
#endif
// Blocks of a row whose scales are converted to float32 together (one vector conversion per 16, then broadcast
// from memory, which costs no arithmetic port).
#define SCALE_CHUNK 256

enum Format { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 3, Q5_1 = 4 };

struct Packed {
  const at::Half* d; const at::Half* m; const int32_t* qh; const uint8_t* qs;
  int64_t nb;  // blocks per row
};

// The 32 weights of block g of row n, as decode() computes them: (q - offset) * d, or d * q + m.
template <int F>
static inline void block_values(const Packed& p, int64_t n, int64_t g, float* w) {
  const float d = static_cast<float>(p.d[n * p.nb + g]);
  if (F == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p.qs) + (n * p.nb + g) * 32;
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(q[j]) * d;
    return;
  }
  const uint8_t* q = p.qs + (n * p.nb + g) * 16;
  const uint32_t h = (F == Q5_0 || F == Q5_1) ? static_cast<uint32_t>(p.qh[n * p.nb + g]) : 0u;
  for (int j = 0; j < 16; ++j) {
    int lo = q[j] & 0x0F, hi = q[j] >> 4;
    if (F == Q5_0 || F == Q5_1) { lo |= ((h >> j) & 1u) << 4; hi |= ((h >> (j + 16)) & 1u) << 4; }
    if (F == Q4_0) { w[j] = d * static_cast<float>(lo - 8); w[j + 16] = d * static_cast<float>(hi - 8); }
    else if (F == Q5_0) { w[j] = d * static_cast<float>(lo - 16); w[j + 16] = d * static_cast<float>(hi - 16); }
    else {
      const float m = static_cast<float>(p.m[n * p.nb + g]);
      w[j] = d * static_cast<float>(lo) + m; w[j + 16] = d * static_cast<float>(hi) + m;
    }
  }
}

#if defined(__AVX512F__)
// The same values, in two vectors (weights 0-15 and 16-31), with the same float32 operations.
template <int F>
static inline void block_vectors(const Packed& p, int64_t n, int64_t g, __m512& w0, __m512& w1) {
  const __m512 d = _mm512_set1_ps(static_cast<float>(p.d[n * p.nb + g]));
  if (F == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p.qs) + (n * p.nb + g) * 32;
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)))), d);
    return;
  }
  const __m128i b = _mm_loadu_si128((const __m128i*)(p.qs + (n * p.nb + g) * 16));
  if (F == Q4_0 || F == Q4_1) {
    // The block's 16 possible weights in one vector (d · (i - 8), or d · i + m: the values decode computes), looked
    // up by nibble: vpermps reads the low 4 bits of each 32-bit index, so the low nibbles need no mask.
    const __m512 codes = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 table;
    if (F == Q4_0) {
      table = _mm512_mul_ps(d, _mm512_sub_ps(codes, _mm512_set1_ps(8.0f)));
    } else {
      table = _mm512_add_ps(_mm512_mul_ps(d, codes), _mm512_set1_ps(static_cast<float>(p.m[n * p.nb + g])));
    }
    const __m512i bytes = _mm512_cvtepu8_epi32(b);
    w0 = _mm512_permutexvar_ps(bytes, table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    return;
  }
  const __m128i low = _mm_set1_epi8(0x0F);
  __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(b, low));
  __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low));
  if (F == Q5_0 || F == Q5_1) {
    const uint32_t h = static_cast<uint32_t>(p.qh[n * p.nb + g]);
    const __m512i sixteen = _mm512_set1_epi32(16);
    lo = _mm512_mask_add_epi32(lo, static_cast<__mmask16>(h & 0xFFFFu), lo, sixteen);
    hi = _mm512_mask_add_epi32(hi, static_cast<__mmask16>(h >> 16), hi, sixteen);
  }
  if (F == Q4_0 || F == Q5_0) {
    const __m512i offset = _mm512_set1_epi32(F == Q4_0 ? 8 : 16);
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, offset)));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, offset)));
  } else {
    const __m512 m = _mm512_set1_ps(static_cast<float>(p.m[n * p.nb + g]));
    w0 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m);
    w1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m);
  }
}
#endif

#if defined(__AVX512F__)
// One row of x, for the formats whose weights are d · (q - offset): the block's products with the unscaled codes are
// summed first and scaled by d once (d · q is exact in float32 — an 11-bit scale times a code of at most 6 bits —
// so only the order of the float32 sums differs from multiplying the unpacked weights). Per block this saves a
// multiply per 16 weights and the scale's broadcast before the FMAs; with many rows the weights are unpacked once
// instead (rows<F, R>).
template <int F>
static inline void block_codes(const Packed& p, int64_t n, int64_t g, __m512& c0, __m512& c1) {
  if (F == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p.qs) + (n * p.nb + g) * 32;
    c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
    c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))));
    return;
  }
  const __m128i b = _mm_loadu_si128((const __m128i*)(p.qs + (n * p.nb + g) * 16));
  const __m512i bytes = _mm512_cvtepu8_epi32(b);
  if (F == Q4_0) {  // the code minus 8, looked up by nibble (vpermps reads the low 4 bits of each index)
    const __m512 table = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    c0 = _mm512_permutexvar_ps(bytes, table);
    c1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    return;
  }
  const __m512i low = _mm512_set1_epi32(0x0F), sixteen = _mm512_set1_epi32(16);
  __m512i lo = _mm512_and_si512(bytes, low), hi = _mm512_srli_epi32(bytes, 4);
  const uint32_t h = static_cast<uint32_t>(p.qh[n * p.nb + g]);
  lo = _mm512_mask_add_epi32(lo, static_cast<__mmask16>(h & 0xFFFFu), lo, sixteen);
  hi = _mm512_mask_add_epi32(hi, static_cast<__mmask16>(h >> 16), hi, sixteen);
  c0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, sixteen));
  c1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, sixteen));
}

template <int F>
static void one_row(const float* x, const Packed& weight, float* y, int64_t n0, int64_t n1) {
  // A local copy: stores through y and scale cannot change its fields, which stay in registers (a product of
  // 3072 x 1024 weights from L2 took 218 us through the reference, 190 us with the copy).
  const Packed p = weight;
  const int64_t bytes = (F == Q8_0) ? 32 : 16;
  alignas(64) float scale[SCALE_CHUNK];
  for (int64_t n = n0; n < n1; ++n) {
    const at::Half* d = p.d + n * p.nb;
    const char* stream = reinterpret_cast<const char*>(p.qs) + n * p.nb * bytes;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < p.nb; g0 += SCALE_CHUNK) {
      const int64_t g1 = std::min<int64_t>(p.nb, g0 + SCALE_CHUNK);
      int64_t c = 0;
      for (; g0 + c + 16 <= g1; c += 16) {
        _mm512_store_ps(scale + c, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g0 + c))));
      }
      for (; g0 + c < g1; ++c) scale[c] = static_cast<float>(d[g0 + c]);
      int64_t g = g0;
      for (; g + 1 < g1; g += 2) {
        _mm_prefetch(stream + g * bytes + PREFETCH_L2, _MM_HINT_T1);
        _mm_prefetch(stream + g * bytes + PREFETCH_L1, _MM_HINT_T0);
        __m512 c0, c1, c2, c3;
        block_codes<F>(p, n, g, c0, c1);
        block_codes<F>(p, n, g + 1, c2, c3);
        const float* xr = x + 32 * g;
        const __m512 t0 = _mm512_fmadd_ps(c1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(c0, _mm512_loadu_ps(xr)));
        const __m512 t1 = _mm512_fmadd_ps(c3, _mm512_loadu_ps(xr + 48), _mm512_mul_ps(c2, _mm512_loadu_ps(xr + 32)));
        acc0 = _mm512_fmadd_ps(_mm512_set1_ps(scale[g - g0]), t0, acc0);
        acc1 = _mm512_fmadd_ps(_mm512_set1_ps(scale[g + 1 - g0]), t1, acc1);
      }
      if (g < g1) {
        __m512 c0, c1;
        block_codes<F>(p, n, g, c0, c1);
        const float* xr = x + 32 * g;
        const __m512 t0 = _mm512_fmadd_ps(c1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(c0, _mm512_loadu_ps(xr)));
        acc0 = _mm512_fmadd_ps(_mm512_set1_ps(scale[g - g0]), t0, acc0);
      }
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
}
#endif

// y[r, n] = sum_k x[r, k] * w[n, k] for the R rows of x, output rows n0 <= n < n1.
template <int F, int R>
static void rows(const float* x, int64_t K, const Packed& weight, float* y, int64_t N, int64_t n0, int64_t n1) {
  const Packed p = weight;  // as in one_row
  for (int64_t n = n0; n < n1; ++n) {
#if defined(__AVX512F__)
    // Four independent accumulators per row (two blocks at a time, each block's two halves apart): one chain of
    // dependent FMAs would hold a row to one FMA latency per 16 weights, below memory speed.
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) for (int a = 0; a < 4; ++a) acc[r][a] = _mm512_setzero_ps();
    int64_t g = 0;
    // Bytes per block of qs; the weights are read as one stream over the rows, prefetched as in one_row.
    const int64_t bytes = (F == Q8_0) ? 32 : 16;
    const char* stream = reinterpret_cast<const char*>(p.qs) + n * p.nb * bytes;
    for (; g + 1 < p.nb; g += 2) {
      _mm_prefetch(stream + g * bytes + PREFETCH_L2, _MM_HINT_T1);
      _mm_prefetch(stream + g * bytes + PREFETCH_L1, _MM_HINT_T0);
      __m512 w0, w1, w2, w3;
      block_vectors<F>(p, n, g, w0, w1);
      block_vectors<F>(p, n, g + 1, w2, w3);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + 32 * g;
        acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xr + 32), acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xr + 48), acc[r][3]);
      }
    }
    if (g < p.nb) {
      __m512 w0, w1;
      block_vectors<F>(p, n, g, w0, w1);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + 32 * g;
        acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
      y[r * N + n] = _mm512_reduce_add_ps(sum);
    }
#else
    float acc[R][32] = {};
    float w[32];
    for (int64_t g = 0; g < p.nb; ++g) {
      block_values<F>(p, n, g, w);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + 32 * g;
        for (int j = 0; j < 32; ++j) acc[r][j] += w[j] * xr[j];
      }
    }
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int j = 0; j < 32; ++j) s += acc[r][j];
      y[r * N + n] = s;
    }
#endif
  }
}

template <int F>
static void pass(const float* x, int64_t R, int64_t K, const Packed& p, float* y, int64_t N, int64_t n0, int64_t n1) {
#if defined(__AVX512F__)
  if (R == 1 && (F == Q8_0 || F == Q4_0 || F == Q5_0)) { one_row<F>(x, p, y, n0, n1); return; }
#endif
  switch (R) {
    case 1: rows<F, 1>(x, K, p, y, N, n0, n1); break;
    case 2: rows<F, 2>(x, K, p, y, N, n0, n1); break;
    case 3: rows<F, 3>(x, K, p, y, N, n0, n1); break;
    case 4: rows<F, 4>(x, K, p, y, N, n0, n1); break;
    case 5: rows<F, 5>(x, K, p, y, N, n0, n1); break;
    case 6: rows<F, 6>(x, K, p, y, N, n0, n1); break;
    case 7: rows<F, 7>(x, K, p, y, N, n0, n1); break;
    default: rows<F, 8>(x, K, p, y, N, n0, n1); break;
  }
}

// x times several weights of the same width (q, k and v; gate and up), each in its own format, written side by side
// into one output: one op call and one output for the layers that read the same input.
torch::Tensor ggml_mm(const torch::Tensor& input, at::IntArrayRef formats, at::TensorList packed) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == torch::kFloat32, "x must be a 2-d float32 tensor");
  const torch::Tensor x = input.contiguous();
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32");
  static const int64_t fields[] = {2, 2, 3, 3, 4};  // packed tensors per format (FORMATS)
  std::vector<Packed> weights;
  std::vector<int64_t> formats_of, offsets{0};
  size_t t = 0;
  for (const int64_t format : formats) {
    TORCH_CHECK(format >= 0 && format <= Q5_1, "unknown format ", format);
    TORCH_CHECK(t + fields[format] <= packed.size(), "fewer packed tensors than the formats need");
    const torch::Tensor& qs = packed[t + fields[format] - 1];
    Packed p{packed[t].data_ptr<at::Half>(), nullptr, nullptr, static_cast<const uint8_t*>(qs.data_ptr()), K / 32};
    if (format == Q4_1 || format == Q5_1) p.m = packed[t + 1].data_ptr<at::Half>();
    if (format == Q5_0) p.qh = packed[t + 1].data_ptr<int32_t>();
    if (format == Q5_1) p.qh = packed[t + 2].data_ptr<int32_t>();
    weights.push_back(p);
    formats_of.push_back(format);
    offsets.push_back(offsets.back() + qs.size(0));
    t += fields[format];
  }
  TORCH_CHECK(t == packed.size(), "more packed tensors than the formats need");
  const int64_t N = offsets.back();
  auto y = torch::empty({R, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Output rows (of all the weights, in order) are split over torch's threads; rows of x go in passes of up to 8
  // (one read of the weight each).
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (size_t w = 0; w < weights.size(); ++w) {
      const int64_t n0 = std::max(begin, offsets[w]) - offsets[w], n1 = std::min(end, offsets[w + 1]) - offsets[w];
      if (n0 >= n1) continue;
      for (int64_t r0 = 0; r0 < R; r0 += 8) {
        const int64_t r = std::min<int64_t>(8, R - r0);
        const float* xr = xp + r0 * K;
        float* yr = yp + r0 * N + offsets[w];  // rows of y are N apart
        const Packed& p = weights[w];
        switch (formats_of[w]) {
          case Q8_0: pass<Q8_0>(xr, r, K, p, yr, N, n0, n1); break;
          case Q4_0: pass<Q4_0>(xr, r, K, p, yr, N, n0, n1); break;
          case Q4_1: pass<Q4_1>(xr, r, K, p, yr, N, n0, n1); break;
          case Q5_0: pass<Q5_0>(xr, r, K, p, yr, N, n0, n1); break;
          default: pass<Q5_1>(xr, r, K, p, yr, N, n0, n1); break;
        }
      }
    }
  });
  return y;
}

// A dispatcher op (not a Python binding): compiled graphs and eager calls reach it without Python in between.
TORCH_LIBRARY(zoo_ggml, m) { m.def("ggml_mm(Tensor x, int[] formats, Tensor[] packed) -> Tensor"); }
TORCH_LIBRARY_IMPL(zoo_ggml, CPU, m) { m.impl("ggml_mm", &ggml_mm); }
