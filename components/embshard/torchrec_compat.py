"""TorchRec's vocabulary in our terms, shared by the export (export.torchrec_plan) and the TorchRec planner
(planners.torchrec_planner), so that neither imports the other: importing torchrec (an optional extra), a
meta-device EmbeddingBagCollection of our tables, a Topology of our devices, TorchRec's estimators under our
memory accounting, and a TorchRec ShardingPlan read back as our Placement.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .errors import EmbshardError, first_line
from .placement import Placement, Shard
from .tableset import TableSet

INSTALL_FIX = "pip install 'embshard[torchrec]' && pip install --no-deps torchrec==1.8.0"
FUSED = "fused"  # TorchRec's FBGEMM TBE kernel with the weights in HBM (what our memory model counts)
TABLE_WISE, COLUMN_WISE, TABLE_COLUMN_WISE = "table_wise", "column_wise", "table_column_wise"
ROW_WISE, TABLE_ROW_WISE, DATA_PARALLEL = "row_wise", "table_row_wise", "data_parallel"
SHARDING_TYPES = (TABLE_WISE, COLUMN_WISE, TABLE_COLUMN_WISE, ROW_WISE, TABLE_ROW_WISE, DATA_PARALLEL)
# Our shard kind -> the TorchRec sharding type it is written as (row pieces: row_wise or table_row_wise).
KIND_TO_SHARDING = {"whole": TABLE_WISE, "column": COLUMN_WISE, "row": ROW_WISE, "replicated": DATA_PARALLEL}


def torchrec_hosts(num_devices: int, hosts) -> int | None:
    """Devices per host in TorchRec's rank order (host h holds ranks h*L .. h*L+L-1), or None when `hosts`
    (the host of each device; None = one host) is not laid out that way: TorchRec cannot run it."""
    if hosts is None:
        return int(num_devices)
    hosts = list(hosts)
    first = hosts[0]
    local = hosts.count(first)
    if num_devices % local or hosts != [hosts[d - d % local] for d in range(num_devices)] \
            or len({hosts[h * local] for h in range(num_devices // local)}) != num_devices // local:
        return None
    return local


def row_layout(rows: int, pieces, num_devices: int, hosts=None) -> tuple[str, int | None] | None:
    """(sharding type, host index) of a table's row pieces [(row_offset, row_size, device), ...] when TorchRec
    1.8 can run them: row_wise = its row blocks over all devices on ranks 0, 1, ... in order (host None);
    table_row_wise = its row blocks over the devices of one host h, in rank order (host h). Else None.
    A table of fewer rows than devices leaves the last ranks empty, as TorchRec's own planner does."""
    ordered = sorted((int(o), int(s), int(d)) for o, s, d in pieces)
    spans, devs = [(o, s) for o, s, _ in ordered], [d for *_, d in ordered]
    if spans == torchrec_row_blocks(rows, num_devices) and devs == list(range(len(spans))):
        return ROW_WISE, None
    local = torchrec_hosts(num_devices, hosts)
    if local is None or spans != torchrec_row_blocks(rows, local):
        return None
    host = devs[0] // local
    if devs != list(range(host * local, host * local + len(spans))):
        return None
    return TABLE_ROW_WISE, host


