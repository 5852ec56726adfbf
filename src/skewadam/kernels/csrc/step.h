// One process's step: each unit's passes scheduled by what fits a core's cache.
// Part of skewadam_cpu.cpp, one translation unit that includes these files in order (its first comment says
// what the kernel does).
#pragma once

#include "passes23.h"

namespace {

// ------------------------------------------------------------------------------------------------ one process
// `step` orders the passes of each unit by what its pass 2 writes (the non-finite check over every gradient comes
// before the first write):
//   * early: a factored unit without a first moment, whose gradient fits a core's L2 cache: its pass 1, then its
//     factored EMAs' inverses and its clip (from pass 1's weighted column sums, cpu.weighted; else, or where they
//     do not hold it, from pass 2, which writes nothing else, on the gradient in cache); after the check its state
//     and pass 3. The gradient is read from memory twice (pass 1, pass 3), with nothing else
//     competing for the cache between pass 1 and pass 2. Without the non-finite check (skip_nonfinite false) a unit
//     of fp32 or fp64 weights is whole: its state and pass 3 follow at once, the gradient read from memory once
//     (bf16 weights wait: their rounding key sums every bank slice's step count).
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
// (a split batch: units whose pass-3 sources, momentum or else gradient, take at most 16 caches: each batch is two
// parallel regions, which cost a scheduler wake-up each on a loaded machine)
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
// still holds it (in the same order, a unit a little larger than the cache would miss on every block). An early
// unit's pass 2 walks backwards, so its pass 3 walks forwards, as the units do: where its gradient is back in memory
// (the check read every gradient since), each run goes on where the last block's ended, which the prefetcher follows
// (walked backwards, the fp32 expert banks' step took ~1.1x the time: docs/guide/kernels.md). Each block has its own
// partial sum, so the order changes no result.
template <class E>
void p2_unit(Param& q, const Stats& st, const Hyper& h, int64_t u, bool backwards) {
  if (weighted_unit<typename E::T>(q, st, h, u)) {  // no pass 2: the clip from pass 1's weighted column sums
    q.clip[u] = clip_of(unit_usq<typename E::T>(q, u), q.geo.ng);
    return;
  }
  const int64_t b0 = u * q.geo.blocks_per_unit, n = q.geo.blocks_per_unit;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t b = b0 + (backwards ? n - 1 - k : k);
    q.partial[b] = p2_block<E>(q, st, h, b);
  }
  q.clip[u] = clip_of(unit_sum<typename E::T>(q, u), q.geo.ng);
}

template <class E>
void p3_unit(const Param& q, const Hyper& h, int64_t u, bool backwards) {
  const int64_t b0 = u * q.geo.blocks_per_unit, n = q.geo.blocks_per_unit;
  for (int64_t k = 0; k < n; ++k) p3_block<E>(q, q.st, h, b0 + (backwards ? n - 1 - k : k));
}

// An early unit before the non-finite check: pass 1 of its blocks, its sums, step count (not stored), factored
// inverses (the EMAs not stored) and, if it steps, pass 2 and its clip.
template <class E>
void early_unit(Param& q, const Hyper& h, int64_t u) {
  const Geo& G = q.geo;
  for (int64_t b = u * G.blocks_per_unit; b < (u + 1) * G.blocks_per_unit; ++b) p1_any<E>(q, h, b);
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
  p3_unit<E>(q, h, u, !q.early);
}

// A whole unit (Param::whole): early_unit, its step count stored (count_steps' value), late_unit.
template <class E>
void whole_unit(Param& q, const Hyper& h, int64_t u) {
  early_unit<E>(q, h, u);
  q.step[u] += float(q.active[u]);
  if (q.active[u]) late_unit<E>(q, h, u);
}

