"""The train_cost_model stage: costs + tables -> trained model, honest accuracy report, MLflow run + registry.

Accuracy is reported on the `heldout` split (unseen shards of seen tables) and the `unseen` split (shards made
only of tables never seen in training), per head (fwd_compute, bwd_compute, comm) and for compute alone
(fwd + bwd: where placements differ), for the learned model and the two references side by side. No total over
compute and comm is reported: comm is a fitted formula, near exact, and would make any total look small.
Also per split: the calibration of the ensemble's interval (the share of measured costs inside it), and the
compute error on shards whose rows were capped to fit the measuring machine against those that were not, and by
shard origin (random shards, devices of greedy plans and their search neighbours, measured planner plans).
The registered model is the ensemble that was evaluated (no refit after the report). The comparison set of a
split is its shards of >= 2 tables whose tables were all measured alone (the single-table reference needs that;
on a single-table shard it would be exact by definition); the learned model is also reported on every shard.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from typing import Any

import numpy as np

from .. import registry, storage
from ..costmodel import REGISTERED_NAME
from ..costmodel.data import CostData, assemble_placements, load
from ..costmodel.ensemble import INTERVAL_LEVEL, coverage, interval, member_predictions
from ..costmodel.reference import AnalyticEstimator, metrics, sum_of_singles, with_totals
from ..costmodel.train import DEFAULT_MEMBERS, History, TrainParams, fit_ensemble
from ..features import FEATURE_NAMES
from ..schemas import FEATURE_VERSION
from ..tableset import TableSet

log = logging.getLogger(__name__)

EVAL_HEADS = ("fwd_compute", "bwd_compute", "comm", "total_compute")
ESTIMATORS = ("learned", "sum_singles", "analytic")


def predict_rows(model, data: CostData, idx: np.ndarray) -> np.ndarray:
    """(len(idx), 3) predictions (the ensemble's mean) of measured shards."""
    return member_predictions(model, data, idx).mean(0)


def calibration(model, data: CostData, idx: np.ndarray) -> dict:
    """Share of measured costs inside the ensemble's interval, per head and for compute, with the interval's
    median relative half-width (how wide it had to be)."""
    per = member_predictions(model, data, idx)
    z = float(getattr(model, "interval_z", 0.0))
    heads = {"fwd_compute": per[..., 0], "bwd_compute": per[..., 1], "total_compute": per[..., :2].sum(-1)}
    truth = {"fwd_compute": data.targets[idx, 0], "bwd_compute": data.targets[idx, 1],
             "total_compute": data.targets[idx, :2].sum(1)}
    out: dict = {"level": INTERVAL_LEVEL, "z": z}
    for h, p in heads.items():
        lo, hi = interval(p, z)
        mean = p.mean(0)
        width = np.median((hi - lo) / 2 / np.maximum(mean, 1e-12)) if len(mean) else float("nan")
        out[h] = {"coverage": coverage(p, truth[h], z), "half_width": float(width)}
    return out


def _compute_metrics_by(learned: np.ndarray, data: CostData, idx: np.ndarray, groups: dict[str, np.ndarray]) -> dict:
    """Compute (forward + backward) metrics of the shards `idx` in each boolean group; `learned`: the model's
    (len(idx), 3) predictions of those shards."""
    pred = learned[:, :2].sum(1)
    true = data.targets[idx, :2].sum(1)
    return {name: metrics(pred[sel], true[sel]) if sel.any() else {"n": 0} for name, sel in groups.items()}


def capped_breakdown(learned: np.ndarray, data: CostData, idx: np.ndarray) -> dict:
    """Compute MAPE on shards measured with rows capped (row_scale < 1) and on the others."""
    if "row_scale" not in data.frame.columns:
        return {}
    capped = data.frame["row_scale"].to_numpy(float)[idx] < 0.999
    return _compute_metrics_by(learned, data, idx, {"capped": capped, "uncapped": ~capped})


def origin_breakdown(learned: np.ndarray, data: CostData, idx: np.ndarray) -> dict:
    """Compute metrics by where a shard came from: random (1-15 tables), plan (devices of greedy plans of 20-200
    tables and their search neighbours: what the planners compare), placement (a planner's measured plans)."""
    if "origin" not in data.frame.columns:
        return {}
    kind = np.array([str(o).split(":")[0] for o in data.frame["origin"].to_numpy()[idx]])
    return _compute_metrics_by(learned, data, idx, {k: kind == k for k in ("random", "plan", "placement")
                                                    if (kind == k).any()})


def kind_breakdown(learned: np.ndarray, data: CostData, idx: np.ndarray) -> dict:
    """Compute metrics (MAPE, RMSE, Spearman) on shards holding a split piece (a column slice or a row range,
    docs/contracts.md "Shard kinds") and on whole-table shards, separately."""
    split = data.split_mask(idx)
    return _compute_metrics_by(learned, data, idx, {"split": split, "whole": ~split})


def element_breakdown(learned: np.ndarray, data: CostData, idx: np.ndarray) -> dict:
    """Compute metrics on shards holding an FP16 table and on FP32-only ones, separately (the model learns a
    table's type from its bytes: only where it measured both does it price both)."""
    if data.holds_fp16 is None:
        return {}
    half = data.holds_fp16[np.asarray(idx, dtype=np.int64)]
    return _compute_metrics_by(learned, data, idx, {"holds_fp16": half, "fp32_only": ~half})


def evaluate(model, data: CostData, analytic: AnalyticEstimator, seed: int = 0) -> dict:
    """Nested report: report[split][estimator][head] = {mape, rmse, spearman, n}, plus coverage and overall."""
    report: dict = {}
    for split in ("heldout", "unseen"):
        idx = data.index(split)
        if len(idx) == 0:
            continue
        true = with_totals(data.targets[idx])
        learned = predict_rows(model, data, idx)
        singles = sum_of_singles(data, idx)
        several = np.array([len(data.shards[s]) >= 2 for s in idx])
        multi = several & np.isfinite(singles[:, :2]).all(1)
        preds = {"learned": learned, "sum_singles": singles, "analytic": analytic.predict(data, idx)}
        rep: dict[str, Any] = {"n_shards": int(len(idx)), "n_compared": int(multi.sum()),
               "coverage_singles": float(np.isfinite(singles[:, :2]).all(1)[several].mean()) if several.any()
               else 0.0}
        for est, p in preds.items():
            pt = with_totals(p)
            rep[est] = {h: metrics(pt[h][multi], true[h][multi]) for h in EVAL_HEADS}
        lt = with_totals(learned)
        rep["learned_all_shards"] = {h: metrics(lt[h], true[h]) for h in EVAL_HEADS}
        rep["overall"] = _evaluate_overall(model, data, idx, seed)
        rep["calibration"] = calibration(model, data, idx)
        rep["rows_capped"] = capped_breakdown(learned, data, idx)
        rep["by_origin"] = origin_breakdown(learned, data, idx)
        rep["by_shard_kind"] = kind_breakdown(learned, data, idx)
        rep["by_element_type"] = element_breakdown(learned, data, idx)
        rep["monotonicity"] = monotonicity(model, data, idx, seed)
        if "spread" in data.frame.columns:
            sp = data.frame["spread"].to_numpy(float)[idx]
            rep["noise_spread_median"] = float(np.nanmedian(sp)) if np.isfinite(sp).any() else float("nan")
        report[split] = rep
    return report


def monotonicity(model, data: CostData, idx: np.ndarray, seed: int = 0, sets: int = 200) -> dict:
    """How often the model predicts a device CHEAPER for one more table: `sets` device contents drawn from the
    split's measured shards, each with every other table of the split added in turn, at the shard's device count.
    A planner minimises the prediction, so every such addition is a free lunch it takes (an unconstrained model
    predicted 4% of them, and the plan that packed tiny tables onto a hot table's device measured 1.19x the best
    greedy's); a monotone model (model._Head) has none."""
    import torch

    tables = np.unique(np.concatenate([data.shards[s] for s in idx])) if len(idx) else np.array([], dtype=int)
    if len(tables) < 2:
        return {}
    rng = np.random.default_rng(seed + 11)
    enc = model.encode(data.features)
    additions = lower = 0
    worst = 0.0
    for s in rng.choice(idx, size=min(sets, len(idx)), replace=False):
        on = data.shards[s]
        rest = np.setdiff1d(tables, on)
        if not len(rest):
            continue
        d = int(data.num_devices[s])
        base = enc[torch.from_numpy(on)].sum(0)
        before = float(model.totals_from_sums(base[None], d)[0])
        after = model.totals_from_sums(base + enc[torch.from_numpy(rest)], d).numpy().astype(float)
        drop = (before - after) / max(before, 1e-12)
        additions += len(rest)
        lower += int((drop > 1e-6).sum())
        worst = max(worst, float(drop.max()))
    return {"additions": int(additions), "lower": int(lower),
            "share_lower": lower / additions if additions else float("nan"), "worst_drop": worst}


def _evaluate_overall(model, data: CostData, idx: np.ndarray, seed: int) -> dict:
    import torch

    pls = assemble_placements(data, idx, 300, seed + 7)
    if not pls:
        return {}
    enc = model.encode(data.features)
    head_pred, max_pred, true = [], [], []
    for shards, y in pls:
        sums = torch.stack([enc[torch.from_numpy(data.shards[s])].sum(0) for s in shards])
        head_pred.append(float(model.overall_from_sums(sums[None])[0]))
        max_pred.append(float(model.totals_from_sums(sums, len(shards)).max()))
        true.append(y)
    return {"overall_head": metrics(np.array(head_pred), np.array(true)),
            "max_of_device_totals": metrics(np.array(max_pred), np.array(true))}


def _flat_metrics(report: dict, prefix: str = "") -> dict[str, float]:
    """MLflow metrics from the nested report: dotted keys, finite numbers only (counts `n` left out)."""
    out: dict[str, float] = {}
    for key, val in report.items():
        name = f"{prefix}{key}"
        if isinstance(val, dict):
            out.update(_flat_metrics(val, name + "."))
        elif isinstance(val, (int, float)) and key != "n" and np.isfinite(val):
            out[name] = float(val)
    return out


def summary_table(report: dict) -> str:
    """A short human table: accuracy per head, learned vs references, per split."""
    lines = []
    for split, rep in report.items():
        lines.append(f"{split}: {rep['n_shards']} shards, {rep['n_compared']} compared (>=2 tables, all singles "
                     f"measured)")
        lines.append(f"  {'head':<14}" + "".join(f"{e:>26}" for e in ESTIMATORS))
        lines.append(f"  {'':<14}" + "".join(f"{'MAPE%  RMSEms  Spearman':>26}" for _ in ESTIMATORS))
        for h in EVAL_HEADS:
            cells = []
            for e in ESTIMATORS:
                m = rep[e][h]
                cells.append(f"{m['mape']:7.1f} {m['rmse']:8.3f} {m['spearman']:8.3f}")
            lines.append(f"  {h:<14}" + "".join(f"{c:>26}" for c in cells))
        ov = rep.get("overall") or {}
        if ov:
            lines.append(f"  overall (assembled placements): head MAPE {ov['overall_head']['mape']:.1f}%, "
                         f"max-of-device-totals MAPE {ov['max_of_device_totals']['mape']:.1f}%")
        cal = rep.get("calibration") or {}
        if "total_compute" in cal:
            c = cal["total_compute"]
            lines.append(f"  interval ({100 * cal['level']:.0f}% target, z={cal['z']:.2f}): holds "
                         f"{100 * c['coverage']:.0f}% of measured compute costs, median half-width "
                         f"{100 * c['half_width']:.0f}%")
        cap = rep.get("rows_capped") or {}
        if cap.get("capped", {}).get("n") and cap.get("uncapped", {}).get("n"):
            lines.append(f"  compute MAPE on shards with capped rows {cap['capped']['mape']:.1f}% "
                         f"(n={cap['capped']['n']}), uncapped {cap['uncapped']['mape']:.1f}% "
                         f"(n={cap['uncapped']['n']})")
        kinds = rep.get("by_shard_kind") or {}
        if kinds:
            lines.append("  compute on split shards (column slices, row ranges): " + ", ".join(
                f"{k} MAPE {v['mape']:.1f}% Spearman {v['spearman']:.3f} (n={v['n']})" if v.get("n")
                else f"{k} none measured" for k, v in kinds.items()))
        types = rep.get("by_element_type") or {}
        if types.get("holds_fp16", {}).get("n"):
            lines.append("  compute by weight type: " + ", ".join(
                f"{k} MAPE {v['mape']:.1f}% Spearman {v['spearman']:.3f} (n={v['n']})" for k, v in types.items()
                if v.get("n")))
        mono = rep.get("monotonicity") or {}
        if mono.get("additions"):
            lines.append(f"  one more table predicted cheaper: {mono['lower']} of {mono['additions']} additions "
                         f"({100 * mono['share_lower']:.1f}%), worst {100 * max(mono['worst_drop'], 0.0):.1f}% "
                         "lower (0 for a monotone model)")
        by = {k: v for k, v in (rep.get("by_origin") or {}).items() if v.get("n")}
        if by:
            lines.append("  compute by shard origin: " + ", ".join(
                f"{k} MAPE {v['mape']:.1f}% Spearman {v['spearman']:.3f} (n={v['n']})" for k, v in by.items()))
    return "\n".join(lines)


def _plots(model, data: CostData, hist: History, folder: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(hist.train_loss, label="train")
    ax[0].plot(hist.val_loss, label="validation")
    ax[0].axvline(hist.best_epoch, color="grey", ls=":", label="best (kept)")
    ax[0].set(yscale="log", xlabel="epoch", ylabel="squared log-ratio loss", title="cost heads")
    ax[0].legend()
    if hist.overall_val_loss:
        ax[1].plot(hist.overall_train_loss, label="train")
        ax[1].plot(hist.overall_val_loss, label="validation")
        ax[1].set(yscale="log", xlabel="epoch", title="overall head")
        ax[1].legend()
    fig.tight_layout()
    paths["learning_curves.png"] = os.path.join(folder, "learning_curves.png")
    fig.savefig(paths["learning_curves.png"], dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for split, color in (("heldout", "tab:blue"), ("unseen", "tab:orange")):
        idx = data.index(split)
        if len(idx) == 0:
            continue
        pred, true = with_totals(predict_rows(model, data, idx)), with_totals(data.targets[idx])
        for a, h in zip(axes, ("fwd_compute", "bwd_compute", "comm")):
            ok = true[h] > 0
            a.scatter(true[h][ok], pred[h][ok], s=8, alpha=0.6, color=color, label=split)
    for a, h in zip(axes, ("fwd_compute", "bwd_compute", "comm")):
        lo, hi = a.get_xlim()
        if lo > 0:
            a.plot([lo, hi], [lo, hi], color="black", lw=0.8)
            a.set(xscale="log", yscale="log")
        a.set(xlabel="measured ms", ylabel="predicted ms", title=h)
        a.legend()
    fig.tight_layout()
    paths["parity.png"] = os.path.join(folder, "parity.png")
    fig.savefig(paths["parity.png"], dpi=90)
    plt.close(fig)
    return paths


def run(costs: str | list[str], tables: str, out: str | None = None, *, seed: int = 0, alias: str | None = None,
        max_epochs: int = 400, patience: int = 60, register: bool = True,
        experiment: str = registry.DEFAULT_EXPERIMENT, members: int = DEFAULT_MEMBERS,
        calibration_dir: str | None = None) -> dict:
    """Train, evaluate, log and register the cost model.

    `members`: networks in the ensemble (costmodel.train.fit_ensemble); the evaluated ensemble is registered.
    `calibration_dir`: where the costs' communication calibration is (comm_calibration.json, by hardware); the
    model records the entry of its hardware, so whoever uses the model knows which all-to-all it learned.
    `out`: folder for the model files, plots and report.json (and the default MLflow sqlite store);
    a temporary folder when None. `alias` (e.g. "challenger") is set on the new registered version.
    Returns {"model" (the trained CostEnsemble), "report", "metrics", "model_uri", "model_version", "run_id",
    "out", "summary", "splits", "history", "tracking_uri"}.
    """
    import mlflow

    from ..costmodel.pyfunc import CostModelPyfunc, example_input, predict_frame

    t0 = time.perf_counter()
    data = load(costs, tables, seed=seed)
    params = TrainParams(seed=seed, max_epochs=max_epochs, patience=patience)
    model, hist = fit_ensemble(data, params, members)
    calibration = None
    if calibration_dir is not None:
        from ..bench.comm import run_calibration

        calibration = run_calibration(calibration_dir, data.hardware)
        for m in model.members:
            m.config.comm_calibration = calibration
    # The network the model was priced for, beside its other params: two versions trained on calibrations apart
    # price every all-to-all differently (bench.comm.warn_if_busy says why a CPU calibration can be off).
    comm_params = {} if not calibration else {
        "comm_bandwidth_gbps": round(float(calibration["bandwidth_Bps"]) / 1e9, 4),
        "comm_latency_us": round(float(calibration["latency_s"]) * 1e6, 2),
        "comm_busy_cores": round(float(calibration.get("busy_cores", 0.0)), 2)}
    analytic = AnalyticEstimator().fit(data, data.index("train"))
    report = evaluate(model, data, analytic, seed=seed)
    flat = _flat_metrics(report)
    summary = summary_table(report)

    out = os.path.abspath(out) if out else tempfile.mkdtemp(prefix="embshard-cost-")
    os.makedirs(out, exist_ok=True)
    uri = registry.use(out, experiment)
    # The model folder, plots and report are published under `out` only once the version is registered: a
    # killed run leaves no model folder without a version, only its stage folder, which the next run into `out`
    # removes (storage.staged_dir).
    with storage.staged_dir(out) as stage:
        artifacts = model.save(os.path.join(stage, "model"))
        plots = _plots(model, data, hist, stage)
        counts = {s: int((data.split == s).sum()) for s in ("train", "val", "heldout", "unseen")}
        full = {"report": report, "splits": counts, "dropped": data.dropped, "analytic": analytic.to_dict(),
                "best_epoch": hist.best_epoch, "epochs": len(hist.val_loss)}
        with open(os.path.join(stage, "report.json"), "w", encoding="utf-8") as f:
            json.dump(full, f, indent=1, default=float)

        tags = {"hardware": data.hardware, "backend": data.backend, "dataset_hash": data.dataset_hash,
                "feature_version": FEATURE_VERSION, "batch_size": data.batch_size}
        # Nested when called inside another run (the policy's outer loop refits the cost model).
        with registry.start_run(run_name="train-cost", nested=mlflow.active_run() is not None) as active:
            mlflow.set_tags({f"embshard.{k}": v for k, v in tags.items()})
            mlflow.log_params({"seed": seed, "members": members, "max_epochs": max_epochs,
                               "patience": patience, "lr": params.lr, "hidden": params.hidden,
                               "embed": params.embed, "head_hidden": params.head_hidden,
                               "monotone": params.monotone,
                               "batch_shards": params.batch_shards,
                               # which split the val/heldout metrics are of (costmodel.data.load)
                               "split_rule": "tables alone train",
                               "costs": costs, "tables": tables, "batch_size": data.batch_size,
                               **comm_params, **{f"n_{k}": v for k, v in counts.items()},
                               **{f"dropped_{k}": v for k, v in data.dropped.items()}})
            for name, series in (("train_loss", hist.train_loss), ("val_loss", hist.val_loss),
                                 ("overall_train_loss", hist.overall_train_loss),
                                 ("overall_val_loss", hist.overall_val_loss)):
                for step, v in enumerate(series):
                    mlflow.log_metric(name, v, step=step)
            mlflow.log_metrics(flat)
            for p in plots.values():
                mlflow.log_artifact(p)
            mlflow.log_artifact(os.path.join(stage, "report.json"))
            version = None
            if register:
                example = example_input(TableSet.read(tables), int(np.max(data.num_devices)))
                version = registry.log_and_register(
                    CostModelPyfunc(), artifacts, REGISTERED_NAME, tags,
                    signature=registry.signature(example, predict_frame(model, example),
                                                 required=["shard", "num_devices", *FEATURE_NAMES]),
                    description=f"Cost model of device shards on {data.hardware} ({data.backend}, batch "
                                f"{data.batch_size}), trained on {counts['train']} measured shards.")
                if alias:
                    registry.set_alias(REGISTERED_NAME, alias, version.version)
            run_id = active.info.run_id
    log.info("train-cost done in %.1f s", time.perf_counter() - t0)
    model_uri = (f"models:/{REGISTERED_NAME}@{alias}" if alias and version is not None
                 else f"models:/{REGISTERED_NAME}/{version.version}" if version is not None else None)
    return {"model": model, "report": report, "metrics": flat, "model_uri": model_uri,
            "model_version": None if version is None else int(version.version), "run_id": run_id, "out": out,
            "summary": summary, "splits": counts, "history": hist,
            "tracking_uri": uri}


# --- `embshard train-cost` ---------------------------------------------------------------------
# What `embshard train-cost` writes and reads: its --out is checked before any work (cli.check_output).
OUTPUT = {"kind": "folder", "writes": ("model", "report.json"), "inputs": ("costs", "tables")}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--costs", required=True, help="costs folder (part-*.parquet) or file")
    parser.add_argument("--tables", required=True, help="tables.parquet the costs were measured on")
    parser.add_argument("--out", default=None, help="folder for model files, plots, report.json and the "
                                                    "default MLflow store (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--members", type=int, default=DEFAULT_MEMBERS,
                        help=f"ensemble members (default {DEFAULT_MEMBERS}; their disagreement is the uncertainty)")
    parser.add_argument("--alias", default=None, help="alias to set on the new version, e.g. challenger")
    parser.add_argument("--max-epochs", type=int, default=400)
    parser.add_argument("--no-register", action="store_true", help="log the run but do not register a model")


def main(args: argparse.Namespace) -> int:
    res = run(args.costs, args.tables, args.out, seed=args.seed, alias=args.alias,
              max_epochs=args.max_epochs, register=not args.no_register, members=args.members)
    sp = res["splits"]
    print(f"shards: train {sp['train']}, val {sp['val']}, heldout {sp['heldout']}, unseen {sp['unseen']}")
    print(res["summary"])
    if res["model_uri"]:
        print(f"registered {res['model_uri']} (version {res['model_version']}, run {res['run_id']})")
    print(f"files in {res['out']}")
    return 0
