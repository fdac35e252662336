"""The pipeline's parameters, defined once: default, JSON schema and description of each. The DAG builds its
trigger form from them, and `check` refuses a bad run before any work: the DAG's first task (check_params),
`embshard pipeline` before it starts Airflow, and every stage on its own (pods get the params as JSON).

Light on purpose (the DAG imports it at parse time in any Airflow image): no torch, numpy or pyarrow.

Why the form gets only types and choices: Airflow's form clamps a number below its minimum to the minimum
without a word (num_tables -5 became 2) and answers a broken pattern with a toast naming neither field nor
reason. Ranges, patterns and the rules between fields are checked here instead, all at once, each problem named
with its field and fix, in the first seconds of the run.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field

from . import checks
from .checks import CURRICULUM_OFF, DEFAULT_CURRICULUM, MAX_LOCAL_DEVICES, curriculum_stages  # noqa: F401
from .errors import EmbshardError

MAX_POLICY_ROUNDS = 3  # the DAG has a task per step of each outer-loop round
# Baselines the promotion may measure beside the candidate and the champion (embshard.planners names; a test
# checks that each is a planner there).
EVAL_PLANNER_CHOICES = ("random", "round_robin", "dim_greedy", "size_greedy", "lookup_greedy",
                        "size_lookup_greedy", "torchrec_table_wise", "torchrec_full")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
DATA_TYPES = ("fp32", "fp16")  # ingest.dlrm.DATA_TYPES' keys (a test holds them equal; that module imports numpy)
DLRM_KEYS = ("dim", "data_type", "rows_file")  # what a trace lacks (ingest --dim, --data-type, --rows-file)
# The smallest population a run learns from: a train pool of 4 tables, whose 4 single-table shards (always
# trained on) are the 4 training shards the cost model needs at the least (a quick pipeline of 8 tables ran end to
# end; 2 tables had failed in train_cost_model after the benchmark).
MIN_TABLES = 8
SYNTHETIC_KEYS = ("num_tables", "hot_large_fraction", "fp16_fraction")  # the generator's: other sources read tables
# What the trigger form enforces itself (types and choices); the rest of a schema is checked by `check`.
FORM_KEYS = ("type", "enum", "items", "examples", "uniqueItems")


@dataclass(frozen=True)
class ParamSpec:
    default: object
    description: str
    schema: dict = field(default_factory=dict)
    fix: str = ""  # how to correct a bad value, when the schema does not say it plainly


def _int(lo: int, hi: int | None = None) -> dict:
    return {"type": "integer", "minimum": lo, **({"maximum": hi} if hi is not None else {})}


SPECS: dict[str, ParamSpec] = {
    "source": ParamSpec("synthetic", "Where the tables come from: the synthetic generator, a table-spec file "
                        "(CSV/Parquet/YAML, TorchRec names) or a DLRM trace (.pt/.pt.gz).",
                        {"enum": ["synthetic", "spec", "dlrm"]}),
    # Optional (null allowed): the synthetic source needs no file, and the UI form must submit with the defaults.
    "input": ParamSpec(None, "Spec or trace file for source spec/dlrm (a path; a trace is read from a local or "
                       "mounted one only; dlrm: also several files of one trace, as a glob pattern such as "
                       "/data/fbgemm_t856_bs65536_*.pt or a comma-separated list); empty for synthetic.",
                       {"type": ["null", "string"]}),
    "num_tables": ParamSpec(240, f"Synthetic source: how many tables to generate ({MIN_TABLES}-100,000).",
                            _int(MIN_TABLES, 100_000)),
    # 0.04 by default for coverage: they are the tables a plan must cut, and a cost model that never measured
    # one mis-prices their cuts (benchmarks/results/cut_accuracy.md). The split suite's gain is not established:
    # of two training runs with them, one beat the run without them and one did not (quality_splits.md).
    "hot_large_fraction": ParamSpec(0.04, "Synthetic source: fraction of the tables drawn as large multi-hot "
                                    "features (1e7-1e8 rows, 20-120 lookups per sample), which independent draws "
                                    "of size and pooling almost never make (0-1).",
                                    {"type": "number", "minimum": 0, "maximum": 1}),
    # 0 by default: a model measured on FP32 tables alone prices shards holding an FP16 table 16% too cheap (median,
    # unseen tables), yet a run with a quarter of its tables FP16 planned no better on FP32 suites and slower on the
    # all-FP16 MLPerf-like list (1.146x), its model's FP32 calibration lost (benchmarks/results/model_ab_fp16.md,
    # costmodel_types.md).
    "fp16_fraction": ParamSpec(0.0, "Synthetic source: fraction of the tables drawn with FP16 weights (the "
                               "others FP32), so that the cost model measures both types (0-1).",
                               {"type": "number", "minimum": 0, "maximum": 1}),
    # A DLRM trace holds indices only: without these a run on one got mixed dims, fp32 and rows = largest id + 1.
    # dim: text in the form (its first type) and from `--param` ("64"); a REST conf may send the number 64.
    "dim": ParamSpec("mixed", f"DLRM source: embedding dim of every table ({checks.DIM_RULE}), or 'mixed' = a seeded "
                     "draw from the synthetic mix 4-256.", {"type": ["string", "integer"]},
                     fix=f"give {checks.DIM_RULE}, or 'mixed'"),
    "data_type": ParamSpec("fp32", "DLRM source: the tables' weight type.", {"enum": list(DATA_TYPES)}),
    "rows_file": ParamSpec(None, "DLRM source: hash sizes, one integer per table of the trace (a local or mounted "
                           "path; empty: each table's largest index + 1).", {"type": ["null", "string"]}),
    "seed": ParamSpec(0, "Seed of every random choice of the run (0-4,294,967,295).", _int(0, 2**32 - 1)),
    "num_tasks": ParamSpec(12, "Tasks sampled per split (train pool / unseen test pool; 1-10,000).",
                           _int(1, 10_000)),
    "tables_per_task": ParamSpec("20-60", "Tables per task: a number or a range like 20-60.",
                                 {"type": "string", "pattern": r"^[1-9]\d*(-[1-9]\d*)?$"},
                                 fix="give a positive number or a range LOW-HIGH like 20-60"),
    "devices": ParamSpec(4, "Devices per task (1-4,096).", _int(1, 4096)),
    # Optional (null: every device on one host): TorchRec names a rank's GPU by its index on its host.
    "devices_per_host": ParamSpec(None, "GPUs per host of the training job (empty: all devices on one host; needed "
                                  "above 128 devices, since torch numbers a host's GPUs 0-127). Plans may then cut "
                                  "tables row-wise within a host, and the TorchRec plans name each rank's local GPU.",
                                  {"type": ["null", "integer"], "minimum": 1, "maximum": MAX_LOCAL_DEVICES}),
    "memory_gb": ParamSpec(128.0, "Memory per device in GiB (a hard constraint; above 0, at most 100,000).",
                           {"type": "number", "exclusiveMinimum": 0, "maximum": 100_000}),
    # Random training shards measured for the cost model; with 160 its unseen compute MAPE was 35%, with 240 23%.
    "bench_shards": ParamSpec(240, "Benchmark budget: shards to measure (2/3 train pool, 1/3 test pool; half random, "
                              "half devices of greedy plans and their search neighbours), besides every table "
                              "alone (10-1,000,000).", _int(10, 1_000_000)),
    "bench_chunks": ParamSpec(3, "Benchmark chunks: mapped tasks (pods) that measure in parallel (1-1,024).",
                              _int(1, 1024)),
    # Where every measuring stage measures (sample_shards' calibration, benchmark chunks, measured policy plans,
    # the promotion's evaluation): auto = the pod's GPU when it has one, else the CPU; cuda without a GPU fails.
    "device": ParamSpec("auto", "Where the measuring stages (sample_shards' all-to-all calibration, benchmark, "
                        "measure_policy_plans, evaluate_and_promote) measure: auto = the pod's GPU when it has one, "
                        "else the CPU; cuda fails at once where no GPU is visible. A pod with several GPUs measures "
                        "the all-to-all with NCCL among them; one GPU uses the NVLink formula. The models are "
                        "tagged with the hardware measured.", {"enum": list(DEVICE_CHOICES)}),
    "bench_batch_size": ParamSpec(0, "Benchmark batch size (0 = the device's default: 2,048 on the CPU, 65,536 on "
                                  "a GPU; at most 4,194,304).", _int(0, 1 << 22)),
    "recalibrate_comm": ParamSpec(False, "Calibrate the all-to-all formula again (otherwise the one stored for "
                                  "this hardware is reused, so that runs and models agree).", {"type": "boolean"}),
    "cost_members": ParamSpec(3, "Cost-model ensemble members: the mean is the prediction, their disagreement the "
                              "uncertainty the search respects (1-32).", _int(1, 32)),
    "policy_iterations": ParamSpec(200, "REINFORCE updates of the policy (1-1,000,000).", _int(1, 1_000_000)),
    "policy_rounds": ParamSpec(2, f"Outer rounds: measure the policy's plans, refit the cost model, retrain (the "
                               f"tasks of rounds beyond this are skipped; 1-{MAX_POLICY_ROUNDS}).",
                               _int(1, MAX_POLICY_ROUNDS)),
    "policy_curriculum": ParamSpec(DEFAULT_CURRICULUM,
                                   "Policy curriculum: growing stages of table counts (LO-HI, comma-separated) of "
                                   "tasks generated from the training pool (2-128 devices scaled with the tables, "
                                   "tight or loose memory), trained beside the run's own tasks and added to the "
                                   "validation that picks the checkpoint; 'off' for the run's tasks only. Off "
                                   "when a round has fewer than 10 updates per stage.",
                                   {"type": "string"},
                                   fix="give 'off' or growing LO-HI ranges like 10-50,50-200,200-1000"),
    "eval_tasks": ParamSpec(5, "Held-out tasks measured (1-1,000).", _int(1, 1000)),
    "eval_rounds": ParamSpec(5, "Measuring rounds of the evaluation (each measures every distinct device shard "
                             "once, in a fresh random order); intervals need 5 or more (1-100).",
                             _int(1, checks.MAX_ROUNDS)),
    # size_greedy left out: never the best on the default population, it only lengthened the evaluation
    "eval_planners": ParamSpec(["dim_greedy", "lookup_greedy", "size_lookup_greedy"],
                               "Baselines measured beside the candidate and the champion (one or more; the first "
                               "is also measured twice, the run's A/A noise floor).",
                               {"type": "array", "items": {"type": "string", "enum": list(EVAL_PLANNER_CHOICES)},
                                "examples": list(EVAL_PLANNER_CHOICES), "minItems": 1, "uniqueItems": True},
                               fix=f"choose one or more of {', '.join(EVAL_PLANNER_CHOICES)}"),
    "promotion_margin": ParamSpec(0.01, "The candidate must beat the champion by this fraction to be promoted "
                                  "(0-0.9).", {"type": "number", "minimum": 0, "maximum": 0.9}),
    "export_tasks": ParamSpec("test", "Which tasks get exported placements.", {"enum": ["test", "train", "all"]}),
    "refine_k": ParamSpec(0, "Measured refinement of the exported plans: the K best distinct candidate plans of each "
                          "task (the policy's, the search's, the greedy heuristics', TorchRec's) measured side by side "
                          "on the run's device in eval_rounds paired rounds, the measured best exported (0 = off, "
                          "1-16).", _int(0, 16)),
    "timeout_scale": ParamSpec(1.0, "Multiplies every task's time limit (sized from measured stage times and this "
                               "run's parameters; see docs/method.md). Raise it for a slow or shared machine "
                               "(0.001-1,000).", {"type": "number", "minimum": 0.001, "maximum": 1000}),
}
DEFAULT_PARAMS: dict = {k: s.default for k, s in SPECS.items()}


def form_schema(key: str) -> dict:
    """The part of a param's schema that the trigger form enforces (types and choices)."""
    return {k: v for k, v in SPECS[key].schema.items() if k in FORM_KEYS}


