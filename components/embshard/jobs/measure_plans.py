"""The outer loop's planning step (measure_policy_plans): the policy's own placements, as a shard list to measure.

The policy of the last round plans the first `num_tasks` training tasks (one greedy rollout each, under the
cost model it was trained against); every device shard of those placements goes into OUT/shards.parquet (the
shards contract), with the run's communication calibration copied beside it. The outer loop
(embshard.outer_loop) then measures that list like the benchmark's shards (jobs.bench) into OUT/costs, a folder
of its own; the refit of the cost model reads the benchmark's costs and every round's measured plans, so it
learns where the policy places tables.
"""
from __future__ import annotations

import os

import pandas as pd

from .. import schemas, storage
from ..bench.runner import MeasureSettings


def run(tables: str, tasks: str, policy_dir: str, cost_model_uri: str, out: str, *, num_tasks: int = 4,
        round_index: int = 2, settings: MeasureSettings | None = None) -> str:
    """Write the device shards of round `round_index - 1`'s policy's plans to OUT/shards.parquet; returns its
    path. `settings.calibration_dir`: the run's communication calibration, copied to OUT so that measuring OUT
    gives costs that match the benchmark's."""
    from ..bench.comm import CALIBRATION_FILE
    from ..bench.sampler import device_shard_row
    from ..costmodel import load as load_cost_model
    from ..placement import Placement
    from ..planners.splitting import split_to_fit
    from ..policy.core import TaskContext, rollout
    from ..policy.model import load_policy_files
    from ..pools import split_train_tasks

    settings = settings or MeasureSettings()
    policy, _ = load_policy_files(os.path.join(policy_dir, "policy.pt"), os.path.join(policy_dir, "policy.json"))
    cost_model = load_cost_model(cost_model_uri)
    fit_tasks, _ = split_train_tasks(tables, tasks)
    rows = []
    for t in fit_tasks[:max(1, int(num_tasks))]:
        # The policy places the task's pieces: its tables, cut where they would not fit (as the planner does).
        view = split_to_fit(t.tables, t.devices, t.task_id)
        ctx = TaskContext.build(cost_model, view.pieces.features(), view.pieces.size_bytes, t.num_devices,
                                view.memory)
        ro = rollout(policy, ctx, 1, "greedy")
        pl = Placement(t.tables, t.num_devices, t.memory_bytes_per_device, view.shards(ro.assignment[0]))
        for d, shard in enumerate(pl.device_shards()):
            if not shard:
                continue
            fields = {"sample_id": f"policy-r{round_index}-{t.task_id}-d{d}", "origin": "placement:learned"}
            if view.is_whole:  # whole tables: the rows as they were
                rows.append({**fields, "table_ids": [t.tables.table_ids[s.table] for s in shard],
                             "num_devices": t.num_devices})
            else:  # the pieces' widths and rows, as sample_shards writes them
                rows.append(device_shard_row(t.tables.table_ids, shard, t.num_devices, **fields))
    shards_path = storage.join(out, "shards.parquet")
    schemas.write(pd.DataFrame(rows), shards_path, "shards")
    # The run's communication calibration, so these costs match the benchmark's.
    if settings.calibration_dir is not None:
        calib = storage.join(settings.calibration_dir, CALIBRATION_FILE)
        if storage.exists(calib):
            storage.write_text(storage.join(out, CALIBRATION_FILE), storage.read_text(calib))
    return shards_path
