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
//   * `step`, for one process (nothing to reduce between passes), in one call (step.h): pass 1 is each unit's sum
//     of g^2 (the non-finite check, the banks' idle slices) and a factored parameter's row and column sums, kept for
//     pass 2; each unit's passes are scheduled by what fits a core's L2 cache (the `cache` cpu.py reads from the
//     OS), so that a pass finds in cache what the pass before it just read. An expert bank slice that fits costs 16
//     bytes of memory traffic a parameter in fp32 (g twice, p read and written) against fused AdamW's 28, 8 in bf16
//     against 14 (skewadam/kernels/traffic.py models every schedule).
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
// and column statistics of the factored parameters (Stats::bytes per parameter: cpu.step_transient_bytes) and per
// unit and per block a few numbers.
//
// Files, one translation unit in this order: base.h (constants, element types, rounding, SIMD streams, work items),
// records.h (types.py's records), params.h (geometry, statistics' storage, checked records), pass1.h (pass 1, step
// counts, factored EMAs), momentum.h (the first moment's codecs), passes23.h (passes 2 and 3), step.h (one
// process's step), and this file (the three passes' API and the module).
//
// Stochastic rounding: bit-identical to skewadam/kernels/rounding.py (same hash, key and element index).
// Compact first moment (bf16, or int8 with an fp32 scale per kQBlock values along the last dim): decoded, updated and
// encoded with quant.py's operations in its order, so the stored bytes are eager's.
// Indexing is int64 throughout; a single row must hold fewer than 2^31 elements.
//
// Shape legend: E units (bank slices), M matrices [R, C] of a factored tensor (all leading dims), R rows, C columns.

#include "step.h"

namespace {

// ------------------------------------------------------------------------------------ the three passes (the seam)
// Pass 1 (eager.grad_stats): per parameter GradStats, float64 tensors (sumsq, rc_sumsq, row, col, row_var_sum; None
// where not factored; p_sumsq with a relative step; absmax for fp64 parameters).
std::vector<StatsRec> grad_stats(const GroupRec& group) {
  const auto& recs = std::get<0>(group);
  const size_t n = recs.size();
  const Hyper h = hyper_of(group);
  const bool relative_step = h.relative_step;
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
    with_elem(qs[i], [&](auto e) { p1_any<decltype(e)>(qs[i], h, b); });
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
  std::vector<std::vector<double>> rmws(n);  // weighted parameters: their Stats' rmw and tp
  std::vector<std::vector<float>> tps(n);
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
      if (q.weighted) {
        q.usq.assign(G.units, std::numeric_limits<double>::quiet_NaN());
        rmws[i].assign(G.M, 0.0);
        q.st.rmw = rmws[i].data();
        tps[i].assign(G.M * G.blocks_per_mat * G.C, 0.0f);
        q.st.tp = tps[i].data();
      }
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
  // the weighted parameters' weighted column sums (the one-process step's pass 1 computes them), the others' pass 2;
  // then pass 2 of the weighted units whose weighted sums do not hold their sum of u^2 (weighted_sumsq)
  const auto blocks_round = [&](const std::vector<std::pair<int32_t, int64_t>>& items, int64_t work, bool sweep) {
    run_items(int64_t(items.size()), work, [&](int64_t k) {
      const auto [i, b] = items[k];
      with_elem(qs[i], [&](auto e) {
        if (sweep && qs[i].weighted)
          p2_weighted_block<decltype(e)>(qs[i], qs[i].st, b);
        else
          qs[i].partial[b] = p2_block<decltype(e)>(qs[i], qs[i].st, h, b);
      });
    });
  };
  blocks_round(blocks, elements, true);
  std::vector<std::pair<int32_t, int64_t>> again;
  int64_t again_elements = 0;
  for (size_t i = 0; i < n; ++i) {
    Param& q = qs[i];
    const Geo& G = q.geo;
    for (int64_t u = 0; q.weighted && u < G.units; ++u) {
      bool weighted = true;
      with_elem(q, [&](auto e) { weighted = !q.active[u] || weighted_unit<typename decltype(e)::T>(q, q.st, h, u); });
      if (weighted) continue;
      for (int64_t b = u * G.blocks_per_unit; b < (u + 1) * G.blocks_per_unit; ++b) again.emplace_back(int32_t(i), b);
      again_elements += G.unit_numel;
    }
  }
  blocks_round(again, again_elements, false);
  for (size_t i = 0; i < n; ++i)
    with_elem(qs[i], [&](auto e) {
      using T = typename decltype(e)::T;
      T* us = std::get<0>(out[i]).data_ptr<T>();
      for (int64_t u = 0; u < qs[i].geo.units; ++u) us[u] = qs[i].active[u] ? unit_usq<T>(qs[i], u) : T(0);
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
