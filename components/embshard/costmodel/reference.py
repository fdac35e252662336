"""The two reference estimators the learned model is compared with, and the accuracy metrics.

- `sum_of_singles`: a shard's cost = the sum of its tables' measured single-table costs (compute from a single
  measured at any device count, since D only sets the all-to-all; comm only from singles at the shard's D).
  Defined only where every table of the shard was measured alone; elsewhere NaN (the report says coverage).
- `AnalyticEstimator`: TorchRec-style bandwidth formulas. Bytes per head:
  fwd/bwd compute ~ B * sum_t (pooling_t * dim_t * bpe_t + dim_t * bpe_t)  (lookups read + pooled output),
  comm ~ B * sum_t dim_t * bpe_t * (D - 1) / D  (the all-to-all share);
  ms = k * bytes + c, with (k, c) >= 0 per head calibrated on the training shards by non-negative least squares
  on relative error (TorchRec takes k from the device's bandwidth; we calibrate it, which only helps it).
"""
from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import nnls
from scipy.stats import spearmanr

from .data import CostData

TOTAL_COMPUTE = "total_compute"


def sum_of_singles(data: CostData, idx: np.ndarray) -> np.ndarray:
    """(len(idx), 3) summed single-table costs; a row is NaN where a table was never measured alone, and its comm
    is NaN where no single was measured at the shard's device count (plan shards span 2-16 devices)."""
    singles = data.singles()
    compute: dict[int, np.ndarray] = {}
    for (t, _d), v in sorted(singles.items()):
        compute.setdefault(t, v[:2])  # compute does not depend on D: any device count's single will do
    out = np.full((len(idx), 3), np.nan)
    for j, s in enumerate(idx):
        d = int(data.num_devices[s])
        tables = [int(t) for t in data.shards[s]]
        if all(t in compute for t in tables):
            out[j, :2] = np.sum([compute[t] for t in tables], axis=0)
            comm = [singles[(t, d)][2] for t in tables if (t, d) in singles]
            if len(comm) == len(tables):
                out[j, 2] = float(np.sum(comm))
    return out


def _bytes(data: CostData, idx: np.ndarray) -> np.ndarray:
    """(len(idx), 3) modelled bytes per head."""
    f = data.features
    dim, pooling = f[:, 0], f[:, 2]
    bpe = np.where(f[:, 0] > 0, f[:, 3] / np.maximum(f[:, 0] * f[:, 1], 1.0), 4.0)  # size / (rows*dim)
    b = float(data.batch_size)
    out = np.zeros((len(idx), 3))
    for j, s in enumerate(idx):
        t = data.shards[s]
        d = float(data.num_devices[s])
        compute = b * np.sum(pooling[t] * dim[t] * bpe[t] + dim[t] * bpe[t])
        out[j] = [compute, compute, b * np.sum(dim[t] * bpe[t]) * (d - 1.0) / d]
    return out


class AnalyticEstimator:
    """The bandwidth formulas above, calibrated (`fit`). Its bytes are sums over a device's tables, so it is also a
    SUM-decomposable `types.CostEstimator` (`encode`, `heads_from_sums`): planners can plan with it."""

    num_members = 1

    def fit(self, data: CostData, idx: np.ndarray) -> AnalyticEstimator:
        self.batch_size = float(data.batch_size)
        x, y = _bytes(data, idx), data.targets[idx]
        self.coef = np.zeros((3, 2))
        for h in range(3):
            ok = y[:, h] > 0
            if not ok.any():
                continue
            w = 1.0 / y[ok, h]  # relative error
            a = np.stack([x[ok, h] * w, w], axis=1)
            scale = np.maximum(a.max(axis=0), 1e-30)
            sol, _ = nnls(a / scale, np.ones(ok.sum()))
            self.coef[h] = sol / scale
        return self

    def predict(self, data: CostData, idx: np.ndarray) -> np.ndarray:
        x = _bytes(data, idx)
        out = x * self.coef[:, 0] + self.coef[:, 1]
        out[:, 2] *= data.num_devices[idx] > 1  # one device: no all-to-all
        return out

    # -- types.CostEstimator: a table's encoding is (compute bytes, all-to-all bytes, 1) per sample -------------
    def encode(self, features) -> torch.Tensor:
        f = torch.as_tensor(np.asarray(features, dtype=np.float64))
        dim, rows, pooling = f[:, 0], f[:, 1], f[:, 2]
        bpe = torch.where(dim > 0, f[:, 3] / torch.clamp(dim * rows, min=1.0), torch.full_like(dim, 4.0))
        return torch.stack([pooling * dim * bpe + dim * bpe, dim * bpe, torch.ones_like(dim)], dim=1).float()

    def heads_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        d = float(num_devices)
        compute = self.batch_size * sums[..., 0].double()
        comm = self.batch_size * sums[..., 1].double() * (d - 1.0) / d
        coef = torch.as_tensor(self.coef, dtype=torch.float64)
        x = torch.stack([compute, compute, comm], dim=-1)
        out = x * coef[:, 0] + coef[:, 1]
        if num_devices <= 1:
            out[..., 2] = 0.0  # one device: no all-to-all
        return torch.where(sums[..., 2:3] > 0, out, torch.zeros_like(out)).float()  # an empty device costs 0

    def totals_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        return self.heads_from_sums(sums, num_devices).sum(-1)

    def member_totals_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        return self.totals_from_sums(sums, num_devices).unsqueeze(0)

    def to_dict(self) -> dict:
        return {"k_ms_per_byte": self.coef[:, 0].tolist(), "c_ms": self.coef[:, 1].tolist()}


def with_totals(pred: np.ndarray) -> dict[str, np.ndarray]:
    """Per-head columns plus total_compute (fwd + bwd) and total (all three)."""
    return {"fwd_compute": pred[:, 0], "bwd_compute": pred[:, 1], "comm": pred[:, 2],
            TOTAL_COMPUTE: pred[:, 0] + pred[:, 1], "total": pred.sum(1)}


def metrics(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """MAPE (%, over true > 0), RMSE (ms), Spearman rank correlation."""
    pred, true = np.asarray(pred, float), np.asarray(true, float)
    ok = np.isfinite(pred) & np.isfinite(true)
    pred, true = pred[ok], true[ok]
    if len(true) == 0:
        return {"mape": float("nan"), "rmse": float("nan"), "spearman": float("nan"), "n": 0}
    pos = true > 0
    mape = float(np.mean(np.abs(pred[pos] - true[pos]) / true[pos]) * 100) if pos.any() else float("nan")
    rmse = float(np.sqrt(np.mean((pred - true) ** 2)))
    rho = float(spearmanr(pred, true).statistic) if len(true) > 2 and np.ptp(true) > 0 and np.ptp(pred) > 0 \
        else float("nan")
    return {"mape": mape, "rmse": rmse, "spearman": rho, "n": int(len(true))}
