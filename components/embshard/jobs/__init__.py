"""One module per pipeline stage, each with a typed `run(...)` and, for commands, its CLI (`configure`, `main`):

ingest -> tasks -> shards -> bench (mapped over chunks) -> train_cost -> train_policy (outer loop, composed in
embshard.outer_loop: measure_plans + bench -> train_cost -> train_policy) -> promote -> export; evaluate is the
command line of the evaluation (embshard.evaluation, which promote runs too); place is the user's one-off planner
call. The DAG's tasks call them through embshard.stages. A job never imports another job
(docs/architecture.md); the algorithms they use live in ingest/, bench/, costmodel/, policy/, planners/,
export/, ruler.py and evaluation.py.
"""
