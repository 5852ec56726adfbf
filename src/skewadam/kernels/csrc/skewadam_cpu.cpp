// SkewAdam's update on CPU: the passes of skewadam/kernels/eager.py as C++ loops over blocks, on ATen's threads.
//
// The math is eager.py's, operation for operation, in the state dtype T (fp32 for bf16 parameters, the parameter's
// dtype otherwise); see that file for the formulas. What differs is how memory is walked:
//
//   * Every parameter is cut into fixed *blocks* that do not depend on the thread count: for a factored tensor
//     [..., R, C], a run of rows of one matrix (>= kMinBlockRows rows, ~kBlock elements); otherwise a run of ~kBlock
//     elements of one unit. The blocks of all parameters are one list of work items that ATen's threads take
//     dynamically (at::parallel_for), so a core slowed by another process takes fewer of them.
//   * Each block writes its partial sums to its own slot, and the slots are added in block order: results are
//     bitwise the same whatever the number of threads, and the same on the three-pass and single-process paths.
//   * Three passes (grad_stats, update_moments, apply_updates) with tensors in between, for the distributed seam.
//   * `step`, for one process (nothing to reduce between passes), in one call: pass 1 is only each unit's sum of
//     g^2 (the non-finite check, the banks' idle slices); then a unit (bank slice or whole tensor) whose gradient
//     or momentum fits in a core's L2 cache is one work item: its row and column statistics, the EMAs, pass 2, its
//     clip, pass 3. Its gradient is read from memory once for all of them, so an expert parameter costs 16 bytes of
//     memory traffic in fp32 (g twice, p read and written) against fused AdamW's 28. Larger units are spread over
//     the threads in rounds.
//
// Transient memory: no buffer of the size of a parameter (except a contiguous copy of a non-contiguous one). The
// three-pass path returns the small statistics as tensors (rows, columns, one value per unit); `step` keeps per
// thread the statistics of one unit, per unit and per block a few numbers, and for split units at most 1/16 of the
// largest unit's elements.
//
// Stochastic rounding: bit-identical to skewadam/kernels/rounding.py (same hash, key and element index).
// Compact first moment (bf16, or int8 with an fp32 scale per 256 values along the last dim): decoded, updated and
// encoded with quant.py's operations in its order ("compact momentum" below), so the stored bytes are eager's.
// Indexing is int64 throughout; a single row must hold fewer than 2^31 elements.
//
// Shape legend: E units (bank slices), M matrices [R, C] of a factored tensor (all leading dims), R rows, C columns.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int64_t kBlock = int64_t(1) << 15;     // target elements per work item
constexpr int64_t kMinBlockRows = 64;             // bounds pass 1's column partials at numel / 64 per tensor
constexpr int64_t kFuseBytes = int64_t(5) << 18;  // 1.25 MiB: a unit whose pass-3 source fits a core's L2 is fused
constexpr int64_t kSerialBelow = int64_t(1) << 18;  // elements: less work than this runs on one thread
constexpr double kRowMeanFloor = 1e-15;           // the paper's guard on mean(row), eager.py's _ROW_MEAN_FLOOR
constexpr int64_t kQBlock = 256;                  // int8 momentum: elements per scale along the last dim (quant.py)
constexpr uint32_t kMomentumStream = 0x5BD1E995u;  // quant.py's _MOMENTUM_STREAM: bf16 momentum's rounding bits
enum MomFmt : int { kMomPlain = 0, kMomBF16 = 1, kMomInt8 = 2 };  // first moment in the math dtype, bf16 or int8

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

template <class F>
void by_dtype(at::ScalarType st, const F& f) {
  switch (st) {
    case at::kFloat: f(Elem<float>{}); break;
    case at::kDouble: f(Elem<double>{}); break;
    case at::kBFloat16: f(Elem<c10::BFloat16>{}); break;
    default: TORCH_CHECK(false, "skewadam C++ CPU kernel: unsupported parameter dtype ", st, " (fp32, fp64, bf16)");
  }
}

at::ScalarType math_dtype(at::ScalarType st) { return st == at::kBFloat16 ? at::kFloat : st; }

// torch.lerp's formula (ATen/native/Lerp.h), so the EMAs round as eager's do.
template <class T>
inline T lerp(T a, T b, T w, bool hi) {
  return hi ? b - (b - a) * (T(1) - w) : a + w * (b - a);
}

// ------------------------------------------------------------------------------------------------ rounding
constexpr uint32_t kMul1 = 0x7FEB352Du, kMul2 = 0x2C1B3C6Du, kGolden = 0x61C88647u;