// Split units, their blocks spread over the threads, in batches: EMAs, pass 2, clips, pass 3. A batch's pass-3
// sources take at most `batch` bytes, so that pass 3 finds them in the L3 cache where pass 2 left them.
void split_units(std::vector<Param>& qs, const std::vector<const Hyper*>& hs,
                 const std::vector<std::pair<int32_t, int64_t>>& units, int64_t batch) {
  for (size_t next = 0; next < units.size();) {
    std::vector<std::pair<int32_t, int64_t>> blocks, p2_blocks;  // (parameter, block): pass 3's, pass 2's
    int64_t bytes = 0, elements = 0, p2_elements = 0;
    const size_t first = next;
    for (; next < units.size() && (next == first || bytes + source_bytes(qs[units[next].first]) <= batch);
         ++next) {
      const auto [i, u] = units[next];
      Param& q = qs[i];
      const Geo& G = q.geo;
      bytes += source_bytes(q);
      elements += G.unit_numel;
      bool weighted = false;
      with_elem(q, [&](auto e) {
        using T = typename decltype(e)::T;
        if (G.factored) update_factored<T, true, true>(q, q.st, *hs[i], u * G.mats_per_unit, (u + 1) * G.mats_per_unit);
        weighted = weighted_unit<T>(q, q.st, *hs[i], u);
      });
      for (int64_t b = u * G.blocks_per_unit; b < (u + 1) * G.blocks_per_unit; ++b) {
        blocks.emplace_back(i, b);
        if (!weighted) p2_blocks.emplace_back(i, b);
      }
      if (!weighted) p2_elements += G.unit_numel;
    }
    const auto round = [&](const auto& items, int64_t work, bool backwards, auto body) {  // (p2_unit: backwards)
      const int64_t nb = int64_t(items.size());
      run_items(nb, work, [&](int64_t j) {
        const auto [i, b] = items[backwards ? nb - 1 - j : j];
        with_elem(qs[i], [&](auto e) { body(e, qs[i], *hs[i], b); });
      });
    };
    round(p2_blocks, p2_elements, false, [&](auto e, Param& q, const Hyper& h, int64_t b) {
      q.partial[b] = p2_block<decltype(e)>(q, q.st, h, b);
    });
    for (size_t k = first; k < next; ++k) {
      Param& q = qs[units[k].first];
      with_elem(q, [&](auto e) {
        q.clip[units[k].second] = clip_of(unit_usq<typename decltype(e)::T>(q, units[k].second), q.geo.ng);
      });
    }
    round(blocks, elements, true, [&](auto e, Param& q, const Hyper& h, int64_t b) {
      p3_block<decltype(e)>(q, q.st, h, b);
    });
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
      if (q.weighted) {  // pass 1's row weights take the beta2 of each unit as if it steps (only such a unit uses them)
        q.usq.assign(G.units, std::numeric_limits<double>::quiet_NaN());
        for (int64_t u = 0; u < G.units; ++u) q.beta2[u] = beta2_at(hypers[gi], step_t(q, q.step[u] + 1.0f));
      }
      hs.push_back(&hypers[gi]);
      const int32_t i = int32_t(qs.size() - 1);
      q.early = early(q, cache) && G.blocks_per_unit;
      q.whole = q.early && !skip_nonfinite && q.dtype != at::kBFloat16;
      const int64_t n = q.early ? G.units : G.blocks();
      for (int64_t k = 0; k < n; ++k) items.emplace_back(i, k);
      elements += G.numel;
      stats_at.push_back(-1);
      if (G.factored) {  // at a 64-byte boundary
        stats_at.back() = (stats_size + 63) / 64 * 64;
        stats_size = stats_at.back() + Stats::bytes(G, G.M, c10::elementSize(math_dtype(q.dtype)), q.weighted);
      }
    }
  }
  Tensor stats = at::empty({std::max<int64_t>(stats_size, 1)}, at::TensorOptions().dtype(at::kByte));
  for (size_t i = 0; i < qs.size(); ++i)
    if (stats_at[i] >= 0)
      with_elem(qs[i], [&](auto e) {
        qs[i].st = Stats::carve<typename decltype(e)::T>(stats.data_ptr<uint8_t>() + stats_at[i], qs[i].geo, 0,
                                                         qs[i].geo.M, qs[i].weighted);
      });
  // pass 1 (with pass 2 of the early units, and pass 3 of the whole ones)
  run_items(int64_t(items.size()), elements, [&](int64_t k) {
    const auto [i, b] = items[k];
    with_elem(qs[i], [&](auto e) {
      if (qs[i].whole)
        whole_unit<decltype(e)>(qs[i], *hs[i], b);
      else if (qs[i].early)
        early_unit<decltype(e)>(qs[i], *hs[i], b);
      else
        p1_any<decltype(e)>(qs[i], *hs[i], b);
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
  // the writes: early and fused units whole by one thread each, in order (p3_unit), then the split ones
  std::vector<std::pair<int32_t, int64_t>> whole, split;
  int64_t whole_elements = 0;
  for (size_t i = 0; i < qs.size(); ++i) {
    Param& q = qs[i];
    if (q.whole) continue;  // stepped
    count_steps(q, *hs[i]);
    for (int64_t u = 0; u < q.geo.units; ++u) {
      if (!q.active[u] || q.geo.blocks_per_unit == 0) continue;
      const bool whole_unit = q.early || fuses(q, cache);
      (whole_unit ? whole : split).emplace_back(int32_t(i), u);
      if (whole_unit) whole_elements += q.geo.unit_numel;
    }
  }
  run_items(int64_t(whole.size()), whole_elements, [&](int64_t k) {
    const auto [i, u] = whole[k];
    with_elem(qs[i], [&](auto e) { late_unit<decltype(e)>(qs[i], *hs[i], u); });
  });
  split_units(qs, hs, split, 16 * cache);
  ct.finish();
  return at::scalar_tensor(false, at::TensorOptions().dtype(at::kBool));
}

}  // namespace
