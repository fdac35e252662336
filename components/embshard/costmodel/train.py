"""Seeded training of the cost network with a validation split and early stopping.

Loss: squared log-ratio log((pred + eps) / (true + eps)) per head, i.e. relative error (MAPE and rank order are
what the planners need); eps = 2% of the head's median keeps near-zero measurements from dominating. Two terms
serve ranking: each shard is weighted by (its compute / the median)^expensive_weight, because the slowest
device decides a placement and expensive shards are the ones that end up slowest; and a pairwise logistic loss
(rank_weight) over pairs of shards in a batch whose measured compute differs by more than RANK_MIN_RATIO asks
the model to order them as measured. Stage 1 trains encoder + three heads on measured shards; stage 2
trains the overall head alone on placements assembled from measured shards (overall = max device total).
"""
from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import hardware
from ..errors import EmbshardError
from ..features import FeatureScaler
from .data import CostData, assemble_placements
from .model import CostModel, CostModelConfig

log = logging.getLogger(__name__)


DEFAULT_MEMBERS = 3  # ensemble members (their disagreement is the model's uncertainty)


@dataclass
class TrainParams:
    seed: int = 0
    max_epochs: int = 400
    patience: int = 60
    min_epochs: int = 100  # the comm head converges slower than noisy compute validation suggests
    lr: float = 3e-3
    weight_decay: float = 1e-2
    batch_shards: int = 64
    overall_placements: int = 2000
    expensive_weight: float = 0.5  # shard weight = (compute / median compute) ** this, clipped to [1/4, 4]
    rank_weight: float = 0.1       # weight of the pairwise ranking loss (0: off)
    hidden: int = 128
    embed: int = 32
    head_hidden: int = 64
    monotone: bool = True          # compute heads that never predict less for one more table (model._Head)
    # A table's bytes per element as an encoder input (model.CostModelConfig). Off: with FP16 tables in training its
    # first model priced both types closer, but the refit its policy planned with did not, nor did the plans
    # (benchmarks/results/model_ab_fp16_type.md, costmodel_types_type_input.md).
    type_input: bool = False


@dataclass
class History:
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    overall_train_loss: list[float] = field(default_factory=list)
    overall_val_loss: list[float] = field(default_factory=list)
    best_epoch: int = 0
    overall_best_epoch: int = 0


