"""`plan.json`: one placement, as a documented and versioned JSON file (schema "embshard.plan/v3").

The JSON Schema ships beside this module (`plan.schema.json`); `write_plan_json` validates before writing and
`read_plan_json` validates after reading, both with the schema and with the consistency checks below.

Fields (all required unless marked; `null` where unknown):
- `schema`: "embshard.plan/v3". A reader also reads v2 files (whole tables and column slices only: no kind,
  row range or sharding type, which are then derived) and v1 files (which also name the balanced estimate
  `lower_bound_ms`), and refuses other versions. Adding optional keys inside `meta` keeps the version; any other
  change bumps it.
- `task_id`: the placement task (tasks.parquet `task_id`).
- `num_devices`: D, the number of devices (ranks) 0..D-1.
- `memory_bytes_per_device`: memory budget of each device in bytes (weights only, as embshard counts it).
- `hosts` (v3, optional): D host indices, the host of each device; absent when all devices share one host.
- `planner`: the planner that made the placement (e.g. "learned", "size_greedy", "torchrec_full").
- `model_uri`: MLflow URI of the model behind a learned planner (e.g. "models:/embshard-policy/3"), else null.
- `created_at`: ISO-8601 UTC time the plan was made. `embshard_version`: the code that made it (an export of a
  plan.json keeps both, as it keeps its `meta`).
- `cost`: predicted costs, `unit` "ms" per training iteration:
  - `device_costs_ms`: D numbers, predicted cost of each device (by the cost model), or null.
  - `overall_ms`: the placement's cost = the largest device cost, or null.
  - `balanced_estimate_ms`: the predicted cost of a perfectly balanced placement of this task (docs/method.md,
    "Balanced estimate"), or null. An estimate, not a bound: measured plans can cost less (v1 called it
    `lower_bound_ms`).
  - `gap`: overall_ms / balanced_estimate_ms - 1 (0.1 = 10% above the estimate), or null.
- `devices`: D entries in device order: `device` (index), `memory_bytes` (bytes of the shards it holds),
  `memory_used_fraction` (memory_bytes / memory_bytes_per_device), `predicted_cost_ms` (or null), and `tables`
  (ids of the tables it holds a shard of, in placement order; a split or replicated table is listed on every
  device holding a piece).
- `tables`: one entry per table: `table_id`, `rows`, `dim`, `bytes_per_element`, `pooling_factor`, `size_bytes`
  (rows * dim * bytes_per_element), `sharding_type` (v3; TorchRec's name: table_wise for a whole table,
  column_wise for column slices, row_wise for row ranges laid out as TorchRec's row-wise sharding over all
  devices, table_row_wise for row ranges laid out over the devices of one host, data_parallel for a replica on
  every device; other row layouts are written row_wise and refused by the TorchRec export) and `shards`: each
  `device`, `kind` (v3: whole | column | row | replicated), `col_offset`, `col_size`, `row_offset`, `row_size`
  (v3; a whole table or a replica is col 0..dim and rows 0..rows, a column slice holds all rows, a row range
  all columns) and `memory_bytes` (row_size * col_size * bytes_per_element). A table's shards are all of one
  kind and cover it exactly once: one whole shard, column slices covering its columns, row ranges covering its
  rows, or one replica on every device.
- `meta`: free-form notes of the planner (JSON values only), e.g. TorchRec's planning time or a fallback note.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any

import numpy as np

from .. import storage
from ..checks import ID_RULE, MAX_DEVICES, bad_id, size_text
from ..errors import EmbshardError
from ..placement import Placement, Shard
from ..tableset import TableSet
from ..types import DeviceTopology

SCHEMA_VERSION = "embshard.plan/v3"
# Versions a reader accepts, with the name each gives the balanced estimate in `cost`.
ESTIMATE_KEY = {"embshard.plan/v1": "lower_bound_ms", "embshard.plan/v2": "balanced_estimate_ms",
                SCHEMA_VERSION: "balanced_estimate_ms"}
V3_SHARD_KEYS = ("kind", "row_offset", "row_size")
SCHEMA_FILE = "plan.schema.json"


def json_schema() -> dict:
    """The JSON Schema of plan.json (shipped in the package)."""
    return json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


def plan_dict(placement: Placement, device_costs=None, balanced_estimate: float | None = None,
              made: dict | None = None) -> dict:
    """The plan.json content of a placement (validated). `made`: the `created_at` and `embshard_version` of the
    plan.json it was read from (an export of a plan keeps when and by which code it was made), else now's."""
    from ..version import code_version

    t = placement.tables
    d = placement.num_devices
    costs = None if device_costs is None else [float(c) for c in np.asarray(device_costs, dtype=float)]
    if costs is not None and not all(math.isfinite(c) and c >= 0 for c in costs):
        raise EmbshardError(f"device costs {costs} are not finite numbers >= 0", field="device_costs",
                            fix="give predicted costs in ms, or none")
    if costs is not None and len(costs) != d:
        raise EmbshardError(f"{len(costs)} device costs for {d} devices", field="device_costs",
                            fix="give one predicted cost per device")
    overall = None if costs is None else max(costs)
    gap = None
    if overall is not None and balanced_estimate is not None and balanced_estimate > 0:
        gap = overall / float(balanced_estimate) - 1.0
    mem = placement.memory_per_device()
    per_table: list[list[Shard]] = [[] for _ in range(len(t))]
    for s in placement.shards:
        per_table[s.table].append(s)
    hosts = placement.devices.hosts
    tables = []
    for i, shards in enumerate(per_table):
        rows, dim, bpe = int(t.rows[i]), int(t.dims[i]), int(t.bytes_per_element[i])
        out = []
        for s in sorted(shards, key=lambda s: (s.col_offset, s.row_offset, s.device)):
            cs = dim if s.col_size is None else int(s.col_size)
            rs = rows if s.row_size is None else int(s.row_size)
            out.append({"device": int(s.device), "kind": s.kind,
                        "col_offset": int(s.col_offset) if s.col_size is not None else 0, "col_size": cs,
                        "row_offset": int(s.row_offset) if s.row_size is not None else 0, "row_size": rs,
                        "memory_bytes": rs * cs * bpe})
        tables.append({
            "table_id": str(t.table_ids[i]), "rows": rows, "dim": dim, "bytes_per_element": bpe,
            "pooling_factor": float(t.pooling_factor[i]), "size_bytes": int(t.size_bytes[i]),
            "sharding_type": _sharding_type(rows, out, d, hosts), "shards": out,
        })
    devices = []
    for dev, shards in enumerate(placement.device_shards()):
        names: list[str] = []
        for s in shards:
            name = str(t.table_ids[s.table])
            if name not in names:
                names.append(name)
        devices.append({"device": dev, "memory_bytes": int(mem[dev]),
                        "memory_used_fraction": float(mem[dev]) / placement.memory_bytes_per_device,
                        "predicted_cost_ms": None if costs is None else costs[dev], "tables": names})
    plan = {
        "schema": SCHEMA_VERSION, "task_id": str(placement.task_id), "num_devices": int(d),
        "memory_bytes_per_device": int(placement.memory_bytes_per_device),
        **({"hosts": [int(h) for h in hosts]} if hosts is not None else {}), "planner": str(placement.planner),
        "model_uri": placement.model_uri,
        # A plan.json's own record is kept as it is, a hand-written plan's "not recorded" too (an export is not
        # when, or by which code, a plan was made).
        "created_at": (made or {}).get("created_at") or _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "embshard_version": ((made or {})["embshard_version"] if "embshard_version" in (made or {})
                             else code_version()),
        "cost": {"unit": "ms", "device_costs_ms": costs, "overall_ms": overall,
                 "balanced_estimate_ms": None if balanced_estimate is None else float(balanced_estimate),
                 "gap": gap},
        "devices": devices, "tables": tables, "meta": json_safe(placement.meta or {}),
    }
    validate_plan(plan)
    return plan


