// A parameter's geometry (blocks, units, matrices), its statistics' storage, and its record checked and pointed at.
// Part of skewadam_cpu.cpp, one translation unit that includes these files in order (its first comment says
// what the kernel does).
#pragma once

#include "records.h"

namespace {

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
// row sums), rvs (sum of row_var before the step) and rmw (the row mean of rinv, for weighted_sumsq); per row the sum
// of g^2; per column the sum of g^2; colp,
// each block's column partials (only when a matrix has more than one block): sums, in double. Per row rinv and per
// column cinv, in T. With `weighted` (Param::weighted), tp: each block's weighted column sums, in float.
struct Stats {
  int64_t m0 = 0;
  double *rc = nullptr, *rvs = nullptr, *rmw = nullptr, *row = nullptr, *col = nullptr, *colp = nullptr;
  void *rinv = nullptr, *cinv = nullptr;
  float* tp = nullptr;

  // Bytes of `count` matrices' statistics, with T of `t_size` bytes.
  static int64_t bytes(const Geo& G, int64_t count, int64_t t_size, bool weighted) {
    const int64_t sums = 3 + G.R + G.C + (G.blocks_per_mat > 1 ? G.blocks_per_mat * G.C : 0);
    return count * (sums * int64_t(sizeof(double)) + (G.R + G.C) * t_size +
                    (weighted ? G.blocks_per_mat * G.C * int64_t(sizeof(float)) : 0));
  }
  // Point into `count` matrices' worth of statistics at base (8-byte aligned, Stats::bytes of them): sums first.
  template <class T>
  static Stats carve(void* base, const Geo& G, int64_t m0, int64_t count, bool weighted) {
    Stats s;
    s.m0 = m0;
    double* d = static_cast<double*>(base);
    for (double** slot : {&s.rc, &s.rvs, &s.rmw}) *slot = std::exchange(d, d + count);
    s.row = std::exchange(d, d + count * G.R);
    s.col = std::exchange(d, d + count * G.C);
    if (G.blocks_per_mat > 1) s.colp = std::exchange(d, d + count * G.blocks_per_mat * G.C);
    T* t = reinterpret_cast<T*>(d);
    s.rinv = std::exchange(t, t + count * G.R);
    s.cinv = std::exchange(t, t + count * G.C);
    if (weighted) s.tp = reinterpret_cast<float*>(t);
    return s;
  }
  double* at(double* p, int64_t m, int64_t width) const { return p + (m - m0) * width; }
  float* at(float* p, int64_t m, int64_t width) const { return p + (m - m0) * width; }
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
  bool weighted = false;         // the clip's sum of u^2 from pass 1's weighted column sums where they hold it (a
                                 // factored unit without momentum: cpu.weighted)
  std::vector<double> usq;       // weighted: per unit, that sum (weighted_sumsq), NaN where pass 2 sums u^2
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
  bool whole = false;  // `step`, early and no non-finite check: pass 3 of each unit right after its pass 2

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
  q.weighted = factored && q.mfmt == kMomNone &&
               (q.dtype == at::kFloat || (q.dtype == at::kBFloat16 && q.geo.unit_numel * 2 <= kWeightedBf16Max));
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

}  // namespace