def planners_of(value) -> list[str]:
    """eval_planners as a list: the form and REST give a list, `--param` and older confs a comma string."""
    if isinstance(value, str):
        return [b.strip() for b in value.split(",") if b.strip()]
    return [str(b) for b in value or []]


def _normalised(params: dict | None) -> dict:
    p = dict(DEFAULT_PARAMS)
    p.update({k: v for k, v in (params or {}).items() if v is not None})
    if isinstance(p.get("eval_planners"), str):
        p["eval_planners"] = planners_of(p["eval_planners"])
    return p


def problems(params: dict | None, *, check_files: bool = True) -> list[tuple[str, str, str]]:
    """Every problem of a run's params as (field, what is wrong, fix); empty when the run may start."""
    import jsonschema

    p = _normalised(params)
    found: list[tuple[str, str, str]] = []
    for key in sorted(set(p) - set(SPECS)):
        close = difflib.get_close_matches(key, list(SPECS), n=1, cutoff=0.6)
        found.append((key, "unknown parameter", (f"did you mean '{close[0]}'? " if close else "")
                      + f"remove it; the parameters are {', '.join(SPECS)}"))
    for key, spec in SPECS.items():
        if key not in p:
            continue
        value = p[key]
        if isinstance(value, float) and not math.isfinite(value):
            found.append((key, f"{value} is not a finite number", "give a finite number"))
            continue
        for err in jsonschema.Draft7Validator(spec.schema).iter_errors(value):
            found.append((key, _says(err.message), spec.fix or _fix_from(spec.schema)))
            break
    bad = {f for f, _, _ in found}
    if "source" not in bad and "input" not in bad:
        src, inp = p["source"], (p["input"] or "").strip()
        if src in ("spec", "dlrm") and not inp:
            found.append(("input", f"source {src} needs an input file", f"give the {src} file's path"))
        elif src == "synthetic" and inp:
            found.append(("input", "the synthetic source reads no file",
                          "leave input empty, or choose source spec or dlrm"))
        elif inp and check_files and src == "dlrm":
            try:
                files = _trace_files(inp)
                missing = [f for f in files if _missing(f)]
                if not missing:
                    from .ingest.dlrm import check_table_counts

                    check_table_counts(files)  # files of one trace: the same tables
            except EmbshardError as e:
                found.append(("input", f"{e.path}: {e.message}" if e.path and e.path != inp else e.message,
                              e.fix or ""))
            else:
                if missing:
                    found.append(("input", f"no file {missing[0]!r} here", _FIX_MISSING))
                elif (what := _trace_format_problem(inp)):
                    found.append(("input", what, "give a DLRM trace: torch.save((indices, offsets, lengths)) as "
                                                 ".pt or .pt.gz (a table spec is source spec)"))
        elif inp and check_files and _missing(inp):
            found.append(("input", f"no file {inp!r} here", _FIX_MISSING))
    dlrm = p["source"] == "dlrm"  # another source's dim or rows_file is refused below, whatever its value
    rows_file = (p["rows_file"] or "").strip() if "rows_file" not in bad else ""
    if dlrm and rows_file and check_files and _missing(rows_file):
        found.append(("rows_file", f"no file {rows_file!r} here", _FIX_MISSING))
    if dlrm and "dim" not in bad and (what := _dim_problem(p["dim"])):
        found.append(("dim", what, SPECS["dim"].fix))
    if "source" not in bad and p["source"] != "synthetic":
        given = params or {}
        for key in SYNTHETIC_KEYS:  # the synthetic generator's: another source ignores them
            if given.get(key) is not None and key not in bad and p[key] != SPECS[key].default:
                found.append((key, f"only the synthetic source generates tables; source {p['source']} reads them "
                              "from its input", f"leave {key} out, or choose source synthetic"))
    if "source" not in bad and p["source"] != "dlrm":
        given = params or {}
        for key in DLRM_KEYS:  # what a trace lacks: the generator draws them, a spec lists them
            if given.get(key) is not None and key not in bad and _dlrm_value(key, p[key]) != SPECS[key].default:
                has = "lists them in its input" if p["source"] == "spec" else "draws them itself"
                also = ("; synthetic FP16 tables: fp16_fraction (1: every table)"
                        if key == "data_type" and p["source"] == "synthetic" else "")
                found.append((key, f"only a dlrm trace needs dims, data type and hash sizes given; source "
                              f"{p['source']} {has}", f"leave {key} out, or choose source dlrm{also}"))
    if "policy_iterations" not in bad and "policy_rounds" not in bad and \
            int(p["policy_iterations"]) < int(p["policy_rounds"]):
        # each round trains policy_iterations // policy_rounds updates (as `embshard train-policy` refuses)
        found.append(("policy_iterations", f"{p['policy_iterations']} updates for {p['policy_rounds']} rounds: a "
                      "round would train none", f"give at least {p['policy_rounds']} (one per round)"))
    # A local trace's table count, from its tensors' shapes: tasks larger than its pools, or a hash-size file of
    # another trace, fail here instead of in ingest, after the trace was read (30 s or more).
    n_trace = _trace_table_count(str(p["input"])) if check_files and dlrm and not {"source", "input"} & bad \
        else None
    if rows_file and n_trace is not None and (local_rows := _local_file(rows_file)):
        from .ingest.dlrm import read_rows_file

        try:
            read_rows_file(local_rows, n_trace, n_trace)
        except EmbshardError as e:
            found.append(("rows_file", e.message, e.fix or ""))
    n_spec = _spec_table_count(str(p["input"])) if p["source"] == "spec" and check_files and "input" not in bad \
        else None
    # A file's population (the schema holds num_tables to MIN_TABLES): 2 tables had failed in train_cost_model,
    # after the benchmark, with "only 1 training and 2 validation shards".
    for n in (n_spec, n_trace):
        if n is not None and (small := population_problem(n, p["source"])):
            found.append(("input", *small))
    if "tables_per_task" not in bad:
        lo, _, hi = str(p["tables_per_task"]).partition("-")
        lo_n, hi_n = int(lo), int(hi or lo)
        if hi_n < lo_n:
            found.append(("tables_per_task", f"the range {p['tables_per_task']} runs backwards",
                          f"write it LOW-HIGH, e.g. {hi_n}-{lo_n}"))
        elif n_spec is not None and hi_n > n_spec // 2:
            found.append(_file_pools_too_small(hi_n, n_spec, "the spec's", "list at least 2 tables in the spec"))
        elif n_trace is not None and hi_n > n_trace // 2:
            found.append(_file_pools_too_small(hi_n, n_trace, "the trace's", "give a trace of at least 2 tables"))
        elif p["source"] == "synthetic" and "num_tables" not in bad and hi_n > int(p["num_tables"]) // 2:
            # ingest splits the tables into a train and a test pool (pools.assign: the test pool is the smaller
            # half), and every task draws from one pool
            found.append(("tables_per_task", f"tasks of up to {hi_n} tables from the {int(p['num_tables']) // 2} "
                          f"tables of the test pool ({p['num_tables']} tables, split into train and test pools)",
                          f"lower tables_per_task to at most {int(p['num_tables']) // 2}, or raise num_tables to "
                          f"at least {2 * hi_n}"))
    if "policy_curriculum" not in bad:
        try:
            curriculum_stages(p["policy_curriculum"])
        except EmbshardError as e:
            found.append(("policy_curriculum", e.message, e.fix or ""))
    if "eval_rounds" not in bad and int(p["eval_rounds"]) < 2:
        # One round per task gives no interval: the gate's verdict (and the export's refinement, refine_k) would
        # rest on single measurements, judged as if they were intervals.
        found.append(("eval_rounds", "one round gives no interval: the promotion gate"
                      + (f" and refine_k {p['refine_k']}" if "refine_k" not in bad and int(p["refine_k"]) > 0
                         else "") + " would judge single measurements",
                      "give eval_rounds 5 or more (2 at the least)"))
    if "devices" not in bad and "devices_per_host" not in bad:
        devices, per_host = int(p["devices"]), p["devices_per_host"]
        if per_host is None and devices > MAX_LOCAL_DEVICES:
            found.append(("devices_per_host", f"{devices} devices on one host, but torch numbers a host's GPUs "
                          f"0-{MAX_LOCAL_DEVICES - 1} (the TorchRec plans could not name them)",
                          "give devices_per_host, the GPUs per host of the training job (e.g. 8)"))
        elif per_host is not None and devices % int(per_host):
            found.append(("devices_per_host", f"{devices} devices do not split into hosts of {per_host}",
                          "give a number of GPUs per host that divides devices"))
    if not {"bench_chunks", "bench_shards"} & bad and int(p["bench_chunks"]) > int(p["bench_shards"]):
        # each chunk measures a share of the shards: more chunks than shards are tasks (pods) that measure nothing
        # (1,024 chunks of 73 shards had mapped 951 empty benchmark tasks)
        found.append(("bench_chunks", f"{p['bench_chunks']} chunks for {p['bench_shards']} shards: chunks beyond "
                      "the shards would measure nothing", f"give bench_chunks of at most {p['bench_shards']} "
                      "(bench_shards)"))
    if "eval_planners" not in bad and len(set(p["eval_planners"])) != len(p["eval_planners"]):
        found.append(("eval_planners", "a planner is listed twice", "list each planner once"))
    return found


