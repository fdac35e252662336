"""TorchRec interop: our placements as TorchRec sharding plans, and TorchRec plans as our placements.

torchrec is an optional extra, imported lazily (`require_torchrec`). Everything here speaks in terms of an
`EmbeddingBagCollection` with one `EmbeddingBagConfig` per table, named by `table_id`, one feature
`f_<table_id>` per table, fp32 or fp16 weights (`bytes_per_element` 4 or 2).

- `to_torchrec_plan(plan)`: a `ShardingPlan` built with torchrec's own API (`construct_module_sharding_plan`
  with `table_wise(rank=r)` for whole tables, a column-wise `ParameterSharding` with our exact slices and ranks
  for column slices, `row_wise()` for row ranges cut by types.row_blocks over all devices, `table_row_wise(h)`
  for row ranges cut by row_blocks over the devices of host h, and `data_parallel()` for a replica on every
  device; compute kernel `fused`, i.e. weights in HBM, except data_parallel's `dense`).
  `DistributedModelParallel(model, plan=...)` consumes it. TorchRec 1.8 routes ids to row pieces by the block
  size ceil(rows / pieces) only, so any other row layout is refused with an error saying how to cut it.
- `torchrec_constraints(plan)` + `fixed_rank_partitioner(plan)` / `torchrec_planner_for(plan)`: for users who
  run TorchRec's own planner. `ParameterConstraints` fix each table's sharding type, column split and
  kernel, but TorchRec has no per-table rank constraint, so a small `Partitioner` puts every shard on our rank.
- `placement_from_sharding_plan(...)`: the reverse conversion, used by the TorchRec baseline planner.
- `plan_to_json` / `plan_from_json`: a pickle-free form of the ShardingPlan (what `embshard export` writes as
  `torchrec_plan.json`; `torchrec_plan.pt` is the same plan pickled with `torch.save`). `plan_from_json(...,
  module=model)` checks the plan's module paths against the model (`check_plan_doc`), which TorchRec does not.

TorchRec numbers ranks host by host (host h holds ranks h*L .. h*L+L-1 with L devices per host): a plan whose
`hosts` are laid out otherwise cannot be handed to TorchRec.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from ..checks import DIM_MULTIPLE, MAX_LOCAL_DEVICES
from ..errors import EmbshardError
from ..placement import Placement
from ..tableset import TableSet
from ..torchrec_compat import (  # noqa: F401  (the export's TorchRec vocabulary, shared with the TorchRec planner)
    COLUMN_WISE,
    DATA_PARALLEL,
    FUSED,
    INSTALL_FIX,
    ROW_WISE,
    SHARDING_TYPES,
    TABLE_COLUMN_WISE,
    TABLE_ROW_WISE,
    TABLE_WISE,
    build_module,
    check_names,
    data_type,
    placement_from_sharding_plan,
    quiet_torchrec,
    require_torchrec,
    row_layout,
    storage_estimators,
    topology,
    torchrec_hosts,
    torchrec_row_blocks,
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


# Segments: Python identifiers, or indices (an EBC inside an nn.Sequential or nn.ModuleList: `sparse.0`).
_MODULE_PATH = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*|\d+)(\.([A-Za-z_][A-Za-z0-9_]*|\d+))*$")


def check_module_path(module_path: str) -> None:
    """"" (the model is the EBC) or a dotted module path of identifiers and container indices (`sparse_arch.ebc`,
    `sparse.0`: as named_modules() names them): TorchRec looks the module up by this name, so `../x` or
    `model..ebc` would be a plan no model can load."""
    if module_path and (not isinstance(module_path, str) or not _MODULE_PATH.match(module_path)):
        raise EmbshardError(f"module path {str(module_path)[:60]!r} is not a dotted attribute path",
                            field="module_path", fix="give the module's name as model.named_modules() lists it "
                            "(identifiers and indices joined by '.', e.g. sparse_arch.embedding_bag_collection or "
                            "sparse.0), or nothing when the model is the EBC")


def to_torchrec_plan(plan_or_placement, *, module=None, module_path: str = "", compute_device: str = "cuda",
                     local_world_size: int | None = None):
    """A torchrec `ShardingPlan` with our ranks, column slices, row ranges and replicas, built with torchrec's API.

    `module_path` is where the EmbeddingBagCollection sits in the user's model ("" = the model is the EBC;
    e.g. "sparse_arch.embedding_bag_collection"). `module` defaults to a meta-device EBC built from the plan; a
    given one must hold exactly the plan's tables, rows, dims and data types (TorchRec takes the shapes from the
    module, so another one gives a plan DistributedModelParallel rejects or that leaves columns unplaced).
    Devices per host: from the plan's `hosts`, else `local_world_size`, else all devices on one host.
    """
    require_torchrec()
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    from .plan_json import shard_spans

    check_module_path(module_path)
    plan = _as_plan(plan_or_placement)
    world = int(plan["num_devices"])
    hosts = plan.get("hosts")
    local = int(local_world_size or world)
    if hosts is not None:
        plan_local = torchrec_hosts(world, hosts)
        if plan_local is None:
            raise EmbshardError(f"hosts {list(hosts)[:16]} are not laid out as TorchRec numbers ranks", field="hosts",
                                fix="give every host the same number of devices, numbered host by host "
                                "(host h: devices h*L .. h*L+L-1)")
        if local_world_size is not None and plan_local != int(local_world_size):
            raise EmbshardError(f"local_world_size {local_world_size} but the plan's hosts hold {plan_local} "
                                "devices each", field="local_world_size", fix="leave it out: the plan's hosts decide")
        local = plan_local
    elif world % local:
        raise EmbshardError(f"{world} devices do not split into hosts of {local}", field="local_world_size",
                            fix="give a number of devices per host that divides the number of devices")
    if local > MAX_LOCAL_DEVICES and compute_device != "cpu":
        raise EmbshardError(f"the plan's {world} devices are on one host, but TorchRec names a rank's GPU by its "
                            f"index on its host and torch's indices stop at {MAX_LOCAL_DEVICES - 1}",
                            field="hosts", fix="give the GPUs per host of the training job (--devices-per-host, "
                            "or the tasks file's devices_per_host)")
    rank_hosts = tuple(d // local for d in range(world))
    if module is None:
        module = build_module(plan["tables"])
    else:
        _check_ebc(module, plan["tables"])
    generators = {}
    for table, shards in zip(plan["tables"], shard_spans(plan)):
        name, kind = table["table_id"], shards[0]["kind"]
        if kind == "whole":
            generators[name] = table_wise(rank=int(shards[0]["device"]), compute_kernel=FUSED)
        elif kind == "column":
            mixed = unequal_widths_on_a_rank([(int(s["device"]), int(s["col_size"])) for s in shards])
            if mixed is not None:
                raise EmbshardError(f"table {name}: device {mixed[0]} holds column slices of widths {mixed[1]}, "
                                    "which TorchRec cannot run (a rank's slices of one table must be one width)",
                                    field="col_size", fix="give that device one slice of the table (or slices of "
                                    "one width); embshard's planners join a table's slices on one device")
            generators[name] = _column_wise_generator(sorted(shards, key=lambda s: s["col_offset"]))
        elif kind == "replicated":
            generators[name] = data_parallel()
        else:
            layout = row_layout(int(table["rows"]), [(s["row_offset"], s["row_size"], s["device"]) for s in shards],
                                world, rank_hosts)
            if layout is None:
                pieces = sorted((int(s["row_offset"]), int(s["row_size"]), int(s["device"])) for s in shards)
                raise EmbshardError(
                    f"table {name}: row ranges (offset, rows, device) {str(pieces[:4])[:-1]}"
                    f"{', ...]' if len(pieces) > 4 else ']'} are not a layout TorchRec can "
                    "run", field="row_offset", fix="cut rows with types.row_blocks over all devices in rank order "
                    "(row_wise) or over the devices of one whole host (table_row_wise)")
            generators[name] = row_wise(compute_kernel=FUSED) if layout[0] == ROW_WISE else \
                table_row_wise(host_index=int(layout[1] or 0))
    try:
        module_plan = construct_module_sharding_plan(
            module, generators, sharder=EmbeddingBagCollectionSharder(), local_size=local, world_size=world,
            device_type=compute_device)
    except AssertionError as exc:  # torchrec reports a table mismatch with an assert
        raise EmbshardError(f"the plan does not match the module's tables ({str(exc)[:160]})", field="tables",
                            fix="pass the EmbeddingBagCollection whose tables are named by table_id") from None
    for ps in module_plan.values():
        if ps.sharding_type == TABLE_ROW_WISE:  # table_row_wise() has no kernel argument; weights in HBM as ours
            ps.compute_kernel = FUSED
    return ShardingPlan({module_path: module_plan})


def _check_ebc(module, tables: list[Mapping]) -> None:
    """The module given to to_torchrec_plan is an EmbeddingBagCollection of exactly the plan's tables."""
    held = module_tables(module)
    if held is None or not callable(getattr(module, "named_modules", None)):
        raise EmbshardError(f"module is a {type(module).__name__}, not an EmbeddingBagCollection", field="module",
                            fix="pass the model's EmbeddingBagCollection (and its path as module_path), or leave "
                            "module out")
    m = table_mismatch({str(t["table_id"]): (int(t["rows"]), int(t["dim"])) for t in tables}, held[0],
                       f"the {len(held[0])} tables of the module given",
                       "pass the EmbeddingBagCollection the plan was made for, or plan again with its tables") or \
        _bytes_mismatch({str(t["table_id"]): int(t["bytes_per_element"]) for t in tables if "bytes_per_element" in t},
                        held[1], f"the {len(held[0])} tables of the module given")
    if m:
        raise EmbshardError(m[1], field="tables" if m[0] is None else f"tables.{m[0]}", fix=m[2])