def write_plan_json(placement: Placement, path: str | os.PathLike, device_costs=None,
                    balanced_estimate: float | None = None, made: dict | None = None) -> dict:
    """Validate and atomically write plan.json for `placement` (`made`: as plan_dict's); returns the written dict."""
    plan = plan_dict(placement, device_costs=device_costs, balanced_estimate=balanced_estimate, made=made)
    storage.write_text(path, json.dumps(plan, indent=2, allow_nan=False) + "\n")
    return plan


def _sharding_type(rows: int, shards: list[dict], num_devices: int, hosts) -> str:
    """TorchRec's name for how a table's shards (plan.json dicts, all of one kind) split it."""
    from ..torchrec_compat import KIND_TO_SHARDING, row_layout

    kind = shards[0]["kind"]
    if kind == "row":
        layout = row_layout(rows, [(s["row_offset"], s["row_size"], s["device"]) for s in shards], num_devices,
                            hosts)
        if layout is not None:
            return layout[0]
    return KIND_TO_SHARDING[kind]


HAND_WRITTEN = "hand-written"  # the planner of a plan.json that names none
# What `completed` fills in from the fields a person writes: a check names these only after the written ones.
DERIVED_KEYS = ("kind", "col_offset", "col_size", "row_offset", "row_size", "memory_bytes", "size_bytes",
                "sharding_type", "devices", "cost", "planner", "model_uri", "created_at", "embshard_version", "meta")
