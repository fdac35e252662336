"""An input worker of bench.runner.InputPrefetcher, run as `python -m embshard.bench.input_worker STATE.pkl`.

STATE.pkl holds the tables and the benchmark settings. Each stdin line is a JSON job {members, cols, where,
rows, replicas, path}: the worker makes that shard's inputs (bench.runner.shard_inputs), saves them to `path`
and answers "ok <path>" (or "error <message>") on stdout, one line per job, in order. EOF ends it.
"""
from __future__ import annotations

import json
import pickle
import sys


def main(argv: list[str] | None = None) -> int:
    from .runner import shard_inputs

    (state_path,) = sys.argv[1:] if argv is None else argv
    with open(state_path, "rb") as f:
        state = pickle.load(f)
    tables, cfg = state["tables"], state["cfg"]
    for line in sys.stdin:
        job = json.loads(line)
        try:
            path = shard_inputs(tables, job["members"], cfg, job["cols"], job["where"],
                                job.get("rows"), job.get("replicas")).save(job["path"])
            print(f"ok {path}", flush=True)
        except Exception as exc:  # reported to the timing process, which stops with it
            print(f"error {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