inline uint32_t mix32(uint32_t x) {
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

// x + bits, truncated to bf16 (NaN as c10::BFloat16 writes it).
inline uint16_t add_truncate(float x, uint32_t bits) {
  const uint32_t t = (__builtin_bit_cast(uint32_t, x) + bits) & 0xFFFF0000u;
  return (t & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(t >> 16);
}

// Element j of a run, rounded.
inline uint16_t round_bf16(float x, uint32_t j, const Rounder& r) {
  const uint32_t jj = j + r.odd;
  const uint32_t h = mix32((r.pair0 + (jj >> 1)) * kGolden + r.key);
  return add_truncate(x, (jj & 1u) ? (h >> 16) : (h & 0xFFFFu));
}

// p[s * stride + j] = value(s, j) for j < n and NS runs, the runs' first elements being rounders r[s] (bf16: rounded
// stochastically). Runs that start at an even index and hold an even count take one hash per pair of elements (the
// lanes are pairs: ~20% faster here than one hash per element); others one per element. Runs hold < 2^31 elements,
// so the index arithmetic stays in 32-bit lanes, which vectorise the hash best.
template <class E, int NS, class F>
inline void write_runs(typename E::raw* __restrict p, int64_t stride, int64_t n, const Rounder* r, const F& value) {
  const uint32_t n32 = uint32_t(n);
  if constexpr (!std::is_same_v<typename E::raw, uint16_t>) {
#pragma omp simd
    for (uint32_t j = 0; j < n32; ++j)
      for (int s = 0; s < NS; ++s) p[s * stride + j] = value(s, j);
  } else {
    bool pairs = n32 % 2 == 0;
    for (int s = 0; s < NS; ++s) pairs = pairs && r[s].odd == 0;
    if (pairs) {
#pragma omp simd
      for (uint32_t k = 0; k < n32 / 2; ++k)
        for (int s = 0; s < NS; ++s) {
          const float x0 = value(s, 2 * k), x1 = value(s, 2 * k + 1);
          const uint32_t h = mix32((r[s].pair0 + k) * kGolden + r[s].key);
          p[s * stride + 2 * k] = add_truncate(x0, h & 0xFFFFu);
          p[s * stride + 2 * k + 1] = add_truncate(x1, h >> 16);
        }
    } else {
#pragma omp simd
      for (uint32_t j = 0; j < n32; ++j)
        for (int s = 0; s < NS; ++s) p[s * stride + j] = round_bf16(value(s, j), j, r[s]);
    }
  }
}

// ------------------------------------------------------------------------------------------------ streams
// A core reads one sequential stream at ~60% of the rate it reads several (measured here: 9-12 GB/s for one, 19-25
// for four), so the hot loops walk kStreams runs far apart at once. Sums go to kLanes independent partial sums
// added in a fixed tree: the order, hence the result, is the same whatever the SIMD width or thread count.
constexpr int kStreams = 4;
constexpr int kLanes = 16;
template <int N>
using Int = std::integral_constant<int, N>;

template <class T>
inline T lanes_sum(const T* a) {
  T b[8], c[4];
  for (int k = 0; k < 8; ++k) b[k] = a[k] + a[k + 8];
  for (int k = 0; k < 4; ++k) c[k] = b[k] + b[k + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// body(j, k) for j < n, element j accumulating into lane k = j % kLanes; whole groups of kLanes vectorised.
template <class F>
inline void for_lanes(int64_t n, const F& body) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
#pragma omp simd
    for (int k = 0; k < kLanes; ++k) body(j + k, k);
  }
  for (int k = 0; k < n - j; ++k) body(j + k, k);
}

// f(ns, i, q): rows [i0, i1) as groups of kStreams rows i, i + q, i + 2q, ...; the rows left over one at a time.
template <class F>
inline void row_groups(int64_t i0, int64_t i1, const F& f) {
  const int64_t q = (i1 - i0) / kStreams;
  for (int64_t k = 0; k < q; ++k) f(Int<kStreams>{}, i0 + k, q);
  for (int64_t i = i0 + kStreams * q; i < i1; ++i) f(Int<1>{}, i, int64_t(0));
}

// f(ns, e, n, stride): elements [e0, e1) as kStreams runs of n elements, `stride` apart; the rest as one run.
template <class F>
inline void run_groups(int64_t e0, int64_t e1, const F& f) {
  const int64_t n = (e1 - e0) / (kStreams * kLanes) * kLanes;
  if (n) f(Int<kStreams>{}, e0, n, n);
  if (e0 + kStreams * n < e1) f(Int<1>{}, e0 + kStreams * n, e1 - e0 - kStreams * n, int64_t(0));
}

// Pass 1, NS rows of n elements `stride` apart: each row's sum of g^2 into out[s * out_stride], column sums into col.
template <class E, int NS>
inline void p1_rows(const typename E::raw* __restrict g, int64_t stride, int64_t n, typename E::T* __restrict col,
                    typename E::T* __restrict out, int64_t out_stride) {
  using T = typename E::T;
  T acc[NS][kLanes] = {};
  for_lanes(n, [&](int64_t jk, int k) {
    T c = col[jk];
    for (int s = 0; s < NS; ++s) {
      const T x = E::load(g[s * stride + jk]);
      acc[s][k] += x * x;
      c += x * x;
    }
    col[jk] = c;
  });
  for (int s = 0; s < NS; ++s) out[s * out_stride] = lanes_sum(acc[s]);
}

// Pass 1, NS runs of n elements `stride` apart: sum of g^2 into acc.
template <class E, int NS>
inline void p1_run(const typename E::raw* __restrict g, int64_t stride, int64_t n, typename E::T* __restrict acc) {
  using T = typename E::T;
  for_lanes(n, [&](int64_t jk, int k) {
    for (int s = 0; s < NS; ++s) {
      const T x = E::load(g[s * stride + jk]);
      acc[k] += x * x;
    }
  });
}

// Pass 2, factored, NS rows: momentum EMA in place; u = src * scale_s * cinv_j, sum of u^2 into acc.
template <class E, int NS, bool kMom>
inline void p2_rows(const typename E::raw* __restrict g, typename E::T* __restrict m, int64_t stride, int64_t n,
                    const typename E::T* __restrict cinv, const typename E::T* scale, typename E::T w1, bool hi1,
                    typename E::T* __restrict acc) {
  using T = typename E::T;
  T sc[NS];
  for (int s = 0; s < NS; ++s) sc[s] = scale[s];
  auto body = [&](int64_t jk, int k) {
    for (int s = 0; s < NS; ++s) {
      T src = E::load(g[s * stride + jk]);
      if constexpr (kMom) {
        src = lerp(m[s * stride + jk], src, w1, hi1);
        m[s * stride + jk] = src;
      }
      const T u = src * sc[s] * cinv[jk];
      acc[k] += u * u;
    }
  };
  for_lanes(n, body);
}

// Pass 2, full, NS runs: second-moment (and momentum) EMAs in place; u = src * corr / sqrt(max(v, floor)).
template <class E, int NS, bool kMom>
inline void p2_run(const typename E::raw* __restrict g, typename E::T* __restrict m, typename E::T* __restrict v,
                   int64_t stride, int64_t n, typename E::T corr, typename E::T w1, bool hi1, typename E::T w2,
                   bool hi2, typename E::T add, typename E::T floor, typename E::T* __restrict acc) {
  using T = typename E::T;
  auto body = [&](int64_t jk, int k) {
    for (int s = 0; s < NS; ++s) {
      const T x = E::load(g[s * stride + jk]);
      const T vv = lerp(v[s * stride + jk], x * x + add, w2, hi2);
      v[s * stride + jk] = vv;
      T src = x;
      if constexpr (kMom) {
        src = lerp(m[s * stride + jk], x, w1, hi1);
        m[s * stride + jk] = src;
      }
      const T u = src * corr / std::sqrt(std::max(vv, floor));
      acc[k] += u * u;
    }
  };
  for_lanes(n, body);
}

// Pass 3, factored, NS rows: p = p*decay + nlr * (src * scale_s * cinv_j).
template <class E, int NS, bool kMom>
inline void p3_rows(typename E::raw* __restrict p, const typename E::raw* __restrict g,
                    const typename E::T* __restrict m, int64_t stride, int64_t n, const typename E::T* __restrict cinv,
                    const typename E::T* scale, typename E::T decay, typename E::T nlr, const Rounder* rnd) {
  using T = typename E::T;
  T sc[NS];
  Rounder r[NS];
  for (int s = 0; s < NS; ++s) {
    sc[s] = scale[s];
    r[s] = rnd[s];
  }
  write_runs<E, NS>(p, stride, n, r, [&](int s, uint32_t j) {
    const T src = kMom ? m[s * stride + j] : E::load(g[s * stride + j]);
    return E::load(p[s * stride + j]) * decay + nlr * (src * sc[s] * cinv[j]);
  });
}

// Pass 3, full, NS runs: p = p*decay + nlr * (src * cc / sqrt(max(v, floor))).
template <class E, int NS, bool kMom>
inline void p3_run(typename E::raw* __restrict p, const typename E::raw* __restrict g,
                   const typename E::T* __restrict m, const typename E::T* __restrict v, int64_t stride, int64_t n,
                   typename E::T cc, typename E::T floor, typename E::T decay, typename E::T nlr,
                   const Rounder* rnd) {
  using T = typename E::T;
  Rounder r[NS];
  for (int s = 0; s < NS; ++s) r[s] = rnd[s];
  write_runs<E, NS>(p, stride, n, r, [&](int s, uint32_t j) {
    const T src = kMom ? m[s * stride + j] : E::load(g[s * stride + j]);
    return E::load(p[s * stride + j]) * decay + nlr * (src * cc / std::sqrt(std::max(v[s * stride + j], floor)));
  });
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

// One parameter's local layout (from its gradient) and its global sizes (for means).
struct Geo {
  int64_t numel = 0, units = 1, unit_numel = 0;
  bool bank = false, factored = false;
  int64_t M = 0, R = 0, C = 0, mats_per_unit = 0, rows_per_block = 1, blocks_per_mat = 0;  // factored
  int64_t blocks_per_unit = 0, block_len = kBlock;  // full: elements per block (whole rows for int8 momentum)
  double Rg = 1, Cg = 1, ng = 1;  // global rows, columns, unit numel

  int64_t blocks() const { return units * blocks_per_unit; }
  int64_t unit_of_mat(int64_t m) const { return mats_per_unit ? m / mats_per_unit : 0; }
  // block b's rows [i0, i1) of matrix m (factored) or elements [e0, e1) (full)
  void rows(int64_t b, int64_t& m, int64_t& i0, int64_t& i1) const {
    m = b / blocks_per_mat;
    i0 = (b % blocks_per_mat) * rows_per_block;
    i1 = std::min(R, i0 + rows_per_block);
  }
  void range(int64_t b, int64_t& e0, int64_t& e1) const {
    const int64_t u = b / blocks_per_unit, k = b % blocks_per_unit;
    e0 = u * unit_numel + k * block_len;
    e1 = std::min(u * unit_numel + unit_numel, e0 + block_len);
  }
};

// `align`: a full tensor's blocks hold whole runs of `align` elements (int8 momentum: rows, so no int8 block straddles
// two work items).
Geo make_geo(const Tensor& g, bool bank, bool factored, at::IntArrayRef global_shape, int64_t align = 1) {
  Geo geo;
  const int64_t nd = g.dim();
  TORCH_CHECK(int64_t(global_shape.size()) == nd, "skewadam: global shape ", global_shape,
              " does not match the local tensor's rank ", nd);
  TORCH_CHECK(!bank || nd >= 1, "skewadam: a bank needs a leading expert dim");
  geo.numel = g.numel();
  geo.bank = bank;
  geo.factored = factored;
  geo.units = bank ? g.size(0) : 1;
  geo.unit_numel = geo.units ? geo.numel / geo.units : 0;
  double ng = 1;
  for (int64_t d = bank ? 1 : 0; d < nd; ++d) ng *= double(global_shape[d]);
  geo.ng = ng;
  if (factored) {
    TORCH_CHECK(nd >= 2 + (bank ? 1 : 0), "skewadam: a factored tensor needs two dims per unit");
    geo.R = g.size(-2);
    geo.C = g.size(-1);
    TORCH_CHECK(geo.C < (int64_t(1) << 31), "skewadam C++ CPU kernel: rows of 2^31 or more elements are not "
                "supported (shape ", g.sizes(), "); use impl='eager'");
    geo.M = 1;
    for (int64_t d = 0; d < nd - 2; ++d) geo.M *= g.size(d);
    geo.mats_per_unit = geo.units ? geo.M / geo.units : 0;
    geo.rows_per_block =
        std::max<int64_t>(1, std::min(geo.R, std::max(kMinBlockRows, kBlock / std::max<int64_t>(geo.C, 1))));
    geo.blocks_per_mat = (geo.R + geo.rows_per_block - 1) / geo.rows_per_block;
    geo.blocks_per_unit = geo.mats_per_unit * geo.blocks_per_mat;
    geo.Rg = double(global_shape[nd - 2]);
    geo.Cg = double(global_shape[nd - 1]);
  } else {
    align = std::max<int64_t>(align, 1);
    geo.block_len = std::max<int64_t>(1, kBlock / align) * align;
    geo.blocks_per_unit = (geo.unit_numel + geo.block_len - 1) / geo.block_len;
  }
  return geo;
}

std::vector<int64_t> unit_keepdim_shape(const Tensor& g, bool bank) {
  std::vector<int64_t> s(g.dim(), 1);
  if (bank) s[0] = g.size(0);
  return s;
}

std::vector<int64_t> stat_shape(const Tensor& g, int64_t r, int64_t c) {
  std::vector<int64_t> s(g.sizes().begin(), g.sizes().end());
  s[s.size() - 2] = r;
  s[s.size() - 1] = c;
  return s;
}

// ------------------------------------------------------------------------------------------------ parameters
struct Hyper {
  double beta1 = 0, beta2 = 0, eps = 0;
  bool add_mode = false;
  double lr = 0, weight_decay = 0;
  int64_t seed = 0;
};

// Factored statistics of matrices [m0, m0 + count) of one parameter, in the math dtype T: per matrix rc (sum of its
// row sums) and rvs (sum of row_var before the step); per row the sum of g^2 and rinv; per column the sum of g^2 and
// cinv; colp, each block's column partials (only when a matrix has more than one block).
struct Stats {
  int64_t m0 = 0;
  void *rc = nullptr, *rvs = nullptr, *row = nullptr, *rinv = nullptr, *col = nullptr, *cinv = nullptr,
       *colp = nullptr;

  static int64_t size(const Geo& G, int64_t count) {
    return count * (2 + 2 * G.R + 2 * G.C + (G.blocks_per_mat > 1 ? G.blocks_per_mat * G.C : 0));
  }
  // Point into `count` matrices' worth of T at base (Stats::size elements).
  template <class T>
  static Stats carve(T* base, const Geo& G, int64_t m0, int64_t count) {
    Stats s;
    s.m0 = m0;
    for (void** slot : {&s.rc, &s.rvs}) *slot = std::exchange(base, base + count);
    for (void** slot : {&s.row, &s.rinv}) *slot = std::exchange(base, base + count * G.R);
    for (void** slot : {&s.col, &s.cinv}) *slot = std::exchange(base, base + count * G.C);
    if (G.blocks_per_mat > 1) s.colp = base;
    return s;
  }
  template <class T>
  T* at(void* p, int64_t m, int64_t width) const {
    return static_cast<T*>(p) + (m - m0) * width;
  }
};

// One parameter through the passes; arrays are raw pointers in the math dtype T.
struct Param {
  Geo geo;
  at::ScalarType dtype = at::kFloat;  // of the gradient (and the parameter)
  const void* g = nullptr;
  void *p = nullptr, *m = nullptr, *v = nullptr, *row_var = nullptr, *col_var = nullptr;
  float* step = nullptr;
  void* sumsq = nullptr;         // per unit, sum of g^2 (T)
  Stats st;                      // all matrices' statistics (three-pass path)
  std::vector<char> active;      // per unit
  std::vector<double> corr;      // per unit: the bias correction, in double (cast to T where used)
  std::vector<double> clip;      // per unit: 1 / max(1, rms(u)), in T's precision
  std::vector<double> partial;   // per block: sum of g^2 or of u^2
  std::vector<double> sumsq_buf;  // storage of sumsq on the single-process path (room for a double or float)
  uint32_t key = 0;              // stochastic rounding key (bf16 parameters)
  // first moment's storage (see "compact momentum"): format, int8 scales [rows, mNB], last dim, bf16 rounding key
  int mfmt = 0;
  float* mscale = nullptr;
  int64_t mC = 1, mNB = 1;
  uint32_t mkey = 0;
};

template <class T>
T* at_(void* p) {
  return static_cast<T*>(p);
}
template <class T>
const T* at_(const void* p) {
  return static_cast<const T*>(p);
}

template <class F>
void with_elem(const Param& q, const F& f) {
  by_dtype(q.dtype, f);
}

// The contiguous elements [e0, e1) of block b.
void block_elems(const Geo& G, int64_t b, int64_t& e0, int64_t& e1) {
  if (!G.factored) return G.range(b, e0, e1);
  int64_t m, i0, i1;
  G.rows(b, m, i0, i1);
  e0 = (m * G.R + i0) * G.C;
  e1 = (m * G.R + i1) * G.C;
}

// ------------------------------------------------------------------------------------------------ pass 1
// Sum of g^2 over block b.
template <class E>
double sumsq_block(const Param& q, int64_t b) {
  using T = typename E::T;
  const auto* g = at_<typename E::raw>(q.g);
  int64_t e0, e1;
  block_elems(q.geo, b, e0, e1);
  T acc[kLanes] = {};
  run_groups(e0, e1, [&](auto ns, int64_t e, int64_t n, int64_t stride) {
    p1_run<E, decltype(ns)::value>(g + e, stride, n, acc);
  });
  return double(lanes_sum(acc));
}

// Factored block b: its rows' sums of g^2 and its column partials (or, for a one-block matrix, the column sums).
template <class E>
void p1_block(const Param& q, const Stats& s, int64_t b) {
  using T = typename E::T;
  const Geo& G = q.geo;
  const auto* g = at_<typename E::raw>(q.g);
  int64_t m, i0, i1;
  G.rows(b, m, i0, i1);
  const int64_t C = G.C;
  T* row = s.at<T>(s.row, m, G.R);
  T* col = G.blocks_per_mat > 1 ? s.at<T>(s.colp, m, G.blocks_per_mat * C) + (b % G.blocks_per_mat) * C
                                : s.at<T>(s.col, m, C);
  std::fill_n(col, C, T(0));
  row_groups(i0, i1, [&](auto ns, int64_t i, int64_t qr) {
    p1_rows<E, decltype(ns)::value>(g + (m * G.R + i) * C, qr * C, C, col, row + i, qr);
  });
}

// Matrices [m_begin, m_end): column sums from their block partials (in block order), rc and rvs.
template <class T>
void p1_finish(const Param& q, const Stats& s, int64_t m_begin, int64_t m_end) {
  const Geo& G = q.geo;
  const int64_t R = G.R, C = G.C;
  const T* rv = at_<T>(q.row_var);
  for (int64_t m = m_begin; m < m_end; ++m) {
    T* col = s.at<T>(s.col, m, C);
    if (G.blocks_per_mat > 1) {
      const T* cp = s.at<T>(s.colp, m, G.blocks_per_mat * C);
      std::copy_n(cp, C, col);
      for (int64_t k = 1; k < G.blocks_per_mat; ++k)
        for (int64_t j = 0; j < C; ++j) col[j] += cp[k * C + j];
    }
    const T* row = s.at<T>(s.row, m, R);
    double sr = 0, sv = 0;
    for (int64_t i = 0; i < R; ++i) {
      sr += double(row[i]);
      sv += double(rv[m * R + i]);
    }
    *s.at<T>(s.rc, m, 1) = T(sr);
    *s.at<T>(s.rvs, m, 1) = T(sv);
  }
}

// ------------------------------------------------------------------------------------------------ passes 2 and 3
// Per unit: active (bank: a non-zero gradient slice), step count, bias correction; the bf16 rounding key.
template <class T>
void count_steps(Param& q, const Hyper& h, int64_t param_id) {
  const Geo& G = q.geo;
  q.active.assign(G.units, 1);
  float* step = q.step;
  if (G.bank) {
    const T* s = at_<T>(q.sumsq);
    for (int64_t u = 0; u < G.units; ++u) {
      q.active[u] = s[u] > T(0);  // an expert that saw no token has an all-zero slice: leave it untouched
      step[u] += float(q.active[u]);
    }
  } else {
    step[0] += 1.0f;
  }
  q.corr.assign(G.units, 0.0);
  for (int64_t u = 0; u < G.units; ++u) {
    // sqrt(1 - beta2^t) / (1 - beta1^t) in double (1 - beta in float32 is off by ~1e-5 relative)
    const double t = G.bank ? std::max(double(step[u]), 1.0) : double(step[0]);
    double c = std::sqrt(1.0 - std::pow(h.beta2, t));
    if (q.m) c /= 1.0 - std::pow(h.beta1, t);
    q.corr[u] = c;
  }
  if (q.dtype == at::kBFloat16 || q.mfmt == kMomBF16) {
    double t = 0;  // the step count after this update, summed over bank slices: rounding_key's `step`
    for (int64_t u = 0; u < (G.bank ? G.units : 1); ++u) t += double(step[u]);
    q.key = rounding_key(h.seed, param_id, int64_t(t));
    q.mkey = mix32(q.key + kMomentumStream);  // bf16 momentum: quant.store_momentum_'s key
  }
}

// Matrices [m_begin, m_end): the factored EMAs (active units only) and the row/column inverse denominators.
template <class T>
void update_factored(const Param& q, const Stats& s, const Hyper& h, int64_t m_begin, int64_t m_end) {
  const Geo& G = q.geo;
  const int64_t R = G.R, C = G.C;
  const T add = h.add_mode ? T(h.eps) : T(0), floor = h.add_mode ? T(0) : T(h.eps);
  const T w2 = T(1.0 - h.beta2), b2 = T(h.beta2), omb2 = T(1.0 - h.beta2);
  const bool hi = std::abs(double(w2)) >= 0.5;
  const T Cg = T(G.Cg), Rg = T(G.Rg), Radd = T(G.Rg * (h.add_mode ? h.eps : 0.0));
  for (int64_t m = m_begin; m < m_end; ++m) {
    const bool on = q.active[G.unit_of_mat(m)];
    T* rv = at_<T>(q.row_var) + m * R;
    T* cv = at_<T>(q.col_var) + m * C;
    const T *row = s.at<T>(s.row, m, R), *col = s.at<T>(s.col, m, C);
    T *rinv = s.at<T>(s.rinv, m, R), *cinv = s.at<T>(s.cinv, m, C);
    if (on) {
      for (int64_t i = 0; i < R; ++i) rv[i] = lerp(rv[i], row[i] / Cg + add, w2, hi);
      for (int64_t j = 0; j < C; ++j) cv[j] = lerp(cv[j], col[j] / Rg + add, w2, hi);
    }
    const T rvs = *s.at<T>(s.rvs, m, 1), rc = *s.at<T>(s.rc, m, 1);
    const T rmean = (on ? rvs * b2 + (rc / Cg + Radd) * omb2 : rvs) / Rg;
    if (!h.add_mode) {
      const T rm = std::max(rmean, T(kRowMeanFloor));
      for (int64_t i = 0; i < R; ++i) rinv[i] = T(1) / std::sqrt(std::max(rv[i] / rm, floor));
      for (int64_t j = 0; j < C; ++j) cinv[j] = T(1) / std::sqrt(std::max(cv[j], floor));
    } else {
      const T rm = std::max(rmean, std::numeric_limits<T>::min());
      for (int64_t i = 0; i < R; ++i) rinv[i] = T(1) / std::sqrt(rv[i] / rm);
      for (int64_t j = 0; j < C; ++j) cinv[j] = T(1) / std::sqrt(cv[j]);
    }
  }
}

// ------------------------------------------------------------------------------------------------ compact momentum
// The first moment stored as quant.py stores it, with the same operations in the same order (so the same bytes):
//   bf16: m = SR(x), rounding.py's bits with key mix32(key + kMomentumStream) and the element's index in the tensor.
//   int8: per block of kQBlock elements along the last dim (the last one padded), scale = absmax (stored fp32),
//         q = copysign(round(sqrt(|x| / max(absmax, tiny)) * 127), x) (round half to even), and decoded
//         x = (|c| * c) * scale with c = q / 127.
// Pass 2 decodes m, takes lerp(m, g, 1 - beta1), stores it, and forms u from the stored value decoded (what pass 3
// reads), as eager does. Walked in chunks of at most kQBlock elements that never straddle an int8 block.

// First-moment storage of q from exp_avg (and exp_avg_scale for int8), validated; `write` for passes that update it.
void set_momentum(Param& q, Contig& ct, const OptTensor& m, const OptTensor& scale, bool write) {
  q.m = nullptr;
  q.mfmt = kMomPlain;
  if (!m) return;
  const at::ScalarType T = math_dtype(q.dtype), st = m->scalar_type();
  q.m = write ? ct.write(*m) : const_cast<void*>(ct.read(*m));
  if (st == T) return;
  if (st == at::kBFloat16) {
    TORCH_CHECK(T == at::kFloat, "skewadam C++ CPU kernel: bf16 momentum needs fp32 or bf16 parameters, got ",
                q.dtype);
    q.mfmt = kMomBF16;
    return;
  }
  TORCH_CHECK(st == at::kChar, "skewadam C++ CPU kernel: momentum of a ", q.dtype, " parameter must be ", T,
              ", bf16 or int8, got ", st);
  TORCH_CHECK(m->dim() >= 1 && scale && scale->scalar_type() == at::kFloat,
              "skewadam C++ CPU kernel: int8 momentum needs its float32 exp_avg_scale");
  q.mC = m->size(-1);
  q.mNB = std::max<int64_t>(1, (q.mC + kQBlock - 1) / kQBlock);
  TORCH_CHECK(scale->numel() == (q.mC ? m->numel() / q.mC : 0) * q.mNB, "skewadam C++ CPU kernel: exp_avg_scale of ",
              "shape ", scale->sizes(), " does not hold one scale per ", kQBlock, " momentum values of shape ",
              m->sizes());
  q.mscale = static_cast<float*>(write ? ct.write(*scale) : const_cast<void*>(ct.read(*scale)));
  q.mfmt = kMomInt8;
}

// The alignment of a full tensor's blocks (make_geo): whole rows for int8 momentum.
int64_t mom_align(const Param& q, bool factored) { return q.mfmt == kMomInt8 && !factored ? q.mC : 1; }

// f(e, n, k): elements [e0, e1) as chunks [e, e + n) of at most kQBlock, each inside int8 block k (int8: e0 starts a
// row, e1 ends one).
template <class F>
inline void mom_chunks(const Param& q, int64_t e0, int64_t e1, const F& f) {
  for (int64_t e = e0; e < e1;) {
    int64_t n = std::min(kQBlock, e1 - e), k = 0;
    if (q.mfmt == kMomInt8) {
      const int64_t row = e / q.mC, col = e - row * q.mC;
      TORCH_INTERNAL_ASSERT(col % kQBlock == 0, "skewadam: an int8 momentum chunk straddles a block");
      n = std::min(n, q.mC - col);
      k = row * q.mNB + col / kQBlock;
    }
    f(e, n, k);
    e += n;
  }
}

// x = (|c| * c) * scale, c = q / 127 (quant.dequantize).
template <class T>
inline T decode_int8(int8_t v, T scale) {
  const T c = T(v) / T(127);
  return std::abs(c) * c * scale;
}

// out[j] = the stored first moment of elements [e, e + n), decoded to T (chunk of int8 block k).
template <class T>
inline void mom_load(const Param& q, int64_t e, int64_t n, int64_t k, T* __restrict out) {
  if (q.mfmt == kMomBF16) {
    const uint16_t* m = at_<uint16_t>(q.m) + e;
    for (int64_t j = 0; j < n; ++j) out[j] = T(Elem<c10::BFloat16>::load(m[j]));
    return;
  }
  const int8_t* m = at_<int8_t>(q.m) + e;
  const T s = T(q.mscale[k]);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = decode_int8(m[j], s);
}

// m = lerp(m, g, w1) on elements [e, e + n), stored compactly; out = the stored value decoded (what pass 3 reads).
template <class E>
inline void mom_update(const Param& q, int64_t e, int64_t n, int64_t k, typename E::T w1, bool hi1,
                       typename E::T* __restrict out) {
  using T = typename E::T;
  const auto* g = at_<typename E::raw>(q.g) + e;
  T x[kQBlock];
  mom_load<T>(q, e, n, k, x);
  for (int64_t j = 0; j < n; ++j) x[j] = lerp(x[j], E::load(g[j]), w1, hi1);
  if (q.mfmt == kMomBF16) {
    if constexpr (std::is_same_v<T, float>) {
      uint16_t* m = at_<uint16_t>(q.m) + e;
      const Rounder r = rounder(e, q.mkey);
      write_runs<Elem<c10::BFloat16>, 1>(m, 0, n, &r, [&](int, uint32_t j) { return x[j]; });
      for (int64_t j = 0; j < n; ++j) out[j] = Elem<c10::BFloat16>::load(m[j]);
    }
    return;
  }
  int8_t* m = at_<int8_t>(q.m) + e;
  T absmax = T(0);
  for (int64_t j = 0; j < n; ++j) absmax = std::max(absmax, std::abs(x[j]));
  q.mscale[k] = float(absmax);
  const T a = std::max(absmax, std::numeric_limits<T>::min()), s = T(float(absmax));
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const int8_t v = int8_t(std::copysign(std::nearbyint(std::sqrt(std::abs(x[j]) / a) * T(127)), x[j]));
    m[j] = v;
    out[j] = decode_int8(v, s);
  }
}

// acc[j % kLanes] += u(j)^2 for j < n.
template <class T, class F>
inline void add_squares(T* __restrict acc, int64_t n, const F& u) {
  for_lanes(n, [&](int64_t j, int k) {
    const T x = u(j);
    acc[k] += x * x;
  });
}

// Pass 2 of block b with compact momentum (p2_block's math): returns the block's sum of u^2.
template <class E>
double p2_compact(const Param& q, const Stats& s, const Hyper& h, int64_t b) {
  using T = typename E::T;
  const Geo& G = q.geo;
  const T w1 = T(1.0 - h.beta1);
  const bool hi1 = std::abs(double(w1)) >= 0.5;
  T acc[kLanes] = {};
  T src[kQBlock];
  if (G.factored) {  // u = src * (rinv_i * corr) * cinv_j
    int64_t mt, i0, i1;
    G.rows(b, mt, i0, i1);
    const int64_t C = G.C;
    const T corr = T(q.corr[G.unit_of_mat(mt)]);
    const T* rinv = s.at<T>(s.rinv, mt, G.R);
    const T* cinv = s.at<T>(s.cinv, mt, C);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t off = (mt * G.R + i) * C;
      const T sc = rinv[i] * corr;
      mom_chunks(q, off, off + C, [&](int64_t e, int64_t n, int64_t k) {
        mom_update<E>(q, e, n, k, w1, hi1, src);
        const T* cj = cinv + (e - off);
        add_squares(acc, n, [&](int64_t j) { return src[j] * sc * cj[j]; });
      });
    }
    return double(lanes_sum(acc));
  }
  // full: v = lerp(v, g^2 + add, 1 - beta2); u = src * corr / sqrt(max(v, floor))
  int64_t e0, e1;
  G.range(b, e0, e1);
  const T corr = T(q.corr[b / G.blocks_per_unit]);
  const T add = h.add_mode ? T(h.eps) : T(0), floor = h.add_mode ? T(0) : T(h.eps);
  const T w2 = T(1.0 - h.beta2);
  const bool hi2 = std::abs(double(w2)) >= 0.5;
  const auto* g = at_<typename E::raw>(q.g);
  T* v = at_<T>(q.v);
  mom_chunks(q, e0, e1, [&](int64_t e, int64_t n, int64_t k) {
    mom_update<E>(q, e, n, k, w1, hi1, src);
    T* ve = v + e;
    for (int64_t j = 0; j < n; ++j) {
      const T x = E::load(g[e + j]);
      ve[j] = lerp(ve[j], x * x + add, w2, hi2);
    }
    add_squares(acc, n, [&](int64_t j) { return src[j] * corr / std::sqrt(std::max(ve[j], floor)); });
  });
  return double(lanes_sum(acc));
}

// Pass 3 of block b with compact momentum (p3_block's math, src = the stored momentum decoded).
template <class E>
void p3_compact(const Param& q, const Stats& s, const Hyper& h, int64_t b) {
  using T = typename E::T;
  const Geo& G = q.geo;
  auto* p = at_<typename E::raw>(q.p);
  const T decay = T(1.0 - h.lr * h.weight_decay), nlr = T(-h.lr);
  T src[kQBlock];
  if (G.factored) {  // p = p*decay + nlr * (src * (rinv_i * corr * clip) * cinv_j)
    int64_t mt, i0, i1;
    G.rows(b, mt, i0, i1);
    const int64_t C = G.C, u = G.unit_of_mat(mt);
    const T cc = T(q.corr[u]) * T(q.clip[u]);
    const T* rinv = s.at<T>(s.rinv, mt, G.R);
    const T* cinv = s.at<T>(s.cinv, mt, C);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t off = (mt * G.R + i) * C;
      const T sc = rinv[i] * cc;
      mom_chunks(q, off, off + C, [&](int64_t e, int64_t n, int64_t k) {
        mom_load<T>(q, e, n, k, src);
        const T* cj = cinv + (e - off);
        const Rounder r = rounder(e, q.key);
        write_runs<E, 1>(p + e, 0, n, &r, [&](int, uint32_t j) {
          return E::load(p[e + j]) * decay + nlr * (src[j] * sc * cj[j]);
        });
      });
    }
    return;
  }
  // full: p = p*decay + nlr * (src * (corr * clip) / sqrt(max(v, floor)))
  int64_t e0, e1;
  G.range(b, e0, e1);
  const int64_t u = b / G.blocks_per_unit;
  const T cc = T(q.corr[u]) * T(q.clip[u]);
  const T floor = h.add_mode ? T(0) : T(h.eps);
  const T* v = at_<T>(q.v);
  mom_chunks(q, e0, e1, [&](int64_t e, int64_t n, int64_t k) {
    mom_load<T>(q, e, n, k, src);
    const Rounder r = rounder(e, q.key);
    write_runs<E, 1>(p + e, 0, n, &r, [&](int, uint32_t j) {
      return E::load(p[e + j]) * decay + nlr * (src[j] * cc / std::sqrt(std::max(v[e + j], floor)));
    });
  });
}

