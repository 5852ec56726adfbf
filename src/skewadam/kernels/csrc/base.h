// The kernel's foundations: the constants cpu.py passes, element types, stochastic rounding, the SIMD streams, work
// items, tensors worked on in place.
// Part of skewadam_cpu.cpp, one translation unit that includes these files in order (its first comment says
// what the kernel does).
#pragma once

#include <torch/extension.h>
#include <pybind11/stl.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // vload and vmadd on AVX-512 and FMA
#endif
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#if !defined(SKEWADAM_QBLOCK) || !defined(SKEWADAM_QMAX) || !defined(SKEWADAM_MOMENTUM_STREAM) || \
    !defined(SKEWADAM_WEIGHTED_BF16_MAX) || !defined(SKEWADAM_MUL1) || !defined(SKEWADAM_MUL2) || \
    !defined(SKEWADAM_GOLDEN) || \
    !defined(SKEWADAM_ROW_MEAN_FLOOR) || !defined(SKEWADAM_RELATIVE_STEP_EPS) || !defined(SKEWADAM_MOM_PLAIN) || \
    !defined(SKEWADAM_MOM_BF16) || !defined(SKEWADAM_MOM_INT8) || !defined(SKEWADAM_MOM_NONE)
#error "build this file with skewadam/kernels/cpu.py: it passes the constants of quant.py, rounding.py and types.py"
#endif

namespace py = pybind11;

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int64_t kBlock = SKEWADAM_BLOCK;           // cpu.BLOCK: target elements per work item
constexpr int64_t kMinBlockRows = SKEWADAM_MIN_BLOCK_ROWS;  // cpu.MIN_BLOCK_ROWS: bounds pass 1's column partials
constexpr int64_t kWeightedBf16Max = SKEWADAM_WEIGHTED_BF16_MAX;  // cpu.WEIGHTED_BF16_MAX: bytes of a unit's gradient
constexpr int64_t kSerialBelow = int64_t(1) << 18;   // elements: less work than this runs on one thread
constexpr int64_t kQBlock = SKEWADAM_QBLOCK;         // quant.BLOCK: int8 momentum values per scale (last dim)
constexpr double kQMax = SKEWADAM_QMAX;              // quant.QMAX: the int8 grid's largest code
constexpr uint32_t kMomentumStream = SKEWADAM_MOMENTUM_STREAM;  // quant.MOMENTUM_STREAM: bf16 momentum's bits
constexpr double kRowMeanFloor = SKEWADAM_ROW_MEAN_FLOOR;       // types.ROW_MEAN_FLOOR
constexpr double kRelativeStepEps = SKEWADAM_RELATIVE_STEP_EPS; // types.RELATIVE_STEP_EPS
static_assert(kQBlock > 0 && kQBlock <= 4096 && kQMax > 0 && kQMax <= 127, "quant.BLOCK / QMAX out of range");
static_assert(kBlock > 0 && kMinBlockRows > 0, "cpu.BLOCK / MIN_BLOCK_ROWS out of range");
// types.MomFmt, the one numbering of the compiled kernels: first moment in the math dtype, bf16, int8, or none
enum MomFmt : int {
  kMomPlain = SKEWADAM_MOM_PLAIN,
  kMomBF16 = SKEWADAM_MOM_BF16,
  kMomInt8 = SKEWADAM_MOM_INT8,
  kMomNone = SKEWADAM_MOM_NONE
};

// ------------------------------------------------------------------------------------------------ elements
template <class P>
struct Elem;
template <>
struct Elem<float> {
  using raw = float;
  using T = float;
  static float load(float x) { return x; }
};
template <>
struct Elem<double> {
  using raw = double;
  using T = double;
  static double load(double x) { return x; }
};
template <>
struct Elem<c10::BFloat16> {
  using raw = uint16_t;
  using T = float;
  static float load(uint16_t b) { return __builtin_bit_cast(float, uint32_t(b) << 16); }
};
using BF16 = Elem<c10::BFloat16>;

