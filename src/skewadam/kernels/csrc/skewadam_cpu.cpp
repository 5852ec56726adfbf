// SkewAdam's update on CPU: the passes of skewadam/kernels/eager.py as C++ loops over blocks, on ATen's threads.
//
// The math is eager.py's, operation for operation, in the statistics dtype T (fp32 for bf16 parameters, the
// parameter's dtype otherwise), pass 1's sums and the second-moment EMAs in double; types.py gives the order of
// operations, eager.py the formulas. cpu.py builds this file with -ffp-contract=off, so
// every operation is rounded on its own, as torch's element-wise ops round: the element-wise state (step counts, the
// first moment in every storage, the full second moment) is bitwise eager's on any x86-64. Sums are added in another
// order than torch adds them, so the factored statistics and the weights agree with eager to rounding.
// What differs from eager is how memory is walked:
//
//   * Every parameter is cut into fixed *blocks* that do not depend on the thread count: for a factored tensor
//     [..., R, C], a run of rows of one matrix (>= kMinBlockRows rows, ~kBlock elements); otherwise a run of ~kBlock
//     elements of one unit. The blocks of all parameters are one list of work items that ATen's threads take
//     dynamically (at::parallel_for), so a core slowed by another process takes fewer of them.
//   * Each block writes its partial sums to its own slot, and the slots are added in block order: results are
//     bitwise the same whatever the number of threads, and the same on the three-pass and single-process paths.
//   * Three passes (grad_stats, update_moments, apply_updates) with tensors in between, for the distributed seam.
//   * `step`, for one process (nothing to reduce between passes), in one call: pass 1 is each unit's sum of g^2
//     (the non-finite check, the banks' idle slices), and for a factored parameter whose units fit a core's L2
//     cache also its row and column sums (grad_stats' pass 1, kept for the step); then such a unit (bank slice or
//     whole tensor) is one work item: the EMAs, pass 2, its clip, pass 3, its gradient read from memory once for
//     passes 2 and 3. An expert parameter costs 16 bytes of memory traffic in fp32 (g twice, p read and written)
//     against fused AdamW's 28, 8 in bf16 against 14. Larger units are spread over the threads in rounds.
//
// Adafactor's options (types.Group: relative_step, beta2_decay) are per-unit scalars here, as in eager: Param's
// `beta2` (the second moment's EMAs), `corr` (pass 2's scale of u) and `scale` (pass 3's), and pass 1's sum of p^2.
//
// One definition per pass: a pass walks a block as *spans* (NS runs of n elements, `stride` apart), and pass 2 is
// p2_span, pass 3 p3_span, each a template over the first moment's codec (NoMom, PlainMom, BF16Mom, Int8Mom: how u's
// source is read, and in pass 2 the momentum EMA stored) and the direction (FactoredDir: u = src * rinv_i * c *
// cinv_j; FullDir: u = src * c / sqrt(max(v_j, floor)), pass 2 first updating v_j). The fused step and the three
// passes call the same functions on the same blocks.
//
// Records: the Python API takes skewadam/kernels/types.py's Group, ParamTensors, GradStats and Moments (NamedTuples,
// as std::tuples; Group and ParamTensors converted with the C API, the per-step cost that matters at a few hundred
// tensors); `fields()` lists the fields in the order read here, and cpu.py checks them against
// types.py when it loads the extension. Every size the kernel indexes with is checked against the parameter first
// (TORCH_CHECK_VALUE: a Python ValueError naming the parameter and the fix), so a mismatched gradient, state or
// statistic is an error, never an out-of-bounds access.
//
// Constants come from the Python modules that define them, as -D flags that cpu.py builds (and hashes into the build's
// name): quant.BLOCK, quant.QMAX and quant.MOMENTUM_STREAM, rounding.py's hash multipliers, types.ROW_MEAN_FLOOR,
// RELATIVE_STEP_EPS and MomFmt (the momentum formats' numbers), and cpu.py's own BLOCK and MIN_BLOCK_ROWS
// (which its step_transient_bytes sizes the kept statistics with).
//
// Transient memory: no buffer of the size of a parameter (except a contiguous copy of a non-contiguous one). The
// three-pass path returns the small statistics as tensors (rows, columns, one value per unit); `step` keeps the row
// and column statistics of the factored parameters whose units it fuses (Stats::bytes per
// parameter: cpu.step_transient_bytes), per unit and per block a few numbers, and for split units at most 1/16 of
// the largest unit's elements.
//
// Stochastic rounding: bit-identical to skewadam/kernels/rounding.py (same hash, key and element index).
// Compact first moment (bf16, or int8 with an fp32 scale per kQBlock values along the last dim): decoded, updated and
// encoded with quant.py's operations in its order, so the stored bytes are eager's.
// Indexing is int64 throughout; a single row must hold fewer than 2^31 elements.
//
// Shape legend: E units (bank slices), M matrices [R, C] of a factored tensor (all leading dims), R rows, C columns.

#include <torch/extension.h>
#include <pybind11/stl.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#if !defined(SKEWADAM_QBLOCK) || !defined(SKEWADAM_QMAX) || !defined(SKEWADAM_MOMENTUM_STREAM) || \
    !defined(SKEWADAM_MUL1) || !defined(SKEWADAM_MUL2) || !defined(SKEWADAM_GOLDEN) || \
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

// x[0] + ... + x[N - 1] as a fixed tree of halves. A loop that adds its NS runs' terms to a lane this way carries
// one add per iteration from one to the next, not NS dependent ones (which bound the loop by the adder's latency).
template <int N, class T>
inline T tree_sum(const T* x) {
  if constexpr (N == 1)
    return x[0];
  else
    return tree_sum<N / 2>(x) + tree_sum<N - N / 2>(x + N / 2);
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

// ------------------------------------------------------------------------------------------------ records
// types.py's records, field for field (cpu.py checks `fields()` against them when it loads the extension).
using ParamRec = std::tuple<Tensor, Tensor, Tensor, OptTensor, OptTensor, OptTensor, OptTensor, OptTensor,
                            std::vector<int64_t>, bool, int64_t, py::object>;
using GroupRec = std::tuple<std::vector<ParamRec>, py::object, double, double, double, std::string, double, int64_t,
                            bool, std::optional<double>>;
using StatsRec = std::tuple<Tensor, OptTensor, OptTensor, OptTensor, OptTensor, OptTensor, OptTensor>;
using Corr = std::variant<Tensor, double>;
using MomentsRec = std::tuple<Tensor, Corr, OptTensor, OptTensor, OptTensor>;

py::dict fields() {
  py::dict d;
  d["ParamTensors"] = std::vector<std::string>{"param", "grad", "step", "exp_avg", "exp_avg_scale", "exp_avg_sq",
                                               "row_var", "col_var", "shape", "bank", "stream", "name"};
  d["Group"] = std::vector<std::string>{"params", "lr", "beta1", "beta2", "eps", "eps_mode", "weight_decay", "seed",
                                        "relative_step", "beta2_decay"};
  d["GradStats"] = std::vector<std::string>{"sumsq", "rc_sumsq", "row", "col", "row_var_sum", "p_sumsq", "absmax"};
  d["Moments"] = std::vector<std::string>{"u_sumsq", "corr", "rinv", "cinv", "active"};
  return d;
}

// The records converted field by field with the C API: pybind's generic casters took 2-4 us per ParamTensors
// (measured: 0.4-0.9 ms a step for the bench model's 211 tensors, up to 5% of it; on 211 tiny tensors the casters
// alone took 0.42 ms where this whole call, conversion and step, takes 0.35 ms). A record that
// is not a tuple of its fields, or a field of another type, is a TypeError naming it (cpu.py then says what is wrong,
// with types.check).
[[noreturn]] void wrong_type(const char* field) {
  throw py::type_error(std::string("skewadam C++ CPU kernel: record field '") + field + "' has the wrong type");
}

Tensor tensor_of(PyObject* o, const char* field) {
  if (!THPVariable_Check(o)) wrong_type(field);
  return THPVariable_Unpack(o);
}

OptTensor opt_tensor_of(PyObject* o, const char* field) {
  if (o == Py_None) return std::nullopt;
  return tensor_of(o, field);
}

int64_t int_of(PyObject* o, const char* field) {
  if (!PyLong_Check(o)) wrong_type(field);
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return int64_t(v);
}

double double_of(PyObject* o, const char* field) {
  if (PyFloat_Check(o)) return PyFloat_AS_DOUBLE(o);
  const double v = PyFloat_AsDouble(o);  // an int, or anything with __float__ (pybind's caster accepts the same)
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    wrong_type(field);
  }
  return v;
}

// A sequence's items: fn(item) for each (a list or tuple without copies).
template <class F>
void for_items(PyObject* seq, const char* field, const F& fn) {
  py::object fast = py::reinterpret_steal<py::object>(PySequence_Fast(seq, ""));
  if (!fast) {
    PyErr_Clear();
    wrong_type(field);
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.ptr());
  PyObject** items = PySequence_Fast_ITEMS(fast.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) fn(items[i]);
}

ParamRec param_rec_of(PyObject* r) {
  if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != Py_ssize_t(std::tuple_size_v<ParamRec>)) wrong_type("params");
  const auto at = [&](Py_ssize_t i) { return PyTuple_GET_ITEM(r, i); };
  std::vector<int64_t> shape;
  for_items(at(8), "shape", [&](PyObject* d) { shape.push_back(int_of(d, "shape")); });
  const int bank = PyObject_IsTrue(at(9));  // as pybind's bool caster converts
  if (bank < 0) throw py::error_already_set();
  return {tensor_of(at(0), "param"), tensor_of(at(1), "grad"), tensor_of(at(2), "step"),
          opt_tensor_of(at(3), "exp_avg"), opt_tensor_of(at(4), "exp_avg_scale"), opt_tensor_of(at(5), "exp_avg_sq"),
          opt_tensor_of(at(6), "row_var"), opt_tensor_of(at(7), "col_var"), std::move(shape), bank == 1,
          int_of(at(10), "stream"), py::reinterpret_borrow<py::object>(at(11))};
}

