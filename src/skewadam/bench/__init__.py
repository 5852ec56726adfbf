"""The benchmark application beside the optimizer library: which optimizers are compared, how much memory each
needs, and how they train. Nothing in the library imports it; ``skewadam.plan`` and the ``skewadam`` command do.

Its modules, each importing only those above it in this list (the planner thereby needs neither the optimizer nor
a kernel module: an arm's builder imports the optimizer when it runs):

extras.py      optional dependencies: what is missing, quiet third-party imports
models.py      the reference MoE transformer and its size presets (tiny, cpu, cpu-20m, paper-6.78b)
data.py        corpora as byte tokens: the embedded Shakespeare or a user's folder, split by document
presets.py     models by name: the reference presets and Transformers MoE configs, built without downloads
arms.py        the arms: every optimizer under comparison, one registry (name, label, lr, builder, memory model)
activations.py the planner's activation model: what a step keeps for backward, the most bytes alive during it
zero_plan.py   the planner's DeepSpeed ZeRO figures: each rank's weights, master, gradients, SkewAdam state, traffic
planner.py     `plan`: bytes of parameters, gradients, master weights, state and step temporaries, per arm
config.py      RunConfig / BenchConfig and the named presets of ``skewadam bench --preset``; a run's identity
logs.py        run logs checked by schema and identity before they count
plots.py       the plots of a run directory (matplotlib)
measure.py     the peak memory of real training steps beside the planner's estimate (``skewadam plan --measure``)
train.py       one training run (a nanoGPT-style loop), in a fresh process per run
report.py      ``skewadam report RUN_DIR``: table and plots from the JSON logs
run.py         ``skewadam bench``: plans the runs, launches them, resumes
bench_step.py  ``skewadam bench-step``: the time and transient memory of one optimizer step
roofline.py    ``skewadam bench-step --roofline``: each path's attained bandwidth beside fused AdamW's and a stream's

The command line is `skewadam.cli`.
"""