def unequal_widths_on_a_rank(slices) -> tuple[int, list[int]] | None:
    """(rank, widths) of the first rank holding column slices [(rank, width), ...] of one table of unequal
    widths, else None. TorchRec 1.8's fused kernel views a rank's rows of a table at one width: such a plan
    fails in DistributedModelParallel (a shape error, or weights of the wrong shape)."""
    widths: dict[int, list[int]] = {}
    for rank, width in slices:
        widths.setdefault(int(rank), []).append(int(width))
    for rank, ws in sorted(widths.items()):
        if len(set(ws)) > 1:
            return rank, ws
    return None


def _column_wise_generator(shards: list[dict]):
    """A torchrec ParameterShardingGenerator for our (possibly uneven) column slices on our ranks.

    torchrec's `column_wise(ranks=...)` only makes even splits and `column_wise(size_per_rank=...)` puts slice k
    on rank k, so the ParameterSharding is assembled from torchrec's types directly.
    """

    def generate(param, local_size, world_size, device_type, sharder):  # noqa: ARG001 (torchrec's callback)
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
        if any(s.get("kind") in ("row", "replicated") for s in shards):
            raise EmbshardError(f"table {table['table_id']} is {table.get('sharding_type')}", field="sharding_type",
                                fix="constraints with fixed ranks cover whole tables and column slices; load a plan "
                                "with row ranges or replicas with to_torchrec_plan instead")
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


def plan_to_json(sharding_plan, *, world_size: int | None = None,
                 tables: Mapping[str, tuple[int, ...]] | None = None, source: Mapping[str, Any] | None = None) -> dict:
    """A pickle-free, JSON-serialisable form of a torchrec ShardingPlan (table-/column-wise plans).

    `world_size` and `tables` ({name: (rows, dim)} or {name: (rows, dim, bytes_per_element)}) are written when
    given, so that `plan_from_json` can refuse a plan with a rank beyond the world, a table missing, or a table of
    another data type (its memory differs from what the plan balanced) without being told them again. `source`
    (what made the plan: task, planner, model version, code version, time) is written as it is, so that a job
    that logs only this file can still be traced to its plan.json and model."""
    modules = {}
    for path, module_plan in sharding_plan.plan.items():
        params = {}
        for name, ps in module_plan.items():
            shards = [{"offsets": [int(x) for x in m.shard_offsets], "sizes": [int(x) for x in m.shard_sizes],
                       "placement": str(m.placement)} for m in (ps.sharding_spec.shards if ps.sharding_spec else [])]
            params[name] = {"sharding_type": ps.sharding_type, "compute_kernel": ps.compute_kernel,
                            "ranks": None if ps.ranks is None else [int(r) for r in ps.ranks], "shards": shards}
        modules[path] = params
    doc: dict[str, Any] = {"schema": PLAN_JSON_VERSION}
    if world_size is not None:
        doc["world_size"] = int(world_size)
    if tables is not None:
        doc["tables"] = {str(n): {"rows": int(v[0]), "dim": int(v[1]),
                                  **({"bytes_per_element": int(v[2])} if len(v) > 2 else {})}
                         for n, v in tables.items()}
    if source is not None:
        doc["source"] = dict(source)
    doc["modules"] = modules
    return doc


