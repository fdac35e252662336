"""TorchRec interop: our placements as TorchRec sharding plans, and TorchRec plans as our placements.

torchrec is an optional extra, imported lazily (`require_torchrec`). Everything here speaks in terms of an
`EmbeddingBagCollection` with one `EmbeddingBagConfig` per table, named by `table_id`, one feature
`f_<table_id>` per table, fp32 or fp16 weights (`bytes_per_element` 4 or 2).

- `to_torchrec_plan(plan)`: a `ShardingPlan` built with torchrec's own API (`construct_module_sharding_plan`
  with `table_wise(rank=r)` for whole tables and a column-wise `ParameterSharding` with our exact slices and
  ranks otherwise; compute kernel `fused`, i.e. weights in HBM). `DistributedModelParallel(model, plan=...)`
  consumes it.
- `torchrec_constraints(plan)` + `fixed_rank_partitioner(plan)` / `torchrec_planner_for(plan)`: for users who
  run TorchRec's own planner. `ParameterConstraints` fix each table's sharding type, column split and
  kernel, but TorchRec has no per-table rank constraint, so a small `Partitioner` puts every shard on our rank.
- `placement_from_sharding_plan(...)`: the reverse conversion, used by the TorchRec baseline planner.
- `plan_to_json` / `plan_from_json`: a pickle-free form of the ShardingPlan (what `embshard export` writes as
  `torchrec_plan.json`; `torchrec_plan.pt` is the same plan pickled with `torch.save`).

Row-wise, table-row-wise and data-parallel shardings have no equivalent in our placement format (a Shard is a
whole table or a column slice on one device), so they are neither produced nor accepted.
"""
from __future__ import annotations

import json
from typing import Mapping

from ..errors import EmbshardError
from ..placement import Placement
from ..torchrec_compat import (  # noqa: F401  (the export's TorchRec vocabulary, shared with the TorchRec planner)
    COLUMN_WISE,
    FUSED,
    INSTALL_FIX,
    TABLE_COLUMN_WISE,
    TABLE_WISE,
    build_module,
    check_names,
    data_type,
    placement_from_sharding_plan,
    quiet_torchrec,
    require_torchrec,
    storage_estimators,
    topology,
)

PLAN_JSON_VERSION = "embshard.torchrec_plan/v1"


def _as_plan(plan_or_placement) -> dict:
    if isinstance(plan_or_placement, Placement):
        from .plan_json import plan_dict

        return plan_dict(plan_or_placement)
    if isinstance(plan_or_placement, Mapping) and "tables" in plan_or_placement:
        return dict(plan_or_placement)
    raise EmbshardError(f"expected a Placement or a plan.json dict, got {type(plan_or_placement).__name__}",
                        field="plan", fix="pass Placement or read_plan_json(path)")


def _sorted_shards(table: Mapping) -> list[dict]:
    return sorted(table["shards"], key=lambda s: s["col_offset"])


def to_torchrec_plan(plan_or_placement, *, module=None, module_path: str = "", compute_device: str = "cuda",
                     local_world_size: int | None = None):
    """A torchrec `ShardingPlan` with our ranks and column slices, built with torchrec's API.

    `module_path` is where the EmbeddingBagCollection sits in the user's model ("" = the model is the EBC;
    e.g. "sparse_arch.embedding_bag_collection"). `module` defaults to a meta-device EBC built from the plan.
    """
    require_torchrec()
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    plan = _as_plan(plan_or_placement)
    world = int(plan["num_devices"])
    local = int(local_world_size or world)
    if module is None:
        module = build_module(plan["tables"])
    generators = {}
    for table in plan["tables"]:
        shards = _sorted_shards(table)
        if len(shards) == 1 and shards[0]["col_size"] == table["dim"]:
            generators[table["table_id"]] = table_wise(rank=int(shards[0]["device"]), compute_kernel=FUSED)
        else:
            generators[table["table_id"]] = _column_wise_generator(shards)
    try:
        module_plan = construct_module_sharding_plan(
            module, generators, sharder=EmbeddingBagCollectionSharder(), local_size=local, world_size=world,
            device_type=compute_device)
    except AssertionError as exc:  # torchrec reports a table mismatch with an assert
        raise EmbshardError(f"the plan does not match the module's tables ({str(exc)[:160]})", field="tables",
                            fix="pass the EmbeddingBagCollection whose tables are named by table_id") from None
    return ShardingPlan({module_path: module_plan})


