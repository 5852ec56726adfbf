"""The benchmark harness: `skewadam bench` trains the reference MoE with each optimizer and compares them.

config.py   RunConfig / BenchConfig dataclasses and the named presets (default, smoke, study)
optimizers.py  the optimizers under comparison, each built from a model, lr and weight decay
train.py    one training run (a nanoGPT-style loop), run in a fresh process per optimizer
bench.py    `skewadam bench`: plans the runs, launches them, resumes, renders the report
report.py   `skewadam report RUN_DIR`: table and plots from the JSON logs
"""
