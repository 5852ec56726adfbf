// The first moment's codecs (none, the statistics dtype, bf16, int8).
// Part of skewadam_cpu.cpp, one translation unit that includes these files in order (its first comment says
// what the kernel does).
#pragma once

#include "pass1.h"

namespace {

// ------------------------------------------------------------------------------------------------ first moment
// The codecs of the first moment's storage. A pass walks a block as spans (NS runs of n elements `stride` apart, the
// first at element e); `update_span<NS>(e, stride, n)` (pass 2) and `read_span<NS>(e, stride)` (pass 3) give a span
// object and its storage pointer `ptr()`, which the pass takes as a __restrict parameter (so the compiler knows the
// momentum's stores alias nothing else it reads) and hands back to `next` / `src` with element i = s * stride + j:
//   next(ptr, i, s, j, x): element i moved towards the gradient x by the EMA, stored, returned as stored (as pass 3
//                          will read it);  src(ptr, i, s, j): u's source in pass 3;  src_pair(ptr, i): elements
//                          i and i + 1's (i even in the run).
// A chunked codec's spans are one run inside one int8 block.

template <class E>
struct NoMom {  // no first moment: u's source is the gradient
  using T = typename E::T;
  using raw = typename E::raw;
  static constexpr bool kChunked = false;
  const raw* g;
  struct Span {
    const raw* p;
    const raw* ptr() const { return p; }
    T next(const raw*, int64_t, int, int64_t, T x) const { return x; }
    T src(const raw* __restrict g, int64_t i, int, int64_t) const { return E::load(g[i]); }
    std::pair<T, T> src_pair(const raw* __restrict g, int64_t i) const { return load_pair<E>(g + i); }
  };
  template <int NS>
  Span update_span(int64_t e, int64_t, int64_t) const { return {g + e}; }
  template <int NS>
  Span read_span(int64_t e, int64_t) const { return {g + e}; }
};

template <class E>
struct PlainMom {  // the statistics dtype
  using T = typename E::T;
  static constexpr bool kChunked = false;
  T* m;
  Ema<T> ema;
  struct Span {
    T* p;
    Ema<T> ema;
    T* ptr() const { return p; }
    T next(T* __restrict m, int64_t i, int, int64_t, T x) const { return m[i] = ema(m[i], x); }
    T src(T* __restrict m, int64_t i, int, int64_t) const { return m[i]; }
    std::pair<T, T> src_pair(T* __restrict m, int64_t i) const { return load_pair<Elem<T>>(m + i); }
  };
  template <int NS>
  Span update_span(int64_t e, int64_t, int64_t) const { return {m + e, ema}; }
  template <int NS>
  Span read_span(int64_t e, int64_t) const { return {m + e, ema}; }
};

struct BF16Mom {  // bf16 with unbiased stochastic rounding (fp32 statistics): rounding.py's bits, quant's key
  using T = float;
  static constexpr bool kChunked = false;
  uint16_t* m;
  uint32_t key;
  Ema<float> ema;
  template <int NS>
  struct Span {
    uint16_t* p;
    Ema<float> ema;
    Rounder r[NS];
    uint16_t* ptr() const { return p; }
    float next(uint16_t* __restrict m, int64_t i, int s, int64_t j, float x) const {
      m[i] = round_bf16(ema(BF16::load(m[i]), x), uint32_t(j), r[s]);
      return BF16::load(m[i]);
    }
    float src(uint16_t* __restrict m, int64_t i, int, int64_t) const { return BF16::load(m[i]); }
    std::pair<float, float> src_pair(uint16_t* __restrict m, int64_t i) const { return load_pair<BF16>(m + i); }
  };
  template <int NS>
  Span<NS> update_span(int64_t e, int64_t stride, int64_t) const {
    Span<NS> sp{m + e, ema, {}};
    for (int s = 0; s < NS; ++s) sp.r[s] = rounder(e + s * stride, key);
    return sp;
  }
  template <int NS>
  Span<NS> read_span(int64_t e, int64_t stride) const { return update_span<NS>(e, stride, 0); }
};

// a * b + c rounded once, also in constant expressions (GCC folds its builtins there).
template <class T>
constexpr T fma_c(T a, T b, T c) {
  if constexpr (std::is_same_v<T, float>)
    return __builtin_fmaf(a, b, c);
  else
    return __builtin_fma(a, b, c);
}

// c = v / QMAX for an int8 code v, the quotient as the division rounds it, from QMAX's reciprocal in two parts (the
// low one exact: 1 - hi * QMAX is, by an FMA), as one multiply and one FMA: divisions bound the int8 loops. Checked
// against the division for every code, at compile time.
template <class T>
struct QRecip {
  static constexpr T hi = T(1) / T(kQMax);
  static constexpr T lo = fma_c(-hi, T(kQMax), T(1)) / T(kQMax);
};
template <class T>
constexpr T code_ratio(int v) {
  return fma_c(T(v), QRecip<T>::hi, T(v) * QRecip<T>::lo);
}
template <class T>
constexpr bool code_ratios_exact() {
  for (int v = -127; v <= 127; ++v)
    if (code_ratio<T>(v) != T(v) / T(kQMax)) return false;
  return true;
}
static_assert(code_ratios_exact<float>() && code_ratios_exact<double>(),
              "quant.QMAX's reciprocal in two parts does not give v / QMAX for every int8 code: decode by division");

// x = (|c| * c) * scale, c = q / QMAX (quant.dequantize).
template <class T>
inline T decode_int8(int8_t v, T scale) {
  const T c = code_ratio<T>(v);
  return std::abs(c) * c * scale;
}

// q = copysign(round(sqrt(fp32(|x| / a)) * QMAX), x), the root correctly rounded (quant.quantize_).
template <class T>
inline int8_t encode_int8(T x, T a) {
  const float r = float(std::abs(x) / a);
  return int8_t(std::copysign(std::nearbyint(std::sqrt(r) * float(kQMax)), float(x)));
}

#ifdef __AVX512F__
// kLanes codes decoded, decode_int8's operations lane by lane (code_ratio's FMA rounds once in both).
inline VF vdecode_int8(__m128i codes, float scale) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
  const __m512 lo = _mm512_mul_ps(v, _mm512_set1_ps(QRecip<float>::lo));
  const __m512 c = _mm512_fmadd_ps(v, _mm512_set1_ps(QRecip<float>::hi), lo);
  return VF(_mm512_mul_ps(_mm512_mul_ps(_mm512_abs_ps(c), c), _mm512_set1_ps(scale)));
}