log = logging.getLogger(__name__)
_PLACEMENT = re.compile(r"^rank:(\d+)/[a-z_]+(:\d+)?$")
_GPU_PLACEMENT = re.compile(r"^rank:(\d+)/(cuda|mtia):(\d+)$")  # the devices TorchRec indexes per host
_PLAN_FIX = "re-export the plan with `embshard export` (this file was edited or made for other tables/devices)"


TABLES_ACCEPTED = ("a TableSet, a path (str or os.PathLike) to a tables.parquet, a table spec (.csv, .yaml or a "
                   "Parquet spec, read as `embshard export --tables` reads it) or the plan.json the plan was exported "
                   "with, a plan.json dict or its tables list, an EmbeddingBagCollection, or a list of TorchRec "
                   "EmbeddingBagConfig")


def module_tables(obj) -> tuple[dict[str, tuple[int, int]], dict[str, int]] | None:
    """({name: (rows, dim)}, {name: bytes per element} where fp32/fp16) of TorchRec tables: an EmbeddingBagCollection
    (anything with TorchRec's `embedding_bag_configs()`) or a list of EmbeddingBagConfig; None for anything else."""
    if callable(getattr(obj, "embedding_bag_configs", None)):
        configs = list(obj.embedding_bag_configs())
    elif isinstance(obj, (list, tuple)) and obj and all(
            all(hasattr(c, a) for a in ("name", "num_embeddings", "embedding_dim")) for c in obj):
        configs = list(obj)
    else:
        return None
    from ..torchrec_compat import TRAINED_BYTES

    return ({str(c.name): (int(c.num_embeddings), int(c.embedding_dim)) for c in configs},
            {str(c.name): TRAINED_BYTES[k] for c in configs
             if (k := getattr(getattr(c, "data_type", None), "name", None)) in TRAINED_BYTES})


def _expected_tables(tables) -> tuple[dict[str, tuple[int, int]] | None, int | None, dict[str, int]]:
    """({name: (rows, dim)}, world size or None, {name: bytes per element} where known) of what the caller says
    the plan is for (TABLES_ACCEPTED)."""
    if tables is None:
        return None, None, {}
    if isinstance(tables, os.PathLike):
        tables = os.fspath(tables)
    if (held := module_tables(tables)) is not None:
        return held[0], None, held[1]
    if isinstance(tables, TableSet):
        return ({str(t): (int(r), int(d)) for t, r, d in zip(tables.table_ids, tables.rows, tables.dims)}, None,
                {str(t): int(b) for t, b in zip(tables.table_ids, tables.bytes_per_element)})
    if isinstance(tables, str):
        from ..ingest.spec import is_spec_path, read_tables

        if is_spec_path(tables) or tables.lower().endswith((".parquet", ".pq")):
            # a spec is read as the CLI reads it (the same tables); a tables.parquet's schema TableSet.read checks
            return _expected_tables(read_tables(tables))
        if not tables.lower().endswith(".json"):
            raise EmbshardError(f"tables= takes {TABLES_ACCEPTED}", path=tables, field="tables",
                                fix="pass the model's table spec, tables.parquet or plan.json")
        from .plan_json import read_plan_json

        tables = read_plan_json(tables)
    world = None
    if isinstance(tables, Mapping) and "tables" in tables:
        world = tables.get("num_devices")
        tables = tables["tables"]
    if not isinstance(tables, (list, tuple)) or not all(
            isinstance(t, Mapping) and all(k in t for k in ("table_id", "rows", "dim")) for t in tables):
        raise EmbshardError(f"tables= is a {type(tables).__name__} of no tables it can read", field="tables",
                            fix=f"pass {TABLES_ACCEPTED}")
    return ({str(t["table_id"]): (int(t["rows"]), int(t["dim"])) for t in tables}, world,
            {str(t["table_id"]): int(t["bytes_per_element"]) for t in tables if "bytes_per_element" in t})


Mismatch = tuple[str | None, str, str]  # (the table, or None for the whole list; message; fix)


def table_mismatch(placed: Mapping[str, tuple[int, int] | None], held: Mapping[str, tuple[int, int]], held_as: str,
                   fix: str) -> Mismatch | None:
    """The first way the plan's tables ({name: (rows, dim)}, None where its shards do not say) are not exactly
    `held`'s, with their rows and dims. `held_as` names the other side ("the 11 tables given"): each message says
    which side has the table, so that the user knows which one to change."""
    for name, size in placed.items():
        want = held.get(name)
        if want is None:
            return name, f"the plan places table {name}, which is not among {held_as}", fix
        if size is not None and tuple(want) != tuple(size):
            return name, (f"table {name}: the plan's shards hold {size[0]:,} rows x {size[1]} columns, {held_as} "
                          f"have it as {want[0]:,} x {want[1]}"), fix
    lost = [n for n in held if n not in placed]
    if lost:
        return None, (f"{held_as} include {len(lost)} table(s) the plan does not place ({', '.join(lost[:3])}"
                      f"{', ...' if len(lost) > 3 else ''})"), fix + ": every table of the model must be placed"
    return None


def _bytes_mismatch(planned: Mapping[str, int], held: Mapping[str, int], held_as: str) -> Mismatch | None:
    """A table of another data type holds other bytes than the plan balanced (fp16 planned, fp32 trained: twice)."""
    for name, b in planned.items():
        if name in held and b != held[name]:
            return name, (f"table {name} was planned with {b}-byte weights, {held_as} have {held[name]}-byte "
                          "ones"), "plan again for the model's data types (its memory per device differs)"
    return None


