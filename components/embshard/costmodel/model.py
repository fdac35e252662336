"""The cost network (DreamShard-style) and `CostModel`, its batched prediction API.

table features --(scaler, saved in the model)--> per-table MLP encoder -> encoding e_t (H channels)
device shard d: s_d = SUM_t e_t  (works for any number of tables)
heads on s_d: forward compute ms, backward compute ms, communication ms (fwd + bwd all-to-all)
overall head on the element-wise MAX over device vectors (trained on placements assembled from measured shards)

Each encoding ends with four raw, additive channels so that the SUM carries exact shard totals that the
heads need: a count (1 per table: an empty device has count 0 and costs 0), dim / DIM_SCALE (the dim sum
drives the all-to-all), pooling * dim / LOOKUP_SCALE (the bytes a lookup reads drive compute, and let the
compute heads extrapolate roughly linearly to shards larger than those measured) and the working set / the
last-level cache (the weight bytes a measured batch touches, features.working_set_bytes, over the cache of the
hardware the model was measured on: summed over a shard it says whether the shard's hot rows fit in cache).
The encoder also sees each table's own working set (log bytes, and log of its share of the cache). Batch size
and cache size are the model's (CostModelConfig): the hardware enters the model.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import cast

import numpy as np
import torch
from torch import nn

from ..errors import EmbshardError, first_line
from ..features import NUM_FEATURES, FeatureScaler, working_set_bytes
from ..schemas import FEATURE_VERSION

HEADS = ("fwd_compute", "bwd_compute", "comm")
DIM_SCALE = 128.0
LOOKUP_SCALE = 1024.0
BIN_STD_FLOOR = 0.1
Z_CLIP = 6.0
NUM_EXTRA = 4  # count, dim sum, lookup-bytes sum, working set / cache
COUNT, DIMSUM, LOOKUPS, WORKING_SET = 0, 1, 2, 3  # positions of the extra channels after the learned part
NUM_DERIVED = 2  # encoder inputs derived from the raw features: log working-set bytes, log working set / cache
DEFAULT_CACHE_BYTES = 32 * 2**20
LOG_CACHE_SHARE_SCALE = 3.0  # log(working set / cache) spans about -15..+3: divided by this, not z-scored
DEFAULT_BATCH_SIZE = 1024


@dataclass
class CostModelConfig:
    hidden: int = 128
    embed: int = 32
    head_hidden: int = 64
    overall_hidden: int = 64
    # ms per unit of each head's output (about the median measured value), so the nets work near 1
    target_scale: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    scaler: dict | None = None
    batch_size: int | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES  # last-level cache of the measured hardware (embshard.hardware)
    derived_scaler: dict | None = None      # mean/std of the NUM_DERIVED encoder inputs on the training tables
    comm_calibration: dict | None = None    # the all-to-all constants the measurements used (bench.comm)
    hardware: str = ""
    backend: str = ""
    feature_version: str = FEATURE_VERSION
    dataset_hash: str = ""
    num_devices_seen: list[int] = field(default_factory=list)
    # Compute heads that never predict a device cheaper for one more table (_Head). False in the configs of models
    # trained before it existed, which load as they were trained.
    monotone: bool = False
    # Bytes per element of the tables the model was measured on (4: FP32, 2: FP16); empty: not recorded (older).
    element_bytes_seen: list[int] = field(default_factory=list)
    # A table's bytes per element (size_bytes / (rows x dim)) as one more encoder input: its type, seen directly
    # rather than as a small shift of log size_bytes against rows and dim. False in older configs (two derived
    # inputs), which load as they were trained.
    type_input: bool = False


def _share_sent(num_devices: torch.Tensor) -> torch.Tensor:
    """(D-1)/D: the share of a device's pooled outputs that the all-to-all sends to other devices."""
    d = num_devices.to(torch.float32).clamp(min=1.0)
    return (d - 1.0) / d