_FIX_MISSING = "give an existing file (a path on the machine that runs ingest, or on its mounted volume)"


def _missing(path: str) -> bool:
    """A local path (or file:// URI) that names no file; a remote URI is left to ingest (a trace or a rows file
    is read from a local path only, and ingest says so in one line: checks.local_input_file)."""
    local = path.removeprefix("file://")
    return "://" not in local and not os.path.isfile(local)


def _local_file(path: str) -> str | None:
    """The local file a path or file:// URI names, or None (a remote URI, or no such file)."""
    local = path.removeprefix("file://")
    return local if "://" not in local and os.path.isfile(local) else None


def _dlrm_value(key: str, value):
    """A dlrm param as ingest reads it, so that a default written another way (`--param rows_file=`, dim ' Mixed')
    is not refused as a value given to another source."""
    if key == "rows_file":
        return (str(value).strip() or None) if value is not None else None
    if key == "dim" and isinstance(value, str):
        return value.strip().lower()
    return value


def _dim_problem(value) -> str | None:
    """What is wrong with a dim param (as ingest.dlrm.choose_dims refuses it), or None."""
    if isinstance(value, str) and value.strip().lower() == "mixed":
        return None
    try:
        # "64" from the form or `--param`, 64 or 64.0 from REST (JSON schema's integer takes 64.0); not "64.5"
        d = int(value) if isinstance(value, float) and value.is_integer() else int(str(value).strip())
    except (ValueError, OverflowError):
        return f"{str(value)[:40]!r} is neither a whole number nor 'mixed'"
    if checks.bad_dim(d):
        return f"{d} is not {checks.DIM_RULE} (FBGEMM's kernels measure no other)"
    return None


