"""Speed of the cost model's batched prediction (target: 10,000 shards of 10 tables in <= 0.1 s on this CPU).

Run: `.venv/bin/python benchmarks/costmodel_predict.py [--model models:/embshard-cost@champion|DIR]`.
Without --model an untrained network of the production size is timed (speed does not depend on the weights).
Prints the median of several repetitions of predict_shards, of the torch fast path (encode once + segment
sum + totals_from_sums) and the ratio to the target.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

TARGET_S = 0.1


def _model(uri: str | None, feats: np.ndarray):
    if uri:
        from embshard.costmodel import load

        return load(uri)
    from embshard.costmodel.model import CostModel, CostModelConfig
    from embshard.features import FeatureScaler

    return CostModel.create(CostModelConfig(), FeatureScaler.fit(feats))


def main() -> None:
    import torch

    from embshard.features import feature_matrix
    from embshard.ingest.synthetic import generate_tables

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--shards", type=int, default=10_000)
    p.add_argument("--tables-per-shard", type=int, default=10)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()

    feats = feature_matrix(generate_tables(856, seed=0, bins_batch_size=1024))
    model = _model(a.model, feats)
    rng = np.random.default_rng(0)
    shards = [rng.choice(len(feats), a.tables_per_shard, replace=False) for _ in range(a.shards)]
    model.predict_shards(feats, shards[:10], 4)  # warm-up

    def timed(fn) -> float:
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    t_api = timed(lambda: model.predict_shards(feats, shards, 4))
    enc = model.encode(feats)
    flat = torch.from_numpy(np.concatenate(shards))
    seg = torch.from_numpy(np.repeat(np.arange(a.shards), a.tables_per_shard))

    def fast():
        sums = torch.zeros(a.shards, enc.shape[1]).index_add_(0, seg, enc[flat])
        return model.totals_from_sums(sums, 4)

    t_fast = timed(fast)
    print(f"threads={torch.get_num_threads()}  {a.shards} shards x {a.tables_per_shard} tables")
    print(f"predict_shards (numpy in/out, encodes the 856 tables):  {t_api * 1e3:8.1f} ms  "
          f"= {t_api / TARGET_S:.2f} x the 0.1 s target")
    print(f"fast path (encodings cached, segment sum + totals):     {t_fast * 1e3:8.1f} ms  "
          f"= {t_fast / TARGET_S:.2f} x the 0.1 s target")


if __name__ == "__main__":
    main()