def _column_wise_generator(shards: list[dict]):
    """A torchrec ParameterShardingGenerator for our (possibly uneven) column slices on our ranks.

    torchrec's `column_wise(ranks=...)` only makes even splits and `column_wise(size_per_rank=...)` puts slice k
    on rank k, so the ParameterSharding is assembled from torchrec's types directly.
    """

    def generate(param, local_size, world_size, device_type, sharder):
        from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
        from torchrec.distributed.sharding_plan import placement
        from torchrec.distributed.types import ParameterSharding

        rows = int(param.shape[0])
        metas = [ShardMetadata(shard_offsets=[0, int(s["col_offset"])], shard_sizes=[rows, int(s["col_size"])],
                               placement=placement(device_type, int(s["device"]), local_size)) for s in shards]
        return ParameterSharding(sharding_type=COLUMN_WISE, compute_kernel=FUSED,
                                 ranks=[int(s["device"]) for s in shards],
                                 sharding_spec=EnumerableShardingSpec(metas))

    return generate


def torchrec_constraints(plan_or_placement) -> dict:
    """Per-table `ParameterConstraints` that restrict TorchRec's planner to our sharding of each table.

    Whole tables get `table_wise`; column-split tables get `column_wise` with `min_partition` = our slice size
    (TorchRec's enumerator splits into equal blocks, so our slices must be equal, a multiple of 4 columns).
    Ranks cannot be expressed as a constraint: use `fixed_rank_partitioner` (or `torchrec_planner_for`).
    """
    require_torchrec()
    from torchrec.distributed.planner import ParameterConstraints

    plan = _as_plan(plan_or_placement)
    out = {}
    for table in plan["tables"]:
        shards = _sorted_shards(table)
        pooling = [max(float(table.get("pooling_factor", 1.0)), 1e-3)]
        if len(shards) == 1:
            out[table["table_id"]] = ParameterConstraints(sharding_types=[TABLE_WISE], compute_kernels=[FUSED],
                                                          pooling_factors=pooling)
            continue
        sizes = {int(s["col_size"]) for s in shards}
        size = sizes.pop()
        if sizes or size % 4 or table["dim"] % size:
            raise EmbshardError(f"table {table['table_id']} has column slices {[s['col_size'] for s in shards]}",
                                field="col_size", fix="TorchRec's planner only makes equal column blocks that are "
                                "a multiple of 4; load the plan with to_torchrec_plan instead")
        out[table["table_id"]] = ParameterConstraints(sharding_types=[COLUMN_WISE], compute_kernels=[FUSED],
                                                      min_partition=size, pooling_factors=pooling)
    return out


def fixed_rank_partitioner(plan_or_placement):
    """A torchrec `Partitioner` that puts every shard on the rank our plan chose (and checks its storage)."""
    require_torchrec()
    from torchrec.distributed.planner.types import Partitioner, PlannerError, PlannerErrorType

    plan = _as_plan(plan_or_placement)
    ranks = {t["table_id"]: {int(s["col_offset"]): int(s["device"]) for s in t["shards"]} for t in plan["tables"]}

    class FixedRankPartitioner(Partitioner):
        def partition(self, proposal, storage_constraint):
            devices = storage_constraint.devices
            for option in proposal:
                want = ranks.get(option.name)
                if want is None:
                    raise PlannerError(f"table {option.name} is not in the embshard plan",
                                       PlannerErrorType.PARTITION)
                for shard in option.shards:
                    rank = want.get(int(shard.offset[1]))
                    if rank is None or int(shard.offset[0]) != 0:
                        raise PlannerError(f"table {option.name}: TorchRec's shard at offset {shard.offset} is "
                                           f"not in the embshard plan (slices at {sorted(want)})",
                                           PlannerErrorType.PARTITION)
                    if not shard.storage.fits_in(devices[rank].storage):
                        raise PlannerError(f"table {option.name}: rank {rank} has {devices[rank].storage} left, "
                                           f"the shard needs {shard.storage}", PlannerErrorType.PARTITION)
                    shard.rank = rank
                    devices[rank].storage -= shard.storage
                    devices[rank].perf += shard.perf
            return proposal

    return FixedRankPartitioner()