GroupRec group_rec_of(py::handle group) {
  PyObject* g = group.ptr();
  if (!PyTuple_Check(g) || PyTuple_GET_SIZE(g) != Py_ssize_t(std::tuple_size_v<GroupRec>)) wrong_type("groups");
  const auto at = [&](Py_ssize_t i) { return PyTuple_GET_ITEM(g, i); };
  std::vector<ParamRec> params;
  for_items(at(0), "params", [&](PyObject* r) { params.push_back(param_rec_of(r)); });
  if (!PyUnicode_Check(at(5))) wrong_type("eps_mode");
  const int relative = PyObject_IsTrue(at(8));
  if (relative < 0) throw py::error_already_set();
  return {std::move(params), py::reinterpret_borrow<py::object>(at(1)), double_of(at(2), "beta1"),
          double_of(at(3), "beta2"), double_of(at(4), "eps"), py::cast<std::string>(at(5)),
          double_of(at(6), "weight_decay"), int_of(at(7), "seed"), relative == 1,
          at(9) == Py_None ? std::nullopt : std::optional<double>(double_of(at(9), "beta2_decay"))};
}

std::vector<GroupRec> group_recs_of(py::handle groups) {
  std::vector<GroupRec> out;
  for_items(groups.ptr(), "groups", [&](PyObject* g) { out.push_back(group_rec_of(g)); });
  return out;
}

struct Hyper {
  double beta1 = 0, beta2 = 0, eps = 0;
  bool add_mode = false;
  double lr = 0, weight_decay = 0;
  int64_t seed = 0;
  bool relative_step = false;
  std::optional<double> beta2_decay;
};

Hyper hyper_of(const GroupRec& group) {
  Hyper h;
  const py::object& lr = std::get<1>(group);
  if (THPVariable_Check(lr.ptr())) {  // a 0-d or 1-element tensor, as torch's optimizers accept
    const Tensor t = THPVariable_Unpack(lr.ptr());
    TORCH_CHECK_VALUE(t.numel() == 1, "Tensor lr must be 1-element");
    h.lr = t.item<double>();
  } else {
    h.lr = lr.cast<double>();
  }
  h.beta1 = std::get<2>(group);
  h.beta2 = std::get<3>(group);
  h.eps = std::get<4>(group);
  const std::string& mode = std::get<5>(group);
  TORCH_CHECK_VALUE(mode == "add" || mode == "floor", "skewadam C++ CPU kernel: eps_mode ", mode,
                    " (expected 'add' or 'floor')");
  h.add_mode = mode == "add";
  h.weight_decay = std::get<6>(group);
  h.seed = std::get<7>(group);
  h.relative_step = std::get<8>(group);
  h.beta2_decay = std::get<9>(group);
  return h;
}

bool skip_of(const OptTensor& skip) {
  if (!skip) return false;
  TORCH_CHECK_VALUE(skip->numel() == 1, "skewadam C++ CPU kernel: skip must be a 0-d bool tensor, got shape ",
                    skip->sizes());
  return skip->item<bool>();
}