def check_plan_doc(doc, where: str = "<torchrec plan>", *, tables=None, world_size: int | None = None,
                   module=None, world_source: str = "the caller") -> None:
    """Refuse a torchrec_plan.json document that a training job must not load: one EmbshardError naming the file
    and the field. Checks the structure, every table's sharding type, kernel, ranks (against its shards'
    placements and the world size) and column slices (from column 0, each column once, all rows), and, when
    known (written in the file, or given as `tables` (TABLES_ACCEPTED) and `world_size`), that exactly the
    expected tables are there with their rows and dims. With `module` (the model DistributedModelParallel will
    shard), each module path of the plan must name an EmbeddingBagCollection of the model holding exactly the
    plan's tables: TorchRec silently leaves a module the plan does not name unsharded (every rank then holds
    every full table)."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    def bad(field: str, message: str, fix: str = _PLAN_FIX) -> EmbshardError:
        return EmbshardError(message, path=where, field=field, fix=fix)

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(doc, Mapping):
        raise bad("schema", f"the plan is a JSON {type(doc).__name__}, not an object")
    if doc.get("schema") != PLAN_JSON_VERSION:
        if str(doc.get("schema", "")).startswith("embshard.plan/"):
            raise bad("schema", f"this is an embshard plan.json ({doc.get('schema')}), not a TorchRec plan",
                      "pass the torchrec_plan.json that `embshard export` wrote beside it")
        raise bad("schema", f"schema {doc.get('schema')!r} is not {PLAN_JSON_VERSION}",
                  "re-export the plan with this embshard version")
    modules = doc.get("modules")
    if not isinstance(modules, Mapping) or not modules:
        raise bad("modules", "no 'modules' object (module path -> table -> sharding)")
    worlds = {}
    if "world_size" in doc:
        if not is_int(doc["world_size"]) or doc["world_size"] < 1:
            raise bad("world_size", f"world size {doc['world_size']!r} is not an integer >= 1")
        worlds["the file"] = int(doc["world_size"])
    expected, given_world, expected_bytes = _expected_tables(tables)
    for who, w in ((world_source, world_size), ("the tables' plan", given_world)):
        if w is not None:
            worlds[who] = int(w)
    if len(set(worlds.values())) > 1:
        # Only the sources that disagree with the file's world are named ("a world of 4 ranks, not 4 (the caller),
        # 2 (the tables' plan)" had read as a contradiction); without one in the file, every source.
        own = worlds.get("the file")
        said = ", ".join(f"{w} ({who})" for who, w in worlds.items() if who != "the file" and w != own)
        raise bad("world_size", f"the plan is for a world of {own} ranks, not {said}" if own is not None
                  else f"the world sizes disagree: {said}", "load the plan exported for this job's number of devices")
    world = next(iter(worlds.values()), None)
    in_file = doc.get("tables")
    if in_file is not None:
        if not isinstance(in_file, Mapping) or not all(
                isinstance(v, Mapping) and is_int(v.get("rows")) and is_int(v.get("dim")) for v in in_file.values()):
            raise bad("tables", "'tables' is not an object of {rows, dim} per table")
        file_bytes = {str(k): v["bytes_per_element"] for k, v in in_file.items() if "bytes_per_element" in v}
        if not all(is_int(b) and b > 0 for b in file_bytes.values()):
            raise bad("tables", "a table's bytes_per_element is not a positive integer")
        in_file = {str(k): (int(v["rows"]), int(v["dim"])) for k, v in in_file.items()}
    seen: set[str] = set()
    placed: dict[str, dict[str, tuple[int, int] | None]] = {}  # module path -> table -> (rows, dim) its shards cover
    kernels = {k.value for k in EmbeddingComputeKernel}
    sharder = EmbeddingBagCollectionSharder()
    for path, params in modules.items():
        if not isinstance(params, Mapping) or not params:
            raise bad(f"modules.{path}", "not an object of tables")
        placed[path] = {}
        for name, p in params.items():
            f = f"modules.{path}.{name}" if path else f"modules.{name}"
            if not isinstance(p, Mapping):
                raise bad(f, "not an object")
            missing = [k for k in ("sharding_type", "compute_kernel", "ranks", "shards") if k not in p]
            if missing:
                raise bad(f"{f}.{missing[0]}", "missing")
            if name in seen:
                raise bad(f, f"table {name} is in more than one module")
            seen.add(name)
            kind = p["sharding_type"]
            if kind not in SHARDING_TYPES:
                raise bad(f"{f}.sharding_type", f"sharding type {str(kind)[:40]!r} is not one of "
                          f"{', '.join(SHARDING_TYPES)}")
            if p["compute_kernel"] not in kernels:
                raise bad(f"{f}.compute_kernel", f"compute kernel {str(p['compute_kernel'])[:40]!r} is not a "
                          f"TorchRec kernel ({FUSED}, ...)")
            allowed = _kernels(sharder, kind, p["shards"])  # TorchRec's own rule for an EBC's sharding type
            if p["compute_kernel"] not in allowed:
                raise bad(f"{f}.compute_kernel", f"a {kind} table cannot run the {p['compute_kernel']!r} kernel "
                          f"(TorchRec's EmbeddingBagCollection runs {', '.join(map(repr, allowed[:3]))}"
                          f"{', ...' if len(allowed) > 3 else ''} for {kind})",
                          f"write {allowed[0]!r} (embshard export writes it)")
            shards, ranks = p["shards"], p["ranks"]
            if not isinstance(ranks, list) or not all(is_int(r) and r >= 0 for r in ranks):
                raise bad(f"{f}.ranks", f"ranks {str(ranks)[:40]} are not a list of ranks")
            beyond = [r for r in ranks if world is not None and r >= world]
            if beyond and world is not None:
                raise bad(f"{f}.ranks", f"rank {beyond[0]} is beyond a world of {world} ranks (ranks 0..{world - 1})",
                          "load the plan exported for this job's number of devices")
            if kind == DATA_PARALLEL:  # a replica on every rank: TorchRec gives it no sharding spec
                # no shards: [] as export writes, or null as TorchRec's own sharding_spec=None reads
                if shards not in ([], None) or ranks != list(range(world if world is not None else len(ranks))) \
                        or not ranks:
                    raise bad(f"{f}.ranks", "a data_parallel table has no shards ([] or null) and every rank in "
                              "ranks")
                size = None
            else:
                size = _check_shards(f, kind, shards, ranks, bad, is_int, world)
            # a replica's shape is the file's (data_parallel has no shards)
            placed[path][name] = size if size is not None else (in_file or {}).get(name)

    def field(path: str | None, name: str | None) -> str:
        if name is None:
            return "modules" if not path else f"modules.{path}"
        path = path if path is not None else next(p for p in placed if name in placed[p])
        return f"modules.{path}.{name}" if path else f"modules.{name}"

    every = {name: size for tables_of in placed.values() for name, size in tables_of.items()}
    for source, held_as in ((in_file, "tables the file lists"), (expected, "tables given")):
        if source is not None and (m := table_mismatch(every, source, f"the {len(source)} {held_as}",
                                                       "load the plan exported for these tables, or plan again "
                                                       "with them")):
            raise bad(field(None, m[0]), m[1], m[2])
    # The data types after the tables themselves: tables given from another list had been told first that one of
    # them was planned with other bytes ("plan again for the model's data types").
    if in_file is not None and (m := _bytes_mismatch(file_bytes, expected_bytes,
                                                     f"the {len(expected or ())} tables given")):
        raise bad(f"tables.{m[0]}.bytes_per_element", m[1], m[2])
    if module is not None:
        _check_module(module, placed, file_bytes if in_file is not None else {}, bad, field)


def _check_module(model, placed: Mapping[str, Mapping[str, tuple[int, int] | None]], planned_bytes: Mapping[str, int],
                  bad, field) -> None:
    """Each module path of the plan names an EmbeddingBagCollection of `model` (as model.named_modules() names it)
    holding exactly the plan's tables of that path, with their rows, dims (and data types, where the file says)."""
    if not callable(getattr(model, "named_modules", None)):
        raise bad("module", f"module= is a {type(model).__name__}, not a torch.nn.Module",
                  "pass the model you give DistributedModelParallel")
    named = dict(model.named_modules())
    ebcs = {p: found for p, m in named.items() if (found := module_tables(m)) is not None}
    for path, tables_of in placed.items():
        homeless = [n for n in tables_of if not any(n in found[0] for found in ebcs.values())]
        if path not in ebcs and homeless:  # route_to_model found no EBC of the model for it
            shown = ", ".join(repr(p) if p else "the model itself" for p in list(ebcs)[:4]) or "none"
            raise bad(field(path, homeless[0]), f"the plan places table {homeless[0]}, which no "
                      f"EmbeddingBagCollection of the model holds (the model's: {shown})",
                      "load the plan exported for this model's tables, or plan again with them")
        if path not in ebcs:
            # the EBC(s) holding the plan's tables, else every EBC: where --module-path should point
            fits = [p for p, found in ebcs.items() if set(found[0]) == set(tables_of)]
            which = "the model's EmbeddingBagCollections holding these tables" if fits else \
                "the model's EmbeddingBagCollections"
            fits = fits or list(ebcs)
            shown = ", ".join(repr(p) if p else "the model itself" for p in fits[:4]) + (", ..." if len(fits) > 4
                                                                                         else "")
            what = (f"module path {path!r} names no module of the model" if path not in named else
                    f"module path {path!r} names a {type(named[path]).__name__}, not an EmbeddingBagCollection")
            fix = ("the model has no EmbeddingBagCollection: pass the model DistributedModelParallel shards"
                   if not fits else
                   f"re-export with `embshard export --module-path {fits[0]}`" if len(fits) == 1 and fits[0] else
                   "re-export without --module-path (the model is the EmbeddingBagCollection)" if len(fits) == 1
                   else f"re-export with --module-path set to one of the model's EmbeddingBagCollections: {shown}")
            raise bad(field(path, None), f"{what} (TorchRec would leave its tables unsharded, every rank holding "
                      f"all of them); {which}: {shown or 'none'}", fix)
        held, held_bytes = ebcs[path]
        held_as = f"the {len(held)} tables of the model's module {path!r}" if path else \
            f"the {len(held)} tables of the model (an EmbeddingBagCollection)"
        m = table_mismatch(tables_of, held, held_as, "load the plan exported for this model's tables, or plan "
                           "again with them") or \
            _bytes_mismatch({n: b for n, b in planned_bytes.items() if n in tables_of}, held_bytes, held_as)
        if m:
            raise bad(field(path, m[0]), m[1], m[2])