def _trace_files(spec: str) -> list[str]:
    """The files a dlrm input names (one, a glob pattern or a comma-separated list: ingest.dlrm.trace_files)."""
    from .ingest.dlrm import trace_files

    return trace_files(spec)


def _input_files(p: dict) -> int:
    """How many files ingest reads (a dlrm input may name several: each is read in full)."""
    if p["source"] != "dlrm" or not (p["input"] or "").strip():
        return 1
    try:
        return len(_trace_files(str(p["input"])))
    except EmbshardError:
        return 1  # check_params names the input's problem


def _trace_table_count(path: str) -> int | None:
    """The tables of a local DLRM trace (its first file, where the input names several), from its tensors'
    shapes (None: remote, compressed or unreadable; ingest reports those, and files of another table count)."""
    try:
        path = _trace_files(path)[0]
    except EmbshardError:
        return None  # reported with the input's other problems
    local = _local_file(path)
    if local is None:
        return None
    from .ingest.dlrm import trace_table_count

    return trace_table_count(local)


def population_problem(n: int, source: str) -> tuple[str, str] | None:
    """(message, fix) when `n` tables are too few for a run to learn from (MIN_TABLES), else None."""
    if n >= MIN_TABLES:
        return None
    return (f"{n} tables: a run learns from at least {MIN_TABLES} (split into a train and a test pool; its cost "
            "model needs 4 train-pool tables at the least)", f"give at least {MIN_TABLES} tables in the {source} file")