// ------------------------------------------------------------------------------------------------ geometry
// One parameter's local layout and its global sizes (for means).
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
// two work items). The caller has checked the sizes (make_param).
Geo make_geo(const Tensor& p, bool bank, bool factored, const std::vector<int64_t>& global_shape, int64_t align) {
  Geo geo;
  const int64_t nd = p.dim();
  geo.numel = p.numel();
  geo.bank = bank;
  geo.factored = factored;
  geo.units = bank ? p.size(0) : 1;
  geo.unit_numel = geo.units ? geo.numel / geo.units : 0;
  double ng = 1;
  for (int64_t d = bank ? 1 : 0; d < nd; ++d) ng *= double(global_shape[d]);
  geo.ng = ng;
  if (factored) {
    geo.R = p.size(-2);
    geo.C = p.size(-1);
    geo.M = 1;
    for (int64_t d = 0; d < nd - 2; ++d) geo.M *= p.size(d);
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

std::vector<int64_t> unit_keepdim_shape(at::IntArrayRef p, bool bank) {
  std::vector<int64_t> s(p.size(), 1);
  if (bank) s[0] = p[0];
  return s;
}

// p's shape with its last two dims replaced by (r, c) (r < 0: keep R).
std::vector<int64_t> stat_shape(at::IntArrayRef p, int64_t r, int64_t c) {
  std::vector<int64_t> s(p.begin(), p.end());
  if (r >= 0) s[s.size() - 2] = r;
  s[s.size() - 1] = c;
  return s;
}

// Factored statistics of matrices [m0, m0 + count) of one parameter, in the math dtype T: per matrix rc (sum of its
// row sums) and rvs (sum of row_var before the step); per row the sum of g^2; per column the sum of g^2; colp, each
// block's column partials (only when a matrix has more than one block): sums, in double. Per row rinv and per column
// cinv, in T.
struct Stats {
  int64_t m0 = 0;
  double *rc = nullptr, *rvs = nullptr, *row = nullptr, *col = nullptr, *colp = nullptr;
  void *rinv = nullptr, *cinv = nullptr;

  // Bytes of `count` matrices' statistics, with T of `t_size` bytes.
  static int64_t bytes(const Geo& G, int64_t count, int64_t t_size) {
    const int64_t sums = 2 + G.R + G.C + (G.blocks_per_mat > 1 ? G.blocks_per_mat * G.C : 0);
    return count * (sums * int64_t(sizeof(double)) + (G.R + G.C) * t_size);
  }
  // Point into `count` matrices' worth of statistics at base (8-byte aligned, Stats::bytes of them): sums first.
  template <class T>
  static Stats carve(void* base, const Geo& G, int64_t m0, int64_t count) {
    Stats s;
    s.m0 = m0;
    double* d = static_cast<double*>(base);
    for (double** slot : {&s.rc, &s.rvs}) *slot = std::exchange(d, d + count);
    s.row = std::exchange(d, d + count * G.R);
    s.col = std::exchange(d, d + count * G.C);
    if (G.blocks_per_mat > 1) s.colp = std::exchange(d, d + count * G.blocks_per_mat * G.C);
    T* t = reinterpret_cast<T*>(d);
    s.rinv = std::exchange(t, t + count * G.R);
    s.cinv = t;
    return s;
  }
  double* at(double* p, int64_t m, int64_t width) const { return p + (m - m0) * width; }
  template <class T>
  T* at(void* p, int64_t m, int64_t width) const {
    return static_cast<T*>(p) + (m - m0) * width;
  }
};

// ------------------------------------------------------------------------------------------------ parameters
// One parameter through the passes; arrays are raw pointers in the math dtype T.
struct Param {
  py::handle name;  // the record's `name`, for errors
  Geo geo;
  at::ScalarType dtype = at::kFloat;  // of the gradient and the parameter
  const void* g = nullptr;
  void *p = nullptr, *m = nullptr, *v = nullptr, *row_var = nullptr, *col_var = nullptr;
  float* step = nullptr;
  int64_t stream = 0;            // rounding stream (param index of rounding_key)
  double* sumsq = nullptr;       // per unit, sum of g^2
  const double* absmax = nullptr;  // fp64 parameters: per unit, max |g| (their squares can underflow)
  Stats st;                      // all matrices' statistics (three-pass path)
  std::vector<char> active;      // per unit
  std::vector<double> corr;      // per unit: pass 2's scale of u, the bias correction, in double (cast to T where used)
  std::vector<double> scale;     // per unit: pass 3's scale of u, corr (relative step: times max(eps2, rms(p)))
  std::vector<double> beta2;     // per unit: the second moment's beta (beta2_decay: 1 - t^d)
  const double* p_sumsq = nullptr;  // relative step: per unit, sum of p^2 before the step
  std::vector<double> clip;      // per unit: 1 / max(1, rms(u)), in T's precision
  std::vector<double> partial;   // per block: sum of g^2 or of u^2
  std::vector<double> p_partial;  // relative step: per block, sum of p^2
  std::vector<double> max_partial;  // fp64 parameters: per block, max |g|
  std::vector<double> sumsq_buf, absmax_buf, p_sumsq_buf;  // the per-unit values on the single-process path
  uint32_t key = 0;              // stochastic rounding key (bf16 parameters)
  // first moment's storage: format, int8 scales [rows, mNB], last dim, bf16 rounding key
  int mfmt = kMomNone;  // kMomNone: no first moment (else q.m is null only when the parameter has no elements)
  float* mscale = nullptr;
  int64_t mC = 1, mNB = 1;
  uint32_t mkey = 0;
  bool early = false;  // `step`: pass 2 of each unit right after its pass 1 (one process)

  std::string label() const {
    std::string s = name ? std::string(py::str(name)) : std::string();
    return s.empty() ? "parameter" : s;
  }
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

#define SKEWADAM_CHECK(q, cond, ...) \
  TORCH_CHECK_VALUE(cond, "skewadam C++ CPU kernel: ", (q).label(), ": ", __VA_ARGS__)

constexpr const char* kStateFix =
    "; the optimizer state does not belong to this parameter (a state dict saved for another model, or p.data "
    "replaced by a tensor of another shape): load the state saved for this model, or reset this parameter's state "
    "with `del optimizer.state[p]`";

// `t` (when `need`: present) has `sizes` and `dtype`, else is absent; `param`: the parameter's shape, for the message.
void check_state(const Param& q, at::IntArrayRef param, const char* key, const OptTensor& t, bool need,
                 at::IntArrayRef sizes, at::ScalarType dtype) {
  SKEWADAM_CHECK(q, t.has_value() == need, "state '", key, "' is ", t ? "present" : "missing", " where a parameter",
                 " of its kind ", need ? "needs one" : "has none", kStateFix);
  if (!t) return;
  SKEWADAM_CHECK(q, t->sizes() == sizes, "state '", key, "' has shape ", t->sizes(), ", a parameter of shape ",
                 param, " needs ", sizes, kStateFix);
  SKEWADAM_CHECK(q, t->scalar_type() == dtype, "state '", key, "' is ", t->scalar_type(), ", expected ", dtype);
}

// Which tensors a call reads and writes: pass 1 the gradient and row_var; pass 2 writes the state; pass 3 writes the
// parameter and reads the first and full second moments; the fused step writes all.
enum Pass { kStatsPass, kMomentsPass, kApplyPass, kFusedPass };

// Point q at a record's tensors, after checking every size and dtype the passes index with.
Param make_param(const ParamRec& r, Contig& ct, Pass pass, bool reads_param = false) {
  Param q;
  q.name = std::get<11>(r);
  const Tensor &p = std::get<0>(r), &g = std::get<1>(r), &step = std::get<2>(r);
  const OptTensor &m = std::get<3>(r), &scale = std::get<4>(r), &v = std::get<5>(r), &rv = std::get<6>(r),
                  &cv = std::get<7>(r);
  const std::vector<int64_t>& shape = std::get<8>(r);
  const bool bank = std::get<9>(r);
  q.stream = std::get<10>(r);
  q.dtype = p.scalar_type();
  SKEWADAM_CHECK(q, q.dtype == at::kFloat || q.dtype == at::kDouble || q.dtype == at::kBFloat16,
                 "unsupported parameter dtype ", q.dtype, " (fp32, fp64, bf16)");
  SKEWADAM_CHECK(q, g.sizes() == p.sizes(), "gradient of shape ", g.sizes(), " for a parameter of shape ", p.sizes(),
                 "; give p.grad the parameter's shape (p.grad.data was replaced by a tensor of another shape?)");
  SKEWADAM_CHECK(q, g.scalar_type() == q.dtype, "gradient dtype ", g.scalar_type(), " differs from the parameter's ",
                 q.dtype, "; give p.grad the parameter's dtype");
  const int64_t nd = p.dim();
  bool fits = int64_t(shape.size()) == nd;
  for (int64_t d = 0; fits && d < nd; ++d) fits = p.size(d) <= shape[d];
  SKEWADAM_CHECK(q, fits, "local shape ", p.sizes(), " does not fit the global shape ", at::IntArrayRef(shape));
  SKEWADAM_CHECK(q, !bank || nd >= 1, "a bank needs a leading expert dim, got a 0-d parameter");
  const at::ScalarType T = math_dtype(q.dtype);
  SKEWADAM_CHECK(q, step.scalar_type() == at::kFloat, "step counts must be float32, got ", step.scalar_type(),
                 kStateFix);
  SKEWADAM_CHECK(q, bank ? step.dim() == 1 && step.size(0) == p.size(0) : step.numel() == 1, "step of shape ",
                 step.sizes(), ", expected ", bank ? "[" + std::to_string(p.size(0)) + "]" : std::string("()"),
                 kStateFix);
  const bool factored = rv.has_value() || cv.has_value();
  if (factored) {
    SKEWADAM_CHECK(q, nd >= 2 + (bank ? 1 : 0), "factored state for a parameter of shape ", p.sizes(), " (bank ",
                   bank, "), which has no matrix per unit", kStateFix);
    SKEWADAM_CHECK(q, p.size(-1) < (int64_t(1) << 31), "rows of 2^31 or more elements are not supported (shape ",
                   p.sizes(), "); use impl='eager'");
    check_state(q, p.sizes(), "row_var", rv, true, stat_shape(p.sizes(), -1, 1), T);
    check_state(q, p.sizes(), "col_var", cv, true, stat_shape(p.sizes(), 1, p.size(-1)), T);
  }
  check_state(q, p.sizes(), "exp_avg_sq", v, !factored, p.sizes(), T);
  if (m) {
    const at::ScalarType st = m->scalar_type();
    SKEWADAM_CHECK(q, m->sizes() == p.sizes(), "state 'exp_avg' has shape ", m->sizes(), ", a parameter of shape ",
                   p.sizes(), " needs ", p.sizes(), kStateFix);
    SKEWADAM_CHECK(q, st == T || (st == at::kBFloat16 && T == at::kFloat) || st == at::kChar,
                   "momentum of a ", q.dtype, " parameter must be ", T, ", bf16 (for fp32 statistics) or int8, got ",
                   st);
    if (st == at::kChar) {
      SKEWADAM_CHECK(q, nd >= 1, "int8 momentum of a 0-d parameter", kStateFix);
      q.mC = p.size(-1);
      q.mNB = std::max<int64_t>(1, (q.mC + kQBlock - 1) / kQBlock);
      check_state(q, p.sizes(), "exp_avg_scale", scale, true, stat_shape(p.sizes(), -1, q.mNB), at::kFloat);
      q.mfmt = kMomInt8;
    } else {
      check_state(q, p.sizes(), "exp_avg_scale", scale, false, {}, at::kFloat);
      q.mfmt = st == T ? kMomPlain : kMomBF16;
    }
  } else {
    check_state(q, p.sizes(), "exp_avg_scale", scale, false, {}, at::kFloat);
  }
  // pointers: what this pass reads and writes
  const bool state_w = pass == kMomentsPass || pass == kFusedPass, param_w = pass == kApplyPass || pass == kFusedPass;
  q.g = ct.read(g);
  if (param_w) q.p = ct.write(p);
  if (reads_param && !param_w) q.p = const_cast<void*>(ct.read(p));
  if (pass != kStatsPass) {
    q.step = static_cast<float*>(state_w ? ct.write(step) : const_cast<void*>(ct.read(step)));
    q.m = state_w ? ct.write(m) : const_cast<void*>(ct.read(m));
    q.mscale = static_cast<float*>(state_w ? ct.write(scale) : const_cast<void*>(ct.read(scale)));
    q.v = state_w ? ct.write(v) : const_cast<void*>(ct.read(v));
  }
  if (pass == kStatsPass) q.row_var = const_cast<void*>(ct.read(rv));
  if (state_w) {
    q.row_var = ct.write(rv);
    q.col_var = ct.write(cv);
  }
  q.geo = make_geo(p, bank, factored, shape, q.mfmt == kMomInt8 && !factored ? q.mC : 1);
  return q;
}

// A statistic or moment tensor of the pass before has `sizes` and `dtype` (what this pass indexes it with).
void check_input(const Param& q, const char* what, const OptTensor& t, bool need, at::IntArrayRef sizes,
                 at::ScalarType dtype) {
  SKEWADAM_CHECK(q, t.has_value() == need, what, " is ", t ? "present" : "missing", " (expected ",
                 need ? "a tensor" : "None", " for this parameter's state)");
  if (!t) return;
  SKEWADAM_CHECK(q, t->sizes() == sizes && t->scalar_type() == dtype, what, " of shape ", t->sizes(), " and dtype ",
                 t->scalar_type(), ", expected shape ", sizes, " and dtype ", dtype);
}

// ------------------------------------------------------------------------------------------------ pass 1
// Pass 1's sums are double: the square of an fp32 or bf16 value is exact there and no sum of finite ones overflows.
// Converting every element to double would make pass 1 twice as slow, so a block of fp32 or bf16 elements is summed
// in float first (as fast as fp32 sums ever were) and its float sums are kept, as doubles, when each lies in
// [kSafeMin, FLT_MAX]: then no square overflowed, and what underflowed (< 2^-150 an element, < 2^-119 a sum) moves a
// sum of at least 2^-90 by less than its float rounding, so they agree with the double sums to float rounding. A
// block with a sum outside (a gradient above ~1e19, a row or column of tiny or no nonzero elements) is summed again
// in double.
constexpr float kSafeMin = 0x1p-90f;

// Whether sums x[0..n) all lie in [kSafeMin, FLT_MAX] (a NaN passes: the double sums would be NaN as well).
inline bool safe(const float* x, int64_t n) {
  float lo = std::numeric_limits<float>::max(), hi = kSafeMin;
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  return lo >= kSafeMin && hi <= std::numeric_limits<float>::max();
}

// Pass 1, NS rows of n elements `stride` apart, in A: each row's sum of g^2 into out[s * out_stride], column sums
// into col.
template <class E, class A, int NS>
inline void p1_rows(const typename E::raw* __restrict g, int64_t stride, int64_t n, A* __restrict col,
                    A* __restrict out, int64_t out_stride) {
  A acc[NS][kLanes] = {};
  for_lanes(n, [&](int64_t jk, int k) {
    A c = col[jk];
    for (int s = 0; s < NS; ++s) {
      const A x = E::load(g[s * stride + jk]);
      acc[s][k] = madd(x, x, acc[s][k]);
      c = madd(x, x, c);
    }
    col[jk] = c;
  });
  for (int s = 0; s < NS; ++s) out[s * out_stride] = lanes_sum(acc[s]);
}

// Pass 1, NS runs of n elements `stride` apart: sum of x^2 into acc, in A.
template <class E, class A, int NS>
inline void p1_run(const typename E::raw* __restrict g, int64_t stride, int64_t n, A* __restrict acc) {
  for_lanes(n, [&](int64_t jk, int k) {
    A sq[NS];
    for (int s = 0; s < NS; ++s) {
      const A x = E::load(g[s * stride + jk]);
      sq[s] = x * x;
    }
    acc[k] += tree_sum<NS>(sq);
  });
}

// The contiguous elements [e0, e1) of block b.
void block_elems(const Geo& G, int64_t b, int64_t& e0, int64_t& e1) {
  if (!G.factored) return G.range(b, e0, e1);
  int64_t m, i0, i1;
  G.rows(b, m, i0, i1);
  e0 = (m * G.R + i0) * G.C;
  e1 = (m * G.R + i1) * G.C;
}

// Sum of x^2 over block b of a tensor of q's layout (its gradient or parameter), in A.
template <class E, class A>
A sumsq_as(const Param& q, const void* x, int64_t b) {
  int64_t e0, e1;
  block_elems(q.geo, b, e0, e1);
  A acc[kLanes] = {};
  run_groups(e0, e1, [&](auto ns, int64_t e, int64_t n, int64_t stride) {
    p1_run<E, A, decltype(ns)::value>(at_<typename E::raw>(x) + e, stride, n, acc);
  });
  return lanes_sum(acc);
}

// Sum of x^2 over block b (in float where safe, see above).
template <class E>
double sumsq_block(const Param& q, const void* x, int64_t b) {
  if constexpr (std::is_same_v<typename E::T, float>) {
    const float sum = sumsq_as<E, float>(q, x, b);
    if (safe(&sum, 1)) return sum;
  }
  return sumsq_as<E, double>(q, x, b);
}

// Max |g| over block b of an fp64 gradient (> 0 iff some element is nonzero, where its sum of squares can underflow).
double absmax_block(const Param& q, int64_t b) {
  int64_t e0, e1;
  block_elems(q.geo, b, e0, e1);
  const double* g = at_<double>(q.g);
  double mx[kLanes] = {};
  for_lanes(e1 - e0, [&](int64_t j, int k) { mx[k] = std::max(mx[k], std::abs(g[e0 + j])); });
  return *std::max_element(mx, mx + kLanes);
}

// Factored block b in A: its rows' sums of g^2 into rows (its first row's first) and its column partials into col
// (C of them).
template <class E, class A>
void p1_block_as(const Param& q, int64_t b, A* rows, A* col) {
  const Geo& G = q.geo;
  const auto* g = at_<typename E::raw>(q.g);
  int64_t m, i0, i1;
  G.rows(b, m, i0, i1);
  const int64_t C = G.C;
  std::fill_n(col, C, A(0));
  row_groups(i0, i1, [&](auto ns, int64_t i, int64_t qr) {
    p1_rows<E, A, decltype(ns)::value>(g + (m * G.R + i) * C, qr * C, C, col, rows + (i - i0), qr);
  });
}

// Factored block b: its rows' sums of g^2 and its column partials (or, for a one-block matrix, the column sums), in
// float where safe (see above).
template <class E>
void p1_block(const Param& q, const Stats& s, int64_t b) {
  const Geo& G = q.geo;
  int64_t m, i0, i1;
  G.rows(b, m, i0, i1);
  const int64_t C = G.C;
  double* row = s.at(s.row, m, G.R);
  double* col = G.blocks_per_mat > 1 ? s.at(s.colp, m, G.blocks_per_mat * C) + (b % G.blocks_per_mat) * C
                                     : s.at(s.col, m, C);
  if constexpr (std::is_same_v<typename E::T, float>) {
    thread_local std::vector<float> scratch;  // the block's float sums: its rows', then its columns'
    scratch.resize(size_t(G.rows_per_block + C));
    float *rowf = scratch.data(), *colf = scratch.data() + G.rows_per_block;
    p1_block_as<E, float>(q, b, rowf, colf);
    if (safe(rowf, i1 - i0) && safe(colf, C)) {
      std::copy(rowf, rowf + (i1 - i0), row + i0);
      std::copy_n(colf, C, col);
      return;
    }
  }
  p1_block_as<E, double>(q, b, row + i0, col);
}

// Pass 1 of block b (the one-process step keeps a fused factored parameter's row and column sums in q.st); fp64
// parameters also its max |g|, a relative step its sum of p^2.
template <class E>
void p1_any(Param& q, int64_t b, bool relative_step) {
  if (q.st.rc)
    p1_block<E>(q, q.st, b);
  else
    q.partial[b] = sumsq_block<E>(q, q.g, b);
  if constexpr (std::is_same_v<typename E::raw, double>) q.max_partial[b] = absmax_block(q, b);
  if (relative_step) q.p_partial[b] = sumsq_block<E>(q, q.p, b);
}

// Matrices [m_begin, m_end): column sums from their block partials (in block order; zero for a matrix with no local
// rows, a shard's empty share), rc and rvs.
template <class T>
void p1_finish(const Param& q, const Stats& s, int64_t m_begin, int64_t m_end) {
  const Geo& G = q.geo;
  const int64_t R = G.R, C = G.C;
  const T* rv = at_<T>(q.row_var);
  for (int64_t m = m_begin; m < m_end; ++m) {
    double* col = s.at(s.col, m, C);
    if (G.blocks_per_mat == 0) std::fill_n(col, C, 0.0);
    if (G.blocks_per_mat > 1) {
      const double* cp = s.at(s.colp, m, G.blocks_per_mat * C);
      std::copy_n(cp, C, col);
      for (int64_t k = 1; k < G.blocks_per_mat; ++k)
        for (int64_t j = 0; j < C; ++j) col[j] += cp[k * C + j];
    }
    const double* row = s.at(s.row, m, R);
    double sr = 0, sv = 0;
    for (int64_t i = 0; i < R; ++i) {
      sr += row[i];
      sv += double(rv[m * R + i]);
    }
    *s.at(s.rc, m, 1) = sr;
    *s.at(s.rvs, m, 1) = sv;
  }
}

// ------------------------------------------------------------------------------------------------ step counts
// The rounding keys of this step (bf16 parameters, bf16 momentum), from the step counts after it.
void set_keys(Param& q, const Hyper& h) {
  if (q.dtype != at::kBFloat16 && q.mfmt != kMomBF16) return;
  double t = 0;  // the step count after this update, summed over bank slices: rounding_key's `step`
  for (int64_t u = 0; u < (q.geo.bank ? q.geo.units : 1); ++u) t += double(q.step[u]);
  q.key = rounding_key(h.seed, q.stream, int64_t(t));
  q.mkey = mix32(q.key + kMomentumStream);  // bf16 momentum: quant.store_momentum_'s key
}

// Unit u's part of a step's count: whether it steps (a unit with elements; a bank slice also needs a nonzero gradient
// element: types.active_units), the second moment's beta, the bias correction; returns its step count after this step
// (count_steps stores it). Needs pass 1's sums of unit u and q's per-unit vectors sized (count_steps sizes them).
float unit_count(Param& q, const Hyper& h, int64_t u) {
  const Geo& G = q.geo;
  // an expert that saw no token has an all-zero slice: leave it
  const bool on = G.ng > 0 && (!G.bank || (q.absmax ? q.absmax : q.sumsq)[u] > 0.0);
  q.active[u] = on;
  const float step = q.step[u] + float(on);
  // sqrt(1 - beta2^t) / (1 - beta1^t) in double (1 - beta in float32 is off by ~1e-5 relative); beta2_decay d:
  // beta2 = 1 - t^d and no second-moment correction (the schedule's average is unbiased)
  const double t = G.bank ? std::max(double(step), 1.0) : double(step);
  q.beta2[u] = h.beta2_decay ? 1.0 - std::pow(t, *h.beta2_decay) : h.beta2;
  double c = h.beta2_decay ? 1.0 : std::sqrt(1.0 - std::pow(h.beta2, t));
  if (q.mfmt != kMomNone) c /= 1.0 - std::pow(h.beta1, t);
  q.corr[u] = c;
  q.scale[u] = h.relative_step ? c * std::max(kRelativeStepEps, std::sqrt(q.p_sumsq[u] / G.ng)) : c;
  return step;
}

void size_counts(Param& q) {
  const int64_t n = q.geo.units;
  q.active.assign(n, 0);
  q.corr.assign(n, 0.0);
  q.scale.assign(n, 0.0);
  q.beta2.assign(n, 0.0);
}

// Per unit: active, step count (stored), bias correction; the bf16 rounding keys.
void count_steps(Param& q, const Hyper& h) {
  size_counts(q);
  for (int64_t u = 0; u < q.geo.units; ++u) q.step[u] = unit_count(q, h, u);
  set_keys(q, h);
}

// Matrices [m_begin, m_end): the factored EMAs' new values (active units only), in double from pass 1's double sums,
// each rounded once into T, stored into the state if kState; if kInverses, the row inverse denominators in double
// from the new values, rounded once (a row's ratio to the mean can be below T's range where rinv is not), the column
// ones in T. (`step` computes the inverses of a unit before the non-finite check, and stores its state after it.)
template <class T, bool kState, bool kInverses>
void update_factored(const Param& q, const Stats& s, const Hyper& h, int64_t m_begin, int64_t m_end) {
  const Geo& G = q.geo;
  const int64_t R = G.R, C = G.C;
  const double add = h.add_mode ? h.eps : 0.0, floor = h.add_mode ? 0.0 : h.eps, Radd = G.Rg * add;
  const T fl = T(floor);  // (eps_mode "add": floor 0, and max(x, 0) is x for the x >= 0 here, NaN kept)
  for (int64_t m = m_begin; m < m_end; ++m) {
    const int64_t unit = G.unit_of_mat(m);
    const bool on = q.active[unit];
    if (!kInverses && !on) continue;  // nothing to store
    const Ema<double> ema(q.beta2[unit]);
    T* rv = at_<T>(q.row_var) + m * R;
    T* cv = at_<T>(q.col_var) + m * C;
    const double *row = s.at(s.row, m, R), *col = s.at(s.col, m, C);
    T *rinv = s.at<T>(s.rinv, m, R), *cinv = s.at<T>(s.cinv, m, C);
    const double rvs = *s.at(s.rvs, m, 1), rc = *s.at(s.rc, m, 1);
    const double rmean = (on ? ema(rvs, rc / G.Cg + Radd) : rvs) / G.Rg;
    const double rm = std::max(rmean, h.add_mode ? std::numeric_limits<double>::min() : kRowMeanFloor);
    for (int64_t i = 0; i < R; ++i) {
      const T r = on ? T(ema(double(rv[i]), row[i] / G.Cg + add)) : rv[i];
      if constexpr (kState) rv[i] = r;
      if constexpr (kInverses) rinv[i] = T(1.0 / std::sqrt(std::max(double(r) / rm, floor)));
    }
    for (int64_t j = 0; j < C; ++j) {
      const T c = on ? T(ema(double(cv[j]), col[j] / G.Rg + add)) : cv[j];
      if constexpr (kState) cv[j] = c;
      if constexpr (kInverses) cinv[j] = T(1) / std::sqrt(std::max(c, fl));
    }
  }
}

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

// x = (|c| * c) * scale, c = q / QMAX (quant.dequantize).
template <class T>
inline T decode_int8(int8_t v, T scale) {
  const T c = T(v) / T(kQMax);
  return std::abs(c) * c * scale;
}

// q = copysign(round(sqrt(fp32(|x| / a)) * QMAX), x), the root correctly rounded (quant.quantize_).
template <class T>
inline int8_t encode_int8(T x, T a) {
  const float r = float(std::abs(x) / a);
  return int8_t(std::copysign(std::nearbyint(std::sqrt(r) * float(kQMax)), float(x)));
}

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
    T absmax = T(0);
    for (int64_t j = 0; j < n; ++j) {
      buf[j] = ema(decode_int8(q[j], s0), E::load(ge[j]));
      absmax = std::max(absmax, std::abs(buf[j]));
    }
    scale[k] = float(absmax);
    const T a = std::max(absmax, std::numeric_limits<T>::min()), s1 = T(float(absmax));
    for (int64_t j = 0; j < n; ++j) {
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

// ------------------------------------------------------------------------------------------------ passes 2 and 3
// The direction u of the update, given its source src (momentum or gradient) and the unit's scale c (pass 2: the bias
// correction; pass 3: times the clip and -lr, so that `plus` is the new weight before rounding, base + u: one
// multiply fewer per element than -lr * u + base). Like the codecs, a direction's array comes in as a __restrict
// parameter d (FactoredDir: cinv from the span's first column, indexed by column j; FullDir: v from the span's first
// element, indexed by element i). `moment`: what pass 2 updates element-wise before forming u.
template <class T, int NS>
struct FactoredDir {  // u = src * (rinv_i * c) * cinv_j, rs[s] = rinv_i * c for the row of run s
  using Ptr = const T*;
  T rs[NS];
  static FactoredDir rows(const T* rinv, int64_t i, int64_t qr, T c) {  // runs s at rows i + s * qr
    FactoredDir d;
    for (int s = 0; s < NS; ++s) d.rs[s] = rinv[i + s * qr] * c;
    return d;
  }
  void moment(Ptr, int64_t, T) const {}
  T u(Ptr __restrict cinv, int s, int64_t j, int64_t, T src) const { return src * rs[s] * cinv[j]; }
  T plus(Ptr __restrict cinv, int s, int64_t j, int64_t, T src, T base) const {
    return madd(src * rs[s], cinv[j], base);
  }
};

template <class T>
struct FullDir {  // u = src * c / sqrt(max(v_i, floor)); pass 2 first moves v_i towards x^2 + add, in double
  using Ptr = T*;
  T c, floor;
  double add;
  Ema<double> ema;
  void moment(Ptr __restrict v, int64_t i, T x) const {
    const double xd = x;
    v[i] = T(ema(double(v[i]), xd * xd + add));
  }
  T u(Ptr __restrict v, int, int64_t, int64_t i, T src) const { return src * c / std::sqrt(std::max(v[i], floor)); }
  T plus(Ptr __restrict v, int s, int64_t j, int64_t i, T src, T base) const { return u(v, s, j, i, src) + base; }
};

// Pass 2 on a span: the moments of each element, then u, its square added to acc. It stays a call (noinline): inlined
// into the block's lambdas, GCC loses its __restrict and keeps acc on the stack, storing it every element (measured:
// pass 2 of an expert bank 40% slower). Pass 3 is best inlined (as a call, its bf16 rounding loop is not vectorised).
template <class E, int NS, class Sp, class Dir>
[[gnu::noinline]] void p2_span(const typename E::raw* __restrict g, decltype(std::declval<const Sp&>().ptr()) __restrict m,
                    typename Dir::Ptr __restrict d, int64_t stride, int64_t n, const Sp sp, const Dir dir,
                    typename E::T* __restrict acc) {
  using T = typename E::T;
  for_lanes(n, [&](int64_t j, int k) {
    T sq[NS];
    for (int s = 0; s < NS; ++s) {
      const int64_t i = s * stride + j;
      const T x = E::load(g[i]);
      dir.moment(d, i, x);
      const T u = dir.u(d, s, j, i, sp.next(m, i, s, j, x));
      sq[s] = u * u;
    }
    acc[k] += tree_sum<NS>(sq);
  });
}

// Pass 3 on a span: p = p*decay - lr * u (bf16: rounded stochastically); dir's scale holds -lr.
template <class E, int NS, class Sp, class Dir>
inline void p3_span(typename E::raw* __restrict p, decltype(std::declval<const Sp&>().ptr()) __restrict m,
                    typename Dir::Ptr __restrict d, int64_t stride, int64_t n, const Sp sp, const Dir dir,
                    typename E::T decay, const Rounder* rnd) {
  using T = typename E::T;
  const auto next = [&](int s, int64_t j, int64_t i, T src, T old) { return dir.plus(d, s, j, i, src, old * decay); };
  write_runs<E, NS>(
      p, stride, n, rnd,
      [&](int s, uint32_t j) {
        const int64_t i = s * stride + j;
        return next(s, j, i, sp.src(m, i, s, j), E::load(p[i]));
      },
      [&](int s, uint32_t k) {
        const int64_t j = 2 * int64_t(k), i = s * stride + j;
        const auto [s0, s1] = sp.src_pair(m, i);
        const auto [p0, p1] = load_pair<E>(p + i);
        return std::pair{next(s, j, i, s0, p0), next(s, j + 1, i + 1, s1, p1)};
      });
}

// Block b of a factored parameter as spans: f(ns, e, stride, n, m, i, qr, c0) for NS rows i, i + qr, ... of matrix m,
// columns [c0, c0 + n). A chunked codec gets one row at a time, cut at its int8 blocks.
template <bool kChunked, class F>
inline void factored_spans(const Geo& G, int64_t b, const F& f) {
  int64_t m, i0, i1;
  G.rows(b, m, i0, i1);
  const int64_t C = G.C;
  if constexpr (kChunked) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t c0 = 0; c0 < C; c0 += kQBlock)
        f(Int<1>{}, (m * G.R + i) * C + c0, int64_t(0), std::min(kQBlock, C - c0), m, i, int64_t(0), c0);
  } else {
    row_groups(i0, i1, [&](auto ns, int64_t i, int64_t qr) {
      f(ns, (m * G.R + i) * C, qr * C, C, m, i, qr, int64_t(0));
    });
  }
}

// Block b of a full parameter as spans: f(ns, e, stride, n). A chunked codec's cut at its int8 blocks (int8 blocks of
// a full tensor hold whole rows of q.mC elements: make_geo's `align`).
template <bool kChunked, class F>
inline void full_spans(const Param& q, int64_t b, const F& f) {
  int64_t e0, e1;
  q.geo.range(b, e0, e1);
  if constexpr (kChunked) {
    for (int64_t e = e0; e < e1;) {
      const int64_t n = std::min(kQBlock, q.mC - e % q.mC);
      f(Int<1>{}, e, int64_t(0), n);
      e += n;
    }
  } else {
    run_groups(e0, e1, [&](auto ns, int64_t e, int64_t n, int64_t stride) { f(ns, e, stride, n); });
  }
}

// Pass 2, one block: the first moment (and full second moment) EMAs in place; returns the block's sum of u^2.
template <class E>
double p2_block(const Param& q, const Stats& st, const Hyper& h, int64_t b) {
  using T = typename E::T;
  const Geo& G = q.geo;
  const auto* g = at_<typename E::raw>(q.g);
  T acc[kLanes] = {};
  T buf[kQBlock];  // int8: a block's new momentum, decoded
  with_momentum<E>(q, h, [&](const auto& mom) {
    constexpr bool kChunked = std::decay_t<decltype(mom)>::kChunked;
    if (G.factored) {
      factored_spans<kChunked>(G, b, [&](auto ns, int64_t e, int64_t stride, int64_t n, int64_t mt, int64_t i,
                                         int64_t qr, int64_t c0) {
        constexpr int NS = decltype(ns)::value;
        const auto dir = FactoredDir<T, NS>::rows(st.at<T>(st.rinv, mt, G.R), i, qr, T(q.corr[G.unit_of_mat(mt)]));
        const auto sp = update_span<NS>(mom, e, stride, n, buf);
        p2_span<E, NS>(g + e, sp.ptr(), st.at<T>(st.cinv, mt, G.C) + c0, stride, n, sp, dir, acc);
      });
    } else {
      const int64_t u = b / G.blocks_per_unit;
      const FullDir<T> dir{T(q.corr[u]), h.add_mode ? T(0) : T(h.eps), h.add_mode ? h.eps : 0.0,
                           Ema<double>(q.beta2[u])};
      full_spans<kChunked>(q, b, [&](auto ns, int64_t e, int64_t stride, int64_t n) {
        constexpr int NS = decltype(ns)::value;
        const auto sp = update_span<NS>(mom, e, stride, n, buf);
        p2_span<E, NS>(g + e, sp.ptr(), at_<T>(q.v) + e, stride, n, sp, dir, acc);
      });
    }
  });
  return double(lanes_sum(acc));
}

// Pass 3, one block: p = p*(1 - lr*wd) - lr * u * clip (bf16: rounded stochastically).
template <class E>
void p3_block(const Param& q, const Stats& st, const Hyper& h, int64_t b) {
  using T = typename E::T;
  const Geo& G = q.geo;
  auto* p = at_<typename E::raw>(q.p);
  const T decay = T(1.0 - h.lr * h.weight_decay), nlr = T(-h.lr);
  with_momentum<E>(q, h, [&](const auto& mom) {
    constexpr bool kChunked = std::decay_t<decltype(mom)>::kChunked;
    if (G.factored) {
      factored_spans<kChunked>(G, b, [&](auto ns, int64_t e, int64_t stride, int64_t n, int64_t mt, int64_t i,
                                         int64_t qr, int64_t c0) {
        constexpr int NS = decltype(ns)::value;
        const int64_t u = G.unit_of_mat(mt);
        const T cc = T(q.scale[u]) * T(q.clip[u]) * nlr;
        const auto dir = FactoredDir<T, NS>::rows(st.at<T>(st.rinv, mt, G.R), i, qr, cc);
        Rounder rnd[NS];
        for (int s = 0; s < NS; ++s) rnd[s] = rounder(e + s * stride, q.key);
        const auto sp = mom.template read_span<NS>(e, stride);
        p3_span<E, NS>(p + e, sp.ptr(), st.at<T>(st.cinv, mt, G.C) + c0, stride, n, sp, dir, decay, rnd);
      });
    } else {
      const int64_t u = b / G.blocks_per_unit;
      const FullDir<T> dir{T(q.scale[u]) * T(q.clip[u]) * nlr, h.add_mode ? T(0) : T(h.eps), 0.0,
                           Ema<double>(0.0)};  // (pass 3 updates no moment)
      full_spans<kChunked>(q, b, [&](auto ns, int64_t e, int64_t stride, int64_t n) {
        constexpr int NS = decltype(ns)::value;
        Rounder rnd[NS];
        for (int s = 0; s < NS; ++s) rnd[s] = rounder(e + s * stride, q.key);
        const auto sp = mom.template read_span<NS>(e, stride);
        p3_span<E, NS>(p + e, sp.ptr(), at_<T>(q.v) + e, stride, n, sp, dir, decay, rnd);
      });
    }
  });
}

// Sum of unit u's block partials (of g^2 or u^2; `partial`: of another sum), in block order.
template <class T>
T unit_sum(const Param& q, int64_t u, const std::vector<double>* partial = nullptr) {
  const std::vector<double>& part = partial ? *partial : q.partial;
  double s = 0;
  for (int64_t k = 0; k < q.geo.blocks_per_unit; ++k) s += part[u * q.geo.blocks_per_unit + k];
  return T(s);
}

// 1 / max(1, rms(u)), as eager computes it in T.
template <class T>
double clip_of(T u_sumsq, double n) {
  return double(T(1) / std::max(std::sqrt(u_sumsq / T(n)), T(1)));
}

// ------------------------------------------------------------------------------------------------ one process
// `step` orders the passes of each unit by what its pass 2 writes (the non-finite check over every gradient comes
// before the first write):
//   * early: a factored unit without a first moment, whose gradient fits a core's L2 cache: its pass 1, then its
//     factored EMAs' inverses and pass 2 (which writes nothing else) with the gradient in cache, its clip; after the
//     check its state and pass 3. The gradient is read from memory twice (pass 1, pass 3), with nothing else
//     competing for the cache between pass 1 and pass 2.
//   * fused: another unit whose pass-3 source (momentum, else gradient) fits the cache: after the check, passes 2
//     and 3 back to back by one thread, the source read from memory once for both.
//   * split: a larger unit, its blocks spread over the threads, pass 2 then pass 3, in batches whose sources fit a
//     share of the L3 cache.
// Every factored parameter keeps pass 1's row and column sums for pass 2 (Stats::bytes per parameter).

// Bytes per element of the first moment (its int8 scales not counted) and of the full second moment.
int64_t momentum_size(const Param& q) {
  return q.mfmt == kMomNone    ? 0
         : q.mfmt == kMomPlain ? c10::elementSize(math_dtype(q.dtype))
         : q.mfmt == kMomBF16  ? 2
                               : 1;
}
int64_t second_moment_size(const Param& q) { return q.geo.factored ? 0 : c10::elementSize(math_dtype(q.dtype)); }

// A unit's schedule for a core's cache of `cache` bytes: early if its gradient fits; fused if what its pass 2 streams
// (gradient, first moment, full second moment) fits; else split.
bool early(const Param& q, int64_t cache) {
  return q.geo.factored && q.mfmt == kMomNone && q.geo.unit_numel * c10::elementSize(q.dtype) <= cache;
}
bool fuses(const Param& q, int64_t cache) {
  return q.geo.unit_numel * (c10::elementSize(q.dtype) + momentum_size(q) + second_moment_size(q)) <= cache;
}
// (a split batch: units whose pass-3 sources, momentum or else gradient, take at most 4 caches)
int64_t source_bytes(const Param& q) {
  return q.geo.unit_numel * (q.mfmt == kMomNone ? c10::elementSize(q.dtype) : momentum_size(q));
}

// Unit u's sum of g^2 from its matrices' rc, as grad_stats adds them.
double mats_sum(const Param& q, const Stats& s, int64_t u) {
  double sum = 0;
  for (int64_t m = u * q.geo.mats_per_unit; m < (u + 1) * q.geo.mats_per_unit; ++m) sum += *s.at(s.rc, m, 1);
  return sum;
}

// Unit u, from pass 1's block results (p1_finish done): its sum of g^2 into q.sumsq; where not null, fp64's max |g|
// into absmax and a relative step's sum of p^2 into p_sumsq.
void unit_stat(const Param& q, int64_t u, double* absmax, double* p_sumsq) {
  const int64_t nb = q.geo.blocks_per_unit;
  q.sumsq[u] = q.st.rc ? mats_sum(q, q.st, u) : unit_sum<double>(q, u);
  if (absmax) {
    const auto first = q.max_partial.begin() + u * nb;
    absmax[u] = nb ? *std::max_element(first, first + nb) : 0.0;
  }
  if (p_sumsq) p_sumsq[u] = unit_sum<double>(q, u, &q.p_partial);
}

void unit_stats(const Param& q, double* absmax, double* p_sumsq) {
  for (int64_t u = 0; u < q.geo.units; ++u) unit_stat(q, u, absmax, p_sumsq);
}

// Pass 2 of unit u's blocks, then its clip; pass 3. A pass over a unit whose data the pass before left in cache walks
// its blocks the other way: what that pass read last comes first, while a cache of least-recently-used eviction
// still holds it (in the same order, a unit a little larger than the cache would miss on every block). Each block
// has its own partial sum, so the order changes no result.
template <class E>
void p2_unit(Param& q, const Stats& st, const Hyper& h, int64_t u, bool backwards) {
  const int64_t b0 = u * q.geo.blocks_per_unit, n = q.geo.blocks_per_unit;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t b = b0 + (backwards ? n - 1 - k : k);
    q.partial[b] = p2_block<E>(q, st, h, b);
  }
  q.clip[u] = clip_of(unit_sum<typename E::T>(q, u), q.geo.ng);
}

template <class E>
void p3_unit(const Param& q, const Hyper& h, int64_t u) {
  for (int64_t b = (u + 1) * q.geo.blocks_per_unit; b-- > u * q.geo.blocks_per_unit;) p3_block<E>(q, q.st, h, b);
}

// An early unit before the non-finite check: pass 1 of its blocks, its sums, step count (not stored), factored
// inverses (the EMAs not stored) and, if it steps, pass 2 and its clip.
template <class E>
void early_unit(Param& q, const Hyper& h, int64_t u) {
  const Geo& G = q.geo;
  for (int64_t b = u * G.blocks_per_unit; b < (u + 1) * G.blocks_per_unit; ++b) p1_any<E>(q, b, h.relative_step);
  p1_finish<typename E::T>(q, q.st, u * G.mats_per_unit, (u + 1) * G.mats_per_unit);
  unit_stat(q, u, q.absmax ? q.absmax_buf.data() : nullptr, q.p_sumsq ? q.p_sumsq_buf.data() : nullptr);
  unit_count(q, h, u);
  if (!q.active[u]) return;
  update_factored<typename E::T, false, true>(q, q.st, h, u * G.mats_per_unit, (u + 1) * G.mats_per_unit);
  p2_unit<E>(q, q.st, h, u, true);
}

// After the check: an early unit's factored EMAs stored (the same values as early_unit's) and pass 3; a fused unit's
// EMAs, passes 2 and 3, its gradient (or momentum) read from memory once for both.
template <class E>
void late_unit(Param& q, const Hyper& h, int64_t u) {
  const Geo& G = q.geo;
  const int64_t m0 = u * G.mats_per_unit, m1 = m0 + G.mats_per_unit;
  if (q.early) {
    update_factored<typename E::T, true, false>(q, q.st, h, m0, m1);
  } else {
    if (G.factored) update_factored<typename E::T, true, true>(q, q.st, h, m0, m1);
    p2_unit<E>(q, q.st, h, u, false);
  }
  p3_unit<E>(q, h, u);
}

// Split units, their blocks spread over the threads, in batches: EMAs, pass 2, clips, pass 3. A batch's pass-3
// sources take at most `batch` bytes, so that pass 3 finds them in the L3 cache where pass 2 left them.
void split_units(std::vector<Param>& qs, const std::vector<const Hyper*>& hs,
                 const std::vector<std::pair<int32_t, int64_t>>& units, int64_t batch) {
  for (size_t next = 0; next < units.size();) {
    std::vector<std::pair<int32_t, int64_t>> blocks;  // (parameter, block)
    int64_t bytes = 0, elements = 0;
    const size_t first = next;
    for (; next < units.size() && (next == first || bytes + source_bytes(qs[units[next].first]) <= batch);
         ++next) {
      const auto [i, u] = units[next];
      Param& q = qs[i];
      const Geo& G = q.geo;
      bytes += source_bytes(q);
      elements += G.unit_numel;
      for (int64_t b = u * G.blocks_per_unit; b < (u + 1) * G.blocks_per_unit; ++b) blocks.emplace_back(i, b);
      with_elem(q, [&](auto e) {
        if (G.factored)
          update_factored<typename decltype(e)::T, true, true>(q, q.st, *hs[i], u * G.mats_per_unit,
                                                               (u + 1) * G.mats_per_unit);
      });
    }
    const int64_t nb = int64_t(blocks.size());
    const auto round = [&](bool backwards, auto body) {  // (p2_unit says why pass 3 walks backwards)
      run_items(nb, elements, [&](int64_t j) {
        const auto [i, b] = blocks[backwards ? nb - 1 - j : j];
        with_elem(qs[i], [&](auto e) { body(e, qs[i], *hs[i], b); });
      });
    };
    round(false, [&](auto e, Param& q, const Hyper& h, int64_t b) {
      q.partial[b] = p2_block<decltype(e)>(q, q.st, h, b);
    });
    for (size_t k = first; k < next; ++k) {
      Param& q = qs[units[k].first];
      with_elem(q, [&](auto e) {
        q.clip[units[k].second] = clip_of(unit_sum<typename decltype(e)::T>(q, units[k].second), q.geo.ng);
      });
    }
    round(true, [&](auto e, Param& q, const Hyper& h, int64_t b) { p3_block<decltype(e)>(q, q.st, h, b); });
  }
}

// ------------------------------------------------------------------------------------------------ Python API
// The three passes for one process: nothing crosses a reduction seam, so no statistic becomes a tensor. Pass 1 is
// the per-unit sum of g^2 (for the non-finite check and the banks' idle slices) and, for factored parameters, their
// row and column sums, kept for pass 2; units early, fused or split (above). Bitwise equal to grad_stats +
// update_moments + apply_updates. Returns a 0-d bool tensor: true, having written nothing, when skip_nonfinite and
// some gradient holds inf or NaN.
Tensor step(const std::vector<GroupRec>& groups, bool skip_nonfinite, int64_t cache) {
  TORCH_CHECK_VALUE(cache > 0, "skewadam C++ CPU kernel: cache_bytes must be > 0, got ", cache);
  Contig ct;
  std::vector<Hyper> hypers;
  hypers.reserve(groups.size());
  std::vector<Param> qs;
  std::vector<const Hyper*> hs;
  std::vector<std::pair<int32_t, int64_t>> items;  // pass 1: (parameter, block), or (parameter, unit) of early ones
  std::vector<int64_t> stats_at;  // per parameter: byte offset of its pass-1 statistics in `stats`, or -1
  int64_t elements = 0, stats_size = 0;
  for (const GroupRec& group : groups) hypers.push_back(hyper_of(group));
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    for (const ParamRec& r : std::get<0>(groups[gi])) {
      Param& q = qs.emplace_back(make_param(r, ct, kFusedPass));
      const Geo& G = q.geo;
      q.partial.assign(G.blocks(), 0.0);
      q.clip.assign(G.units, 1.0);
      q.sumsq_buf.assign(G.units, 0.0);
      q.sumsq = q.sumsq_buf.data();
      if (q.dtype == at::kDouble) {
        q.max_partial.assign(G.blocks(), 0.0);
        q.absmax_buf.assign(G.units, 0.0);
        q.absmax = q.absmax_buf.data();
      }
      if (hypers[gi].relative_step) {
        q.p_partial.assign(G.blocks(), 0.0);
        q.p_sumsq_buf.assign(G.units, 0.0);
        q.p_sumsq = q.p_sumsq_buf.data();
      }
      size_counts(q);
      hs.push_back(&hypers[gi]);
      const int32_t i = int32_t(qs.size() - 1);
      q.early = early(q, cache) && G.blocks_per_unit;
      const int64_t n = q.early ? G.units : G.blocks();
      for (int64_t k = 0; k < n; ++k) items.emplace_back(i, k);
      elements += G.numel;
      stats_at.push_back(-1);
      if (G.factored) {  // at a 64-byte boundary
        stats_at.back() = (stats_size + 63) / 64 * 64;
        stats_size = stats_at.back() + Stats::bytes(G, G.M, c10::elementSize(math_dtype(q.dtype)));
      }
    }
  }
  Tensor stats = at::empty({std::max<int64_t>(stats_size, 1)}, at::TensorOptions().dtype(at::kByte));
  for (size_t i = 0; i < qs.size(); ++i)
    if (stats_at[i] >= 0)
      with_elem(qs[i], [&](auto e) {
        qs[i].st = Stats::carve<typename decltype(e)::T>(stats.data_ptr<uint8_t>() + stats_at[i], qs[i].geo, 0,
                                                         qs[i].geo.M);
      });
  // pass 1 (with pass 2 of the early units)
  run_items(int64_t(items.size()), elements, [&](int64_t k) {
    const auto [i, b] = items[k];
    with_elem(qs[i], [&](auto e) {
      if (qs[i].early)
        early_unit<decltype(e)>(qs[i], *hs[i], b);
      else
        p1_any<decltype(e)>(qs[i], b, hs[i]->relative_step);
    });
  });
  bool finite = true;
  for (Param& q : qs) {
    if (!q.early) {
      with_elem(q, [&](auto e) {
        if (q.st.rc) p1_finish<typename decltype(e)::T>(q, q.st, 0, q.geo.M);
      });
      unit_stats(q, q.absmax ? q.absmax_buf.data() : nullptr, q.p_sumsq ? q.p_sumsq_buf.data() : nullptr);
    }
    for (int64_t u = 0; u < q.geo.units; ++u) finite = finite && std::isfinite(q.sumsq[u]);
  }
  if (skip_nonfinite && !finite) return at::scalar_tensor(true, at::TensorOptions().dtype(at::kBool));
  // the writes: early and fused units whole by one thread each (the last read first: likeliest still in cache), then
  // the split ones
  std::vector<std::pair<int32_t, int64_t>> whole, split;
  int64_t whole_elements = 0;
  for (size_t i = 0; i < qs.size(); ++i) {
    Param& q = qs[i];
    count_steps(q, *hs[i]);
    for (int64_t u = 0; u < q.geo.units; ++u) {
      if (!q.active[u] || q.geo.blocks_per_unit == 0) continue;
      const bool whole_unit = q.early || fuses(q, cache);
      (whole_unit ? whole : split).emplace_back(int32_t(i), u);
      if (whole_unit) whole_elements += q.geo.unit_numel;
    }
  }
  std::reverse(whole.begin(), whole.end());
  run_items(int64_t(whole.size()), whole_elements, [&](int64_t k) {
    const auto [i, u] = whole[k];
    with_elem(qs[i], [&](auto e) { late_unit<decltype(e)>(qs[i], *hs[i], u); });
  });
  split_units(qs, hs, split, 4 * cache);
  ct.finish();
  return at::scalar_tensor(false, at::TensorOptions().dtype(at::kBool));
}

