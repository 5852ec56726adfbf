// Passes 2 and 3: the update direction, the moments and sum of u^2, the weights.
// Part of skewadam_cpu.cpp, one translation unit that includes these files in order (its first comment says
// what the kernel does).
#pragma once

#include "momentum.h"

namespace {

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

#ifdef __AVX512F__
// Pass 2 of bf16 momentum and a factored direction on the span's first whole groups of kLanes elements, as p2_span's
// loop computes each lane (BF16Mom::Span::next, FactoredDir::u); returns how many it did (none where a run starts at
// an odd element). One hash serves a pair of elements (round_bf16's halves of it): GCC's loop hashed each element,
// 8 lanes at a time, and a matrix with bf16 momentum took 1.3x to 1.5x the step's time.
template <class E, int NS>
inline int64_t p2_bf16_momentum(const typename E::raw* __restrict g, uint16_t* __restrict m,
                                const float* __restrict cinv, int64_t stride, int64_t n, const BF16Mom::Span<NS>& sp,
                                const FactoredDir<float, NS>& dir, float* __restrict acc) {
  for (int s = 0; s < NS; ++s)
    if (sp.r[s].odd) return 0;
  const __m512 b = _mm512_set1_ps(sp.ema.b), w = _mm512_set1_ps(sp.ema.w);
  const VU8 pairs = {0, 1, 2, 3, 4, 5, 6, 7};
  __m512 a = _mm512_loadu_ps(acc);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const __m512 c = _mm512_loadu_ps(cinv + j);
    __m512 sq[NS];
    for (int s = 0; s < NS; ++s) {
      const int64_t i = s * stride + j;
      const __m512 e = _mm512_add_ps(_mm512_mul_ps(__m512(vload<BF16>(m + i)), b),  // Ema: s * b + x * w
                                     _mm512_mul_ps(__m512(vload<E>(g + i)), w));
      const VU8 h = mix32((sp.r[s].pair0 + uint32_t(j >> 1) + pairs) * kGolden + sp.r[s].key);  // round_bf16's
      const __m512i bits = _mm512_cvtepu16_epi32(__m256i(h));  // element 2t: hash t's low half, 2t + 1: its high half
      const __mmask16 number = _mm512_cmp_ps_mask(e, e, _CMP_ORD_Q);
      const __m512i stored = _mm512_mask_and_epi32(_mm512_set1_epi32(0x7FC00000), number,  // add_truncate_hi
                                                   _mm512_add_epi32(_mm512_castps_si512(e), bits),
                                                   _mm512_set1_epi32(int(0xFFFF0000u)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(m + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(stored, 16)));
      const __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(stored), _mm512_set1_ps(dir.rs[s])), c);
      sq[s] = _mm512_mul_ps(u, u);
    }
    a = _mm512_add_ps(a, tree_sum<NS>(sq));
  }
  _mm512_storeu_ps(acc, a);
  return j;
}
#endif