def _trace_format_problem(path: str) -> str | None:
    """ingest.dlrm.trace_format_problem of each local file of a trace input (None: none found, or remote)."""
    from .ingest.dlrm import trace_format_problem

    try:
        files = _trace_files(path)
    except EmbshardError:
        return None  # reported with the input's other problems
    for f in files:
        local = _local_file(f)
        if local is not None and (what := trace_format_problem(local)):
            return f"{f} {what}"
    return None


def _file_pools_too_small(hi_n: int, n: int, whose: str, too_few: str) -> tuple[str, str, str]:
    """tables_per_task's problem when tasks of up to hi_n tables cannot be drawn from a file's n tables."""
    return ("tables_per_task", f"tasks of up to {hi_n} tables from the {n // 2} tables of the test pool ({whose} "
            f"{n} tables, split into train and test pools)",
            f"{too_few} (the tables are split into two pools)" if n < 2
            else f"lower tables_per_task to at most {n // 2}" + (f", e.g. {max(n // 4, 1)}-{n // 2}" if n >= 4
                                                                  else ""))


def _spec_table_count(path: str) -> int | None:
    """The tables a local spec file lists (None: a remote or unreadable file, whose errors ingest reports)."""
    local = _local_file(path)
    if local is None:
        return None
    from .ingest.spec import read_spec_file

    try:
        return len(read_spec_file(local))
    except EmbshardError:
        return None