COMPUTED_KEYS = ("kind", "memory_bytes", "size_bytes", "sharding_type")  # of those, the ones computed from others


def completed(plan: Any) -> Any:
    """A v3 plan.json as a person may write it, with what can be derived filled in where it is missing: a plan
    names `schema`, `task_id`, `num_devices`, `memory_bytes_per_device` (optional `hosts`) and its `tables`
    (`table_id`, `rows`, `dim`, `bytes_per_element`, `pooling_factor`, and `shards`: each a `device`, and for a
    cut `col_offset`/`col_size` or `row_offset`/`row_size`, or `kind: replicated` on every device). Filled in: the
    shards' kinds, offsets, sizes and bytes, each table's size and sharding type, `devices`, `cost` (no
    prediction), `planner` (HAND_WRITTEN), `model_uri`, `created_at`, `embshard_version` and `meta`. What is given
    is kept as given, so the checks still refuse a given field that contradicts the shards. Anything else (another
    version, values of the wrong type) is returned as it is, for the checks to name."""
    def whole_number(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(plan, dict) or plan.get("schema") != SCHEMA_VERSION:
        return plan
    tables, d = plan.get("tables"), plan.get("num_devices")
    # A count the schema refuses is left to it: a hand-written num_devices of 10**7 had built ten million device
    # entries (minutes, gigabytes) before the schema said "at most 65536".
    if not isinstance(tables, list) or not isinstance(d, int) or isinstance(d, bool) or not 0 < d <= MAX_DEVICES \
            or not all(
            isinstance(t, dict) and all(whole_number(t.get(k)) for k in ("rows", "dim", "bytes_per_element"))
            and isinstance(t.get("shards"), list) and t["shards"]
            and all(isinstance(s, dict) and whole_number(s.get("device")) for s in t["shards"]) for t in tables):
        return plan
    plan = json.loads(json.dumps(plan))  # a copy: the caller's dict is left as it was
    for t in plan["tables"]:
        rows, dim, bpe = t["rows"], t["dim"], t["bytes_per_element"]
        t.setdefault("size_bytes", rows * dim * bpe)
        for sh in t["shards"]:
            sh.setdefault("col_offset", 0)
            sh.setdefault("col_size", dim)
            sh.setdefault("row_offset", 0)
            sh.setdefault("row_size", rows)
            if not all(whole_number(sh[k]) for k in ("col_offset", "col_size", "row_offset", "row_size")):
                return plan
            # a shard not at (0, dim) is a column slice, one not at (0, rows) a row range, even when it overruns
            # the table (then the coverage check names its range: "needs its sharding_type" had said nothing of it)
            sh.setdefault("kind", "column" if (sh["col_offset"], sh["col_size"]) != (0, dim) else
                          "row" if (sh["row_offset"], sh["row_size"]) != (0, rows) else "whole")
            sh.setdefault("memory_bytes", sh["row_size"] * sh["col_size"] * bpe)
            if not whole_number(sh["memory_bytes"]):
                return plan
        kinds = {sh["kind"] for sh in t["shards"]}
        if "sharding_type" not in t and len(kinds) == 1 and kinds <= {"whole", "column", "row", "replicated"}:
            t["sharding_type"] = _sharding_type(rows, t["shards"], d, plan.get("hosts"))
    if "devices" not in plan and d > 0:  # from the shards on the task's devices (the checks name any other)
        mem = [0] * d
        names: list[list[str]] = [[] for _ in range(d)]
        for t in plan["tables"]:
            for sh in t["shards"]:
                if not 0 <= sh["device"] < d:
                    continue
                mem[sh["device"]] += sh["memory_bytes"]
                if t.get("table_id") not in names[sh["device"]]:
                    names[sh["device"]].append(t.get("table_id"))
        budget = plan.get("memory_bytes_per_device")
        plan["devices"] = [{"device": i, "memory_bytes": mem[i],
                            "memory_used_fraction": mem[i] / budget if whole_number(budget) and budget > 0 else 0.0,
                            "predicted_cost_ms": None, "tables": names[i]} for i in range(d)]
    plan.setdefault("planner", HAND_WRITTEN)
    plan.setdefault("model_uri", None)
    plan.setdefault("created_at", "not recorded")
    plan.setdefault("embshard_version", "")
    plan.setdefault("cost", {"unit": "ms", "device_costs_ms": None, "overall_ms": None,
                             ESTIMATE_KEY[SCHEMA_VERSION]: None, "gap": None})
    plan.setdefault("meta", {})
    return plan


def read_plan_json(path: str | os.PathLike) -> dict:
    """Read and validate a plan.json (v3, or v2/v1 as written by earlier versions; any other version is refused).
    A v3 plan written by hand may leave out what can be derived from its shards (`completed`)."""
    from ..checks import read_json_file

    where = os.fspath(path)
    plan = read_json_file(where, fix="check the path (`embshard place --out DIR` writes DIR/plan.json)")
    plan = completed(plan)
    validate_plan(plan, where)
    return plan


def validate_plan(plan: Any, where: str = "<plan.json>") -> None:
    """Check `plan` against the JSON Schema and the consistency rules; raise EmbshardError naming the field."""
    if isinstance(plan, Mapping) and str(plan.get("schema", "")).startswith("embshard.torchrec_plan/"):
        raise EmbshardError("a TorchRec plan, not a plan.json", path=where, field="schema",
                            fix="give the plan.json beside it (export writes the TorchRec plans from it)")
    if isinstance(plan, Mapping) and plan.get("schema") not in ESTIMATE_KEY:
        raise EmbshardError(f"schema {plan.get('schema')!r} is not {SCHEMA_VERSION!r}", path=where, field="schema",
                            fix="re-export the plan with this embshard version")
    _schema_check(plan, json_schema(), where)
    cost, key = plan["cost"], ESTIMATE_KEY[plan["schema"]]
    other = next(k for k in ESTIMATE_KEY.values() if k != key)
    if key not in cost or other in cost:  # each version names the estimate its own way, exactly once
        raise EmbshardError(f"a {plan['schema']} plan names the balanced estimate {key!r}", path=where,
                            field=f"cost.{other if other in cost else key}",
                            fix=f"give cost.{key} (a number or null) and no cost.{other}")
    _consistency_check(plan, where)


def _schema_check(plan: Any, schema: dict, where: str) -> None:
    bad = _non_finite(plan, "")
    if bad is not None:  # JSON Schema takes NaN and Infinity (Python's json reads them) as numbers
        raise EmbshardError("not a finite number (NaN or Infinity)", path=where, field=bad or "<root>",
                            fix="give a finite number")
    try:
        import jsonschema
    except ImportError:  # jsonschema comes with the airflow extra; without it the built-in subset checker runs
        err = _mini_validate(plan, schema, "")
        if err:
            raise EmbshardError(err[1], path=where, field=err[0] or "<root>",
                                fix=f"follow the {SCHEMA_VERSION} schema (embshard/export/{SCHEMA_FILE})") from None
        return
    def named(e) -> list[str]:
        parts = [str(p) for p in e.absolute_path]
        if e.validator == "required":  # name the missing key, not its parent: one a person writes first
            absent = [k for k in e.validator_value if k not in e.instance]
            parts += [next((k for k in absent if k not in DERIVED_KEYS), absent[0])]
        return parts

    # A field a person wrote is named before one derived from it (a hand-written plan whose col_size is a word
    # cannot be completed, and "'planner' is a required property" said nothing of the word).
    def rank(e) -> tuple:
        path = named(e)
        missing = e.validator == "required"
        # under a derived object, or a derived key missing: what `completed` could not fill in (last); a wrong
        # value of a key computed from others (memory_bytes from a wrong row_size) before those
        return (any(p in DERIVED_KEYS for p in path[:-1]) or (missing and path[-1] in DERIVED_KEYS),
                not missing and bool(path) and path[-1] in COMPUTED_KEYS, list(e.absolute_path))

    errors = sorted(_validator(jsonschema)(schema).iter_errors(plan), key=rank)
    if errors:
        e = errors[0]
        parts = named(e)
        field = ".".join(parts) or "<root>"
        if e.validator == "pattern":  # an id (the only patterns of the schema)
            raise EmbshardError(_not_an_id(e.instance), path=where, field=field, fix=ID_FIX)
        message = f"{parts[-1]!r} is a required property" if e.validator == "required" else e.message[:200]
        older = plan.get("schema") if isinstance(plan, Mapping) and plan.get("schema") != SCHEMA_VERSION else None
        if older and e.validator == "required" and parts[-1] in DERIVED_KEYS:
            # Only a v3 plan has what is derived filled in: a hand-written v2 file had been told only that
            # 'planner' is required.
            raise EmbshardError(f"{message} of {older} plans (only {SCHEMA_VERSION} fills in what its shards "
                                "give)", path=where, field=field,
                                fix=f'write "schema": "{SCHEMA_VERSION}" in a hand-written plan')
        raise EmbshardError(message, path=where, field=field,
                            fix=f"follow the {SCHEMA_VERSION} schema (embshard/export/{SCHEMA_FILE})")


ID_FIX = ("rename it (a plan's task_id names export's folder of the task; a table_id is the table's name in "
          "TorchRec's plan)")


def _not_an_id(value) -> str:
    return f"{str(value)[:60]!r} is not an id ({ID_RULE})"


def _validator(jsonschema):
    """Draft 2020-12 with JSON's integers only: the draft counts 4.0 as an integer, and a device number written as
    1.0 had reached a list index (a traceback); 4.0 is refused as "not of type 'integer'" instead."""
    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine("integer", lambda _, value: _is_type(value, "integer"))
    return jsonschema.validators.extend(base, type_checker=checker)


def _non_finite(value: Any, at: str) -> str | None:
    """The path of the first NaN or infinite number in a JSON value, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, sub in items:
        bad = _non_finite(sub, f"{at}.{key}" if at else str(key))
        if bad is not None:
            return bad
    return None


_TYPES: dict[str, type] = {"object": dict, "array": list, "string": str, "null": type(None), "boolean": bool}


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, _TYPES[name])


def _mini_validate(value: Any, schema: dict, at: str) -> tuple[str, str] | None:
    """The subset of JSON Schema that plan.schema.json uses; returns (field, message) of the first error."""
    if "const" in schema and value != schema["const"]:
        return at, f"must be {schema['const']!r}"
    if "enum" in schema and value not in schema["enum"]:
        return at, f"must be one of {schema['enum']!r}"
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is_type(value, t) for t in types):
            return at, f"{value!r:.60} is not of type {' or '.join(types)}"
    if (isinstance(value, (int, float)) and not isinstance(value, bool) and "minimum" in schema
            and value < schema["minimum"]):
        return at, f"{value} is less than the minimum of {schema['minimum']}"
    if (isinstance(value, (int, float)) and not isinstance(value, bool) and "maximum" in schema
            and value > schema["maximum"]):
        return at, f"{value} is greater than the maximum of {schema['maximum']}"
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        return at, "must not be empty"
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        return at, _not_an_id(value)
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                return (f"{at}.{key}" if at else key), f"{key!r} is a required property"
        props = schema.get("properties", {})
        for key, sub in value.items():
            path = f"{at}.{key}" if at else key
            if key in props:
                err = _mini_validate(sub, props[key], path)
                if err:
                    return err
            elif schema.get("additionalProperties", True) is False:
                return path, "additional property not allowed"
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            return at, f"needs at least {schema['minItems']} item(s)"
        if "items" in schema:
            for k, item in enumerate(value):
                err = _mini_validate(item, schema["items"], f"{at}.{k}" if at else str(k))
                if err:
                    return err
    return None


def shard_spans(plan: Mapping) -> list[list[dict]]:
    """Per table, its shards with every v3 field (kind, col_offset/col_size, row_offset/row_size): a v1/v2 plan's
    shards (whole tables and column slices only) get the values v3 writes for them."""
    v3 = plan["schema"] == SCHEMA_VERSION
    out = []
    for t in plan["tables"]:
        shards = []
        for s in t["shards"]:
            s = dict(s)
            if not v3:
                s["kind"] = "whole" if len(t["shards"]) == 1 and s["col_size"] == t["dim"] else "column"
                s["row_offset"], s["row_size"] = 0, t["rows"]
            shards.append(s)
        out.append(shards)
    return out


def _consistency_check(plan: dict, where: str) -> None:
    def fail(field: str, msg: str, fix: str) -> None:
        raise EmbshardError(msg, path=where, field=field, fix=fix)

    d = plan["num_devices"]
    budget = plan["memory_bytes_per_device"]
    v3 = plan["schema"] == SCHEMA_VERSION
    # The schema's id pattern ends in `$`, which lets a trailing newline through (re.search): the whole id here.
    for field, value in [("task_id", plan["task_id"])] + [(f"tables.{k}.table_id", t["table_id"])
                                                          for k, t in enumerate(plan["tables"])]:
        if bad_id(value):
            fail(field, _not_an_id(value), ID_FIX)
    if v3:  # the schema keeps these optional so that v1/v2 files pass it; v3 writes them always
        for k, t in enumerate(plan["tables"]):
            # (a table whose shards mix kinds gets no sharding_type from `completed`: the mixing is said below)
            if "sharding_type" not in t and len({sh.get("kind") for sh in t["shards"]}) < 2:
                fail(f"tables.{k}.sharding_type", f"table {t['table_id']}: a {SCHEMA_VERSION} table needs its "
                     "sharding_type", "re-export the plan with this embshard version")
            for j, s in enumerate(t["shards"]):
                missing = [key for key in V3_SHARD_KEYS if key not in s]
                if missing:
                    fail(f"tables.{k}.shards.{j}.{missing[0]}", f"table {t['table_id']}: a {SCHEMA_VERSION} "
                         "shard needs kind, row_offset and row_size", "re-export the plan with this embshard version")
    elif "hosts" in plan:
        fail("hosts", f"a {plan['schema']} plan has no hosts", f"write {SCHEMA_VERSION} to give hosts")
    if "hosts" in plan and len(plan["hosts"]) != d:
        fail("hosts", f"{len(plan['hosts'])} hosts for {d} devices", "give the host of every device, or none")
    if "hosts" in plan and DeviceTopology(d, budget, hosts=tuple(plan["hosts"])).devices_per_host() is None:
        # TorchRec numbers ranks host by host: another layout is one no job runs (export had dropped it silently)
        shown = ", ".join(str(h) for h in plan["hosts"][:8]) + (", ..." if d > 8 else "")
        fail("hosts", f"hosts [{shown}] are not TorchRec's rank order (host h holds devices h*L .. h*L+L-1, L "
             "devices each)", "list the hosts in rank order, or plan again with --devices-per-host")
    if [dev["device"] for dev in plan["devices"]] != list(range(d)):
        fail("devices", f"devices must be listed 0..{d - 1} in order", "one entry per device")
    ids = [t["table_id"] for t in plan["tables"]]
    if len(set(ids)) != len(ids):
        twice = sorted({t for t in ids if ids.count(t) > 1})
        fail("tables", f"duplicate table_id {twice[:3]}", "list every table once")
    mem = [0] * d
    holders: list[set] = [set() for _ in range(d)]
    cover = "shards must be of one kind and cover the table exactly once (columns, rows, or a replica per device)"
    for k, (t, shards) in enumerate(zip(plan["tables"], shard_spans(plan))):
        name, rows, dim = t["table_id"], t["rows"], t["dim"]
        if t["size_bytes"] != rows * dim * t["bytes_per_element"]:
            fail(f"tables.{k}.size_bytes", f"table {name}: size_bytes != rows*dim*bytes_per_element",
                 "recompute size_bytes")
        kinds = {s["kind"] for s in shards}
        if len(kinds) > 1:
            fail(f"tables.{k}.shards", f"table {name} mixes {' and '.join(sorted(kinds))} shards", cover)
        kind = kinds.pop()
        for s in shards:
            if s["device"] >= d:
                fail(f"tables.{k}.shards", f"table {name}: device {s['device']} >= num_devices {d}",
                     "use devices 0..num_devices-1")
            full_cols = (s["col_offset"], s["col_size"]) == (0, dim)
            full_rows = (s["row_offset"], s["row_size"]) == (0, rows)
            if (kind != "column" and not full_cols) or (kind != "row" and not full_rows):
                fail(f"tables.{k}.shards", f"table {name}: a {kind} shard at columns {s['col_offset']}+"
                     f"{s['col_size']}, rows {s['row_offset']}+{s['row_size']}", "a column slice holds all rows, a "
                     "row range all columns, a whole or replicated shard the whole table")
            if s["memory_bytes"] != s["row_size"] * s["col_size"] * t["bytes_per_element"]:
                fail(f"tables.{k}.shards", f"table {name}: shard memory_bytes != row_size*col_size*bytes",
                     "recompute memory_bytes")
            mem[s["device"]] += s["memory_bytes"]
            holders[s["device"]].add(name)
        if kind == "replicated":
            if sorted(s["device"] for s in shards) != list(range(d)):
                fail(f"tables.{k}.shards", f"table {name}: replicas on devices "
                     f"{sorted(s['device'] for s in shards)[:8]}, not one on each of {d}", cover)
        elif kind == "whole" and len(shards) != 1:
            fail(f"tables.{k}.shards", f"table {name}: {len(shards)} whole shards", cover)
        else:
            key, total, unit = ("row", rows, "rows") if kind == "row" else ("col", dim, "columns")
            nxt = 0
            for s in sorted(shards, key=lambda s: s[f"{key}_offset"]):
                off = s[f"{key}_offset"]
                if off != nxt:
                    fail(f"tables.{k}.shards", f"table {name}: {unit} {min(off, nxt)}..{max(off, nxt)} are "
                         f"{'missing' if off > nxt else 'placed twice'}", cover)
                nxt += s[f"{key}_size"]
            if nxt != total:
                fail(f"tables.{k}.shards", f"table {name}: shards cover {nxt} of {total} {unit}", cover)
        if v3:
            want = _sharding_type(rows, shards, d, plan.get("hosts"))
            if t["sharding_type"] != want:
                fail(f"tables.{k}.sharding_type", f"table {name}: sharding_type {t['sharding_type']!r} but its "
                     f"shards are {want}", f"write {want!r}")
    # The budget first, from the shards themselves: a hand edit that overfills a device is told so, not only that
    # devices[] no longer matches the shards moved.
    over = [i for i in range(d) if mem[i] > budget]
    if over:
        i = over[0]
        fail(f"devices.{i}.memory_bytes", _over_text(i, mem[i], budget), "this placement breaks the memory budget; "
             "re-plan it")
    # After a hand edit the simplest fix is to drop what is derived (a v3 plan has it filled in again: `completed`).
    derived = ("devices[] is derived from tables[].shards: after moving a shard, leave devices[] and cost out of "
               "the plan (they are filled in again; the old predicted costs no longer hold)" if v3 else
               "devices[] is derived from tables[].shards: after moving a shard, set each device's memory_bytes "
               "and tables to what its shards hold, or write the plan as embshard.plan/v3 and leave devices[] out")
    for dev in plan["devices"]:
        i = dev["device"]
        if dev["memory_bytes"] != mem[i]:
            fail(f"devices.{i}.memory_bytes", f"device {i}: memory_bytes {dev['memory_bytes']} but its shards in "
                 f"tables[] hold {mem[i]}", derived)
        if mem[i] > budget:
            fail(f"devices.{i}.memory_bytes", _over_text(i, mem[i], budget), "this placement breaks the memory "
                 "budget; re-plan it")
        used = dev.get("memory_used_fraction")
        if used is not None and not math.isclose(used, mem[i] / budget, rel_tol=1e-9, abs_tol=1e-12):
            fail(f"devices.{i}.memory_used_fraction", f"device {i}: memory_used_fraction {used:g} but its shards "
                 f"fill {mem[i] / budget:g} of it", derived)
        if set(dev["tables"]) != holders[i]:
            extra, missing = sorted(set(dev["tables"]) - holders[i]), sorted(holders[i] - set(dev["tables"]))
            fail(f"devices.{i}.tables", f"device {i}: lists {extra[:3] or 'no table'} without a shard there and "
                 f"misses {missing[:3] or 'none'} of its shards' tables", derived)
    costs = plan["cost"]["device_costs_ms"]
    if costs is not None and len(costs) != d:
        fail("cost.device_costs_ms", f"{len(costs)} costs for {d} devices", "one cost per device")
    # The costs' summaries are derived from them: one that contradicts them would be quoted as the plan's cost.
    overall = plan["cost"].get("overall_ms")
    if costs is not None and overall is not None and not math.isclose(overall, max(costs), rel_tol=1e-9):
        fail("cost.overall_ms", f"overall_ms {overall:g} but the slowest device_costs_ms is {max(costs):g}",
             "overall_ms is the largest device cost: set it to that, or null")
    if (costs is None) != (overall is None):
        fail("cost.overall_ms", "overall_ms and device_costs_ms must be given together",
             "give both (the largest device cost is overall_ms), or neither")


def _over_text(device: int, held: int, budget: int) -> str:
    """A device over its memory, in units a person reads (bytes alone had read '2594649344 bytes, 232417332 over')."""
    return (f"device {device} holds {held:,} bytes ({size_text(held)}), {size_text(held - budget)} over its "
            f"{size_text(budget)}")


def json_safe(value: Any) -> Any:
    """meta values as plain JSON (numpy scalars/arrays converted, non-finite floats and objects as strings)."""
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [json_safe(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def changed_pooling(plan: Mapping, tables: TableSet) -> list[tuple[str, float, float]]:
    """(table, pooling in the plan, pooling in `tables`) of each table whose lookups per sample are not what the
    plan was made for; `tables` holds the plan's tables in its order (placement_from_plan's)."""
    return [(str(t["table_id"]), float(t["pooling_factor"]), float(p))
            for t, p in zip(plan["tables"], tables.pooling_factor)
            if not math.isclose(float(t["pooling_factor"]), float(p), rel_tol=1e-9)]


PLAN_AGAIN = "(fix: plan again with every table, if the plan is meant for all of them)"


def left_out_note(placed, available, tables_path: str) -> str | None:
    """A line saying which tables of `available` (a tables file's ids) a plan placing `placed` leaves out, when it
    leaves out fewer than it places (a plan of most of a file's tables that misses a few looks like a mistake; a
    task's plan of some tables of a run's pool, the usual case, is not said); None otherwise."""
    available = [str(t) for t in available]
    placed = {str(t) for t in placed} & set(available)  # a plan's table not in the file is another check's error
    left_out = [t for t in available if t not in placed]
    if not left_out or len(left_out) >= len(placed):
        return None
    named = ", ".join(left_out[:3]) + (", ..." if len(left_out) > 3 else "")
    total = len(available)
    return f"the plan places {len(placed)} of the {total} tables of {tables_path} (not placed: {named})"


def placement_from_plan(plan: Mapping, tables: TableSet, where: str | None = None,
                        tables_source: str = "tables.parquet") -> Placement:
    """Rebuild the Placement of a (validated) plan.json of any version over `tables` (a TableSet holding at least
    the plan's tables, with the plan's rows, dims and element sizes: a plan of other tables is refused); its
    topology carries the plan's hosts. `where` names the plan in errors (default its task id), `tables_source`
    the file the tables were read from."""
    where = where or str(plan.get("task_id", "plan.json"))
    ids = [t["table_id"] for t in plan["tables"]]
    sub = tables.select(ids, where=where, source=tables_source)
    for k, t in enumerate(plan["tables"]):
        for key, theirs in (("rows", sub.rows), ("dim", sub.dims), ("bytes_per_element", sub.bytes_per_element)):
            if int(t[key]) != int(theirs[k]):
                raise EmbshardError(f"table {t['table_id']}: the plan's {key} is {t[key]}, the table's "
                                    f"{int(theirs[k])}", path=where, field=f"tables.{k}.{key}",
                                    fix="give a plan made for these tables (or re-ingest the tables it was made for)")
    shards = []
    for i, pieces in enumerate(shard_spans(plan)):
        for s in pieces:
            dev, kind = int(s["device"]), s["kind"]
            if kind == "column":
                shards.append(Shard(i, dev, int(s["col_offset"]), int(s["col_size"])))
            elif kind == "row":
                shards.append(Shard(i, dev, row_offset=int(s["row_offset"]), row_size=int(s["row_size"])))
            else:
                shards.append(Shard(i, dev, kind="replicated" if kind == "replicated" else ""))
    d, mem = int(plan["num_devices"]), int(plan["memory_bytes_per_device"])
    hosts = None if plan.get("hosts") is None else tuple(int(h) for h in plan["hosts"])
    placement = Placement(sub, d, mem, shards, planner=plan["planner"], model_uri=plan["model_uri"],
                          task_id=plan["task_id"], meta=dict(plan.get("meta", {})),
                          topology=DeviceTopology(d, mem, hosts=hosts))
    placement.check(where)
    return placement