template <class F>
void by_dtype(at::ScalarType st, const F& f) {
  switch (st) {
    case at::kFloat: f(Elem<float>{}); break;
    case at::kDouble: f(Elem<double>{}); break;
    case at::kBFloat16: f(BF16{}); break;
    default: TORCH_CHECK(false, "skewadam C++ CPU kernel: unsupported parameter dtype ", st, " (fp32, fp64, bf16)");
  }
}

at::ScalarType math_dtype(at::ScalarType st) { return st == at::kBFloat16 ? at::kFloat : st; }

// a * b + c, fused where the CPU has FMA: for the sums of squares and the weight's update, which depend on sums and
// so agree with eager only to rounding anyway (the element-wise state, bitwise eager's, is never computed with it).
template <class T>
inline T madd(T a, T b, T c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// The EMA s * beta + x * (1 - beta), both coefficients rounded from double: eager.ema, operation for operation. (No
// choice of form inside the loops, as torch.lerp makes: a branch there stops GCC vectorising them.)
template <class T>
struct Ema {
  T b, w;
  explicit Ema(double beta) : b(T(beta)), w(T(1.0 - beta)) {}
  T operator()(T s, T x) const { return s * b + x * w; }
};

// ------------------------------------------------------------------------------------------------ rounding
constexpr uint32_t kMul1 = SKEWADAM_MUL1, kMul2 = SKEWADAM_MUL2, kGolden = SKEWADAM_GOLDEN;  // rounding.py's

// 8 rounding keys, one a lane (GCC's vector operators work lane by lane).
using VU8 = uint32_t [[gnu::vector_size(8 * sizeof(uint32_t))]];

// rounding.py's hash, of one key or of 8 lanes.
template <class U>
inline U mix32(U x) {
  static_assert(std::is_same_v<U, uint32_t> || std::is_same_v<U, VU8>, "mix32 hashes uint32_t keys");
  x ^= x >> 16;
  x *= kMul1;
  x ^= x >> 15;
  x *= kMul2;
  x ^= x >> 16;
  return x;
}

inline uint32_t rounding_key(int64_t seed, int64_t param_index, int64_t step) {
  return mix32(mix32(mix32(uint32_t(seed)) ^ uint32_t(param_index)) + uint32_t(step));
}

// Stochastic rounding of a run of elements whose first one is element `first` of its tensor: the bits of
// rounding.py, from hash (key, index / 2), low half for even and high half for odd indices. Offsets j within a run
// are < 2^31, so the index arithmetic stays in 32-bit lanes.
struct Rounder {
  uint32_t pair0, odd, key;
};

inline Rounder rounder(int64_t first, uint32_t key) { return {uint32_t(first >> 1), uint32_t(first & 1), key}; }

// x + bits, truncated to bf16, in the high half of a 32-bit word; a NaN x as c10::BFloat16 writes NaN, whatever its
// sign and payload (the add alone could carry it into inf, or past the sign bit to zero).
inline uint32_t add_truncate_hi(float x, uint32_t bits) {
  return std::isnan(x) ? 0x7FC00000u : (__builtin_bit_cast(uint32_t, x) + bits) & 0xFFFF0000u;  // isnan: one compare
}

// The same in the low half (no mask: the shift drops the low bits).
inline uint32_t add_truncate_lo(float x, uint32_t bits) {
  return std::isnan(x) ? 0x7FC0u : (__builtin_bit_cast(uint32_t, x) + bits) >> 16;
}

inline uint16_t add_truncate(float x, uint32_t bits) { return uint16_t(add_truncate_lo(x, bits)); }

// Element j of a run, rounded.
inline uint16_t round_bf16(float x, uint32_t j, const Rounder& r) {
  const uint32_t jj = j + r.odd;
  const uint32_t h = mix32((r.pair0 + (jj >> 1)) * kGolden + r.key);
  return add_truncate(x, (jj & 1u) ? (h >> 16) : (h & 0xFFFFu));
}

// Elements p[0] and p[1] in the math dtype. Two bf16 are one 32-bit word (element 0 in its low half), split by a
// shift and a mask: a SIMD lane holds a pair, and reading bf16 pairs needs no shuffle.
static_assert(std::endian::native == std::endian::little, "bf16 pairs are read as little-endian 32-bit words");
template <class E>
inline std::pair<typename E::T, typename E::T> load_pair(const typename E::raw* p) {
  if constexpr (std::is_same_v<typename E::raw, uint16_t>) {
    uint32_t w;
    std::memcpy(&w, p, sizeof w);
    return {__builtin_bit_cast(float, w << 16), __builtin_bit_cast(float, w & 0xFFFF0000u)};
  } else {
    return {E::load(p[0]), E::load(p[1])};
  }
}

// f(0), ..., f(N - 1), unrolled in the source: GCC meets a loop over a few runs inside a SIMD loop by vectorising
// across the runs (4 lanes, with scalar loads and stores) instead of along them.
template <int N, class F>
inline void unrolled(const F& f) {
  [&]<int... S>(std::integer_sequence<int, S...>) { (f(S), ...); }(std::make_integer_sequence<int, N>{});
}

// p[s * stride + j] = value(s, j) for j < n and NS runs, the runs' first elements being rounders r[s] (bf16: rounded
// stochastically). Runs that start at an even index and hold an even count take one hash per pair of elements,
// pair(s, k) giving elements 2k and 2k + 1 (load_pair's lanes: the pair's hash, its two values and its stored word
// share one 32-bit lane, so the loop has no shuffle); others one hash per element. Runs hold < 2^31 elements, so
// the index arithmetic stays in 32-bit lanes, which vectorise the hash best. Always inlined: called, it reaches
// value and pair through their closures, whose pointers a 32-bit store might alias, so GCC reloads them per element
// and gathers (3x slower).
template <class E, int NS, class F, class F2>
[[gnu::always_inline]] inline void write_runs(typename E::raw* __restrict p, int64_t stride, int64_t n, const Rounder* r, const F& value,
                       const F2& pair) {
  const uint32_t n32 = uint32_t(n);
  if constexpr (!std::is_same_v<typename E::raw, uint16_t>) {
#pragma omp simd
    for (uint32_t j = 0; j < n32; ++j)
      for (int s = 0; s < NS; ++s) p[s * stride + j] = value(s, j);
  } else {
    bool pairs = n32 % 2 == 0;
    uint32_t h0[NS];  // the hash input of run s's pair k is h0[s] + k * kGolden
    for (int s = 0; s < NS; ++s) {
      pairs = pairs && r[s].odd == 0;
      h0[s] = r[s].pair0 * kGolden + r[s].key;
    }
    if (pairs) {
#pragma omp simd
      for (uint32_t k = 0; k < n32 / 2; ++k)
        unrolled<NS>([&](int s) {
          const auto [x0, x1] = pair(s, k);
          const uint32_t h = mix32(h0[s] + k * kGolden);
          const uint32_t w = add_truncate_lo(x0, h & 0xFFFFu) | add_truncate_hi(x1, h >> 16);
          std::memcpy(p + s * stride + 2 * k, &w, sizeof w);
        });
    } else {
#pragma omp simd
      for (uint32_t j = 0; j < n32; ++j)
        for (int s = 0; s < NS; ++s) p[s * stride + j] = round_bf16(value(s, j), j, r[s]);
    }
  }
}

// ------------------------------------------------------------------------------------------------ streams
// The hot loops walk kStreams runs far apart at once (on Zen 4 one stream read at ~60% of several's rate): two, as
// four took Zen 5 ~1.1x the fp32 step's time and Zen 4 the same (bf16 pass 1: kP1Streams; pass 3: one). Sums go to
// kLanes independent partial sums added in a fixed tree: the order, hence the result, is the same whatever the
// SIMD width or thread count.
constexpr int kStreams = 2;
constexpr int kLanes = 16;
template <int N>
using Int = std::integral_constant<int, N>;

template <class T>
inline T lanes_sum(const T* a) {
  // the tree in vector halves: written per lane, GCC adds the 16 lanes one by one through the stack
  using V8 [[gnu::vector_size(8 * sizeof(T))]] = T;
  using V4 [[gnu::vector_size(4 * sizeof(T))]] = T;
  V8 lo, hi;
  std::memcpy(&lo, a, sizeof lo);
  std::memcpy(&hi, a + 8, sizeof hi);
  const V8 b = lo + hi;  // b[k] = a[k] + a[k + 8]
  V4 b0, b1;
  std::memcpy(&b0, &b, sizeof b0);
  std::memcpy(&b1, reinterpret_cast<const char*>(&b) + sizeof b0, sizeof b1);
  const V4 c = b0 + b1;  // c[k] = b[k] + b[k + 4]
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// x[0] + ... + x[N - 1] as a fixed tree of halves. A loop that adds its NS runs' terms to a lane this way carries
// one add per iteration from one to the next, not NS dependent ones (which bound the loop by the adder's latency).
template <int N, class T>
inline T tree_sum(const T* x) {
  if constexpr (N == 1)
    return x[0];
  else
    return tree_sum<N / 2>(x) + tree_sum<N - N / 2>(x + N / 2);
}

// body(j, k) for j < n, element j accumulating into lane k = j % kLanes; whole groups of kLanes vectorised, U of
// them an iteration (so that a sum the body carries from one j to the next, as pass 1's column sums do, is U
// independent chains, not one bound by the adder's latency). Each lane sees its elements in the order of j whatever U.
template <int U = 1, class F>
inline void for_lanes(int64_t n, const F& body) {
  int64_t j = 0;
  for (; j + U * kLanes <= n; j += U * kLanes) {
#pragma omp simd
    for (int k = 0; k < kLanes; ++k)
      for (int u = 0; u < U; ++u) body(j + u * kLanes + k, k);
  }
  for (; j + kLanes <= n; j += kLanes) {
#pragma omp simd
    for (int k = 0; k < kLanes; ++k) body(j + k, k);
  }
  for (int k = 0; k < n - j; ++k) body(j + k, k);
}

// kLanes floats as one vector, for pass 1's loops: from scalar code GCC widens bf16 8 lanes at a time, with a shuffle
// for each half (pass 1 of the bf16 expert banks took ~1.1x the time: docs/guide/kernels.md). Each lane does the
// scalar loop's operations in its order (madd: fused where the CPU has FMA), so the results are the same bits.
using VF = float [[gnu::vector_size(kLanes * sizeof(float))]];

// Elements p[0, kLanes) as floats.
template <class E>
inline VF vload(const typename E::raw* p) {
  static_assert(std::is_same_v<typename E::T, float>, "vectors of floats");
  if constexpr (std::is_same_v<typename E::raw, uint16_t>) {
#ifdef __AVX512F__
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return VF(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#else
    using VH = uint16_t [[gnu::vector_size(kLanes * sizeof(uint16_t))]];
    using VW = uint32_t [[gnu::vector_size(kLanes * sizeof(uint32_t))]];
    VH h;
    std::memcpy(&h, p, sizeof h);
    return reinterpret_cast<VF>(__builtin_convertvector(h, VW) << 16);
#endif
  } else {
    VF x;
    std::memcpy(&x, p, sizeof x);
    return x;
  }
}

inline void vstore(float* p, VF x) { std::memcpy(p, &x, sizeof x); }

// A hint to fetch the line a page past p. The hardware prefetcher stops at a 4 KiB page's end, and pass 1's runs pause
// at each row for its sums' arithmetic: with it, Zen 5 took ~0.92x the fp32 expert banks' step time
// (docs/guide/kernels.md). A prefetch never faults, and the address is an integer, so one past a tensor's end is safe.
constexpr uintptr_t kPrefetchAhead = 4096;
inline void prefetch_ahead(const void* p) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + kPrefetchAhead));
}