def torchrec_row_blocks(rows: int, parts: int) -> list[tuple[int, int]]:
    """The non-empty row ranges (offset, size) TorchRec 1.8 gives `parts` ranks of a `rows`-row table: blocks of
    ceil(rows / parts) rows, the last the rest, ranks past the rows empty (types.row_blocks where rows >= parts,
    the layout our planners cut)."""
    block = -(-int(rows) // max(int(parts), 1))
    return [(o, min(block, rows - o)) for o in range(0, int(rows), block)] if rows > 0 else []


def require_torchrec():
    """Import torchrec or raise a one-line EmbshardError that says how to install it."""
    from .imports import root_logging_kept

    try:
        with root_logging_kept():  # fbgemm_gpu's import-time logging.info configures the root logger
            import torchrec  # noqa: F401
            from torchrec.distributed.planner import EmbeddingShardingPlanner  # noqa: F401
    except (ImportError, OSError) as exc:
        raise EmbshardError(f"torchrec is not available ({first_line(exc, 80)})",
                            field="torchrec", fix=INSTALL_FIX) from None
    quiet_torchrec()
    return torchrec


def quiet_torchrec() -> None:
    """TorchRec logs every planner step at INFO/WARNING (and warns that Topology should come from its
    factory); keep our output readable."""
    for name in ("torchrec", "torchrec.distributed", "torchrec.distributed.planner",
                 "torchrec.distributed.planner.types"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:  # a level the caller set is theirs (a notebook's INFO had become ERROR)
            logger.setLevel(logging.ERROR)


def check_names(table_ids) -> None:
    """TorchRec keys tables by name in an nn.ModuleDict: names must be non-empty, free of '.', and not one of the
    dict's own attributes ('items', 'keys', 'type', 'to', ...: ModuleDict refuses them as keys)."""
    reserved = MODULE_DICT_ATTRIBUTES
    bad = [t for t in table_ids if not t or "." in t or t in reserved]
    if bad:
        shown = bad[:6]  # the list and the attributes named among them agree (a 'type' had been named only after)
        taken = [t for t in shown if t in reserved]
        names = ", ".join(repr(t) for t in taken)
        why = "" if not taken else (f" ({names} is an nn.ModuleDict attribute)" if len(taken) == 1
                                    else f" ({names} are nn.ModuleDict attributes)")
        more = f" and {len(bad) - len(shown)} more" if len(bad) > len(shown) else ""
        raise EmbshardError(f"table ids {shown}{more} cannot name TorchRec tables{why}", field="table_id",
                            fix="rename those tables: ids without '.' that are not nn.ModuleDict attributes (they "
                                "become its keys), e.g. with a prefix ('t_items')")


def unnamable_warning(table_ids) -> str | None:
    """Table ids TorchRec cannot take (check_names) ingest and plan fine but fail at export: one warning line for
    the commands before it (ingest, place), None when every id is fine."""
    try:
        check_names([str(t) for t in table_ids])
    except EmbshardError as exc:
        return f"{exc.message}: plans of these tables cannot be exported to TorchRec (fix: {exc.fix})"
    return None


def warn_if_unnamable(table_ids, log: logging.Logger) -> None:
    """unnamable_warning's line, logged."""
    line = unnamable_warning(table_ids)
    if line:
        log.warning(line)


# The names nn.ModuleDict refuses as keys: its attributes (dir() of an instance, torch 2.13; a test compares them
# with the installed torch), kept here so that `place` with a heuristic warns without importing torch.
MODULE_DICT_ATTRIBUTES = frozenset((
    "T_destination", "__annotations__", "__call__", "__class__", "__contains__", "__delattr__", "__delitem__",
    "__dict__", "__dir__", "__doc__", "__eq__", "__format__", "__ge__", "__getattr__", "__getattribute__",
    "__getitem__", "__getstate__", "__gt__", "__hash__", "__init__", "__init_subclass__", "__iter__", "__le__",
    "__len__", "__lt__", "__module__", "__ne__", "__new__", "__reduce__", "__reduce_ex__", "__repr__", "__setattr__",
    "__setitem__", "__setstate__", "__sizeof__", "__str__", "__subclasshook__", "__weakref__", "_apply",
    "_backward_hooks", "_backward_pre_hooks", "_buffers", "_call_impl", "_compiled_call_impl", "_forward_hooks",
    "_forward_hooks_always_called", "_forward_hooks_with_kwargs", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_get_backward_hooks", "_get_backward_pre_hooks", "_get_name",
    "_is_full_backward_hook", "_load_from_state_dict", "_load_state_dict_post_hooks", "_load_state_dict_pre_hooks",
    "_maybe_warn_non_full_backward_hook", "_modules", "_named_members", "_non_persistent_buffers_set", "_parameters",
    "_register_load_state_dict_pre_hook", "_register_state_dict_hook", "_replicate_for_data_parallel",
    "_save_to_state_dict", "_slow_forward", "_state_dict_hooks", "_state_dict_pre_hooks", "_version",
    "_wrapped_call_impl", "add_module", "apply", "bfloat16", "buffers", "call_super_init", "children", "clear",
    "compile", "cpu", "cuda", "double", "dump_patches", "eval", "extra_repr", "float", "forward", "get_buffer",
    "get_extra_state", "get_parameter", "get_submodule", "half", "ipu", "items", "keys", "load_state_dict",
    "modules", "mtia", "named_buffers", "named_children", "named_modules", "named_parameters", "parameters", "pop",
    "register_backward_hook", "register_buffer", "register_forward_hook", "register_forward_pre_hook",
    "register_full_backward_hook", "register_full_backward_pre_hook", "register_load_state_dict_post_hook",
    "register_load_state_dict_pre_hook", "register_module", "register_parameter", "register_state_dict_post_hook",
    "register_state_dict_pre_hook", "requires_grad_", "set_extra_state", "set_submodule", "share_memory",
    "state_dict", "to", "to_empty", "train", "training", "type", "update", "values", "xpu", "zero_grad",
))


# Bytes per weight of the TorchRec DataTypes (by name) it trains: both ways between a table's bytes_per_element
# and a config's data_type.
TRAINED_BYTES = {"FP32": 4, "FP16": 2}


def data_type(bytes_per_element: int):
    from torchrec import DataType

    for name, size in TRAINED_BYTES.items():
        if int(bytes_per_element) == size:
            return DataType[name]
    raise EmbshardError(f"{bytes_per_element}-byte weights have no TorchRec training data type",
                        field="bytes_per_element", fix="TorchRec trains fp32 (4) or fp16 (2) tables")


def build_module(tables: list[Mapping[str, Any]] | TableSet, names: list[str] | None = None,
                 device: str = "meta"):
    """An EmbeddingBagCollection with one table per entry (rows, dim, bytes_per_element), on `device`.

    `tables` is a TableSet or the `tables` list of a plan.json; `names` default to the table ids.
    """
    require_torchrec()
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    specs = _table_specs(tables)
    names = names if names is not None else [s["table_id"] for s in specs]
    check_names(names)
    configs = [EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], num_embeddings=int(s["rows"]),
                                  embedding_dim=int(s["dim"]), data_type=data_type(s["bytes_per_element"]))
               for n, s in zip(names, specs)]
    return EmbeddingBagCollection(tables=configs, device=torch.device(device))


