// Pass 1 (sums of g^2), the step counts and the factored second moment's EMAs.
// Part of skewadam_cpu.cpp, one translation unit that includes these files in order (its first comment says
// what the kernel does).
#pragma once

#include "params.h"

namespace {

// ------------------------------------------------------------------------------------------------ pass 1
// Pass 1's sums are double: the square of an fp32 or bf16 value is exact there and no sum of finite ones overflows.
// Converting every element to double would make pass 1 twice as slow, so a block of fp32 or bf16 elements is summed
// in float first (as fast as fp32 sums ever were) and its float sums are kept, as doubles, when each lies in
// [kSafeMin, FLT_MAX]: then no square overflowed, and what underflowed (< 2^-150 an element, < 2^-119 a sum) moves a
// sum of at least 2^-90 by less than its float rounding, so they agree with the double sums to float rounding. A
// block with a sum outside (a gradient above ~1e19, a row or column of tiny or no nonzero elements) is summed again
// in double.
constexpr float kSafeMin = 0x1p-90f;

// Runs pass 1 walks at once: bf16 gradients four (with two, Zen 5 took ~1.09x the bf16 expert banks' time), others
// kStreams. Pass 2's weighted column sums group rows the same way, so that they add them in pass 1's order.
template <class E>
constexpr int kP1Streams = std::is_same_v<typename E::raw, uint16_t> ? 4 : kStreams;

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
// into col. In float, whole groups of kLanes as vectors (base.h), the lanes and order of for_lanes.
template <class E, class A, int NS>
inline void p1_rows(const typename E::raw* __restrict g, int64_t stride, int64_t n, A* __restrict col,
                    A* __restrict out, int64_t out_stride) {
  A acc[NS][kLanes] = {};
  int64_t j = 0;  // elements [0, j) done as vectors
  if constexpr (std::is_same_v<A, float>) {
    VF v[NS] = {};
    for (; j + kLanes <= n; j += kLanes) {
      VF c = vload<Elem<float>>(col + j);
      for (int s = 0; s < NS; ++s) {
        prefetch_ahead(g + s * stride + j);
        const VF x = vload<E>(g + s * stride + j);
        v[s] = vmadd(x, x, v[s]);
        c = vmadd(x, x, c);
      }
      vstore(col + j, c);
    }
    for (int s = 0; s < NS; ++s) std::memcpy(acc[s], &v[s], sizeof v[s]);
  }
  for_lanes<4>(n - j, [&](int64_t jk, int k) {
    A c = col[j + jk];
    for (int s = 0; s < NS; ++s) {
      const A x = E::load(g[s * stride + j + jk]);
      acc[s][k] = madd(x, x, acc[s][k]);
      c = madd(x, x, c);
    }
    col[j + jk] = c;
  });
  for (int s = 0; s < NS; ++s) out[s * out_stride] = lanes_sum(acc[s]);
}

// A factored EMA's new value for a row or column of sum of squares `sum` over n elements, rounded once into T (in
// double from pass 1's double sums).
template <class T>
inline T factored_ema(const Ema<double>& ema, T old, double sum, double n, double add) {
  return T(ema(double(old), sum / n + add));
}

// Pass 1's weighted column sums (Param::weighted): t_j += x^2 / row_var_i of NS rows, row_var_i its value after the
// step, its weight w[s] = 1 / row_var_i. A column's additions follow its rows in the block's order (row_groups), the
// same in the step's pass 1 (right after each row group's sums, its rows still in L1) and in pass 2 of the three
// passes, so the two give the same bits.
template <class E, int NS>
inline void p1_weighted(const typename E::raw* __restrict g, int64_t stride, int64_t n, const float* w,
                        float* __restrict t) {
  static_assert(std::is_same_v<typename E::T, float>, "weighted column sums are float statistics");
  int64_t j = 0;  // elements [0, j) done as vectors
  for (; j + kLanes <= n; j += kLanes) {
    VF c = vload<Elem<float>>(t + j);
    for (int s = 0; s < NS; ++s) {
      const VF x = vload<E>(g + s * stride + j);
      c = vmadd(x * w[s], x, c);
    }
    vstore(t + j, c);
  }
  for_lanes(n - j, [&](int64_t jk, int) {
    float c = t[j + jk];
    for (int s = 0; s < NS; ++s) {
      const float x = E::load(g[s * stride + j + jk]);
      c = madd(x * w[s], x, c);
    }
    t[j + jk] = c;
  });
}

// Row i's weight in pass 1's weighted column sums, from its sum of g^2: 1 / row_var_i after the step (update_factored's
// value, for a unit that steps).
struct RowWeight {
  const float* rv;  // the matrix's row_var before the step
  Ema<double> ema;
  double Cg, add;
  float operator()(int64_t i, double sum) const { return 1.0f / factored_ema(ema, rv[i], sum, Cg, add); }
};

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
  run_groups<kP1Streams<E>>(e0, e1, [&](auto ns, int64_t e, int64_t n, int64_t stride) {
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
// (C of them); with t (a weighted parameter), its weighted column partials, rows weighted by rw.
template <class E, class A>
void p1_block_as(const Param& q, int64_t b, A* rows, A* col, float* t, const RowWeight& rw) {
  const Geo& G = q.geo;
  const auto* g = at_<typename E::raw>(q.g);
  int64_t m, i0, i1;
  G.rows(b, m, i0, i1);
  const int64_t C = G.C;
  std::fill_n(col, C, A(0));
  if (t) std::fill_n(t, C, 0.0f);
  row_groups<kP1Streams<E>>(i0, i1, [&](auto ns, int64_t i, int64_t qr) {
    constexpr int NS = decltype(ns)::value;
    const auto* gi = g + (m * G.R + i) * C;
    p1_rows<E, A, NS>(gi, qr * C, C, col, rows + (i - i0), qr);
    if constexpr (std::is_same_v<typename E::T, float>) {
      if (t) {
        float w[NS];
        for (int s = 0; s < NS; ++s) w[s] = rw(i + s * qr, double(rows[i - i0 + s * qr]));
        p1_weighted<E, NS>(gi, qr * C, C, w, t);
      }
    }
  });
}

// Factored block b: its rows' sums of g^2 and its column partials (or, for a one-block matrix, the column sums), in
// float where safe (see above).
template <class E>
void p1_block(const Param& q, const Stats& s, const Hyper& h, int64_t b) {
  const Geo& G = q.geo;
  int64_t m, i0, i1;
  G.rows(b, m, i0, i1);
  const int64_t C = G.C;
  double* row = s.at(s.row, m, G.R);
  double* col = G.blocks_per_mat > 1 ? s.at(s.colp, m, G.blocks_per_mat * C) + (b % G.blocks_per_mat) * C
                                     : s.at(s.col, m, C);
  float* t = s.tp ? s.at(s.tp, m, G.blocks_per_mat * C) + (b % G.blocks_per_mat) * C : nullptr;
  RowWeight rw{nullptr, Ema<double>(0.0), G.Cg, 0.0};
  if (t) rw = {at_<float>(q.row_var) + m * G.R, Ema<double>(q.beta2[G.unit_of_mat(m)]), G.Cg, h.add_mode ? h.eps : 0.0};
  if constexpr (std::is_same_v<typename E::T, float>) {
    thread_local std::vector<float> scratch;  // the block's float sums: its rows', then its columns'
    scratch.resize(size_t(G.rows_per_block + C));
    float *rowf = scratch.data(), *colf = scratch.data() + G.rows_per_block;
    p1_block_as<E, float>(q, b, rowf, colf, t, rw);
    if (safe(rowf, i1 - i0) && safe(colf, C)) {
      std::copy(rowf, rowf + (i1 - i0), row + i0);
      std::copy_n(colf, C, col);
      return;
    }
  }
  p1_block_as<E, double>(q, b, row + i0, col, t, rw);
}

// Pass 1 of block b (a factored parameter's row and column sums into q.st, in the one-process step its weighted column
// sums too); fp64 parameters also its max |g|, a relative step its sum of p^2.
template <class E>
void p1_any(Param& q, const Hyper& h, int64_t b) {
  if (q.st.rc)
    p1_block<E>(q, q.st, h, b);
  else
    q.partial[b] = sumsq_block<E>(q, q.g, b);
  if constexpr (std::is_same_v<typename E::raw, double>) q.max_partial[b] = absmax_block(q, b);
  if (h.relative_step) q.p_partial[b] = sumsq_block<E>(q, q.p, b);
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

// The t of the bias correction and of beta2_decay of a unit whose step count becomes `step`.
double step_t(const Param& q, float step) { return q.geo.bank ? std::max(double(step), 1.0) : double(step); }

// The second moment's beta at t (beta2_decay d: 1 - t^d).
double beta2_at(const Hyper& h, double t) { return h.beta2_decay ? 1.0 - std::pow(t, *h.beta2_decay) : h.beta2; }

// Unit u's part of a step's count: whether it steps (a unit with elements; a bank slice also needs a nonzero gradient
// element: types.active_units), the second moment's beta, the bias correction; returns its step count after this step
// (count_steps stores it). Needs pass 1's sums of unit u and q's per-unit vectors sized (count_steps sizes them).
float unit_count(Param& q, const Hyper& h, int64_t u) {
  const Geo& G = q.geo;
  // an expert that saw no token has an all-zero slice: leave it (and one with a NaN: types.active_units)
  const bool live = q.absmax ? q.absmax[u] > 0.0 && !std::isnan(q.sumsq[u]) : q.sumsq[u] > 0.0;
  const bool on = G.ng > 0 && (!G.bank || live);
  q.active[u] = on;
  const float step = q.step[u] + float(on);
  // sqrt(1 - beta2^t) / (1 - beta1^t) in double (1 - beta in float32 is off by ~1e-5 relative); beta2_decay d:
  // beta2 = 1 - t^d and no second-moment correction (the schedule's average is unbiased)
  const double t = step_t(q, step);
  q.beta2[u] = beta2_at(h, t);
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
// ones in T, and rmw: the row mean. (`step` computes the inverses of a unit before the non-finite check, and stores
// its state after it.)
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
      const T r = on ? factored_ema(ema, rv[i], row[i], G.Cg, add) : rv[i];
      if constexpr (kState) rv[i] = r;
      if constexpr (kInverses) rinv[i] = T(1.0 / std::sqrt(std::max(double(r) / rm, floor)));
    }
    for (int64_t j = 0; j < C; ++j) {
      const T c = on ? factored_ema(ema, cv[j], col[j], G.Rg, add) : cv[j];
      if constexpr (kState) cv[j] = c;
      if constexpr (kInverses) cinv[j] = T(1) / std::sqrt(std::max(c, fl));
    }
    if constexpr (kInverses)
      if (s.rmw) *s.at(s.rmw, m, 1) = rm;
  }
}

}  // namespace