// madd, lane by lane.
inline VF vmadd(VF a, VF b, VF c) {
#if defined(__AVX512F__) && defined(__FMA__)
  return VF(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#elif defined(__FMA__)
  using V8 = float [[gnu::vector_size(8 * sizeof(float))]];
  V8 h[3][2];
  std::memcpy(h[0], &a, sizeof a);
  std::memcpy(h[1], &b, sizeof b);
  std::memcpy(h[2], &c, sizeof c);
  for (int k = 0; k < 2; ++k) h[2][k] = V8(_mm256_fmadd_ps(__m256(h[0][k]), __m256(h[1][k]), __m256(h[2][k])));
  std::memcpy(&c, h[2], sizeof c);
  return c;
#else
  return a * b + c;
#endif
}

// f(ns, i, q): rows [i0, i1) as groups of S rows i, i + q, i + 2q, ...; the rows left over one at a time.
template <int S = kStreams, class F>
inline void row_groups(int64_t i0, int64_t i1, const F& f) {
  const int64_t q = (i1 - i0) / S;
  for (int64_t k = 0; k < q; ++k) f(Int<S>{}, i0 + k, q);
  for (int64_t i = i0 + S * q; i < i1; ++i) f(Int<1>{}, i, int64_t(0));
}

// f(ns, e, n, stride): elements [e0, e1) as S runs of n elements, `stride` apart; the rest as one run.
template <int S = kStreams, class F>
inline void run_groups(int64_t e0, int64_t e1, const F& f) {
  const int64_t n = (e1 - e0) / (S * kLanes) * kLanes;
  if (n) f(Int<S>{}, e0, n, n);
  if (e0 + S * n < e1) f(Int<1>{}, e0 + S * n, e1 - e0 - S * n, int64_t(0));
}

// ------------------------------------------------------------------------------------------------ work items
// Run f(i) for i < n on ATen's threads, each thread taking the next item when it is free. Work of fewer than
// kSerialBelow elements runs on the calling thread: waking a pool thread costs more than it saves there (up to a
// scheduler time slice, milliseconds, when other processes load the machine).
template <class F>
void run_items(int64_t n, int64_t elements, const F& f) {
  const int64_t nt = elements < kSerialBelow ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  if (nt <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      f(i);
  });
}