// Pass 2, one block: momentum and full second moment EMAs in place; returns the block's sum of u^2.
template <class E>
double p2_block(const Param& q, const Stats& s, const Hyper& h, int64_t b) {
  using T = typename E::T;
  if (q.mfmt != kMomPlain) return p2_compact<E>(q, s, h, b);
  const Geo& G = q.geo;
  const auto* g = at_<typename E::raw>(q.g);
  T* m = at_<T>(q.m);
  const T w1 = T(1.0 - h.beta1);
  const bool hi1 = std::abs(double(w1)) >= 0.5;
  T acc[kLanes] = {};
  auto with_mom = [&](auto body) { m ? body(std::true_type{}) : body(std::false_type{}); };
  if (G.factored) {
    int64_t mt, i0, i1;
    G.rows(b, mt, i0, i1);
    const int64_t C = G.C;
    const T corr = T(q.corr[G.unit_of_mat(mt)]);
    const T* rinv = s.at<T>(s.rinv, mt, G.R);
    const T* cinv = s.at<T>(s.cinv, mt, C);
    with_mom([&](auto mom) {
      row_groups(i0, i1, [&](auto ns, int64_t i, int64_t qr) {
        constexpr int NS = decltype(ns)::value;
        T scale[NS];
        for (int k = 0; k < NS; ++k) scale[k] = rinv[i + k * qr] * corr;
        const int64_t off = (mt * G.R + i) * C;
        p2_rows<E, NS, decltype(mom)::value>(g + off, m ? m + off : nullptr, qr * C, C, cinv, scale, w1, hi1, acc);
      });
    });
    return double(lanes_sum(acc));
  }
  int64_t e0, e1;
  G.range(b, e0, e1);
  const T corr = T(q.corr[b / G.blocks_per_unit]);
  const T add = h.add_mode ? T(h.eps) : T(0), floor = h.add_mode ? T(0) : T(h.eps);
  const T w2 = T(1.0 - h.beta2);
  const bool hi2 = std::abs(double(w2)) >= 0.5;
  T* v = at_<T>(q.v);
  with_mom([&](auto mom) {
    run_groups(e0, e1, [&](auto ns, int64_t e, int64_t n, int64_t stride) {
      p2_run<E, decltype(ns)::value, decltype(mom)::value>(g + e, m ? m + e : nullptr, v + e, stride, n, corr, w1,
                                                           hi1, w2, hi2, add, floor, acc);
    });
  });
  return double(lanes_sum(acc));
}