// Pass 1 (eager.grad_stats): per parameter GradStats, float64 tensors (sumsq, rc_sumsq, row, col, row_var_sum; None
// where not factored; p_sumsq with a relative step; absmax for fp64 parameters).
std::vector<StatsRec> grad_stats(const GroupRec& group) {
  const auto& recs = std::get<0>(group);
  const size_t n = recs.size();
  const bool relative_step = std::get<8>(group);
  Contig ct;
  std::vector<Param> qs;
  qs.reserve(n);
  std::vector<StatsRec> out(n);
  std::vector<Tensor> colps;
  std::vector<std::pair<int32_t, int64_t>> blocks;
  int64_t elements = 0;
  for (size_t i = 0; i < n; ++i) {
    Param& q = qs.emplace_back(make_param(recs[i], ct, kStatsPass, relative_step));
    const Tensor& p = std::get<0>(recs[i]);
    const Geo& G = q.geo;
    const auto opts = p.options().dtype(at::kDouble);
    const auto units = unit_keepdim_shape(p.sizes(), G.bank);
    Tensor sumsq = at::empty(units, opts);
    q.sumsq = sumsq.data_ptr<double>();
    q.partial.assign(G.blocks(), 0.0);
    OptTensor p_sumsq, absmax;
    if (relative_step) {
      q.p_partial.assign(G.blocks(), 0.0);
      p_sumsq = at::empty(units, opts);
    }
    if (q.dtype == at::kDouble) {
      q.max_partial.assign(G.blocks(), 0.0);
      absmax = at::empty(units, opts);
    }
    for (int64_t b = 0; b < G.blocks(); ++b) blocks.emplace_back(int32_t(i), b);
    elements += G.numel;
    out[i] = {sumsq, std::nullopt, std::nullopt, std::nullopt, std::nullopt, p_sumsq, absmax};
    if (!G.factored) continue;
    Tensor rc = at::empty(stat_shape(p.sizes(), 1, 1), opts), row = at::empty(stat_shape(p.sizes(), -1, 1), opts),
           col = at::empty(stat_shape(p.sizes(), 1, G.C), opts), rvs = at::empty(stat_shape(p.sizes(), 1, 1), opts);
    q.st.rc = rc.data_ptr<double>();
    q.st.row = row.data_ptr<double>();
    q.st.col = col.data_ptr<double>();
    q.st.rvs = rvs.data_ptr<double>();
    if (G.blocks_per_mat > 1) {
      colps.push_back(at::empty({G.M * G.blocks_per_mat * G.C}, opts));
      q.st.colp = colps.back().data_ptr<double>();
    }
    out[i] = {sumsq, rc, row, col, rvs, p_sumsq, absmax};
  }
  run_items(int64_t(blocks.size()), elements, [&](int64_t k) {
    const auto [i, b] = blocks[k];
    with_elem(qs[i], [&](auto e) { p1_any<decltype(e)>(qs[i], b, relative_step); });
  });
  for (size_t i = 0; i < n; ++i) {
    Param& q = qs[i];
    with_elem(q, [&](auto e) {
      if (q.geo.factored) p1_finish<typename decltype(e)::T>(q, q.st, 0, q.geo.M);
    });
    const OptTensor &p_sumsq = std::get<5>(out[i]), &absmax = std::get<6>(out[i]);
    unit_stats(q, absmax ? absmax->data_ptr<double>() : nullptr, p_sumsq ? p_sumsq->data_ptr<double>() : nullptr);
  }
  return out;
}