def _check_shards(f: str, kind: str, shards, ranks: list[int], bad, is_int, world: int | None) -> tuple[int, int]:
    """The (rows, columns) a table's shards cover, once each: column slices of all rows (table_wise: one),
    or (row_wise, table_row_wise) row ranges of all columns in TorchRec's row blocks on consecutive ranks,
    trailing empty ranges allowed (row_wise: over the `world`'s ranks, when known)."""
    if not isinstance(shards, list) or not shards:
        raise bad(f"{f}.shards", "no shards")
    placed = []
    for k, s in enumerate(shards):
        ok = (isinstance(s, Mapping) and isinstance(s.get("offsets"), list) and isinstance(s.get("sizes"), list)
              and len(s["offsets"]) == 2 and len(s["sizes"]) == 2
              and all(is_int(v) and v >= 0 for v in s["offsets"] + s["sizes"]))
        m = _PLACEMENT.match(str(s.get("placement", ""))) if isinstance(s, Mapping) else None
        if not ok or m is None:
            raise bad(f"{f}.shards[{k}]", "not {offsets: [row, col], sizes: [rows, cols], placement: "
                      "'rank:R/cuda:N'}")
        placed.append((*(int(v) for v in s["offsets"]), *(int(v) for v in s["sizes"]), int(m.group(1))))
    if ranks != [r for *_, r in placed]:
        raise bad(f"{f}.ranks", f"ranks {str(ranks)[:40]} disagree with the shards' placements "
                  f"{[r for *_, r in placed][:8]}")
    if kind == TABLE_WISE and len(shards) != 1:
        raise bad(f"{f}.shards", f"a table_wise table with {len(shards)} shards")
    by_rows = kind in (ROW_WISE, TABLE_ROW_WISE)
    # (offset along the split, size along it, size across it, offset across it) of each shard
    spans = [(ro, rs, cs, co) if by_rows else (co, cs, rs, ro) for ro, co, rs, cs, _ in placed]
    across = {(size, off) for _, _, size, off in spans}
    if len(across) != 1 or across.pop()[1] != 0:
        raise bad(f"{f}.shards", f"{kind} shards must each hold all {'columns' if by_rows else 'rows'}",
                  "split a table by rows (row_wise, table_row_wise) or by columns, not both")
    if any(size == 0 for _, size, _, _ in spans) and not by_rows:
        raise bad(f"{f}.shards", "an empty column slice")
    odd = sorted({cs for _, _, _, cs, _ in placed if cs % DIM_MULTIPLE}) if kind != TABLE_WISE and not by_rows else []
    if odd:  # FBGEMM's kernels take widths of multiples of 4: DMP would fail later, inside the job
        raise bad(f"{f}.shards", f"column slices of {odd[0]} columns (slices must be multiples of {DIM_MULTIPLE} "
                  "columns)", f"cut the table into slices of multiples of {DIM_MULTIPLE} columns; re-plan with "
                  "embshard place")
    if not by_rows and (mixed := unequal_widths_on_a_rank([(r, cs) for _, _, _, cs, r in placed])) is not None:
        raise bad(f"{f}.shards", f"rank {mixed[0]} holds column slices of widths {mixed[1]}, which TorchRec cannot "
                  "run (a rank's slices of one table must be one width)",
                  "give that rank one slice of the table (or slices of one width), or re-plan with embshard place")
    nxt = 0
    for off, size, _, _ in sorted(spans, key=lambda x: (x[0], x[1] == 0)):
        if off != nxt:
            raise bad(f"{f}.shards", f"the shards do not cover the {'rows' if by_rows else 'columns'} once (one "
                      f"starts at {off}, expected {nxt})")
        nxt += size
    if by_rows:
        _check_row_blocks(f, kind, placed, nxt, bad, world)
    return (nxt, spans[0][2]) if by_rows else (spans[0][2], nxt)