// Sum of unit u's block partials, in block order.
template <class T>
T unit_sum(const Param& q, int64_t u) {
  double s = 0;
  for (int64_t k = 0; k < q.geo.blocks_per_unit; ++k) s += q.partial[u * q.geo.blocks_per_unit + k];
  return T(s);
}

// 1 / max(1, rms(u)), as eager computes it in T.
template <class T>
double clip_of(T u_sumsq, double n) {
  return double(T(1) / std::max(std::sqrt(u_sumsq / T(n)), T(1)));
}

// Pass 3, one block: p = p*(1 - lr*wd) - lr * u * clip (bf16: rounded stochastically).
template <class E>
void p3_block(const Param& q, const Stats& s, const Hyper& h, int64_t b) {
  using T = typename E::T;
  using raw = typename E::raw;
  if (q.mfmt != kMomPlain) return p3_compact<E>(q, s, h, b);
  const Geo& G = q.geo;
  const raw* g = at_<raw>(q.g);
  const T* m = at_<T>(q.m);
  raw* p = at_<raw>(q.p);
  const T decay = T(1.0 - h.lr * h.weight_decay), nlr = T(-h.lr);
  auto with_mom = [&](auto body) { m ? body(std::true_type{}) : body(std::false_type{}); };
  if (G.factored) {
    int64_t mt, i0, i1;
    G.rows(b, mt, i0, i1);
    const int64_t C = G.C, u = G.unit_of_mat(mt);
    const T cc = T(q.corr[u]) * T(q.clip[u]);
    const T* rinv = s.at<T>(s.rinv, mt, G.R);
    const T* cinv = s.at<T>(s.cinv, mt, C);
    with_mom([&](auto mom) {
      row_groups(i0, i1, [&](auto ns, int64_t i, int64_t qr) {
        constexpr int NS = decltype(ns)::value;
        T scale[NS];
        Rounder rnd[NS];
        const int64_t off = (mt * G.R + i) * C;
        for (int k = 0; k < NS; ++k) {
          scale[k] = rinv[i + k * qr] * cc;
          rnd[k] = rounder(off + k * qr * C, q.key);
        }
        p3_rows<E, NS, decltype(mom)::value>(p + off, g + off, m ? m + off : nullptr, qr * C, C, cinv, scale, decay,
                                             nlr, rnd);
      });
    });
    return;
  }
  int64_t e0, e1;
  G.range(b, e0, e1);
  const int64_t u = b / G.blocks_per_unit;
  const T cc = T(q.corr[u]) * T(q.clip[u]);
  const T floor = h.add_mode ? T(0) : T(h.eps);
  const T* v = at_<T>(q.v);
  with_mom([&](auto mom) {
    run_groups(e0, e1, [&](auto ns, int64_t e, int64_t n, int64_t stride) {
      constexpr int NS = decltype(ns)::value;
      Rounder rnd[NS];
      for (int k = 0; k < NS; ++k) rnd[k] = rounder(e + k * stride, q.key);
      p3_run<E, NS, decltype(mom)::value>(p + e, g + e, m ? m + e : nullptr, v + e, stride, n, cc, floor, decay, nlr,
                                          rnd);
    });
  });
}

