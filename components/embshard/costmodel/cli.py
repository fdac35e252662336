"""`embshard train-cost`: train the cost model on measured costs, report its accuracy, register it."""
from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--costs", required=True, help="costs folder (part-*.parquet) or file")
    parser.add_argument("--tables", required=True, help="tables.parquet the costs were measured on")
    parser.add_argument("--out", default=None, help="folder for model files, plots, report.json and the "
                                                    "default MLflow store (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alias", default=None, help="alias to set on the new version, e.g. challenger")
    parser.add_argument("--unseen-frac", type=float, default=0.5,
                        help="fraction of the tables held out as never seen in training")
    parser.add_argument("--max-epochs", type=int, default=400)
    parser.add_argument("--no-register", action="store_true", help="log the run but do not register a model")


def main(args: argparse.Namespace) -> int:
    from .stage import run

    res = run(args.costs, args.tables, args.out, seed=args.seed, alias=args.alias, unseen_frac=args.unseen_frac,
              max_epochs=args.max_epochs, register=not args.no_register)
    sp = res["splits"]
    print(f"shards: train {sp['train']}, val {sp['val']}, heldout {sp['heldout']}, unseen {sp['unseen']}")
    print(res["summary"])
    if res["model_uri"]:
        print(f"registered {res['model_uri']} (version {res['model_version']}, run {res['run_id']})")
    print(f"files in {res['out']}")
    return 0