// encode_int8 of kLanes values, lane by lane: the same operations, and int8_t's conversion as x86 does it (the low
// byte of the truncated int32: a NaN gives 0).
inline __m128i vencode_int8(__m512 x, __m512 a) {
  const __m512 r = _mm512_sqrt_ps(_mm512_div_ps(_mm512_abs_ps(x), a));
  const __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(r, _mm512_set1_ps(float(kQMax))),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // nearbyint
  const __m512i sign = _mm512_set1_epi32(int(0x80000000u));
  const __m512i signed_t = _mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castps_si512(t)),  // copysign
                                           _mm512_and_si512(sign, _mm512_castps_si512(x)));
  return _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_castsi512_ps(signed_t)));
}
#endif

template <class E>
struct Int8Mom {  // int8 codes, one fp32 scale (the block's absmax) per kQBlock values along the last dim
  using T = typename E::T;
  static constexpr bool kChunked = true;
  int8_t* m;
  float* scale;
  int64_t C, NB;
  const typename E::raw* g;
  Ema<T> ema;
  int64_t block(int64_t e) const {
    const int64_t row = e / C;
    return row * NB + (e - row * C) / kQBlock;
  }
  struct Update {  // pass 2: the block's new values, stored, decoded into buf (the caller's array of kQBlock)
    const T* p;
    const T* ptr() const { return p; }
    T next(const T* __restrict buf, int64_t i, int, int64_t, T) const { return buf[i]; }
  };
  struct Read {
    const int8_t* p;
    T sc;
    const int8_t* ptr() const { return p; }
    T src(const int8_t* __restrict q, int64_t i, int, int64_t) const { return decode_int8(q[i], sc); }
    std::pair<T, T> src_pair(const int8_t* __restrict q, int64_t i) const {
      return {decode_int8(q[i], sc), decode_int8(q[i + 1], sc)};
    }
  };
  // The block's new values (decode, EMA), its scale, its codes; buf = the codes decoded.
  template <int NS>
  Update update(T* __restrict buf, int64_t e, int64_t n) const {
    static_assert(NS == 1, "int8 spans are one run inside one block");
    const int64_t k = block(e);
    int8_t* q = m + e;
    const auto* ge = g + e;
    const T s0 = T(scale[k]);
    T mx[kLanes] = {};  // the absmax in lanes (a maximum is exact in any order; one chain would not vectorise)
    int64_t j0 = 0;
#ifdef __AVX512F__
    if constexpr (std::is_same_v<T, float>) {  // GCC vectorises for_lanes' loop 4 lanes wide, its absmax one chain
                                               // of compares: a matrix with int8 momentum took 1.3x the step's time
      const VF b = VF(_mm512_set1_ps(ema.b)), w = VF(_mm512_set1_ps(ema.w));
      __m512 vmx = _mm512_setzero_ps();
      for (; j0 + kLanes <= n; j0 += kLanes) {
        const VF x = vdecode_int8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j0)), s0) * b +
                     vload<E>(ge + j0) * w;
        vstore(buf + j0, x);
        vmx = _mm512_max_ps(_mm512_abs_ps(__m512(x)), vmx);  // std::max(vmx, |x|): NaN gives the second operand
      }
      std::memcpy(mx, &vmx, sizeof vmx);
    }