// Tensors to work on in place, contiguous: a non-contiguous one is copied, and written back by `finish`, which also
// bumps the version counters of the tensors written (as torch's in-place ops do, so autograd notices).
struct Contig {
  std::vector<std::pair<Tensor, Tensor>> writeback;
  std::vector<Tensor> keep, written;
  const void* read(const Tensor& t) {
    TORCH_CHECK(t.device().is_cpu(), "skewadam C++ CPU kernel: got a tensor on ", t.device(),
                "; use impl='eager' for parameters off the CPU");
    if (t.is_contiguous()) return t.numel() ? t.data_ptr() : nullptr;
    keep.push_back(t.contiguous());
    return keep.back().data_ptr();
  }
  const void* read(const OptTensor& t) { return t ? read(*t) : nullptr; }
  void* write(const Tensor& t) {
    TORCH_CHECK(t.device().is_cpu(), "skewadam C++ CPU kernel: got a tensor on ", t.device(),
                "; use impl='eager' for parameters off the CPU");
    if (t.is_contiguous()) {
      written.push_back(t);
      return t.numel() ? t.data_ptr() : nullptr;
    }
    writeback.emplace_back(t, t.contiguous());
    return writeback.back().second.data_ptr();
  }
  void* write(const OptTensor& t) { return t ? write(*t) : nullptr; }
  void finish() {
    for (auto& [orig, work] : writeback) orig.copy_(work);  // an in-place op: bumps orig's version itself
    for (Tensor& t : written) t.unsafeGetTensorImpl()->bump_version();
  }
};

}  // namespace
