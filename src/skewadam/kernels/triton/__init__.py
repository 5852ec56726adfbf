"""SkewAdam's update as Triton kernels: the passes of `skewadam.kernels.eager` for GPU tensors, with no host sync.

The math is eager's, operation for operation, in eager's dtypes: the statistics of pass 1 in float64 (`GradStats`:
the square of an fp32 or bf16 value is exact there, and no sum of finite ones overflows, so only inf/NaN gradients are
non-finite), the second-moment EMAs in float64 from them (float64 coefficients) rounded once into the state, the rest
in the state dtype ``T`` (fp32 for bf16 parameters, the parameter's dtype otherwise): the momentum's EMA as
`eager.ema` (``x * (1 - beta) + s * beta``, the coefficients float64 rounded to T), the write as
``p * decay - u * lr`` (lr and decay float64 rounded to T), the int8 code as `quant.quantize_` (the ratio rounded to
fp32, its correctly rounded root, times 127, rint), every operation IEEE-rounded on its own in eager's order (kernels
are compiled with ``enable_fp_fusion=False``: no FMA; divisions and square roots round to nearest). What differs from
eager is only the order of summation. So, as eager and the C++ kernel promise each other, the element-wise
state is bitwise eager's: step counts, the first moment in every storage (fp32/fp64 values, bf16 values, int8 codes
and scales) and the full second moment; bf16 parameters and momentum are rounded with exactly the bits of
`skewadam.kernels.rounding`. The factored statistics and the weights depend on sums: they agree to rounding. (Against
eager run on CUDA an int8 code can differ by one: torch's CUDA division by the scalar 127 multiplies by its
reciprocal.)

Launch structure. A param group is split into *buckets* by (parameter dtype, factored or not, first-moment format
`skewadam.kernels.types.MomFmt`), the values that change the compiled code; each pass is a few launches per bucket,
whatever its number of tensors (as torch's fused multi-tensor optimizers do). The tensors' addresses and sizes go to
the kernels in a small device table (one int64 row per tensor, `tables.tensor_table`, uploaded from pinned memory
without a sync); the work is cut into items, matrices and units (`skewadam.kernels.triton_layout`). Every index is
int64; every load and store is masked by the sizes in the tables, which are checked on the host against the tensors
before any launch.

Passes (eager's, with the distributed seam between them):

1. `grad_stats`: per item, the rows' sums of ``g^2`` (complete: an item holds whole rows) and the columns' partial
   sums (its own slot, or the column sums themselves for a one-strip matrix); then per matrix the column partials
   added in strip order, ``rc`` and the row-statistic sum; then per unit ``sum g^2``. Fixed orders: deterministic.
2. `update_moments_`: per tensor, the step counts (a bank slice advances only if its gradient has a nonzero element:
   ``sum g^2 > 0``, or for fp64 parameters, whose squares can underflow, the max ``|g|`` pass 1 also takes; both
   sum across shards), the bias corrections (float64 on the device) and the rounding keys; per matrix, the factored
   EMAs and ``rinv``/``cinv``; per item, the momentum and full second moment in place and its partial ``sum u^2``;
   per unit, ``sum u^2``.
3. `apply_updates_`: per tensor, each unit's clip ``1/max(1, rms(u))`` and the rounding key; per item,
   ``p = p*(1 - lr*wd) - lr * u * clip``, rounded stochastically for bf16.

Passes 2 and 3 compute the update direction ``u`` with one kernel (`passes.direction_tiles`).

Adafactor's options (`skewadam.kernels.types.Group`) are inside the passes, per unit, as eager has them: with
``relative_step`` pass 1 also sums ``p^2`` in float64 (`GradStats.p_sumsq`) and pass 2 returns pass 3's scale of u,
``corr * max(RELATIVE_STEP_EPS, sqrt(p_sumsq / n))`` in float64 rounded once, as `Moments.corr` (the weight decay
keeps ``lr``); with ``beta2_decay`` d every second-moment EMA of a unit uses ``beta2_t = 1 - t**d`` at its new step
count t, and the bias correction drops ``sqrt(1 - beta2^t)``. ``t**d`` is ``exp(d * log(t))`` in float64 on the
device (eager takes the host's pow): with a beta2 decay the full second moment agrees with eager's to that rounding.

`step_` runs the three passes of every group back to back. Its finite check is pass 1's: the per-unit sums of
``g^2`` set a device flag (an atomic max) that every later kernel reads, writing nothing when it is set (as fused
AdamW's ``found_inf``); the returned ``skipped`` is that flag, on the device.

Step counts live on the device, beside the parameter, for banks and single tensors alike (the kernels read and
advance them; a host step would need a sync to skip; ``BACKENDS["triton"].device_steps`` tells the optimizer): the
rounding key ``rounding_key(seed, stream, sum of steps)`` and the bias corrections are computed from them in the
kernels. A unit with no elements in the global shape is left untouched, its step count included. The group's hyperparameters travel
as float64 in the table's header row; ``lr`` may be a float or a one-element float tensor (read in the kernel if on
the parameters' device; a CPU tensor's value is read on the host, which is no device sync). A ``skip`` flag is read
on the device too (``BACKENDS["triton"].skip_on_host`` is False).

Memory traffic per element of an expert bank (factored, no momentum, fp32 or bf16 weights): ``g`` read by pass 1 and by
pass 3 with ``p`` read and written: 16 bytes in fp32 (fused AdamW: 28), 8 in bf16 (every tier:
`skewadam.kernels.traffic.triton`). Its clip's ``sum u^2`` comes from weighted column sums that `step_`'s pass 1 adds up
right after each group of rows' sums, re-reading those rows from cache (`weighted`: ``sum_ij (g_ij rinv_i c cinv_j)^2 =
c^2 rm sum_j cinv_j^2 sum_i g_ij^2 / row_var_i``); pass 2 reads the gradient only of a unit where they do not hold it (a
floored row, a sum below `weighted.SAFE_MIN`). Transient memory: the statistics (rows, columns, units), the column
partials of matrices cut into several strips, the weighted column sums (per strip), one float per item, and the tables
(`step_transient_bytes`). A non-contiguous parameter, gradient or state tensor is also copied (and written back if the
pass writes it).

Under ``TRITON_INTERPRET=1`` (set before triton is first imported) the kernels run on CPU tensors, slowly, which is how
they are tested without a GPU.

Modules: `device` (the tables' columns and the element math), `passes` (the kernels), `weighted` (the clip's sum of
u^2 from weighted column sums), `tables` (checks, buckets, the tensor table), `entry` (launches and these entry
points); `skewadam.kernels.triton_layout` (the work layout and `step_transient_bytes`) imports no triton.

Example:
    >>> skipped = step_([group], skip_nonfinite=True)  # one skewadam.kernels.types.Group of CUDA tensors
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("triton") is None:  # pragma: no cover - exercised only where triton is absent
    raise ImportError("skewadam.kernels.triton needs the triton package (pip install triton); use impl='eager' "
                      "without it")

from ..triton_layout import step_transient_bytes
from .entry import apply_updates_, grad_stats, step_, stochastic_round_bf16, update_moments_
from .tables import available, interpreted

__all__ = ["grad_stats", "update_moments_", "apply_updates_", "step_", "step_transient_bytes", "available",
           "interpreted", "stochastic_round_bf16"]
