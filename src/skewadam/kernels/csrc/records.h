// types.py's records, converted with the C API, and a group's hyperparameters.
// Part of skewadam_cpu.cpp, one translation unit that includes these files in order (its first comment says
// what the kernel does).
#pragma once

#include "base.h"

namespace {

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
  // (the ns_* fields shape the orthogonal update, which runs in Python: group_rec_of skips them)
  d["Group"] = std::vector<std::string>{"params", "lr", "beta1", "beta2", "eps", "eps_mode", "weight_decay", "seed",
                                        "relative_step", "beta2_decay", "ns_steps", "ns_dtype", "ns_interval"};
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
  constexpr Py_ssize_t kOrthogonalFields = 3;  // ns_steps, ns_dtype, ns_interval (fields())
  if (!PyTuple_Check(g) || PyTuple_GET_SIZE(g) != Py_ssize_t(std::tuple_size_v<GroupRec>) + kOrthogonalFields)
    wrong_type("groups");
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

}  // namespace