def _says(message: str) -> str:
    # jsonschema's "'abc' is not of type 'integer'" is already plain; keep it short, on one line, cut at a word end.
    from .errors import first_line

    return first_line(" ".join(message.split()), 160)


def _fix_from(schema: dict) -> str:
    if "enum" in schema:
        return f"choose one of {', '.join(map(str, schema['enum']))}"
    lo = schema.get("minimum", schema.get("exclusiveMinimum"))
    hi = schema.get("maximum")
    kind = {"integer": "a whole number", "number": "a number", "boolean": "true or false",
            "string": "a text"}.get(str(schema.get("type")), "a value")
    above = "minimum" not in schema and "exclusiveMinimum" in schema  # the bound itself is refused
    if lo is not None and hi is not None:
        return f"give {kind} above {lo}, up to {hi}" if above else f"give {kind} from {lo} to {hi}"
    if lo is not None:
        return f"give {kind} above {lo}" if above else f"give {kind} of at least {lo}"
    return f"give {kind}"


def check(params: dict | None, *, check_files: bool = True) -> dict:
    """The run's params with defaults filled in, or one EmbshardError naming every bad field and its fix."""
    found = problems(params, check_files=check_files)
    if found:
        detail = "; ".join(f"{f}: {what} (fix: {fix})" for f, what, fix in found)
        raise EmbshardError(f"{len(found)} invalid pipeline parameter(s): {detail}",
                            field=",".join(dict.fromkeys(f for f, _, _ in found)))
    return _normalised(params)