// ------------------------------------------------------------------------------------------------ one process
// Passes 2 and 3 of one unit, done whole by one thread: the factored statistics of its matrices (pass 1's rows and
// columns, then the EMAs), pass 2 on its blocks, its clip, pass 3. Its gradient (or momentum) is read from memory
// once; the next reads hit the core's cache. `scratch` holds Stats::size(geo, mats_per_unit) elements of T.
template <class E>
void fused_unit(Param& q, const Hyper& h, int64_t u, typename E::T* scratch) {
  using T = typename E::T;
  const Geo& G = q.geo;
  const int64_t b0 = u * G.blocks_per_unit, b1 = b0 + G.blocks_per_unit;
  Stats s;
  if (G.factored) {
    const int64_t m0 = u * G.mats_per_unit;
    s = Stats::carve(scratch, G, m0, G.mats_per_unit);
    for (int64_t b = b0; b < b1; ++b) p1_block<E>(q, s, b);
    p1_finish<T>(q, s, m0, m0 + G.mats_per_unit);
    update_factored<T>(q, s, h, m0, m0 + G.mats_per_unit);
  }
  for (int64_t b = b0; b < b1; ++b) q.partial[b] = p2_block<E>(q, s, h, b);
  q.clip[u] = clip_of(unit_sum<T>(q, u), G.ng);
  for (int64_t b = b0; b < b1; ++b) p3_block<E>(q, s, h, b);
}

