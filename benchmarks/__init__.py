"""embshard's side-by-side benchmark harness: `python -m benchmarks` (or `make bench`) writes benchmarks/results/.

One run produces four reports, each a Markdown table (and a plot) naming the hardware it ran on:
  quality        measured cost (real kernels) of every planner, TorchRec's included, on held-out suites;
  planning_time  planning seconds of the learned planner and TorchRec's, tables x devices, log-log;
  costmodel      the cost model's accuracy per head against the reference estimators;
  pipeline       the wall time of each stage of the Airflow pipeline that trained the models.
Modules: pipeline_stages (train or reuse a run), quality, planning_time, costmodel_accuracy, report (the page),
common (hardware line, Markdown, progress). The scripts beside them (bench_throughput.py, ...) stand alone.
"""