// Pass 2 on a span: the moments of each element, then u, its square added to acc. It stays a call (noinline): inlined
// into the block's lambdas, GCC loses its __restrict and keeps acc on the stack, storing it every element (measured:
// pass 2 of an expert bank 40% slower). Pass 3 is best inlined (as a call, its bf16 rounding loop is not vectorised).
template <class E, int NS, class Sp, class Dir>
[[gnu::noinline]] void p2_span(const typename E::raw* __restrict g, decltype(std::declval<const Sp&>().ptr()) __restrict m,
                    typename Dir::Ptr __restrict d, int64_t stride, int64_t n, const Sp sp, const Dir dir,
                    typename E::T* __restrict acc) {
  using T = typename E::T;
  int64_t j0 = 0;  // elements done as vectors
#ifdef __AVX512F__
  if constexpr (std::is_same_v<Sp, BF16Mom::Span<NS>> && std::is_same_v<Dir, FactoredDir<float, NS>>)
    j0 = p2_bf16_momentum<E, NS>(g, m, d, stride, n, sp, dir, acc);
#endif
  for_lanes(n - j0, [&](int64_t jk, int k) {
    const int64_t j = j0 + jk;
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
template <bool kChunked, int S = kStreams, class F>
inline void factored_spans(const Geo& G, int64_t b, const F& f) {
  int64_t m, i0, i1;
  G.rows(b, m, i0, i1);
  const int64_t C = G.C;
  if constexpr (kChunked) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t c0 = 0; c0 < C; c0 += kQBlock)
        f(Int<1>{}, (m * G.R + i) * C + c0, int64_t(0), std::min(kQBlock, C - c0), m, i, int64_t(0), c0);
  } else {
    row_groups<S>(i0, i1, [&](auto ns, int64_t i, int64_t qr) {
      f(ns, (m * G.R + i) * C, qr * C, C, m, i, qr, int64_t(0));
    });
  }
}

// Block b of a full parameter as spans: f(ns, e, stride, n). A chunked codec's cut at its int8 blocks (int8 blocks of
// a full tensor hold whole rows of q.mC elements: make_geo's `align`).
template <bool kChunked, int S = kStreams, class F>
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
    run_groups<S>(e0, e1, [&](auto ns, int64_t e, int64_t n, int64_t stride) { f(ns, e, stride, n); });
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

// Pass 2 of a weighted parameter in the three passes: block b's weighted column sums (pass 1's of the one-process step,
// the rows weighted by row_var after the step, which update_factored has stored).
template <class E>
void p2_weighted_block(const Param& q, const Stats& st, int64_t b) {
  if constexpr (!std::is_same_v<typename E::T, float>) {
    TORCH_INTERNAL_ASSERT(false, "skewadam C++ CPU kernel: weighted column sums of a ", q.dtype, " parameter");
  } else {
  const Geo& G = q.geo;
  const auto* g = at_<typename E::raw>(q.g);
  int64_t m, i0, i1;
  G.rows(b, m, i0, i1);
  const int64_t C = G.C;
  const float* rv = at_<float>(q.row_var) + m * G.R;
  float* t = st.at(st.tp, m, G.blocks_per_mat * C) + (b % G.blocks_per_mat) * C;
  std::fill_n(t, C, 0.0f);
  row_groups<kP1Streams<E>>(i0, i1, [&](auto ns, int64_t i, int64_t qr) {
    constexpr int NS = decltype(ns)::value;
    float w[NS];
    for (int s = 0; s < NS; ++s) w[s] = 1.0f / rv[i + s * qr];
    p1_weighted<E, NS>(g + (m * G.R + i) * C, qr * C, C, w, t);
  });
  }
}

// Unit u's sum of u^2 from its weighted column sums (a weighted parameter, after update_factored's inverses):
// sum_ij (g_ij * rinv_i * c * cinv_j)^2 = c^2 * rm * sum_j cinv_j^2 * t_j with t_j = sum_i g_ij^2 / row_var_i, as
// rinv_i^2 = rm / row_var_i where no row's ratio to the mean is floored (eps_mode "floor": a floored row's rinv is
// the largest, 1 / sqrt(eps); a row at that value counts as floored). NaN (pass 2 then sums u^2 itself) where one
// is, or a weighted column sum of a block left [kSafeMin, FLT_MAX] (as pass 1's float sums, what underflowed in it is
// then below its rounding), unless it is 0 in a column of no nonzero element.
template <class T>
double weighted_sumsq(const Param& q, const Stats& s, const Hyper& h, int64_t u) {
  const Geo& G = q.geo;
  const int64_t R = G.R, C = G.C, nb = G.blocks_per_mat;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const T top = T(1.0 / std::sqrt(h.add_mode ? 0.0 : h.eps));  // (eps_mode "add": no floor; an infinite rinv fails)
  double sum = 0;
  for (int64_t m = u * G.mats_per_unit; m < (u + 1) * G.mats_per_unit; ++m) {
    const T* rinv = s.at<T>(s.rinv, m, R);
    T mx[kLanes] = {};  // the largest rinv, in lanes (a maximum is exact in any order; one chain would not vectorise)
    for_lanes(R, [&](int64_t i, int k) { mx[k] = std::max(mx[k], rinv[i]); });
    if (*std::max_element(mx, mx + kLanes) >= top) return nan;
    const float* tp = s.at(s.tp, m, nb * C);
    const double* col = s.at(s.col, m, C);
    const T* cinv = s.at<T>(s.cinv, m, C);
    // per column: the blocks' weighted sums added in block order, and their least (an infinite or NaN one makes the
    // total so); vectorised over columns, as this runs once a unit on one thread
    thread_local std::vector<double> tj;
    thread_local std::vector<float> lo;
    tj.assign(size_t(C), 0.0);
    lo.assign(size_t(C), std::numeric_limits<float>::max());
    double* __restrict tjp = tj.data();
    float* __restrict lop = lo.data();
    for (int64_t k = 0; k < nb; ++k) {
      const float* __restrict tk = tp + k * C;
      for_lanes(C, [&](int64_t j, int) {
        tjp[j] += double(tk[j]);
        lop[j] = std::min(lop[j], tk[j]);
      });
    }
    int64_t bad = 0;
    double sm = 0;
    for (int64_t j = 0; j < C; ++j) {
      bad += !((lop[j] >= kSafeMin || (tjp[j] == 0 && col[j] == 0)) && tjp[j] <= std::numeric_limits<float>::max());
      sm += double(cinv[j]) * double(cinv[j]) * tjp[j];
    }
    if (bad) return nan;
    sum += *s.at(s.rmw, m, 1) * sm;
  }
  const double c = double(T(q.corr[u]));
  sum *= c * c;
  return std::isfinite(sum) ? sum : nan;
}

// Pass 3, one block: p = p*(1 - lr*wd) - lr * u * clip (bf16: rounded stochastically).
// Its rows one run at a time: two runs took Zen 5 1.03x-1.09x the expert banks' step time (on Zen 4 one matched
// four). It writes each element alone, so the runs change no result.
template <class E>
void p3_block(const Param& q, const Stats& st, const Hyper& h, int64_t b) {
  using T = typename E::T;
  const Geo& G = q.geo;
  auto* p = at_<typename E::raw>(q.p);
  const T decay = T(1.0 - h.lr * h.weight_decay), nlr = T(-h.lr);
  with_momentum<E>(q, h, [&](const auto& mom) {
    constexpr bool kChunked = std::decay_t<decltype(mom)>::kChunked;
    if (G.factored) {
      factored_spans<kChunked, 1>(G, b, [&](auto ns, int64_t e, int64_t stride, int64_t n, int64_t mt, int64_t i,
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
      full_spans<kChunked, 1>(q, b, [&](auto ns, int64_t e, int64_t stride, int64_t n) {
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

// Whether unit u's sum of u^2 comes from its weighted column sums (q.usq[u], set here), not from pass 2.
template <class T>
bool weighted_unit(Param& q, const Stats& st, const Hyper& h, int64_t u) {
  if (!q.weighted) return false;
  q.usq[u] = weighted_sumsq<T>(q, st, h, u);
  return !std::isnan(q.usq[u]);
}

// Unit u's sum of u^2, in T: from its weighted column sums where weighted_unit said so, else pass 2's partials.
template <class T>
T unit_usq(const Param& q, int64_t u) {
  return q.weighted && !std::isnan(q.usq[u]) ? T(q.usq[u]) : unit_sum<T>(q, u);
}

// 1 / max(1, rms(u)), as eager computes it in T.
template <class T>
double clip_of(T u_sumsq, double n) {
  return double(T(1) / std::max(std::sqrt(u_sumsq / T(n)), T(1)));
}

}  // namespace