def _check_row_blocks(f: str, kind: str, placed, rows: int, bad, world: int | None) -> None:
    """TorchRec routes a row-wise table's ids to ranks by blocks of ceil(rows / ranks) rows (torchrec_row_blocks),
    so other row ranges would send ids to ranks that do not hold their rows: the shards must be those blocks, in
    rank order on consecutive ranks (row_wise: ranks 0..world-1; table_row_wise: one host's ranks): the layout
    export writes (torchrec_compat.row_layout, over the table's n ranks counted from its first)."""
    n = len(placed)
    by_offset = sorted(placed, key=lambda p: (p[2] == 0, p[0]))  # (row_off, col_off, rows, cols, rank)
    spans = [(ro, rs) for ro, _, rs, _, _ in by_offset if rs > 0]
    ranks = [r for *_, r in by_offset]
    first = 0 if kind == ROW_WISE else ranks[0]
    blocks = row_layout(rows, [(ro, rs, r - first) for ro, _, rs, _, r in by_offset if rs > 0], n)
    if blocks != (ROW_WISE, None) or ranks != list(range(first, first + n)) or (kind == TABLE_ROW_WISE and first % n):
        shown = f"{[(o, o + s) for o, s in spans][:3]}{'...' if len(spans) > 3 else ''}"
        raise bad(f"{f}.shards", f"{kind} row ranges {shown}"
                  f" on ranks {ranks[:4]}{'...' if n > 4 else ''} are not TorchRec's blocks of {-(-rows // n):,} rows "
                  f"on consecutive ranks{' from 0' if kind == ROW_WISE else ' of one host'}, so ids would reach ranks "
                  "without their rows", "re-export the plan with embshard export (it writes TorchRec's layout)")
    if kind == ROW_WISE and world is not None and n != world:
        raise bad(f"{f}.shards", f"a row_wise table on {n} of {world} ranks (TorchRec splits it over every rank)",
                  "shard it table_row_wise over one host, or over all ranks; re-export with embshard export")


def plan_from_json(data: Mapping | str | os.PathLike, *, tables=None, world_size: int | None = None, module=None,
                   where: str | None = None, local_world_size: int | None = None, rename_gpus: bool = True):
    """Rebuild the torchrec ShardingPlan from `plan_to_json` output (a dict, or a path to the JSON file).
    `where` names a dict in errors (e.g. the file rank 0 read it from before broadcasting it).

    The plan is checked first (`check_plan_doc`): a training job gets one EmbshardError naming the file and the
    field, before it builds a process group, instead of a wrong or failing sharding. Give `tables`
    (TABLES_ACCEPTED), `world_size` and `module` (the model DistributedModelParallel shards: each module path of
    the plan must be an EmbeddingBagCollection in it holding the plan's tables) to check the plan against them too.
    With `module`, each table goes to the model's EBC that holds it (route_to_model: a model with a weighted EBC
    beside an unweighted one loads one plan). Without `world_size`, an initialized process group's is checked,
    else the launcher's WORLD_SIZE (torchrun sets it before the script builds its group).
    A plan on CUDA devices is refused in a job (a process group) without CUDA: export CPU jobs' plans with
    `--compute-device cpu`. A plan that cuts a table table-row-wise (over one host's ranks) is checked against the
    job's ranks per host: `local_world_size` when given, else, in a job, TorchRec's own `get_local_size`; with
    ranks per host given, or set by the job's launcher (LOCAL_WORLD_SIZE, MPI's), each rank's GPU is named as
    TorchRec names it there (gpus_on_hosts: a plan exported without hosts loads on a job of several);
    `rename_gpus=False` keeps the names as written (a reader that uses the ranks only, e.g. `evaluate --plan`).
    """
    require_torchrec()
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    doc: Mapping
    if isinstance(data, (str, os.PathLike)):

        where = data = os.fspath(data)
        doc = _read_plan_file(where)
    else:
        where, doc = where or "<torchrec plan>", data
    world_source = "world_size="
    if world_size is None:
        world_size, world_source = _job_world_size(), "this job's process group"
    if world_size is None:  # before init_process_group: the world its launcher set (torchrun's WORLD_SIZE)
        world_size, world_source = _launcher_world_size()
    if module is not None and isinstance(doc, Mapping):
        doc = route_to_model(doc, module)
    check_plan_doc(doc, where, tables=tables, world_size=world_size, module=module, world_source=world_source)
    _check_compute_device(doc, where)
    job_local = _check_host_size(doc, where, local_world_size, world_size)
    # GPUs are named again only for ranks per host that are known: given, or set in the job's environment (torchrun,
    # MPI). TorchRec's own fallback (8, or the world) is a guess: a plan for hosts of 4 loaded by a job that sets
    # none (srun, mp.spawn) would be renamed to GPUs its hosts lack.
    if rename_gpus and job_local is not None and (local_world_size is not None or _local_size_in_env()):
        doc = gpus_on_hosts(doc, job_local, where)
    plan = {}
    for path, params in doc["modules"].items():
        module_plan = EmbeddingModuleShardingPlan()
        for name, p in params.items():
            spec = EnumerableShardingSpec([ShardMetadata(shard_offsets=s["offsets"], shard_sizes=s["sizes"],
                                                         placement=s["placement"]) for s in p["shards"]]) \
                if p["sharding_type"] != DATA_PARALLEL else None
            module_plan[name] = ParameterSharding(sharding_type=p["sharding_type"],
                                                  compute_kernel=p["compute_kernel"], ranks=p["ranks"],
                                                  sharding_spec=spec)
        plan[path] = module_plan
    return ShardingPlan(plan)