// Units too large for one core's cache, their blocks spread over the threads in three rounds (statistics, pass 2,
// pass 3). Batched so that their statistics take at most `budget` elements of scratch at a time.
void split_units(std::vector<Param>& qs, const std::vector<const Hyper*>& hs,
                 const std::vector<std::pair<int32_t, int64_t>>& units, int64_t budget) {
  size_t next = 0;
  while (next < units.size()) {
    std::vector<std::pair<int32_t, int64_t>> batch;
    std::vector<int64_t> offsets;
    int64_t size = 0, elements = 0;
    for (; next < units.size(); ++next) {
      const Geo& G = qs[units[next].first].geo;
      const int64_t need = G.factored ? Stats::size(G, G.mats_per_unit) : 0;
      if (!batch.empty() && size + need > budget) break;
      batch.push_back(units[next]);
      offsets.push_back(size);
      size += need;
      elements += G.unit_numel;
    }
    Tensor scratch = at::empty({std::max<int64_t>(size, 1)}, at::TensorOptions().dtype(at::kDouble));
    std::vector<Stats> stats(batch.size());
    std::vector<std::pair<int32_t, int64_t>> blocks;  // (batch index, block)
    for (size_t k = 0; k < batch.size(); ++k) {
      const auto [i, u] = batch[k];
      Param& q = qs[i];
      with_elem(q, [&](auto e) {
        using T = typename decltype(e)::T;  // double scratch elements hold T values, one per element
        if (q.geo.factored)
          stats[k] = Stats::carve(reinterpret_cast<T*>(scratch.data_ptr<double>() + offsets[k]), q.geo,
                                  u * q.geo.mats_per_unit, q.geo.mats_per_unit);
      });
      for (int64_t b = u * q.geo.blocks_per_unit; b < (u + 1) * q.geo.blocks_per_unit; ++b)
        blocks.emplace_back(int32_t(k), b);
    }
    auto round = [&](auto body) {
      run_items(int64_t(blocks.size()), elements, [&](int64_t j) {
        const auto [k, b] = blocks[j];
        Param& q = qs[batch[k].first];
        with_elem(q, [&](auto e) { body(e, q, k, b); });
      });
    };
    round([&](auto e, Param& q, size_t k, int64_t b) {
      if (q.geo.factored) p1_block<decltype(e)>(q, stats[k], b);
    });
    for (size_t k = 0; k < batch.size(); ++k) {
      Param& q = qs[batch[k].first];
      if (!q.geo.factored) continue;
      const int64_t m0 = batch[k].second * q.geo.mats_per_unit, m1 = m0 + q.geo.mats_per_unit;
      with_elem(q, [&](auto e) {
        using T = typename decltype(e)::T;
        p1_finish<T>(q, stats[k], m0, m1);
        update_factored<T>(q, stats[k], *hs[batch[k].first], m0, m1);
      });
    }
    round([&](auto e, Param& q, size_t k, int64_t b) {
      q.partial[b] = p2_block<decltype(e)>(q, stats[k], *hs[batch[k].first], b);
    });
    for (const auto& [i, u] : batch)
      with_elem(qs[i], [&](auto e) {
        qs[i].clip[u] = clip_of(unit_sum<typename decltype(e)::T>(qs[i], u), qs[i].geo.ng);
      });
    round([&](auto e, Param& q, size_t k, int64_t b) {
      p3_block<decltype(e)>(q, stats[k], *hs[batch[k].first], b);
    });
  }
}

// ------------------------------------------------------------------------------------------------ Python API
// The three passes for one process: nothing crosses a reduction seam, so no statistic becomes a tensor. Pass 1 is
// only the per-unit sum of g^2 (for the non-finite check and the banks' idle slices); each unit's row and column
// statistics are computed in pass 2, next to their use. Bitwise equal to grad_stats + update_moments +
// apply_updates. Returns false, having written nothing, when skip_nonfinite and some gradient holds inf or NaN.
bool step(const std::vector<std::vector<Tensor>>& params, const std::vector<std::vector<Tensor>>& grads,
          const std::vector<std::vector<Tensor>>& steps, const std::vector<std::vector<OptTensor>>& exp_avgs,
          const std::vector<std::vector<OptTensor>>& exp_avg_scales,
          const std::vector<std::vector<OptTensor>>& exp_avg_sqs, const std::vector<std::vector<OptTensor>>& row_vars,
          const std::vector<std::vector<OptTensor>>& col_vars, const std::vector<std::vector<bool>>& banks,
          const std::vector<std::vector<std::vector<int64_t>>>& shapes,
          const std::vector<std::vector<int64_t>>& param_ids, const std::vector<Hyper>& hypers, bool skip_nonfinite) {
  const size_t ng = params.size();
  TORCH_CHECK(grads.size() == ng && steps.size() == ng && exp_avgs.size() == ng && exp_avg_scales.size() == ng &&
                  exp_avg_sqs.size() == ng && row_vars.size() == ng && col_vars.size() == ng && banks.size() == ng &&
                  shapes.size() == ng && param_ids.size() == ng && hypers.size() == ng,
              "skewadam C++ CPU kernel: per-group lists of different lengths");
  Contig ct;
  std::vector<Param> qs;
  std::vector<const Hyper*> hs;
  std::vector<int64_t> ids;
  std::vector<std::pair<int32_t, int64_t>> blocks;
  int64_t elements = 0;
  for (size_t gi = 0; gi < ng; ++gi) {
    const size_t n = params[gi].size();
    TORCH_CHECK(grads[gi].size() == n && steps[gi].size() == n && exp_avgs[gi].size() == n &&
                    exp_avg_scales[gi].size() == n && exp_avg_sqs[gi].size() == n && row_vars[gi].size() == n &&
                    col_vars[gi].size() == n && banks[gi].size() == n && shapes[gi].size() == n &&
                    param_ids[gi].size() == n,
                "skewadam C++ CPU kernel: tensor lists of different lengths in group ", gi);
    for (size_t i = 0; i < n; ++i) {
      Param& q = qs.emplace_back();
      const Tensor& g = grads[gi][i];
      q.dtype = g.scalar_type();
      TORCH_CHECK(params[gi][i].scalar_type() == q.dtype, "skewadam C++ CPU kernel: gradient dtype ", q.dtype,
                  " differs from the parameter's ", params[gi][i].scalar_type());
      const at::ScalarType T = math_dtype(q.dtype);
      for (const OptTensor* t : {&exp_avg_sqs[gi][i], &row_vars[gi][i], &col_vars[gi][i]})
        TORCH_CHECK(!t->has_value() || (*t)->scalar_type() == T, "skewadam C++ CPU kernel: state of a ", q.dtype,
                    " parameter must be ", T, ", got ", (*t)->scalar_type());
      TORCH_CHECK(steps[gi][i].scalar_type() == at::kFloat, "skewadam C++ CPU kernel: step counts must be float32");
      q.g = ct.read(g);
      q.p = ct.write(params[gi][i]);
      q.step = static_cast<float*>(ct.write(steps[gi][i]));
      set_momentum(q, ct, exp_avgs[gi][i], exp_avg_scales[gi][i], true);
      q.v = ct.write(exp_avg_sqs[gi][i]);
      q.row_var = ct.write(row_vars[gi][i]);
      q.col_var = ct.write(col_vars[gi][i]);
      const bool factored = row_vars[gi][i].has_value();
      q.geo = make_geo(g, banks[gi][i], factored, shapes[gi][i], mom_align(q, factored));
      q.partial.assign(q.geo.blocks(), 0.0);
      q.clip.assign(q.geo.units, 1.0);
      q.sumsq_buf.assign(q.geo.units, 0.0);
      q.sumsq = q.sumsq_buf.data();
      hs.push_back(&hypers[gi]);
      ids.push_back(param_ids[gi][i]);
      for (int64_t b = 0; b < q.geo.blocks(); ++b) blocks.emplace_back(int32_t(qs.size() - 1), b);
      elements += q.geo.numel;
    }
  }
  // pass 1: per-unit sums of g^2
  run_items(int64_t(blocks.size()), elements, [&](int64_t k) {
    const auto [i, b] = blocks[k];
    with_elem(qs[i], [&](auto e) { qs[i].partial[b] = sumsq_block<decltype(e)>(qs[i], b); });
  });
  bool finite = true;
  for (Param& q : qs)
    with_elem(q, [&](auto e) {
      using T = typename decltype(e)::T;
      for (int64_t u = 0; u < q.geo.units; ++u) {
        at_<T>(q.sumsq)[u] = unit_sum<T>(q, u);
        finite = finite && std::isfinite(at_<T>(q.sumsq)[u]);
      }
    });
  if (skip_nonfinite && !finite) return false;
  // passes 2 and 3: units that fit a core's L2 cache whole, by one thread each; larger ones split
  std::vector<std::pair<int32_t, int64_t>> fused, split;
  int64_t fused_elements = 0, scratch_per_thread = 0, largest = 1;
  for (size_t i = 0; i < qs.size(); ++i) {
    Param& q = qs[i];
    const Geo& G = q.geo;
    with_elem(q, [&](auto e) { count_steps<typename decltype(e)::T>(q, *hs[i], ids[i]); });
    const int64_t m_bytes = q.mfmt == kMomPlain ? c10::elementSize(math_dtype(q.dtype)) : q.mfmt == kMomBF16 ? 2 : 1;
    const int64_t src_bytes = G.unit_numel * (q.m ? m_bytes : int64_t(c10::elementSize(q.dtype)));
    largest = std::max(largest, G.unit_numel);
    for (int64_t u = 0; u < G.units; ++u) {
      if (!q.active[u] || G.blocks_per_unit == 0) continue;
      if (src_bytes <= kFuseBytes) {
        fused.emplace_back(int32_t(i), u);
        fused_elements += G.unit_numel;
        if (G.factored) scratch_per_thread = std::max(scratch_per_thread, Stats::size(G, G.mats_per_unit));
      } else {
        split.emplace_back(int32_t(i), u);
      }
    }
  }
  std::reverse(fused.begin(), fused.end());  // pass 1 ended with the last parameters: likeliest still in cache
  const int64_t nt = std::max(1, at::get_num_threads());
  Tensor scratch = at::empty({std::max<int64_t>(nt * scratch_per_thread, 1)}, at::TensorOptions().dtype(at::kDouble));
  run_items(int64_t(fused.size()), fused_elements, [&](int64_t k) {
    const auto [i, u] = fused[k];
    double* mine = scratch.data_ptr<double>() + at::get_thread_num() * scratch_per_thread;
    with_elem(qs[i], [&](auto e) {
      using E = decltype(e);
      fused_unit<E>(qs[i], *hs[i], u, reinterpret_cast<typename E::T*>(mine));
    });
  });
  split_units(qs, hs, split, std::max<int64_t>(largest / 16, kBlock));  // <= 1/8 of an fp32 copy of the largest unit
  ct.finish();
  return true;
}