class _Head(nn.Module):
    """MLP plus a linear skip: with few measured tables the linear part (cost ~ sum of per-table work, the
    analytic model's shape) carries the trend and the MLP the fused, sub-additive correction.

    `monotone`: non-decreasing in every input channel, so that a device never costs less for holding one more
    table (every encoding channel is >= 0: the encoder ends in a ReLU and the additive channels are counts and
    sizes). An unconstrained head learned the opposite off its data: the champion predicted a device holding a
    50-lookup fp16 table at 4.66 ms alone and 4.05 ms with seven tiny tables beside it, the planner packed tiny
    tables onto that device, and the plan measured 1.19x the best greedy's. Every weight is kept >= 0 (`constrain_`
    after each optimizer step); half of the hidden units are convex (relu(u)) and half concave (min(u, 0)), so the
    head can still be sub-additive, which fused kernels are."""

    def __init__(self, width: int, hidden: int, monotone: bool = False):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.skip = nn.Linear(width, 1, bias=False)
        self.monotone = bool(monotone)
        self.convex = hidden - hidden // 2  # the first units are relu(u), the rest min(u, 0)
        if self.monotone:
            with torch.no_grad():
                for w in self._weights():
                    w.abs_()

    @property
    def inner(self) -> nn.Linear:
        """The first layer (in `mlp`, whose state-dict keys every saved model has)."""
        return cast(nn.Linear, self.mlp[0])

    @property
    def outer(self) -> nn.Linear:
        return cast(nn.Linear, self.mlp[2])

    def _weights(self) -> tuple[torch.Tensor, ...]:
        return self.inner.weight, self.outer.weight, self.skip.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.monotone:
            return self.mlp(x) + self.skip(x)
        u = self.inner(x)
        c = self.convex
        hidden = torch.cat([torch.relu(u[..., :c]), -torch.relu(-u[..., c:])], dim=-1)
        return self.outer(hidden) + self.skip(x)

    def constrain_(self) -> None:
        """Project the weights back onto >= 0 (after an optimizer step); nothing for an unconstrained head."""
        if self.monotone:
            with torch.no_grad():
                for w in self._weights():
                    w.clamp_(min=0.0)

    def relu_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W1 (hidden, width), b1, w2 (1, hidden), b2, skip (1, width)) of the same function written with relu
        units alone: a concave unit v * min(u, 0) is (-v) * relu(-u) (costmodel.scoring's fused evaluator)."""
        w1: torch.Tensor = self.inner.weight
        b1: torch.Tensor = self.inner.bias
        w2: torch.Tensor = self.outer.weight
        if self.monotone:
            sign = torch.ones(len(b1), dtype=w1.dtype)
            sign[self.convex:] = -1.0
            w1, b1, w2 = w1 * sign.unsqueeze(1), b1 * sign, w2 * sign
        return w1, b1, w2, self.outer.bias, self.skip.weight


class CostNet(nn.Module):
    # buffers (register_buffer): declared so that mypy does not type them as Module.__getattr__'s Tensor | Module
    target_scale: torch.Tensor
    scaler_mean: torch.Tensor
    scaler_std: torch.Tensor
    derived_mean: torch.Tensor
    derived_std: torch.Tensor

    def __init__(self, cfg: CostModelConfig):
        super().__init__()
        e = cfg.embed
        self.batch_size = int(cfg.batch_size or DEFAULT_BATCH_SIZE)
        self.cache_bytes = float(cfg.cache_bytes or DEFAULT_CACHE_BYTES)
        self.type_input = bool(cfg.type_input)
        self.num_derived = NUM_DERIVED + int(self.type_input)
        self.encoder = nn.Sequential(nn.Linear(NUM_FEATURES + self.num_derived, cfg.hidden), nn.ReLU(),
                                     nn.Linear(cfg.hidden, e), nn.ReLU())
        h_in = e + NUM_EXTRA
        self.fwd = _Head(h_in, cfg.head_hidden, cfg.monotone)
        self.bwd = _Head(h_in, cfg.head_hidden, cfg.monotone)
        # comm = latency(D) + rate * dim_sum * (D-1)/D: the all-to-all moves B x dim_sum pooled values, of which
        # (D-1)/D leave the device. The shape is physical, not an MLP over D, so a model measured on one device
        # count extrapolates to others (an MLP over D, trained on D=4 only, predicted 0.6x the comm at D=8).
        # Latency grows with log2 D for real collectives; its slope starts near 0 and only moves when the
        # measurements span several device counts.
        self.comm_rate = nn.Parameter(torch.tensor(0.0))
        self.comm_latency = nn.Parameter(torch.tensor(-2.0))
        self.comm_latency_slope = nn.Parameter(torch.tensor(-8.0))
        # overall: MAX over devices of [sum encoding, the 3 predicted heads, the device total]
        o_in = h_in + len(HEADS) + 1
        self.overall = nn.Sequential(nn.Linear(o_in, cfg.overall_hidden), nn.ReLU(),
                                     nn.Linear(cfg.overall_hidden, 1))
        self.register_buffer("target_scale", torch.tensor(cfg.target_scale, dtype=torch.float32))
        self.register_buffer("scaler_mean", torch.zeros(NUM_FEATURES))
        self.register_buffer("scaler_std", torch.ones(NUM_FEATURES))
        self.register_buffer("derived_mean", torch.zeros(self.num_derived))
        self.register_buffer("derived_std", torch.ones(self.num_derived))

    def constrain_(self) -> None:
        """Keep monotone compute heads monotone after an optimizer step (_Head.constrain_)."""
        self.fwd.constrain_()
        self.bwd.constrain_()

    def working_set(self, raw: torch.Tensor) -> torch.Tensor:
        """(N,) weight bytes a measured batch touches per table (features.working_set_bytes at the model's batch)."""
        ws = working_set_bytes(raw.detach().cpu().numpy(), self.batch_size)
        return torch.as_tensor(ws, dtype=raw.dtype, device=raw.device)

    def derived(self, ws: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """(N, num_derived) unscaled, from working sets (N,) and raw features: log1p(bytes), log of the working
        set's cache share, and with `type_input` the bytes per element (size_bytes / (rows x dim))."""
        cols = [torch.log1p(ws), torch.log((ws + 1.0) / self.cache_bytes)]
        if self.type_input:
            cols.append(raw[:, 3] / (raw[:, 1] * raw[:, 0]).clamp(min=1.0))
        return torch.stack(cols, dim=-1)

    def encode_scaled(self, x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """(N, H) encodings from scaled features x and raw features (for the derived inputs and the additive
        channels)."""
        ws = self.working_set(raw)
        d = ((self.derived(ws, raw) - self.derived_mean) / self.derived_std).clamp(-Z_CLIP, Z_CLIP)
        extra = torch.stack([torch.ones_like(raw[:, 0]), raw[:, 0] / DIM_SCALE,
                             raw[:, 0] * raw[:, 2] / LOOKUP_SCALE, ws / self.cache_bytes], dim=-1)
        return torch.cat([self.encoder(torch.cat([x, d.to(x.dtype)], dim=-1)), extra.to(x.dtype)], dim=-1)

    def heads(self, sums: torch.Tensor, num_devices: torch.Tensor) -> torch.Tensor:
        """(..., 3) ms for fwd compute, bwd compute, comm from device sums (..., H); 0 for empty devices."""
        softplus = nn.functional.softplus
        f = softplus(self.fwd(sums))
        b = softplus(self.bwd(sums))
        out = torch.cat([f, b, self._comm(sums, num_devices)], dim=-1) * self.target_scale
        return out * self._nonempty(sums)

    def comm_head(self, sums: torch.Tensor, num_devices: torch.Tensor) -> torch.Tensor:
        """(..., 1) `heads(sums, num_devices)[..., 2:]` (the same values) without the compute heads' MLPs."""
        return self._comm(sums, num_devices) * self.target_scale[2:] * self._nonempty(sums)

    def _comm(self, sums: torch.Tensor, num_devices: torch.Tensor) -> torch.Tensor:
        """(..., 1) the comm head before its target scale."""
        softplus = nn.functional.softplus
        dimsum = sums[..., -NUM_EXTRA + DIMSUM:][..., :1]
        nd = num_devices.to(sums.dtype).expand(*sums.shape[:-1]).unsqueeze(-1)  # (..., 1)
        latency = softplus(self.comm_latency) + softplus(self.comm_latency_slope) * torch.log2(nd.clamp(min=1.0))
        return (dimsum * softplus(self.comm_rate) * _share_sent(nd) + latency) * (nd > 1)  # one device: no comm

    @staticmethod
    def _nonempty(sums: torch.Tensor) -> torch.Tensor:
        return (sums[..., -NUM_EXTRA + COUNT] > 0.5).unsqueeze(-1)

    def overall_from(self, sums: torch.Tensor, heads: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Overall ms of placements: sums (P, D, H), heads (P, D, 3), mask (P, D) True for real devices."""
        scale = self.target_scale.sum()
        total = heads.sum(-1, keepdim=True)
        v = torch.cat([sums, heads / scale, total / scale], dim=-1)
        v = v.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1)
        v = torch.nan_to_num(v, neginf=0.0)
        return nn.functional.softplus(self.overall(v)).squeeze(-1) * scale


class CostModel:
    """The trained cost network with its feature normalisation: everything a loaded model needs.

    Raw features are the (N, 21) matrix of `embshard.features.feature_matrix` (FEATURE_NAMES order).
    Heads, in order: fwd_compute, bwd_compute, comm (= fwd + bwd all-to-all), all in ms.
    """

    def __init__(self, net: CostNet, config: CostModelConfig):
        self.net = net.eval()
        self.config = config

    # -- construction and persistence --------------------------------------------------------------------------
    @classmethod
    def create(cls, config: CostModelConfig, scaler: FeatureScaler, train_raw: np.ndarray | None = None
               ) -> CostModel:
        """A fresh model; `train_raw` (raw features of the training tables) fits the derived inputs' scaling."""
        net = CostNet(config)
        if train_raw is not None and len(train_raw):
            with torch.no_grad():
                raw_t = torch.as_tensor(np.asarray(train_raw, dtype=np.float32))
                d = net.derived(net.working_set(raw_t), raw_t)
            # (one type only: a constant input, std 1 below, centred to 0)
            d_std = d.std(0) if len(d) > 1 else torch.ones(net.num_derived)
            d_std = torch.where(d_std < 1e-3, torch.ones_like(d_std), d_std)
            net.derived_mean.copy_(d.mean(0))
            net.derived_std.copy_(d_std)
            # The cache share keeps a fixed scale (not centred on this training set): with measurements from
            # several machines in one model, the same table on a smaller cache must look different.
            net.derived_mean[1] = 0.0
            net.derived_std[1] = LOG_CACHE_SHARE_SCALE
        config.derived_scaler = {"mean": net.derived_mean.tolist(), "std": net.derived_std.tolist()}
        # Access bins are fractions: a bin that is rare in the training pool has a tiny std, and an unseen
        # table using it would get a z-score in the hundreds. Floor their std; clip all z-scores (_scaled).
        std = np.asarray(scaler.std, dtype=np.float64).copy()
        std[4:] = np.maximum(std[4:], BIN_STD_FLOOR)
        config.scaler = {"mean": list(map(float, scaler.mean)), "std": list(map(float, std))}
        net.scaler_mean.copy_(torch.as_tensor(scaler.mean, dtype=torch.float32))
        net.scaler_std.copy_(torch.as_tensor(std, dtype=torch.float32))
        return cls(net, config)

    def save(self, folder: str) -> dict[str, str]:
        """Write weights.pt (state_dict) and config.json; returns the artifact paths (MLflow artifacts)."""
        os.makedirs(folder, exist_ok=True)
        weights, config = os.path.join(folder, "weights.pt"), os.path.join(folder, "config.json")
        torch.save(self.net.state_dict(), weights)
        with open(config, "w", encoding="utf-8") as f:
            json.dump(asdict(self.config), f, indent=1)
        return {"weights": weights, "config": config}

    @classmethod
    def from_files(cls, weights: str, config: str) -> CostModel:
        try:
            with open(config, encoding="utf-8") as f:
                cfg = CostModelConfig(**json.load(f))
            net = CostNet(cfg)
            net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        except (OSError, ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise EmbshardError(f"cannot load the cost model ({first_line(exc)})", path=weights,
                                fix="re-train with `embshard train-cost`") from None
        return cls(net, cfg)

    @classmethod
    def load_dir(cls, folder: str) -> CostModel:
        return cls.from_files(os.path.join(folder, "weights.pt"), os.path.join(folder, "config.json"))

    # -- fast torch path (policy, search) ----------------------------------------------------------------------
    @property
    def width(self) -> int:
        """H, the number of channels of a table encoding."""
        return self.config.embed + NUM_EXTRA

    def _scaled(self, raw: torch.Tensor) -> torch.Tensor:
        x = raw.clone()
        x[:, :4] = torch.log1p(x[:, :4])
        return ((x - self.net.scaler_mean) / self.net.scaler_std).clamp(-Z_CLIP, Z_CLIP)

    def encode(self, features) -> torch.Tensor:
        """(N, H) float32 encodings of tables from raw (N, 21) features; normalisation happens inside.

        Sum the encodings of a device's tables and pass the sum to `totals_from_sums`/`heads_from_sums`.
        Channel `-3` of an encoding is 1 (a table count): an all-zero sum is an empty device and costs 0, so a
        caller only needs to sum over the tables actually on the device (zeros elsewhere).
        """
        raw = _as_raw(features)
        with torch.no_grad():
            return self.net.encode_scaled(self._scaled(raw), raw)

    def comm_encode(self, features) -> torch.Tensor:
        """(N, H) encodings holding only what the comm head reads, the count and dim-sum channels (the values
        `encode` gives them), zeros elsewhere: `heads_from_sums(...)[..., 2]` of them is the comm head of
        `encode(features)` without running the encoder (a replica's price asks for it on every split round)."""
        raw = _as_raw(features)
        out = torch.zeros(len(raw), self.width)
        out[:, self.config.embed + COUNT] = 1.0
        out[:, self.config.embed + DIMSUM] = raw[:, 0] / DIM_SCALE
        return out

    def heads_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        """(..., 3) ms (fwd compute, bwd compute, comm) from device sums (..., H)."""
        with torch.no_grad():
            return self.net.heads(sums, torch.tensor(float(num_devices)))

    def comm_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        """(...) `heads_from_sums(sums, num_devices)[..., 2]`, the comm head alone (a replica's price asks for it
        on every split round, on `comm_encode`'s encodings: running the compute heads too was most of its time)."""
        with torch.no_grad():
            return self.net.comm_head(sums, torch.tensor(float(num_devices)))[..., 0]

    def totals_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        """(...) total ms of each device from the SUM of its tables' encodings (..., H); empty device -> 0."""
        return self.heads_from_sums(sums, num_devices).sum(-1)

    num_members = 1  # one network: no uncertainty (types.CostEstimator)

    def member_totals_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        """(1, ...) device totals: this model is its only member."""
        return self.totals_from_sums(sums, num_devices).unsqueeze(0)

    def overall_from_sums(self, sums: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Overall-cost head: (P,) ms of P placements from device sums (P, D, H), D = num_devices."""
        d = sums.shape[-2]
        if mask is None:
            mask = sums[..., -NUM_EXTRA + COUNT] > -1.0  # all devices present
        with torch.no_grad():
            heads = self.net.heads(sums, torch.tensor(float(d)))
            return self.net.overall_from(sums, heads, mask)

    # -- numpy API ---------------------------------------------------------------------------------------------
    def predict_shards(self, features, shards: Sequence[np.ndarray], num_devices: int) -> np.ndarray:
        """(S, 3) ms (fwd compute, bwd compute, comm) of S device shards, each an array of row indices into
        `features` (N, 21 raw). Vectorised: one encoding pass and one segment sum, no loop over shards."""
        enc = self.encode(features)
        if len(shards) == 0:
            return np.zeros((0, len(HEADS)), dtype=np.float32)
        lengths = np.fromiter((len(s) for s in shards), dtype=np.int64, count=len(shards))
        flat = np.concatenate([np.asarray(s, dtype=np.int64).ravel() for s in shards]) if lengths.sum() else \
            np.zeros(0, dtype=np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= enc.shape[0]):
            raise EmbshardError(f"shard row index out of range 0..{enc.shape[0] - 1}", field="shards",
                                fix="shards hold row indices into the features matrix")
        seg = torch.from_numpy(np.repeat(np.arange(len(shards)), lengths))
        sums = torch.zeros(len(shards), enc.shape[1])
        sums.index_add_(0, seg, enc[torch.from_numpy(flat)])
        return self.heads_from_sums(sums, num_devices).numpy()

    def predict_placement(self, features, assignment, num_devices: int) -> tuple[np.ndarray, float]:
        """(per-device total ms (D,), overall = max of them) for a table-wise assignment (N,) of devices."""
        enc = self.encode(features)
        assignment = torch.as_tensor(np.asarray(assignment, dtype=np.int64))
        if assignment.numel() != enc.shape[0]:
            raise EmbshardError(f"assignment has {assignment.numel()} entries for {enc.shape[0]} tables",
                                field="assignment", fix="give one device per table row")
        if assignment.numel() and (assignment.min() < 0 or assignment.max() >= num_devices):
            raise EmbshardError(f"device index out of range 0..{num_devices - 1}", field="assignment")
        sums = torch.zeros(num_devices, enc.shape[1]).index_add_(0, assignment, enc)
        totals = self.totals_from_sums(sums, num_devices).numpy()
        return totals, float(totals.max()) if len(totals) else 0.0


def _as_raw(features) -> torch.Tensor:
    if isinstance(features, torch.Tensor):
        raw = features.to(torch.float32)
    else:
        raw = torch.from_numpy(np.array(features, dtype=np.float32))  # a copy: callers may pass read-only views
    if raw.ndim != 2 or raw.shape[1] != NUM_FEATURES:
        raise EmbshardError(f"features of shape {tuple(raw.shape)}", field="features",
                            fix=f"pass the (N, {NUM_FEATURES}) raw matrix of embshard.features.feature_matrix")
    return raw