// Pass 2 (eager.update_moments_): per parameter Moments (u_sumsq, corr: pass 3's scale, a tensor for a bank, else a
// float, rinv, cinv, active). `skip` true: nothing written, zeros returned.
std::vector<MomentsRec> update_moments(const GroupRec& group, const std::vector<StatsRec>& stats,
                                       const OptTensor& skip) {
  const auto& recs = std::get<0>(group);
  const size_t n = recs.size();
  TORCH_CHECK_VALUE(stats.size() == n, "skewadam C++ CPU kernel: ", stats.size(), " GradStats for ", n,
                    " parameters");
  const Hyper h = hyper_of(group);
  const bool skipped = skip_of(skip);
  Contig ct;
  std::vector<Param> qs;
  qs.reserve(n);
  std::vector<MomentsRec> out;
  std::vector<std::pair<int32_t, int64_t>> blocks;
  int64_t elements = 0;
  for (size_t i = 0; i < n; ++i) {
    Param& q = qs.emplace_back(make_param(recs[i], ct, skipped ? kStatsPass : kMomentsPass));
    const Tensor& p = std::get<0>(recs[i]);
    const Geo& G = q.geo;
    const at::ScalarType T = math_dtype(q.dtype);
    const auto& [sumsq, rc, row, col, rvs, p_sumsq, absmax] = stats[i];
    const auto units = unit_keepdim_shape(p.sizes(), G.bank);
    const at::ScalarType D = at::kDouble;
    check_input(q, "GradStats.sumsq", sumsq, true, units, D);
    check_input(q, "GradStats.rc_sumsq", rc, G.factored, G.factored ? stat_shape(p.sizes(), 1, 1) : units, D);
    check_input(q, "GradStats.row", row, G.factored, G.factored ? stat_shape(p.sizes(), -1, 1) : units, D);
    check_input(q, "GradStats.col", col, G.factored, G.factored ? stat_shape(p.sizes(), 1, G.C) : units, D);
    check_input(q, "GradStats.row_var_sum", rvs, G.factored, G.factored ? stat_shape(p.sizes(), 1, 1) : units, D);
    check_input(q, "GradStats.p_sumsq", p_sumsq, h.relative_step, units, D);
    check_input(q, "GradStats.absmax", absmax, q.dtype == at::kDouble, units, D);
    auto opts = p.options().dtype(T);
    OptTensor rinv, cinv, active_t;
    Corr corr = 0.0;
    if (G.factored) {
      rinv = at::zeros(stat_shape(p.sizes(), -1, 1), opts);
      cinv = at::zeros(stat_shape(p.sizes(), 1, G.C), opts);
    }
    if (G.bank) {
      corr = at::zeros(units, opts);
      active_t = at::zeros(units, opts.dtype(at::kBool));
    }
    if (skipped) {
      out.emplace_back(at::zeros(units, opts), corr, rinv, cinv, active_t);
      continue;
    }
    const auto read = [&](const OptTensor& t) { return static_cast<double*>(const_cast<void*>(ct.read(t))); };
    q.sumsq = read(sumsq);
    q.p_sumsq = read(p_sumsq);
    q.absmax = read(absmax);
    count_steps(q, h);
    if (G.factored) {
      q.st.rc = read(rc);
      q.st.row = read(row);
      q.st.col = read(col);
      q.st.rvs = read(rvs);
      q.st.rinv = rinv->data_ptr();
      q.st.cinv = cinv->data_ptr();
      with_elem(q, [&](auto e) { update_factored<typename decltype(e)::T, true, true>(q, q.st, h, 0, G.M); });
    }
    if (G.bank) {
      for (int64_t u = 0; u < G.units; ++u) {
        with_elem(q, [&](auto e) { at_<typename decltype(e)::T>(std::get<Tensor>(corr).data_ptr())[u] = q.scale[u]; });
        active_t->data_ptr<bool>()[u] = q.active[u];
      }
    } else {
      corr = q.scale[0];
    }
    q.partial.assign(G.blocks(), 0.0);
    for (int64_t b = 0; b < G.blocks(); ++b)
      if (q.active[b / G.blocks_per_unit]) blocks.emplace_back(int32_t(i), b);
    elements += G.numel;
    out.emplace_back(at::empty(units, opts), corr, rinv, cinv, active_t);
  }
  if (skipped) return out;
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
void apply_updates(const GroupRec& group, const std::vector<MomentsRec>& moments, const OptTensor& skip) {
  const auto& recs = std::get<0>(group);
  const size_t n = recs.size();
  TORCH_CHECK_VALUE(moments.size() == n, "skewadam C++ CPU kernel: ", moments.size(), " Moments for ", n,
                    " parameters");
  const Hyper h = hyper_of(group);
  if (skip_of(skip)) return;
  Contig ct;
  std::vector<Param> qs;
  qs.reserve(n);
  std::vector<std::pair<int32_t, int64_t>> blocks;
  int64_t elements = 0;
  for (size_t i = 0; i < n; ++i) {
    Param& q = qs.emplace_back(make_param(recs[i], ct, kApplyPass));
    const Tensor& p = std::get<0>(recs[i]);
    const Geo& G = q.geo;
    const at::ScalarType T = math_dtype(q.dtype);
    const auto& [u_sumsq, corr, rinv, cinv, active] = moments[i];
    const auto units = unit_keepdim_shape(p.sizes(), G.bank);
    check_input(q, "Moments.u_sumsq", u_sumsq, true, units, T);
    check_input(q, "Moments.rinv", rinv, G.factored, G.factored ? stat_shape(p.sizes(), -1, 1) : units, T);
    check_input(q, "Moments.cinv", cinv, G.factored, G.factored ? stat_shape(p.sizes(), 1, G.C) : units, T);
    check_input(q, "Moments.active", active, G.bank, units, at::kBool);
    const Tensor* corr_t = std::get_if<Tensor>(&corr);
    SKEWADAM_CHECK(q, corr_t || !G.bank, "Moments.corr of a bank must be a tensor (one value per slice)");
    if (corr_t) check_input(q, "Moments.corr", *corr_t, true, units, T);
    q.st.rinv = const_cast<void*>(ct.read(rinv));
    q.st.cinv = const_cast<void*>(ct.read(cinv));
    q.active.assign(G.units, G.ng > 0);
    q.scale.assign(G.units, corr_t ? 0.0 : std::get<double>(corr));
    q.clip.assign(G.units, 1.0);
    const void* us = ct.read(u_sumsq);
    const void* cp = corr_t ? ct.read(*corr_t) : nullptr;
    const bool* ap = static_cast<const bool*>(ct.read(active));
    with_elem(q, [&](auto e) {
      using T = typename decltype(e)::T;
      for (int64_t u = 0; u < G.units; ++u) {
        if (cp) q.scale[u] = double(at_<T>(cp)[u]);
        if (ap) q.active[u] = q.active[u] && ap[u];
        q.clip[u] = clip_of(at_<T>(us)[u], G.ng);
      }
    });
    set_keys(q, h);
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
    write_runs<BF16, 1>(
        o + e0, 0, std::min(kBlock, n - e0), &r, [&](int, uint32_t j) { return s[e0 + j]; },
        [&](int, uint32_t k) { return load_pair<Elem<float>>(s + e0 + 2 * k); });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "SkewAdam's update passes on CPU (see skewadam/kernels/cpu.py)";
  m.def("fields", &fields, "the record fields this extension reads, in order (types.py's NamedTuples)");
  m.def("step", [](py::handle groups, bool skip_nonfinite, int64_t cache_bytes) {
    return step(group_recs_of(groups), skip_nonfinite, cache_bytes);
  }, pybind11::arg("groups"), pybind11::arg("skip_nonfinite"), pybind11::arg("cache_bytes"),
        "passes 1-3 for one process; a 0-d bool tensor, true if skipped for a non-finite gradient");
  m.def("grad_stats", [](py::handle group) { return grad_stats(group_rec_of(group)); }, pybind11::arg("group"),
        "pass 1: sums of g^2");
  m.def("update_moments", [](py::handle group, const std::vector<StatsRec>& stats, const OptTensor& skip) {
    return update_moments(group_rec_of(group), stats, skip);
  }, pybind11::arg("group"), pybind11::arg("stats"), pybind11::arg("skip"),
        "pass 2: step counts, moments, per-unit sum of u^2");
  m.def("apply_updates", [](py::handle group, const std::vector<MomentsRec>& moments, const OptTensor& skip) {
    apply_updates(group_rec_of(group), moments, skip);
  }, pybind11::arg("group"), pybind11::arg("moments"), pybind11::arg("skip"),
        "pass 3: clip, decay, write (bf16: stochastic rounding)");
  m.def("stochastic_round_bf16", &stochastic_round_bf16, "rounding.py's stochastic rounding of fp32 to bf16");
  m.def("rounding_key", [](int64_t seed, int64_t param_index, int64_t step) {
    return int64_t(rounding_key(seed, param_index, step));
  }, "rounding.py's rounding_key");
}