def _table_specs(tables) -> list[dict]:
    if isinstance(tables, TableSet):
        return [{"table_id": str(t), "rows": int(r), "dim": int(d), "bytes_per_element": int(b),
                 "pooling_factor": float(p)}
                for t, r, d, b, p in zip(tables.table_ids, tables.rows, tables.dims, tables.bytes_per_element,
                                         tables.pooling_factor)]
    return [dict(t) for t in tables]


def topology(num_devices: int, memory_bytes_per_device: int, local_world_size: int | None = None,
             compute_device: str = "cuda"):
    """TorchRec Topology of D devices with our memory per device as HBM capacity."""
    require_torchrec()
    from torchrec.distributed.planner import Topology

    return Topology(world_size=int(num_devices), local_world_size=int(local_world_size or num_devices),
                    compute_device=compute_device, hbm_cap=int(memory_bytes_per_device))


def storage_estimators(topo, constraints, memory_model: str = "tables"):
    """TorchRec's perf + storage estimators. memory_model 'tables' counts weights only (= our accounting);
    'torchrec' is TorchRec's training estimate (weights + optimizer state + input/output buffers)."""
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator

    if memory_model not in ("tables", "torchrec"):
        raise EmbshardError(f"unknown memory model {memory_model!r}", field="memory_model",
                            fix="use 'tables' or 'torchrec'")
    # is_inference=True drops optimizer state and the IO buffers from the storage estimate: weights only.
    storage = EmbeddingStorageEstimator(topology=topo, constraints=constraints,
                                        is_inference=memory_model == "tables")
    return [EmbeddingPerfEstimator(topology=topo, constraints=constraints), storage]