def _read_plan_file(path: str):
    """The JSON of a torchrec_plan.json, or one line that says what the file is when it is not one: a missing
    file and the pickled `torchrec_plan.pt` had been told to re-export "(this file was edited or made for other
    tables/devices)"."""
    from ..checks import read_json_file

    export_fix = "give the torchrec_plan.json that `embshard export` wrote (OUT/TASK/torchrec_plan.json)"
    try:
        return read_json_file(path, field="json", fix=_PLAN_FIX)
    except EmbshardError as exc:
        if exc.message == "file not found":
            raise EmbshardError(exc.message, path=path, field="json", fix=export_fix) from None
        if "not UTF-8" in exc.message and is_pickled(path):
            raise pickled_plan_error(path, "json") from None
        raise


def is_pickled(path: str) -> bool:
    """Whether the file starts as torch.save's zip or a bare pickle does (a torchrec_plan.pt)."""
    try:
        from .. import storage

        head = storage.read_head(path, 4)
    except OSError:
        return False
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def pickled_plan_error(path: str, field: str) -> EmbshardError:
    """The one line for a pickled TorchRec plan given where its JSON is read."""
    return EmbshardError("a pickled TorchRec plan (torch.save), not its JSON", path=path, field=field,
                         fix="pass the torchrec_plan.json beside it (embshard export writes both; a plan of TorchRec's "
                             "own planner: embshard.export.torchrec_plan.plan_to_json(plan, world_size=W)), or load "
                             "this one with torch.load(path, weights_only=False), only from a source you trust")


def _kernels(sharder, sharding_type: str, shards) -> list[str]:
    """The compute kernels TorchRec's EBC sharder runs for `sharding_type` on the device the shards name (CPU
    ranks: `rank:R/cpu`; a data_parallel table names none: CUDA's list); CUDA's list for a type it does not list
    for the CPU (row-wise plans run on CPU ranks with the fused kernel)."""
    on_cpu = bool(shards) and all(str(s.get("placement", "")).endswith("/cpu") for s in shards
                                  if isinstance(s, Mapping))
    if on_cpu and sharding_type in sharder.sharding_types("cpu"):
        return list(sharder.compute_kernels(sharding_type, "cpu"))
    return list(sharder.compute_kernels(sharding_type, "cuda"))


def table_row_wise_host(doc: Mapping) -> tuple[str | None, int | None]:
    """(a table cut table-row-wise, its ranks: the plan's ranks per host), or (None, None) when none is."""
    return next(((n, len(p["ranks"])) for params in doc["modules"].values() for n, p in params.items()
                 if p["sharding_type"] == TABLE_ROW_WISE), (None, None))


# What TorchRec's get_local_size reads, in its order (torchrec.distributed.comm).
_LOCAL_SIZE_ENV = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def _local_size_in_env() -> bool:
    """Whether the job's environment says its ranks per host (a launcher set one of TorchRec's variables)."""
    return any(os.environ.get(k, "").strip().isdigit() and int(os.environ[k]) > 0 for k in _LOCAL_SIZE_ENV)


def _check_host_size(doc: Mapping, where: str, local_world_size: int | None,
                     world_size: int | None = None) -> int | None:
    """A table_row_wise table's ranks are one host of the plan (check_plan_doc: consecutive, from a multiple of
    their count), so the plan's ranks per host are their count. TorchRec groups a job's ranks into hosts of
    `get_local_size`: LOCAL_WORLD_SIZE (or MPI's local size), 8 when none is set, the world when that does not
    divide it. Other hosts fail deep inside DistributedModelParallel (an IndexError in its table-row-wise
    sharding, or "Number of local shards (0) does not match"). Checked against `local_world_size` when given, else
    inside a job against what TorchRec will use: a job has a process group, or its launcher set the ranks per host
    (torchrun's LOCAL_WORLD_SIZE: a script that loads its plan before init_process_group); outside a job (reading
    or evaluating a plan) there is nothing to compare with. Returns the ranks per host it checked against (None:
    none known)."""
    name, plan_local = table_row_wise_host(doc)
    source = "local_world_size"
    if local_world_size is None:
        world = _job_world_size()
        if world is None and world_size is not None and _local_size_in_env():
            world = int(world_size)  # the launcher's job, before its process group: TorchRec reads the same
        if world is None:
            return None
        from torchrec.distributed.comm import get_local_size

        local_world_size = int(get_local_size(world))
        set_to = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        source = (f"TorchRec's ranks per host from LOCAL_WORLD_SIZE={set_to}" if set_to else
                  "TorchRec's ranks per host: LOCAL_WORLD_SIZE is not set")
    if int(local_world_size) < 1:
        raise EmbshardError(f"local_world_size {local_world_size}: no ranks per host", path=where,
                            field="local_world_size", fix="give the job's ranks per host (at least 1)")
    if world_size is not None and int(world_size) % int(local_world_size):
        raise EmbshardError(f"{int(world_size)} ranks do not split into hosts of {int(local_world_size)}",
                            path=where, field="local_world_size",
                            fix="give the job's ranks per host, a divisor of its world size")
    if plan_local is not None and int(local_world_size) != plan_local:
        raise EmbshardError(
            f"table {name} is cut table-row-wise over hosts of {plan_local} ranks, but this job's hosts hold "
            f"{int(local_world_size)} ({source})", path=where, field="local_world_size",
            fix=f"run the job with {plan_local} ranks per host (LOCAL_WORLD_SIZE={plan_local}; torchrun "
                f"--nproc-per-node {plan_local}), or plan and export again with --devices-per-host "
                f"{int(local_world_size)}")
    return int(local_world_size)