class _Batcher:
    """Segment-sum inputs for a set of shards (flat table rows + shard id of each)."""

    def __init__(self, data: CostData):
        self.data = data

    def __call__(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        shards = [self.data.shards[s] for s in idx]
        lengths = np.fromiter((len(s) for s in shards), dtype=np.int64, count=len(shards))
        return (torch.from_numpy(np.concatenate(shards)),
                torch.from_numpy(np.repeat(np.arange(len(shards)), lengths)))


def _sums(net, x, raw, flat, seg, n):
    enc = net.encode_scaled(x, raw)
    return torch.zeros(n, enc.shape[1]).index_add_(0, seg, enc[flat])


def _log_ratio(pred, true, eps, mask):
    err = (torch.log(pred + eps) - torch.log(true + eps)) ** 2
    return (err * mask).sum() / mask.sum().clamp(min=1.0)


RANK_MIN_RATIO = 1.15  # pairs closer than this are inside the measurement noise (benchmarks/results/label_noise.md)


def _pairwise_rank(pred: torch.Tensor, true: torch.Tensor, nd: torch.Tensor) -> torch.Tensor:
    """Logistic loss on the order of pairs (same device count, measured ratio > RANK_MIN_RATIO) by log cost."""
    lp, lt = torch.log(pred.clamp(min=1e-9)), torch.log(true.clamp(min=1e-9))
    dt = lt.unsqueeze(0) - lt.unsqueeze(1)
    keep = (dt.abs() > float(np.log(RANK_MIN_RATIO))) & (nd.unsqueeze(0) == nd.unsqueeze(1))
    if not keep.any():
        return pred.sum() * 0.0
    dp = lp.unsqueeze(0) - lp.unsqueeze(1)
    return torch.nn.functional.softplus(-torch.sign(dt[keep]) * dp[keep] * 4.0).mean()


def fit(data: CostData, params: TrainParams) -> tuple[CostModel, History]:
    torch.manual_seed(params.seed)
    rng = np.random.default_rng(params.seed)
    threads = int(os.environ.get("EMBSHARD_NUM_THREADS", "0") or 0)
    # torch counts the node's cores, not a container's CPU limit: a pod limited to 8 CPUs on a 96-core node ran 96
    # threads and was throttled by its quota
    torch.set_num_threads(threads if threads > 0 else min(torch.get_num_threads(), hardware.usable_cpus()))
    tr, va = data.index("train"), data.index("val")
    used = np.unique(np.concatenate([data.shards[s] for s in tr]))
    scaler = FeatureScaler.fit(data.features[used])  # fitted on training tables only
    y_tr = data.targets[tr]
    scale = [float(np.median(y_tr[y_tr[:, h] > 0, h])) if (y_tr[:, h] > 0).any() else 1.0 for h in range(3)]
    cfg = CostModelConfig(hidden=params.hidden, embed=params.embed, head_hidden=params.head_hidden,
                          monotone=params.monotone, element_bytes_seen=list(data.element_bytes),
                          type_input=params.type_input,
                          target_scale=scale, batch_size=data.batch_size, cache_bytes=data.cache_bytes,
                          hardware=data.hardware,
                          backend=data.backend, dataset_hash=data.dataset_hash,
                          num_devices_seen=sorted(int(d) for d in np.unique(data.num_devices[tr])))
    model = CostModel.create(cfg, scaler, data.features[used])
    net = model.net.train()
    _init_comm(net, data, tr, scale[2])
    raw = torch.from_numpy(data.features.astype(np.float32))
    x = model._scaled(raw)
    eps = torch.tensor(scale, dtype=torch.float32) * 0.02
    y_all = torch.from_numpy(data.targets.astype(np.float32))
    nd_all = torch.from_numpy(data.num_devices.astype(np.float32))
    # comm of a one-device shard is 0 by construction: no loss there
    mask_all = torch.ones_like(y_all)
    mask_all[:, 2] = (nd_all > 1).float()
    batch = _Batcher(data)

    compute_all = y_all[:, :2].sum(1)
    median_compute = float(compute_all[torch.from_numpy(tr)].median()) if len(tr) else 1.0
    weight_all = (compute_all / max(median_compute, 1e-9)).clamp(min=1e-9) ** params.expensive_weight
    weight_all = weight_all.clamp(0.25, 4.0)

    def loss_of(idx: np.ndarray) -> torch.Tensor:
        flat, seg = batch(idx)
        sums = _sums(net, x, raw, flat, seg, len(idx))
        t = torch.from_numpy(idx)
        pred = net.heads(sums, nd_all[t])
        w = weight_all[t] / weight_all[t].mean()
        loss = _log_ratio(pred, y_all[t], eps, mask_all[t] * w.unsqueeze(1))
        if params.rank_weight > 0:
            loss = loss + params.rank_weight * _pairwise_rank(pred[:, :2].sum(1), compute_all[t], nd_all[t])
        return loss

    # Weight decay on the nonlinear parts only: the linear skips (the analytic, additive trend) stay free, the
    # MLPs must earn their corrections; this is what keeps unseen tables sane when few tables were measured.
    # The comm head's three physical constants are free too.
    def is_free(name: str) -> bool:
        return ".skip." in name or name.startswith("comm_")

    # The latency's growth with log2 D can only be learned from several device counts: frozen (near 0) otherwise.
    multi_d = len(np.unique(data.num_devices[tr][data.num_devices[tr] > 1])) >= 2
    net.comm_latency_slope.requires_grad_(multi_d)
    trainable = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if not n.startswith("overall") and not is_free(n)]
    free = [p for n, p in trainable if is_free(n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": params.weight_decay},
                             {"params": free, "weight_decay": 0.0}], lr=params.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=params.patience // 3)
    hist = History()
    best, best_state, bad = float("inf"), None, 0
    for epoch in range(params.max_epochs):
        net.train()
        order = rng.permutation(tr)
        total, n = 0.0, 0
        for i in range(0, len(order), params.batch_shards):
            idx = order[i:i + params.batch_shards]
            loss = loss_of(idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
            net.constrain_()
            total, n = total + loss.item() * len(idx), n + len(idx)
        with torch.no_grad():
            net.eval()
            v = float(loss_of(va))
        hist.train_loss.append(total / n)
        hist.val_loss.append(v)
        sched.step(v)
        if v < best - 1e-6:
            best, best_state, bad, hist.best_epoch = v, copy.deepcopy(net.state_dict()), 0, epoch
        else:
            bad += 1
            if bad >= params.patience and epoch >= params.min_epochs:
                break
    if best_state is None:  # no finite validation loss in any epoch (or max_epochs = 0)
        raise EmbshardError("the cost heads' validation loss was never finite: no weights to keep",
                            fix="check the measured costs for NaN/inf, or raise max_epochs")
    net.load_state_dict(best_state)
    log.info("cost heads: best val loss %.4f at epoch %d of %d", best, hist.best_epoch, len(hist.val_loss))
    _fit_overall(model, data, params, hist, x, raw)
    model.net.eval()
    return model, hist


def _init_comm(net, data: CostData, idx: np.ndarray, comm_scale: float) -> None:
    """Start the comm head at the least-squares fit of comm = latency + rate * dim_sum * (D-1)/D on the
    training shards: the head is that formula, so training then only refines it (from an arbitrary start the
    two scalars took hundreds of epochs to get there)."""
    from .model import DIM_SCALE

    multi = idx[data.num_devices[idx] > 1]
    if len(multi) < 2:
        return
    dimsum = np.array([data.features[data.shards[s], 0].sum() for s in multi]) / DIM_SCALE
    d = data.num_devices[multi].astype(np.float64)
    x = dimsum * (d - 1.0) / d
    y = data.targets[multi, 2] / comm_scale
    a = np.stack([np.ones_like(x), x], axis=1)
    (latency, rate), *_ = np.linalg.lstsq(a, y, rcond=None)

    def softplus_inv(v: float) -> float:
        v = max(float(v), 1e-4)
        return float(np.log(np.expm1(v))) if v < 20 else v

    with torch.no_grad():
        net.comm_latency.fill_(softplus_inv(latency))
        net.comm_rate.fill_(softplus_inv(rate))


_SAID_NO_PLACEMENTS: set[int] = set()


def _fit_overall(model: CostModel, data: CostData, params: TrainParams, hist: History, x, raw) -> None:
    """Stage 2: the overall head on assembled placements; encoder and heads stay frozen."""
    net = model.net
    sets = {}
    for name, split, seed in (("train", "train", params.seed), ("val", "val", params.seed + 1)):
        sets[name] = assemble_placements(data, data.index(split), params.overall_placements if name == "train"
                                         else params.overall_placements // 4, seed)
    if not sets["train"] or not sets["val"]:
        # once per training data, not once per ensemble member (it was said 2-4 times): the members' data are
        # copies (dataclasses.replace, their own split) of one features array
        say = log.warning if id(data.features) not in _SAID_NO_PLACEMENTS else log.debug
        _SAID_NO_PLACEMENTS.add(id(data.features))
        say("no multi-device placements to assemble: the overall head stays untrained "
            "(planners use the max of device totals anyway)")
        return
    with torch.no_grad():
        enc = net.encode_scaled(x, raw)

    def tensors(pls):
        # group by device count: one (P, D, H) block per D
        groups: dict[int, list] = {}
        for shards, y in pls:
            groups.setdefault(len(shards), []).append((shards, y))
        out = []
        for d, items in groups.items():
            sums = torch.stack([torch.stack([enc[torch.from_numpy(data.shards[s])].sum(0) for s in sh])
                                for sh, _ in items])
            with torch.no_grad():
                heads = net.heads(sums, torch.tensor(float(d)))
            out.append((sums, heads, torch.tensor([y for _, y in items], dtype=torch.float32)))
        return out

    tr, va = tensors(sets["train"]), tensors(sets["val"])
    eps = float(net.target_scale.sum()) * 0.02
    opt = torch.optim.Adam(net.overall.parameters(), lr=params.lr)

    def loss_of(blocks):
        losses = [_log_ratio(net.overall_from(s, h, torch.ones(s.shape[:2], dtype=torch.bool)), y, eps,
                             torch.ones_like(y)) * len(y) for s, h, y in blocks]
        return sum(losses) / sum(len(b[2]) for b in blocks)

    best, best_state, bad = float("inf"), None, 0
    for epoch in range(params.max_epochs):
        loss = loss_of(tr)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            v = float(loss_of(va))
        hist.overall_train_loss.append(loss.item())
        hist.overall_val_loss.append(v)
        if v < best - 1e-6:
            best, best_state, bad, hist.overall_best_epoch = v, copy.deepcopy(net.overall.state_dict()), 0, epoch
        else:
            bad += 1
            if bad >= params.patience:
                break
    if best_state is None:  # no finite validation loss in any epoch (or max_epochs = 0)
        raise EmbshardError("the overall head's validation loss was never finite: no weights to keep",
                            fix="check the measured costs for NaN/inf, or raise max_epochs")
    net.overall.load_state_dict(best_state)


def fit_ensemble(data: CostData, params: TrainParams, members: int = DEFAULT_MEMBERS, subsample: float = 0.85):
    """(CostEnsemble, History of the first member): `members` networks, each with its own seed and its own random
    `subsample` of the training shards (validation stays shared), so that they disagree where data is thin.
    The interval's z is fitted on the validation shards (costmodel.ensemble.fit_interval_z)."""
    import dataclasses

    from .ensemble import CostEnsemble, fit_interval_z

    if members < 1:
        raise EmbshardError(f"{members} ensemble members", field="members",
                            fix=f"use 1 or more (default {DEFAULT_MEMBERS})")
    models, first = [], None
    tr = data.index("train")
    for k in range(members):
        split = data.split
        if members > 1:
            rng = np.random.default_rng(params.seed * 1000 + k)
            split = split.copy()
            split[tr[rng.random(len(tr)) > subsample]] = ""  # left out of this member's training
        model, hist = fit(dataclasses.replace(data, split=split), dataclasses.replace(params, seed=params.seed + k))
        models.append(model)
        first = first or hist
        log.info("cost model: member %d of %d trained", k + 1, members)
    ens = CostEnsemble(models)
    va = data.index("val")
    if members > 1 and len(va):
        from .ensemble import member_predictions

        per = member_predictions(ens, data, va).sum(-1)  # (K, V) totals
        ens.interval_z = fit_interval_z(per, data.targets[va].sum(1))
    assert first is not None
    return ens, first