# --- time limits ---------------------------------------------------------------------------------------------------
# Sized from measured stage times (benchmarks/results/pipeline.md: the default run on a 2-core CPU) and the work a
# run's params ask for: SAFETY times the measured rate, never below a floor that covers start-up (imports, MLflow,
# the comm calibration). A GPU measures the same shards with batches 32x larger, whose inputs take seconds to make.
SAFETY = 10.0
FLOOR_S = {"check_params": 120, "ingest": 900, "sample_shards": 900, "benchmark": 900, "train_cost_model": 900,
           "train_policy": 900, "measure_policy_plans": 900, "evaluate_and_promote": 1200, "export_placements": 900}
# Measured seconds per unit of work, on the default run (units in the comments).
RATE_S = {
    "ingest": 9.3 / 240,               # per synthetic table
    "benchmark": 155.6 / (240 + 240),  # per shard (random and plan shards, and every table alone)
    "train_cost_model": 20.4 / 480,    # per measured shard
    "train_policy": 18.0 / 100,        # per REINFORCE iteration at tasks of up to 60 tables
    "measure_policy_plans": 8.4 / 4,   # per measured task of up to 60 tables
    "evaluate_and_promote": 114.8 / (5 * 5 * 5),  # per task x round x entry, tasks of up to 60 tables
    "export_placements": 6.5 / 12,     # per exported task
}
GPU_FACTOR = 4.0
RUN_TIMEOUT_H = 24.0  # the whole run (dagrun_timeout): it must not hold the one-run-at-a-time queue forever


def _max_tables(p: dict) -> int:
    lo, _, hi = str(p["tables_per_task"]).partition("-")
    return int(hi or lo)


def _curriculum_on(p: dict) -> bool:
    try:
        return bool(curriculum_stages(p.get("policy_curriculum")))
    except EmbshardError:
        return False


