"""The benchmark harness: `skewadam bench` trains the reference MoE with each optimizer arm and compares them.

config.py      RunConfig / BenchConfig dataclasses and the named presets (default, smoke, study)
train.py       one training run (a nanoGPT-style loop), run in a fresh process per optimizer
bench.py       `skewadam bench`: plans the runs, launches them, resumes
report.py      `skewadam report RUN_DIR`: table and plots from the JSON logs
bench_step.py  `skewadam bench-step`: the time and transient memory of one optimizer step
measure.py     the peak memory of real training steps beside the planner's estimate (`skewadam plan --measure`)

The optimizers themselves are `skewadam.arms`; the command line is `skewadam.cli`.
"""