def placement_from_sharding_plan(sharding_plan, tables: TableSet, num_devices: int, memory_bytes_per_device: int,
                                 names: list[str] | None = None, module_path: str = "", **kw) -> Placement:
    """Our Placement from a torchrec ShardingPlan over an EBC of `tables` (named `names`, default table ids).

    Column slices of one table on the same rank that touch are merged; a table whose slices all sit on one
    rank becomes a whole-table shard. Row-wise and table-row-wise shards become row pieces (TorchRec's empty
    trailing row blocks are dropped; all rows on one rank, as on a world of 1: the table whole), data_parallel a
    replica on every device (the table whole on one device). Anything else (grid shards, a
    shard split by rows and columns) cannot be expressed and raises one error naming the table.
    """
    names = names if names is not None else [str(t) for t in tables.table_ids]
    module_plan = sharding_plan.plan.get(module_path)
    if module_plan is None:
        raise EmbshardError(f"no module {module_path!r} in the TorchRec plan ({list(sharding_plan.plan)})",
                            field="module_path", fix="give the path of the EmbeddingBagCollection")
    fix = f"allow only the sharding types {', '.join(SHARDING_TYPES)}"
    shards: list[Shard] = []
    for i, name in enumerate(names):
        ps = module_plan.get(name)
        if ps is None:
            raise EmbshardError(f"table {name} is missing from the TorchRec plan", field="table_id")
        rows, dim = int(tables.rows[i]), int(tables.dims[i])
        if ps.sharding_type == DATA_PARALLEL:
            if num_devices > 1:
                shards.extend(Shard(i, d, kind="replicated") for d in range(int(num_devices)))
            else:
                shards.append(Shard(i, 0))  # a copy on the one device: the table, whole
            continue
        if ps.sharding_type not in SHARDING_TYPES or ps.sharding_spec is None:
            raise EmbshardError(f"table {name} is sharded {ps.sharding_type}, which a placement cannot express",
                                field="sharding_type", fix=fix)
        by_rows = ps.sharding_type in (ROW_WISE, TABLE_ROW_WISE)
        pieces = []
        for meta in ps.sharding_spec.shards:
            row_off, col_off = (int(x) for x in meta.shard_offsets)
            n_rows, n_cols = (int(x) for x in meta.shard_sizes)
            if by_rows and n_rows == 0:
                continue  # TorchRec gives ranks past the last row block an empty shard
            if (col_off, n_cols) != (0, dim) if by_rows else (row_off, n_rows) != (0, rows):
                raise EmbshardError(f"table {name} ({ps.sharding_type}) has a shard at rows {row_off}+{n_rows}, "
                                    f"columns {col_off}+{n_cols}: split by rows and columns at once",
                                    field="shard_offsets", fix=fix)
            pieces.append((row_off, n_rows, int(meta.placement.rank())) if by_rows
                          else (col_off, n_cols, int(meta.placement.rank())))
        if by_rows and len(pieces) == 1 and pieces[0][:2] == (0, rows):
            shards.append(Shard(i, pieces[0][2]))  # every row on one rank (e.g. a world of 1): the table, whole
        elif by_rows:
            shards.extend(Shard(i, rank, row_offset=off, row_size=n) for off, n, rank in sorted(pieces))
        else:
            shards.extend(_merge_slices(i, sorted(pieces), dim))
    return Placement(tables, int(num_devices), int(memory_bytes_per_device), shards, **kw)


def _merge_slices(table: int, pieces: list[tuple[int, int, int]], dim: int) -> list[Shard]:
    merged: list[list[int]] = []
    for off, size, rank in pieces:
        if merged and merged[-1][2] == rank and merged[-1][0] + merged[-1][1] == off:
            merged[-1][1] += size
        else:
            merged.append([off, size, rank])
    if len(merged) == 1 and merged[0][0] == 0 and merged[0][1] == dim:
        return [Shard(table, merged[0][2])]
    return [Shard(table, rank, off, size) for off, size, rank in merged]
