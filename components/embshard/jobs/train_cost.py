"""The train_cost_model stage: costs + tables -> trained model, honest accuracy report, MLflow run + registry.

Accuracy is reported on the `heldout` split (unseen shards of seen tables) and the `unseen` split (shards made
only of tables never seen in training), per head (fwd_compute, bwd_compute, comm, total_compute, total),
for the learned model and the two references side by side. The comparison set of a split is its shards of
>= 2 tables whose tables were all measured alone (the single-table reference needs that; on a single-table
shard it would be exact by definition); the learned model is also reported on every shard of the split.
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

from .. import registry
from ..costmodel import REGISTERED_NAME
from ..costmodel.data import CostData, assemble_placements, load
from ..costmodel.model import HEADS, CostModel
from ..costmodel.reference import AnalyticEstimator, metrics, sum_of_singles, with_totals
from ..costmodel.train import History, TrainParams, fit
from ..features import FEATURE_NAMES
from ..schemas import FEATURE_VERSION
from ..tableset import TableSet

log = logging.getLogger(__name__)

EVAL_HEADS = ("fwd_compute", "bwd_compute", "comm", "total_compute", "total")
ESTIMATORS = ("learned", "sum_singles", "analytic")


def predict_rows(model: CostModel, data: CostData, idx: np.ndarray) -> np.ndarray:
    """(len(idx), 3) predictions of measured shards, one batched call per device count."""
    out = np.zeros((len(idx), len(HEADS)))
    for d in np.unique(data.num_devices[idx]):
        sel = np.flatnonzero(data.num_devices[idx] == d)
        out[sel] = model.predict_shards(data.features, [data.shards[s] for s in idx[sel]], int(d))
    return out


def evaluate(model: CostModel, data: CostData, analytic: AnalyticEstimator, seed: int = 0) -> dict:
    """Nested report: report[split][estimator][head] = {mape, rmse, spearman, n}, plus coverage and overall."""
    report: dict = {}
    for split in ("heldout", "unseen"):
        idx = data.index(split)
        if len(idx) == 0:
            continue
        true = with_totals(data.targets[idx])
        learned = predict_rows(model, data, idx)
        singles = sum_of_singles(data, idx)
        multi = np.array([len(data.shards[s]) >= 2 for s in idx]) & np.isfinite(singles).all(1)
        preds = {"learned": learned, "sum_singles": singles, "analytic": analytic.predict(data, idx)}
        several = np.array([len(data.shards[s]) >= 2 for s in idx])
        rep: dict[str, Any] = {"n_shards": int(len(idx)), "n_compared": int(multi.sum()),
               "coverage_singles": float(np.isfinite(singles).all(1)[several].mean()) if several.any() else 0.0}
        for est, p in preds.items():
            pt = with_totals(p)
            rep[est] = {h: metrics(pt[h][multi], true[h][multi]) for h in EVAL_HEADS}
        lt = with_totals(learned)
        rep["learned_all_shards"] = {h: metrics(lt[h], true[h]) for h in EVAL_HEADS}
        rep["overall"] = _evaluate_overall(model, data, idx, seed)
        if "spread" in data.frame.columns:
            sp = data.frame["spread"].to_numpy(float)[idx]
            rep["noise_spread_median"] = float(np.nanmedian(sp)) if np.isfinite(sp).any() else float("nan")
        report[split] = rep
    return report


def _evaluate_overall(model: CostModel, data: CostData, idx: np.ndarray, seed: int) -> dict:
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


def _flat_metrics(report: dict) -> dict[str, float]:
    out = {}
    for split, rep in report.items():
        for key, val in rep.items():
            if isinstance(val, dict):
                for head, m in val.items():
                    for name, x in m.items():
                        if name != "n" and x == x:  # skip NaN
                            out[f"{split}.{key}.{head}.{name}"] = float(x)
            elif isinstance(val, (int, float)) and val == val:
                out[f"{split}.{key}"] = float(val)
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
    return "\n".join(lines)


def _plots(model: CostModel, data: CostData, hist: History, folder: str) -> dict[str, str]:
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
        experiment: str = registry.DEFAULT_EXPERIMENT, refit_all: bool = True) -> dict:
    """Train, evaluate, log and register the cost model.

    `refit_all`: after the report, refit on all measured train-pool shards (the held-out ones too) and register
    that model (the report then describes the training procedure, not the registered weights' own test set).
    `out`: folder for the model files, plots and report.json (and the default MLflow sqlite store);
    a temporary folder when None. `alias` (e.g. "challenger") is set on the new registered version.
    Returns {"model" (the trained CostModel), "report", "metrics", "model_uri", "model_version", "run_id",
    "out", "summary", "splits", "history", "tracking_uri"}.
    """
    import mlflow

    from ..costmodel.pyfunc import CostModelPyfunc, example_input, predict_frame

    t0 = time.perf_counter()
    data = load(costs, tables, seed=seed)
    params = TrainParams(seed=seed, max_epochs=max_epochs, patience=patience)
    model, hist = fit(data, params)
    analytic = AnalyticEstimator().fit(data, data.index("train"))
    report = evaluate(model, data, analytic, seed=seed)
    eval_model = model
    if refit_all:
        # The report above measures the procedure honestly; the model that gets registered then learns from
        # every measured train-pool shard (the held-out ones too). Test-pool shards stay out: the held-out
        # tasks that evaluate the planner are made of those tables (embshard.pools).
        import dataclasses

        split = data.split.copy()
        split[split == "heldout"] = "train"
        model, _ = fit(dataclasses.replace(data, split=split), params)
    flat = _flat_metrics(report)
    summary = summary_table(report)

    out = os.path.abspath(out) if out else tempfile.mkdtemp(prefix="embshard-cost-")
    os.makedirs(out, exist_ok=True)
    artifacts = model.save(os.path.join(out, "model"))
    plots = _plots(eval_model, data, hist, out)  # parity of the honestly evaluated model
    counts = {s: int((data.split == s).sum()) for s in ("train", "val", "heldout", "unseen")}
    full = {"report": report, "splits": counts, "dropped": data.dropped, "analytic": analytic.to_dict(),
            "best_epoch": hist.best_epoch, "epochs": len(hist.val_loss)}
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(full, f, indent=1, default=float)

    uri = registry.use(out, experiment)
    tags = {"hardware": data.hardware, "backend": data.backend, "dataset_hash": data.dataset_hash,
            "feature_version": FEATURE_VERSION, "batch_size": data.batch_size}
    # Nested when called inside another run (the policy's outer loop refits the cost model).
    with registry.start_run(run_name="train-cost", nested=mlflow.active_run() is not None) as active:
        mlflow.set_tags({f"embshard.{k}": v for k, v in tags.items()})
        mlflow.log_params({"seed": seed, "refit_all": refit_all, "max_epochs": max_epochs,
                           "patience": patience, "lr": params.lr, "hidden": params.hidden, "embed": params.embed,
                           "head_hidden": params.head_hidden, "batch_shards": params.batch_shards,
                           "costs": costs, "tables": tables, "batch_size": data.batch_size,
                           **{f"n_{k}": v for k, v in counts.items()}, **{f"dropped_{k}": v
                                                                         for k, v in data.dropped.items()}})
        for name, series in (("train_loss", hist.train_loss), ("val_loss", hist.val_loss),
                             ("overall_train_loss", hist.overall_train_loss),
                             ("overall_val_loss", hist.overall_val_loss)):
            for step, v in enumerate(series):
                mlflow.log_metric(name, v, step=step)
        mlflow.log_metrics(flat)
        for p in plots.values():
            mlflow.log_artifact(p)
        mlflow.log_artifact(os.path.join(out, "report.json"))
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
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--costs", required=True, help="costs folder (part-*.parquet) or file")
    parser.add_argument("--tables", required=True, help="tables.parquet the costs were measured on")
    parser.add_argument("--out", default=None, help="folder for model files, plots, report.json and the "
                                                    "default MLflow store (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alias", default=None, help="alias to set on the new version, e.g. challenger")
    parser.add_argument("--max-epochs", type=int, default=400)
    parser.add_argument("--no-register", action="store_true", help="log the run but do not register a model")


def main(args: argparse.Namespace) -> int:
    res = run(args.costs, args.tables, args.out, seed=args.seed, alias=args.alias,
              max_epochs=args.max_epochs, register=not args.no_register)
    sp = res["splits"]
    print(f"shards: train {sp['train']}, val {sp['val']}, heldout {sp['heldout']}, unseen {sp['unseen']}")
    print(res["summary"])
    if res["model_uri"]:
        print(f"registered {res['model_uri']} (version {res['model_version']}, run {res['run_id']})")
    print(f"files in {res['out']}")
    return 0