#endif
    for_lanes(n - j0, [&](int64_t j, int l) {
      buf[j0 + j] = ema(decode_int8(q[j0 + j], s0), E::load(ge[j0 + j]));
      mx[l] = std::max(mx[l], std::abs(buf[j0 + j]));
    });
    const T absmax = *std::max_element(mx, mx + kLanes);
    scale[k] = float(absmax);
    const T a = std::max(absmax, std::numeric_limits<T>::min()), s1 = T(float(absmax));
    int64_t j1 = 0;
#ifdef __AVX512F__
    if constexpr (std::is_same_v<T, float>) {  // GCC's loop takes the codes through int16 to int8 and back
      for (; j1 + kLanes <= n; j1 += kLanes) {
        const __m128i v = vencode_int8(_mm512_loadu_ps(buf + j1), _mm512_set1_ps(a));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j1), v);
        vstore(buf + j1, vdecode_int8(v, s1));
      }
    }
#endif
    for (int64_t j = j1; j < n; ++j) {
      const int8_t v = encode_int8(buf[j], a);
      q[j] = v;
      buf[j] = decode_int8(v, s1);
    }
    return {buf};
  }
  template <int NS>
  Read read_span(int64_t e, int64_t) const { return {m + e, T(scale[block(e)])}; }
};

// f(codec) with q's first-moment codec.
template <class E, class F>
void with_momentum(const Param& q, const Hyper& h, const F& f) {
  using T = typename E::T;
  using raw = typename E::raw;
  switch (q.mfmt) {
    case kMomNone: return f(NoMom<E>{at_<raw>(q.g)});
    case kMomPlain: return f(PlainMom<E>{at_<T>(q.m), Ema<T>(h.beta1)});
    case kMomBF16:
      if constexpr (std::is_same_v<T, float>) return f(BF16Mom{at_<uint16_t>(q.m), q.mkey, Ema<float>(h.beta1)});
      break;
    case kMomInt8: return f(Int8Mom<E>{at_<int8_t>(q.m), q.mscale, q.mC, q.mNB, at_<raw>(q.g), Ema<T>(h.beta1)});
  }
  TORCH_INTERNAL_ASSERT(false, "skewadam C++ CPU kernel: no codec for momentum format ", q.mfmt);
}

// Pass 2's span of codec `mom`: int8 computes the block's new momentum first, into buf (kQBlock elements).
template <int NS, class Mom, class T>
inline auto update_span(const Mom& mom, int64_t e, int64_t stride, int64_t n, T* buf) {
  if constexpr (Mom::kChunked)
    return mom.template update<NS>(buf, e, n);
  else
    return mom.template update_span<NS>(e, stride, n);
}

}  // namespace