def gpus_on_hosts(doc: Mapping, local: int, where: str) -> Mapping:
    """`doc` with every shard's GPU named as TorchRec names it on hosts of `local` ranks: rank R's GPU is
    cuda:{R % local} (torchrec.distributed.sharding_plan.placement). Which rank holds what is the plan's; the GPU
    index is the job's: a plan exported without hosts names rank 10's GPU cuda:10, which a job on hosts of 8
    runs as cuda:2, and DistributedModelParallel fails on the mismatch deep inside ("Local shard tensor device
    does not match"). So the names follow the job, with a warning when they change. Table-row-wise plans were
    checked against the job's hosts before (_check_host_size): for them nothing changes. `doc` itself when no name
    does."""
    from torchrec.distributed.sharding_plan import placement  # TorchRec's own naming, as the export uses it

    def named(shard: Mapping) -> str:
        m = _GPU_PLACEMENT.match(str(shard["placement"]))
        return shard["placement"] if m is None else placement(m.group(2), int(m.group(1)), int(local))

    changed = [(s["placement"], named(s)) for params in doc["modules"].values() for p in params.values()
               for s in p.get("shards") or () if named(s) != s["placement"]]
    if not changed:
        return doc
    log.warning("%s names its ranks' GPUs for other hosts than this job's %d ranks per host: renamed as TorchRec "
                "names them (rank R on cuda:R %% %d, e.g. %s -> %s); which rank holds what is unchanged", where,
                int(local), int(local), *changed[0])
    return {**doc, "modules": {path: {name: {**p, "shards": [{**s, "placement": named(s)} for s in p["shards"]]}
                                      if p.get("shards") else p for name, p in params.items()}
                               for path, params in doc["modules"].items()}}


def _launcher_world_size() -> tuple[int | None, str]:
    """(the world size a job's launcher set in the environment, where it came from), or (None, "") when none is
    set: a script that loads its plan before init_process_group (torchrun) had a 2-device plan run on 4 ranks, 2
    of them idle, without a word, and an 8-device plan on 4 ranks fail with an IndexError inside TorchRec.
    WORLD_SIZE alone, what init_process_group's env:// reads (torchrun sets it): MPI's and Slurm's task counts
    are not the world where one task per host spawns the ranks."""
    value = os.environ.get("WORLD_SIZE", "").strip()
    if value.isdigit() and int(value) >= 1:
        return int(value), f"the launcher's WORLD_SIZE={value}"
    return None, ""


def _job_world_size() -> int | None:
    """The world size of this process's default process group (a training job's), None when there is none: a
    plan for another world size fails inside TorchRec (an IndexError in its sharding) instead of here."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def _check_compute_device(doc: Mapping, where: str) -> None:
    """A plan whose shards live on CUDA devices cannot be loaded by a training job without CUDA (a CPU gloo job:
    a process group, no CUDA device): TorchRec would fail deep inside DistributedModelParallel ('Local shard tensor
    device does not match'). Outside a job (no process group: reading a GPU job's plan on a laptop) it loads."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() or not (dist.is_available() and dist.is_initialized()):
        return
    for path, params in doc["modules"].items():
        for name, p in params.items():
            on_cuda = [s["placement"] for s in p["shards"] or [] if "/cuda" in str(s["placement"])]
            if on_cuda:
                f = f"modules.{path}.{name}" if path else f"modules.{name}"
                raise EmbshardError(f"the plan puts table {name} on {on_cuda[0]}, and this process has no CUDA "
                                    "device", path=where, field=f"{f}.shards",
                                    fix="for a CPU job, export with `embshard export --compute-device cpu` "
                                        "(to_torchrec_plan(..., compute_device='cpu'))")


def route_to_model(doc: Mapping, model) -> Mapping:
    """`doc` with each table under the module path of the EmbeddingBagCollection of `model` that holds it, where
    the plan's own path does not: one plan for a model of several EBCs (TorchRec's `is_weighted` is per EBC, so
    weighted features sit in an EBC of their own), whatever `--module-path` it was exported with. Tables that no
    EBC, or more than one, holds stay where they are (check_plan_doc names them); `doc` itself when nothing moves."""
    modules = doc.get("modules")
    if not isinstance(modules, Mapping) or not callable(getattr(model, "named_modules", None)):
        return doc
    held: dict[str, list[str]] = {}  # table -> the model's EBC paths holding it
    for p, m in model.named_modules():
        if (found := module_tables(m)) is not None:
            for name in found[0]:
                held.setdefault(name, []).append(p)
    routed: dict[str, dict] = {}
    moved = False
    for path, params in modules.items():
        if not isinstance(params, Mapping):
            return doc
        for name, p in params.items():
            homes = held.get(str(name), [])
            to = homes[0] if len(homes) == 1 and path not in homes else path
            if name in routed.get(to, {}):
                return doc  # a table listed under two modules: check_plan_doc refuses the file as it is
            moved |= to != path
            routed.setdefault(to, {})[name] = p
    return {**doc, "modules": routed} if moved else doc


def rank_layout(sharding_plan, module_path: str = "") -> dict[str, list[tuple[int, int, int]]]:
    """{table: [(col_offset, col_size, rank), ...]} of a ShardingPlan, sorted by offset (for comparisons)."""
    out = {}
    for name, ps in sharding_plan.plan[module_path].items():
        shards = ps.sharding_spec.shards if ps.sharding_spec is not None else []  # data_parallel: no spec
        out[name] = sorted((int(m.shard_offsets[1]), int(m.shard_sizes[1]), int(m.placement.rank()))
                           for m in shards if int(m.shard_sizes[0]) > 0)
    return out


def plan_layout(plan_or_placement) -> dict[str, list[tuple[int, int, int]]]:
    """The same layout from our side (plan.json dict or Placement)."""
    plan = _as_plan(plan_or_placement)
    # A replica is no shard in TorchRec's sharding spec (data_parallel has none), so it lists no pieces here.
    return {t["table_id"]: sorted((int(s["col_offset"]), int(s["col_size"]), int(s["device"])) for s in t["shards"]
                                  if s.get("kind") != "replicated") for t in plan["tables"]}


__all__ = ["require_torchrec", "build_module", "to_torchrec_plan", "torchrec_constraints", "fixed_rank_partitioner",
           "torchrec_planner_for", "placement_from_sharding_plan", "plan_to_json", "plan_from_json", "topology",
           "rank_layout", "plan_layout", "INSTALL_FIX"]