def stage_timeout_s(stage: str, params: dict | None) -> float:
    """The time limit of one task of `stage` in a run with `params` (timeout_scale included)."""
    p = _normalised(params)
    size = max(1.0, _max_tables(p) / 60)
    gpu = GPU_FACTOR if p["device"] != "cpu" else 1.0
    shards = int(p["bench_shards"]) + int(p["num_tables"])
    work = {
        "ingest": RATE_S["ingest"] * int(p["num_tables"]) * (1 if p["source"] == "synthetic" else 20)
        * _input_files(p),
        "benchmark": RATE_S["benchmark"] * shards / int(p["bench_chunks"]) * gpu,
        "train_cost_model": RATE_S["train_cost_model"] * shards * int(p["cost_members"]) / 3,
        # the curriculum (its 1,000-table updates capped by work, and validation on 12+ tasks of all its shapes)
        # measured 70 s for 300 updates (a 2-core CPU shared with other work): 1.3x the rate; 2x allowed
        "train_policy": RATE_S["train_policy"] * int(p["policy_iterations"]) * size
        * (2.0 if _curriculum_on(p) else 1.0),
        "measure_policy_plans": RATE_S["measure_policy_plans"] * 4 * size * gpu,
        "evaluate_and_promote": RATE_S["evaluate_and_promote"] * int(p["eval_tasks"]) * int(p["eval_rounds"])
        * (len(planners_of(p["eval_planners"])) + 3) * size * gpu,
        # refine_k measures K candidates per exported task in eval_rounds rounds, at the evaluation's rate
        "export_placements": (RATE_S["export_placements"] + RATE_S["evaluate_and_promote"] * int(p["eval_rounds"])
                              * int(p["refine_k"]) * gpu) * int(p["num_tasks"]) * 2 * size,
    }.get(stage, 0.0)
    return float(p["timeout_scale"]) * max(FLOOR_S.get(stage, 900), SAFETY * work)


PARAMS_FILE_ENV = "EMBSHARD_PARAMS_FILE"


def run_defaults() -> dict:
    """The DAG's param defaults: DEFAULT_PARAMS with the values of the JSON or YAML mapping that
    EMBSHARD_PARAMS_FILE names, read when the DAG is parsed. They are what every scheduled or asset-triggered run
    uses (such a run has no conf of its own: it had retrained on the synthetic default whatever a team's tables
    were) and what the trigger form starts from. Checked as a run's params are (the data files are not: the
    process that parses the DAG may not see them; ingest does), so that a bad file is one error naming it."""
    path = os.environ.get(PARAMS_FILE_ENV, "").strip()
    if not path:
        return dict(DEFAULT_PARAMS)
    import yaml  # light, and in every Airflow image

    fix = f"make {PARAMS_FILE_ENV} name a JSON or YAML mapping of pipeline params, e.g. {{source: spec, input: ...}}"
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except OSError as exc:
        raise EmbshardError(f"cannot be read ({exc.strerror or exc})", path=path, field=PARAMS_FILE_ENV,
                            fix=fix) from None
    except yaml.YAMLError as exc:
        raise EmbshardError(f"not JSON or YAML ({str(exc).splitlines()[0]})", path=path, field=PARAMS_FILE_ENV,
                            fix=fix) from None
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise EmbshardError(f"holds a {type(values).__name__}, not a mapping of params", path=path,
                            field=PARAMS_FILE_ENV, fix=fix)
    try:
        return check(values, check_files=False)
    except EmbshardError as exc:
        raise exc.at(path) from None


def run_timeout_h() -> float:
    """The whole run's limit in hours: EMBSHARD_RUN_TIMEOUT_H (read when the DAG is parsed), else RUN_TIMEOUT_H."""
    raw = os.environ.get("EMBSHARD_RUN_TIMEOUT_H", "")
    try:
        value = float(raw) if raw else RUN_TIMEOUT_H
    except ValueError:
        raise EmbshardError(f"EMBSHARD_RUN_TIMEOUT_H={raw!r}", field="EMBSHARD_RUN_TIMEOUT_H",
                            fix="set it to a number of hours") from None
    if not math.isfinite(value) or value <= 0:
        raise EmbshardError(f"EMBSHARD_RUN_TIMEOUT_H={raw!r}", field="EMBSHARD_RUN_TIMEOUT_H",
                            fix="set it to a positive number of hours")
    return value

