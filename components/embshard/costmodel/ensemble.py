"""An ensemble of cost networks: its mean is the prediction, its disagreement the uncertainty.

Members are trained with different seeds on different subsamples of the training shards (costmodel.train
`fit_ensemble`). The ensemble keeps the members' SUM decomposition: a table's encoding is the concatenation of
its members' encodings (K x H channels), so device sums, scorers, the policy and the search work unchanged;
`heads_from_sums` splits the sum per member and averages their heads.

Uncertainty: the spread of the members' log predictions. `interval_z` scales it into an interval that held the
stated share of the validation shards' measured costs (fitted in training, reported on held-out and unseen
shards as calibration); `member_totals_from_sums` lets the search refuse moves whose predicted gain is smaller
than the members' disagreement about it (planners.search).
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import EmbshardError
from .model import HEADS, CostModel, _as_raw

INTERVAL_LEVEL = 0.9  # the share of measured costs an interval is fitted to hold


class CostEnsemble:
    """K CostModels used as one (same prediction API as CostModel, plus intervals and member predictions)."""

    def __init__(self, members: Sequence[CostModel], interval_z: float = 1.645):
        if not members:
            raise EmbshardError("an ensemble needs at least one member", field="members")
        self.members = list(members)
        self.interval_z = float(interval_z)
        self._w = members[0].width

    # -- what callers read ------------------------------------------------------------------------------------
    @property
    def config(self):
        """The first member's config (hardware, batch size, cache: the same for every member)."""
        return self.members[0].config

    @property
    def width(self) -> int:
        return self._w * len(self.members)

    @property
    def num_members(self) -> int:
        return len(self.members)

    def _split(self, sums: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(sums, self._w, dim=-1))

    # -- SUM-decomposable API (CostModel's) -------------------------------------------------------------------
    def encode(self, features) -> torch.Tensor:
        raw = _as_raw(features)
        return torch.cat([m.encode(raw) for m in self.members], dim=-1)

    def comm_encode(self, features) -> torch.Tensor:
        """CostModel.comm_encode of every member, side by side (as `encode`)."""
        raw = _as_raw(features)
        return torch.cat([m.comm_encode(raw) for m in self.members], dim=-1)

    def member_heads_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        """(K, ..., 3) ms per member."""
        return torch.stack([m.heads_from_sums(s, num_devices) for m, s in zip(self.members, self._split(sums))])

    def heads_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        return self.member_heads_from_sums(sums, num_devices).mean(0)

    def comm_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        """CostModel.comm_from_sums, the members' mean (as `heads_from_sums`)."""
        return torch.stack([m.comm_from_sums(s, num_devices) for m, s in zip(self.members, self._split(sums))]
                           ).mean(0)

    def member_totals_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        """(K, ...) device totals per member."""
        return self.member_heads_from_sums(sums, num_devices).sum(-1)

    def totals_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        return self.heads_from_sums(sums, num_devices).sum(-1)

    def overall_from_sums(self, sums: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return torch.stack([m.overall_from_sums(s, mask) for m, s in zip(self.members, self._split(sums))]).mean(0)

    # -- numpy API --------------------------------------------------------------------------------------------
    def member_predict_shards(self, features, shards: Sequence[np.ndarray], num_devices: int) -> np.ndarray:
        """(K, S, 3) ms per member."""
        return np.stack([m.predict_shards(features, shards, num_devices) for m in self.members])

    def predict_shards(self, features, shards: Sequence[np.ndarray], num_devices: int) -> np.ndarray:
        return self.member_predict_shards(features, shards, num_devices).mean(0)

    def predict_shards_interval(self, features, shards: Sequence[np.ndarray], num_devices: int
                                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean, low, high), each (S, 3) ms: mean x exp(-/+ z x the members' std of log predictions)."""
        per = self.member_predict_shards(features, shards, num_devices)
        return (per.mean(0), *interval(per, self.interval_z))

    def predict_columns(self, features, shards: Sequence[np.ndarray], num_devices: int) -> dict[str, np.ndarray]:
        """Per head and the total: `<head>_ms`, `<head>_ms_low`, `<head>_ms_high` (S,) each: what
        `embshard predict` and the registered pyfunc return."""
        per = self.member_predict_shards(features, shards, num_devices)
        per = np.concatenate([per, per.sum(-1, keepdims=True)], axis=-1)  # (K, S, 4): the heads and the total
        low, high = interval(per, self.interval_z)
        cols: dict[str, np.ndarray] = {}
        for h, name in enumerate(("fwd_compute", "bwd_compute", "comm", "total")):
            cols.update({f"{name}_ms": per[:, :, h].mean(0), f"{name}_ms_low": low[:, h],
                         f"{name}_ms_high": high[:, h]})
        return cols

    def predict_placement(self, features, assignment, num_devices: int) -> tuple[np.ndarray, float]:
        totals = np.mean([m.predict_placement(features, assignment, num_devices)[0] for m in self.members], axis=0)
        return totals, float(totals.max()) if len(totals) else 0.0

    # -- persistence --------------------------------------------------------------------------------------------
    def save(self, folder: str) -> dict[str, str]:
        """member-<k>/ (weights.pt, config.json) per member and ensemble.json; returns the artifact paths."""
        os.makedirs(folder, exist_ok=True)
        paths: dict[str, str] = {}
        for k, m in enumerate(self.members):
            for name, p in m.save(os.path.join(folder, f"member-{k}")).items():
                paths[f"member{k}_{name}"] = p
        meta = os.path.join(folder, "ensemble.json")
        with open(meta, "w", encoding="utf-8") as f:
            json.dump({"members": len(self.members), "interval_z": self.interval_z,
                       "interval_level": INTERVAL_LEVEL}, f, indent=1)
        paths["ensemble"] = meta
        return paths

    @classmethod
    def from_files(cls, paths: dict[str, str]) -> CostEnsemble:
        try:
            with open(paths["ensemble"], encoding="utf-8") as f:
                meta = json.load(f)
            members = [CostModel.from_files(paths[f"member{k}_weights"], paths[f"member{k}_config"])
                       for k in range(int(meta["members"]))]
        except (OSError, ValueError, KeyError) as exc:
            raise EmbshardError(f"cannot load the cost-model ensemble ({str(exc)[:120]})",
                                path=paths.get("ensemble", "?"), fix="re-train with `embshard train-cost`") from None
        return cls(members, float(meta.get("interval_z", 1.645)))

    @classmethod
    def load_dir(cls, folder: str) -> CostEnsemble:
        meta = os.path.join(folder, "ensemble.json")
        if not os.path.exists(meta):
            raise EmbshardError("not a cost-model ensemble folder (no ensemble.json)", path=folder,
                                fix="pass a folder written by `embshard train-cost`")
        with open(meta, encoding="utf-8") as f:
            k = int(json.load(f).get("members", 0))
        paths = {"ensemble": meta}
        for i in range(k):
            paths[f"member{i}_weights"] = os.path.join(folder, f"member-{i}", "weights.pt")
            paths[f"member{i}_config"] = os.path.join(folder, f"member-{i}", "config.json")
        return cls.from_files(paths)


def member_predictions(model, data, idx: np.ndarray) -> np.ndarray:
    """(K, len(idx), 3) member predictions of measured shards (costmodel.data.CostData rows `idx`), one batched
    call per device count; a single CostModel counts as one member."""
    members = getattr(model, "members", [model])
    out = np.zeros((len(members), len(idx), len(HEADS)))
    for d in np.unique(data.num_devices[idx]):
        sel = np.flatnonzero(data.num_devices[idx] == d)
        shards = [data.shards[s] for s in idx[sel]]
        for k, m in enumerate(members):
            out[k, sel] = m.predict_shards(data.features, shards, int(d))
    return out


def log_spread(per_member: np.ndarray) -> np.ndarray:
    """(…) std over members (axis 0) of log predictions: the relative disagreement."""
    logs = np.log(np.maximum(per_member, 1e-9))
    return logs.std(0)


def interval(per_member: np.ndarray, z: float) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) = mean x exp(-/+ z x log spread) of (K, ...) member predictions."""
    mean = per_member.mean(0)
    s = log_spread(per_member)
    return mean * np.exp(-z * s), mean * np.exp(z * s)


def fit_interval_z(per_member: np.ndarray, true: np.ndarray, level: float = INTERVAL_LEVEL) -> float:
    """The z for which `level` of the measured costs fall inside mean x exp(+/- z x spread): the quantile of
    |log(true / mean)| / spread over the shards given (validation). 1.645 where there is nothing to fit."""
    mean = per_member.mean(0)
    s = log_spread(per_member)
    ok = (true > 0) & (mean > 0) & (s > 0)
    if ok.sum() < 5:
        return 1.645
    ratio = np.abs(np.log(true[ok] / mean[ok])) / s[ok]
    return float(np.quantile(ratio, level))


def coverage(per_member: np.ndarray, true: np.ndarray, z: float) -> float:
    """Share of measured costs inside the interval (NaN when none are positive)."""
    lo, hi = interval(per_member, z)
    ok = true > 0
    if not ok.any():
        return float("nan")
    return float(((true[ok] >= lo[ok]) & (true[ok] <= hi[ok])).mean())


__all__ = ["CostEnsemble", "HEADS", "INTERVAL_LEVEL", "coverage", "fit_interval_z", "interval", "member_predictions"]
