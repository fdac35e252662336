"""Cost-model accuracy per head against the reference estimators, from the pipeline's cost-model report.

The train_cost_model stage evaluates on two splits it never trained on: `heldout` (unseen shards of seen tables)
and `unseen` (shards made only of tables never seen in training), per head, for the learned model and the two
references (sum of single-table costs; an analytic bytes model fitted on the training shards). Its report.json
and parity plot live in the run root's cost_model/ folder; this module turns them into a results page.
"""
from __future__ import annotations

import json
import os
import shutil

import pandas as pd

from .common import md_table

ESTIMATORS = ("learned", "sum_singles", "analytic")
# No total over compute and comm: comm is a fitted formula (near exact) and would make a total look small.
HEADS = ("fwd_compute", "bwd_compute", "comm", "total_compute")


def report_dir(root: str, round_index: int | None = None) -> str:
    """Where the train_cost_model stage wrote the report of a round's model: cost_model/ for the first round,
    cost_model/round-<r>/ for a later one (the model the run registered last, and the one its policy uses)."""
    base = os.path.join(root, "cost_model")
    return base if not round_index or int(round_index) <= 1 else os.path.join(base, f"round-{int(round_index)}")


def load(root: str, round_index: int | None = None) -> dict | None:
    path = os.path.join(report_dir(root, round_index), "report.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def table(full: dict) -> pd.DataFrame:
    """One row per (split, head): MAPE % and Spearman of each estimator on the compared shards."""
    rows = []
    for split, rep in full.get("report", {}).items():
        for h in HEADS:
            row = {"split": split, "head": h, "compared shards": rep.get("n_compared"),
                   "all shards": rep.get("n_shards")}
            for e in ESTIMATORS:
                m = (rep.get(e) or {}).get(h) or {}
                row[f"{e} MAPE %"] = m.get("mape", float("nan"))
                row[f"{e} Spearman"] = m.get("spearman", float("nan"))
            m = (rep.get("learned_all_shards") or {}).get(h) or {}
            row["learned MAPE % (all shards)"] = m.get("mape", float("nan"))
            rows.append(row)
    return pd.DataFrame(rows)


def overall(full: dict) -> pd.DataFrame:
    rows = []
    for split, rep in full.get("report", {}).items():
        ov = rep.get("overall") or {}
        for k, m in ov.items():
            rows.append({"split": split, "estimate of a placement's cost": k, "MAPE %": m.get("mape"),
                         "Spearman": m.get("spearman"), "placements": m.get("n")})
    return pd.DataFrame(rows)


def markdown(full: dict | None, root: str, out_dir: str, hw_line: str, model_uri: str,
             policy_cost_model: str | None = None, round_index: int | None = None) -> tuple[str, dict]:
    """The page text and headline numbers; copies the stage's parity plot next to it."""
    lines = ["# Cost-model accuracy", "", f"Hardware: {hw_line}", ""]
    if full is None:
        lines.append(f"No cost-model report found under {report_dir(root, round_index)}.")
        return "\n".join(lines), {}
    splits = full.get("splits", {})
    lines += [f"Model `{model_uri}`, trained by the pipeline's train_cost_model stage on measured device shards "
              f"(splits: {', '.join(f'{k} {v}' for k, v in splits.items())}; best epoch {full.get('best_epoch')}). "
              "`heldout`: unseen shards of training tables; `unseen`: shards of tables never seen in training. "
              "Compared on the shards of >= 2 tables whose tables were all measured alone (what the sum-of-singles "
              "reference needs); `learned MAPE % (all shards)` is the learned model on every shard of the split. "
              "MAPE: mean absolute percentage error (lower is better); Spearman: rank correlation (higher is "
              "better, what placement search needs).", ""]
    if policy_cost_model and policy_cost_model != model_uri:
        lines += [f"The learned planner uses `{policy_cost_model}`: the policy stage's refit of this model on the "
                  "shards it measured for its own placements.", ""]
    parity = os.path.join(report_dir(root, round_index), "parity.png")
    if os.path.exists(parity):
        shutil.copyfile(parity, os.path.join(out_dir, "costmodel_parity.png"))
        lines += ["![parity](costmodel_parity.png)", ""]
    tab = table(full)
    lines += [md_table(tab, {"compared shards": 0, "all shards": 0}), ""]
    ov = overall(full)
    if len(ov):
        lines += ["Whole placements assembled from measured shards (max over devices):", "",
                  md_table(ov, {"placements": 0}), ""]
    cal_rows = []
    for split, rep in full.get("report", {}).items():
        cal = (rep.get("calibration") or {}).get("total_compute") or {}
        cap = rep.get("rows_capped") or {}
        if cal:
            cal_rows.append({"split": split, "interval target %": 100 * rep["calibration"]["level"],
                             "measured compute inside %": 100 * cal["coverage"],
                             "median half-width %": 100 * cal["half_width"],
                             "compute MAPE %, capped rows": (cap.get("capped") or {}).get("mape"),
                             "capped shards": (cap.get("capped") or {}).get("n"),
                             "compute MAPE %, uncapped": (cap.get("uncapped") or {}).get("mape"),
                             "uncapped shards": (cap.get("uncapped") or {}).get("n")})
    if cal_rows:
        lines += ["The ensemble's interval (calibrated on the validation shards) and the error on shards whose rows "
                  "were capped to fit this machine's memory:", "",
                  md_table(pd.DataFrame(cal_rows), {"capped shards": 0, "uncapped shards": 0}), ""]
    origin_rows = [{"split": split, "shards": kind, "n": v["n"], "compute MAPE %": v["mape"],
                    "compute Spearman": v["spearman"]}
                   for split, rep in full.get("report", {}).items()
                   for kind, v in (rep.get("by_origin") or {}).items() if v.get("n")]
    if origin_rows:
        lines += ["Compute error by where the shards come from: `random` (1-15 random tables), `plan` (devices of "
                  "greedy plans of 20-200-table tasks on 2-16 devices, half one search step away: the shards "
                  "planners compare), `placement` (the learned planner's own measured plans):", "",
                  md_table(pd.DataFrame(origin_rows), {"n": 0}), ""]
    type_rows = [{"split": split, "shards": kind, "n": v["n"], "compute MAPE %": v["mape"],
                  "compute Spearman": v["spearman"]}
                 for split, rep in full.get("report", {}).items()
                 for kind, v in (rep.get("by_element_type") or {}).items() if v.get("n")]
    if any(r["shards"] == "holds_fp16" for r in type_rows):
        lines += ["Compute error by weight type: shards holding an FP16 table, and FP32-only ones (the model tells the "
                  "types apart by a table's bytes per row: it prices a type well only where it measured it):", "",
                  md_table(pd.DataFrame(type_rows), {"n": 0}), ""]
    mono_rows = [{"split": split, "additions tried": m["additions"], "predicted cheaper": m["lower"],
                  "share %": 100 * m["share_lower"], "worst drop %": 100 * max(m["worst_drop"], 0.0)}
                 for split, rep in full.get("report", {}).items()
                 if (m := rep.get("monotonicity") or {}).get("additions")]
    if mono_rows:
        lines += ["One more table on a device, predicted cheaper than the device without it (measured device contents "
                  "of the split, every other table added in turn; a planner takes every such prediction as a free "
                  "lunch; 0 for a monotone model):", "",
                  md_table(pd.DataFrame(mono_rows), {"additions tried": 0, "predicted cheaper": 0}), ""]
    head = {}
    for split in ("unseen", "heldout"):
        sub = tab[(tab["split"] == split) & (tab["head"] == "total_compute")]
        if len(sub):
            r = sub.iloc[0]
            head[split] = {e: {"mape": r[f"{e} MAPE %"], "spearman": r[f"{e} Spearman"]} for e in ESTIMATORS}
            head[split]["learned_all_shards_mape"] = r["learned MAPE % (all shards)"]
            head[split]["shards"] = r["compared shards"]
            head[split]["all_shards"] = r["all shards"]
    return "\n".join(lines), head