// Pass 1 (eager.grad_stats): per parameter [sumsq, rc_sumsq, row, col, row_var_sum] (None where not factored).
std::vector<std::vector<OptTensor>> grad_stats(const std::vector<Tensor>& grads, const std::vector<OptTensor>& row_vars,
                                               const std::vector<bool>& banks,
                                               const std::vector<at::ScalarType>& dtypes) {
  const size_t n = grads.size();
  TORCH_CHECK(row_vars.size() == n && banks.size() == n && dtypes.size() == n,
              "skewadam C++ CPU kernel: tensor lists of different lengths");
  Contig ct;
  std::vector<Param> qs(n);
  std::vector<std::vector<OptTensor>> out(n);
  std::vector<Tensor> colps;
  std::vector<std::pair<int32_t, int64_t>> blocks;
  int64_t elements = 0;
  for (size_t i = 0; i < n; ++i) {
    Param& q = qs[i];
    const Tensor& g = grads[i];
    q.dtype = g.scalar_type();
    TORCH_CHECK(dtypes[i] == math_dtype(q.dtype), "skewadam C++ CPU kernel: math dtype ", dtypes[i], " for a ",
                q.dtype, " gradient is not supported (expected ", math_dtype(q.dtype), ")");
    q.g = ct.read(g);
    q.geo = make_geo(g, banks[i], row_vars[i].has_value(), g.sizes());
    const Geo& G = q.geo;
    auto opts = g.options().dtype(dtypes[i]);
    Tensor sumsq = at::empty(unit_keepdim_shape(g, banks[i]), opts);
    q.sumsq = sumsq.data_ptr();
    q.partial.assign(G.blocks(), 0.0);
    for (int64_t b = 0; b < G.blocks(); ++b) blocks.emplace_back(int32_t(i), b);
    elements += G.numel;
    out[i] = {sumsq, std::nullopt, std::nullopt, std::nullopt, std::nullopt};
    if (!G.factored) continue;
    q.row_var = const_cast<void*>(ct.read(*row_vars[i]));
    Tensor rc = at::empty(stat_shape(g, 1, 1), opts), row = at::empty(stat_shape(g, G.R, 1), opts),
           col = at::empty(stat_shape(g, 1, G.C), opts), rvs = at::empty(stat_shape(g, 1, 1), opts);
    q.st.rc = rc.data_ptr();
    q.st.row = row.data_ptr();
    q.st.col = col.data_ptr();
    q.st.rvs = rvs.data_ptr();
    if (G.blocks_per_mat > 1) {
      colps.push_back(at::empty({G.M * G.blocks_per_mat * G.C}, opts));
      q.st.colp = colps.back().data_ptr();
    }
    out[i] = {sumsq, rc, row, col, rvs};
  }
  run_items(int64_t(blocks.size()), elements, [&](int64_t k) {
    const auto [i, b] = blocks[k];
    with_elem(qs[i], [&](auto e) {
      if (qs[i].geo.factored)
        p1_block<decltype(e)>(qs[i], qs[i].st, b);
      else
        qs[i].partial[b] = sumsq_block<decltype(e)>(qs[i], b);
    });
  });
  for (Param& q : qs)
    with_elem(q, [&](auto e) {
      using T = typename decltype(e)::T;
      const Geo& G = q.geo;
      if (!G.factored) {
        for (int64_t u = 0; u < G.units; ++u) at_<T>(q.sumsq)[u] = unit_sum<T>(q, u);
        return;
      }
      p1_finish<T>(q, q.st, 0, G.M);
      for (int64_t u = 0; u < G.units; ++u) {
        double s = 0;
        for (int64_t m = u * G.mats_per_unit; m < (u + 1) * G.mats_per_unit; ++m) s += double(at_<T>(q.st.rc)[m]);
        at_<T>(q.sumsq)[u] = T(s);
      }
    });
  return out;
}

