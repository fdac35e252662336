"""One module per pipeline stage, each with a typed `run(...)` and its CLI (`configure`, `main`):

ingest -> tasks -> shards -> bench (mapped over chunks) -> train_cost -> train_policy (outer loop:
measure_plans -> train_cost) -> evaluate + promote -> export;  place is the user's one-off planner call.
The DAG's tasks call them through embshard.stages; the algorithms they use live in ingest/, bench/, costmodel/,
policy/, planners/ and export/.
"""