def torchrec_planner_for(plan_or_placement, batch_size: int = 512):
    """TorchRec's `EmbeddingShardingPlanner` configured to reproduce our plan (constraints + fixed ranks)."""
    require_torchrec()
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.proposers import GreedyProposer
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation

    plan = _as_plan(plan_or_placement)
    topo = topology(plan["num_devices"], plan["memory_bytes_per_device"])
    constraints = torchrec_constraints(plan)
    enumerator = EmbeddingEnumerator(topology=topo, batch_size=batch_size, constraints=constraints,
                                     estimator=storage_estimators(topo, constraints))
    return EmbeddingShardingPlanner(
        topology=topo, batch_size=batch_size, enumerator=enumerator, constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(0.0), proposer=GreedyProposer(),
        partitioner=fixed_rank_partitioner(plan), stats=[], debug=False)


def plan_to_json(sharding_plan) -> dict:
    """A pickle-free, JSON-serialisable form of a torchrec ShardingPlan (table-/column-wise plans)."""
    modules = {}
    for path, module_plan in sharding_plan.plan.items():
        params = {}
        for name, ps in module_plan.items():
            shards = [{"offsets": [int(x) for x in m.shard_offsets], "sizes": [int(x) for x in m.shard_sizes],
                       "placement": str(m.placement)} for m in (ps.sharding_spec.shards if ps.sharding_spec else [])]
            params[name] = {"sharding_type": ps.sharding_type, "compute_kernel": ps.compute_kernel,
                            "ranks": None if ps.ranks is None else [int(r) for r in ps.ranks], "shards": shards}
        modules[path] = params
    return {"schema": PLAN_JSON_VERSION, "modules": modules}


def plan_from_json(data: Mapping | str):
    """Rebuild the torchrec ShardingPlan from `plan_to_json` output (a dict, or a path to the JSON file)."""
    require_torchrec()
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    doc: Mapping
    if isinstance(data, str):
        from .. import storage

        where = data
        doc = json.loads(storage.read_text(data))
    else:
        where, doc = "<torchrec plan>", data
    if doc.get("schema") != PLAN_JSON_VERSION:
        raise EmbshardError(f"schema {doc.get('schema')!r} is not {PLAN_JSON_VERSION}", path=where,
                            field="schema", fix="re-export the plan with this embshard version")
    plan = {}
    for path, params in doc["modules"].items():
        module_plan = EmbeddingModuleShardingPlan()
        for name, p in params.items():
            spec = EnumerableShardingSpec([ShardMetadata(shard_offsets=s["offsets"], shard_sizes=s["sizes"],
                                                         placement=s["placement"]) for s in p["shards"]])
            module_plan[name] = ParameterSharding(sharding_type=p["sharding_type"],
                                                  compute_kernel=p["compute_kernel"], ranks=p["ranks"],
                                                  sharding_spec=spec if p["shards"] else None)
        plan[path] = module_plan
    return ShardingPlan(plan)


def rank_layout(sharding_plan, module_path: str = "") -> dict[str, list[tuple[int, int, int]]]:
    """{table: [(col_offset, col_size, rank), ...]} of a ShardingPlan, sorted by offset (for comparisons)."""
    out = {}
    for name, ps in sharding_plan.plan[module_path].items():
        out[name] = sorted((int(m.shard_offsets[1]), int(m.shard_sizes[1]), int(m.placement.rank()))
                           for m in ps.sharding_spec.shards)
    return out


def plan_layout(plan_or_placement) -> dict[str, list[tuple[int, int, int]]]:
    """The same layout from our side (plan.json dict or Placement)."""
    plan = _as_plan(plan_or_placement)
    return {t["table_id"]: sorted((int(s["col_offset"]), int(s["col_size"]), int(s["device"])) for s in t["shards"])
            for t in plan["tables"]}


__all__ = ["require_torchrec", "build_module", "to_torchrec_plan", "torchrec_constraints", "fixed_rank_partitioner",
           "torchrec_planner_for", "placement_from_sharding_plan", "plan_to_json", "plan_from_json", "topology",
           "rank_layout", "plan_layout", "INSTALL_FIX"]