// Pass 2 (eager.update_moments_): per parameter (u_sumsq, corr tensor (bank) or None, corr float, rinv, cinv, active).
std::vector<std::tuple<Tensor, OptTensor, double, OptTensor, OptTensor, OptTensor>> update_moments(
    const std::vector<Tensor>& grads, const std::vector<Tensor>& steps, const std::vector<OptTensor>& exp_avgs,
    const std::vector<OptTensor>& exp_avg_sqs, const std::vector<OptTensor>& row_vars,
    const std::vector<OptTensor>& col_vars, const std::vector<std::vector<OptTensor>>& stats,
    const std::vector<bool>& banks, const std::vector<std::vector<int64_t>>& shapes, double beta1, double beta2,
    double eps, bool add_mode, const std::vector<OptTensor>& exp_avg_scales, int64_t seed,
    const std::vector<int64_t>& param_ids) {
  const size_t n = grads.size();
  TORCH_CHECK(steps.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && row_vars.size() == n &&
                  col_vars.size() == n && stats.size() == n && banks.size() == n && shapes.size() == n &&
                  exp_avg_scales.size() == n && param_ids.size() == n,
              "skewadam C++ CPU kernel: tensor lists of different lengths");
  Contig ct;
  Hyper h{beta1, beta2, eps, add_mode};
  h.seed = seed;
  std::vector<Param> qs(n);
  std::vector<std::tuple<Tensor, OptTensor, double, OptTensor, OptTensor, OptTensor>> out;
  std::vector<std::pair<int32_t, int64_t>> blocks;
  int64_t elements = 0;
  for (size_t i = 0; i < n; ++i) {
    Param& q = qs[i];
    const Tensor& g = grads[i];
    q.dtype = g.scalar_type();
    q.g = ct.read(g);
    q.step = static_cast<float*>(ct.write(steps[i]));
    set_momentum(q, ct, exp_avgs[i], exp_avg_scales[i], true);
    q.v = ct.write(exp_avg_sqs[i]);
    q.row_var = ct.write(row_vars[i]);
    q.col_var = ct.write(col_vars[i]);
    q.geo = make_geo(g, banks[i], row_vars[i].has_value(), shapes[i], mom_align(q, row_vars[i].has_value()));
    const Geo& G = q.geo;
    TORCH_CHECK(stats[i].size() == 5 && stats[i][0], "skewadam C++ CPU kernel: GradStats has 5 fields");
    q.sumsq = const_cast<void*>(ct.read(*stats[i][0]));
    auto opts = g.options().dtype(math_dtype(q.dtype));
    OptTensor rinv, cinv, corr_t, active_t;
    with_elem(q, [&](auto e) { count_steps<typename decltype(e)::T>(q, h, param_ids[i]); });
    if (G.factored) {
      q.st.rc = const_cast<void*>(ct.read(*stats[i][1]));
      q.st.row = const_cast<void*>(ct.read(*stats[i][2]));
      q.st.col = const_cast<void*>(ct.read(*stats[i][3]));
      q.st.rvs = const_cast<void*>(ct.read(*stats[i][4]));
      rinv = at::empty(stat_shape(g, G.R, 1), opts);
      cinv = at::empty(stat_shape(g, 1, G.C), opts);
      q.st.rinv = rinv->data_ptr();
      q.st.cinv = cinv->data_ptr();
      with_elem(q, [&](auto e) { update_factored<typename decltype(e)::T>(q, q.st, h, 0, G.M); });
    }
    if (G.bank) {
      corr_t = at::empty(unit_keepdim_shape(g, true), opts);
      active_t = at::empty(unit_keepdim_shape(g, true), opts.dtype(at::kBool));
      for (int64_t u = 0; u < G.units; ++u) {
        with_elem(q, [&](auto e) { at_<typename decltype(e)::T>(corr_t->data_ptr())[u] = q.corr[u]; });
        active_t->data_ptr<bool>()[u] = q.active[u];
      }
    }
    q.partial.assign(G.blocks(), 0.0);
    for (int64_t b = 0; b < G.blocks(); ++b)
      if (q.active[b / G.blocks_per_unit]) blocks.emplace_back(int32_t(i), b);
    elements += G.numel;
    out.emplace_back(at::empty(unit_keepdim_shape(g, G.bank), opts), corr_t, G.bank ? 0.0 : q.corr[0], rinv, cinv,
                     active_t);
  }
  run_items(int64_t(blocks.size()), elements, [&](int64_t k) {
    const auto [i, b] = blocks[k];
    with_elem(qs[i], [&](auto e) { qs[i].partial[b] = p2_block<decltype(e)>(qs[i], qs[i].st, h, b); });
  });
  for (size_t i = 0; i < n; ++i)
    with_elem(qs[i], [&](auto e) {
      using T = typename decltype(e)::T;
      T* us = std::get<0>(out[i]).data_ptr<T>();
      for (int64_t u = 0; u < qs[i].geo.units; ++u) us[u] = qs[i].active[u] ? unit_sum<T>(qs[i], u) : T(0);
    });
  ct.finish();
  return out;
}

// Pass 3 (eager.apply_updates_), from the (reduced) per-unit sums of u^2 and pass 2's other results.
void apply_updates(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                   const std::vector<Tensor>& steps, const std::vector<OptTensor>& exp_avgs,
                   const std::vector<OptTensor>& exp_avg_sqs, const std::vector<Tensor>& u_sumsqs,
                   const std::vector<OptTensor>& corr_ts, const std::vector<double>& corr_fs,
                   const std::vector<OptTensor>& rinvs, const std::vector<OptTensor>& cinvs,
                   const std::vector<OptTensor>& actives,
                   const std::vector<bool>& banks, const std::vector<std::vector<int64_t>>& shapes, double lr,
                   double weight_decay, double eps, bool add_mode, int64_t seed,
                   const std::vector<int64_t>& param_ids, const std::vector<OptTensor>& exp_avg_scales) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && steps.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  u_sumsqs.size() == n && corr_ts.size() == n && corr_fs.size() == n && rinvs.size() == n &&
                  cinvs.size() == n && actives.size() == n && banks.size() == n && shapes.size() == n &&
                  param_ids.size() == n && exp_avg_scales.size() == n,
              "skewadam C++ CPU kernel: tensor lists of different lengths");
  Contig ct;
  Hyper h;
  h.eps = eps;
  h.add_mode = add_mode;
  h.lr = lr;
  h.weight_decay = weight_decay;
  h.seed = seed;
  std::vector<Param> qs(n);
  std::vector<std::pair<int32_t, int64_t>> blocks;
  int64_t elements = 0;
  for (size_t i = 0; i < n; ++i) {
    Param& q = qs[i];
    Tensor g = grads[i];
    if (g.scalar_type() != params[i].scalar_type()) g = g.to(params[i].scalar_type());
    q.dtype = g.scalar_type();
    q.g = ct.read(g);
    q.p = ct.write(params[i]);
    q.step = static_cast<float*>(const_cast<void*>(ct.read(steps[i])));
    set_momentum(q, ct, exp_avgs[i], exp_avg_scales[i], false);
    q.v = exp_avg_sqs[i] ? const_cast<void*>(ct.read(*exp_avg_sqs[i])) : nullptr;
    q.st.rinv = rinvs[i] ? const_cast<void*>(ct.read(*rinvs[i])) : nullptr;
    q.st.cinv = cinvs[i] ? const_cast<void*>(ct.read(*cinvs[i])) : nullptr;
    q.geo = make_geo(g, banks[i], rinvs[i].has_value(), shapes[i], mom_align(q, rinvs[i].has_value()));
    const Geo& G = q.geo;
    q.active.assign(G.units, 1);
    q.corr.assign(G.units, corr_fs[i]);
    q.clip.assign(G.units, 1.0);
    const void* us = ct.read(u_sumsqs[i]);
    const void* cp = corr_ts[i] ? ct.read(*corr_ts[i]) : nullptr;
    const bool* ap = actives[i] ? static_cast<const bool*>(ct.read(*actives[i])) : nullptr;
    with_elem(q, [&](auto e) {
      using T = typename decltype(e)::T;
      TORCH_CHECK(u_sumsqs[i].scalar_type() == c10::CppTypeToScalarType<T>::value && u_sumsqs[i].numel() == G.units,
                  "skewadam C++ CPU kernel: u_sumsq must hold one ", c10::CppTypeToScalarType<T>::value,
                  " value per unit");
      for (int64_t u = 0; u < G.units; ++u) {
        if (cp) q.corr[u] = double(at_<T>(cp)[u]);
        if (ap) q.active[u] = ap[u];
        q.clip[u] = clip_of(at_<T>(us)[u], G.ng);
      }
    });
    if (q.dtype == at::kBFloat16) {
      double t = 0;
      for (int64_t k = 0; k < steps[i].numel(); ++k) t += double(q.step[k]);
      q.key = rounding_key(seed, param_ids[i], int64_t(t));
    }
    for (int64_t b = 0; b < G.blocks(); ++b)
      if (q.active[b / G.blocks_per_unit]) blocks.emplace_back(int32_t(i), b);
    elements += G.numel;
  }
  run_items(int64_t(blocks.size()), elements, [&](int64_t k) {
    const auto [i, b] = blocks[k];
    with_elem(qs[i], [&](auto e) { p3_block<decltype(e)>(qs[i], qs[i].st, h, b); });
  });
  ct.finish();
}

Tensor stochastic_round_bf16(const Tensor& x, int64_t key) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "stochastic_round_bf16 takes a float32 tensor, got ", x.scalar_type());
  Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  Tensor src = x.contiguous();
  const float* s = src.numel() ? src.data_ptr<float>() : nullptr;
  uint16_t* o = out.numel() ? static_cast<uint16_t*>(out.data_ptr()) : nullptr;
  const int64_t n = src.numel();
  const uint32_t k = uint32_t(key);
  run_items((n + kBlock - 1) / kBlock, n, [&](int64_t b) {
    const int64_t e0 = b * kBlock;
    const Rounder r = rounder(e0, k);
    write_runs<Elem<c10::BFloat16>, 1>(o + e0, 0, std::min(kBlock, n - e0), &r,
                                       [&](int, uint32_t j) { return s[e0 + j]; });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "SkewAdam's update passes on CPU (see skewadam/kernels/cpu.py)";
  pybind11::class_<Hyper>(m, "Hyper")
      .def(pybind11::init<double, double, double, bool, double, double, int64_t>(), pybind11::arg("beta1"),
           pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("add_mode"), pybind11::arg("lr"),
           pybind11::arg("weight_decay"), pybind11::arg("seed"));
  m.def("step", &step, "passes 1-3 for one process; false if skipped for a non-finite gradient");
  m.def("grad_stats", &grad_stats, "pass 1: sums of g^2");
  m.def("update_moments", &update_moments, "pass 2: step counts, moments, per-unit sum of u^2");
  m.def("apply_updates", &apply_updates, "pass 3: clip, decay, write (bf16: stochastic rounding)");
  m.def("stochastic_round_bf16", &stochastic_round_bf16, "rounding.py's stochastic rounding of fp32 to bf16");
  m.def("rounding_key", [](int64_t seed, int64_t param_index, int64_t step) {
    return int64_t(rounding_key(seed, param_index, step));
  }, "rounding.py's rounding_key");
}
