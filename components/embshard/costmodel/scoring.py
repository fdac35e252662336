"""Scoring placements with a cost model (any `types.CostEstimator`), fast enough for RL rollouts and search.

The cost model is SUM-decomposable: a device's cost is a function of the sum of its tables' encodings. So a
task's tables are encoded once, and any candidate device content is scored from a sum of rows: adding or
removing a table is one vector addition, and thousands of candidates are one batched call.

Replicas (kind 'replicated'): the model prices a replica's compute from its features (1/D of the lookups,
`piece_features`); its communication differs in kind from a table's, so it is an additive analytic term per
piece (`replica_extra_ms`, carried as one more channel of the scorer's sums): minus the all-to-all the model
would charge for its dim (a replica sends no pooled outputs) plus the ring all-reduce of its gradient
(rows x dim x bytes per element, latency + 2 (D-1)/D bytes / bandwidth), as the benchmark measures it (bench.comm).
"""
from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch

from ..placement import Placement, Shard
from ..tableset import TableSet
from ..types import REPLICATED, CostEstimator


@contextlib.contextmanager
def single_threaded():
    """Run torch on one thread: planning calls thousands of tiny ops, for which intra-op threads only add
    synchronisation (16x slower at 200 tables x 8 devices on a busy 2-core machine, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def torch_defaults():
    """float32 tensors on the CPU as torch's defaults while the models are loaded or planning runs, whatever the
    caller set: a notebook's torch.set_default_dtype(torch.float64), or a model built under `with
    torch.device("meta")` (as TorchRec's docs build them), had made planning fail deep inside torch."""
    # A device context is a mode every torch call goes through (planning took 1.5x as long inside one): entered only
    # when the caller's default device is another one (a device context is the calling thread's own).
    device = (contextlib.nullcontext() if torch.get_default_device().type == "cpu"
              else torch.device("cpu"))
    with _float32_default(), device:
        yield


_DTYPE_LOCK = threading.Lock()
_dtype_users = 0            # blocks inside _float32_default (any thread)
_dtype_before = None        # the default the first of them found, put back by the last


@contextlib.contextmanager
def _float32_default():
    """float32 as torch's default dtype, which is the whole process's: nothing changes when it already is (the
    usual case); else the first block (of any thread) sets it and the last one out puts the caller's back, so that
    two threads planning at once do not undo each other's."""
    global _dtype_users, _dtype_before
    with _DTYPE_LOCK:
        if _dtype_users == 0 and torch.get_default_dtype() == torch.float32:
            changed = False
        else:
            changed = True
            if _dtype_users == 0:
                _dtype_before = torch.get_default_dtype()
                torch.set_default_dtype(torch.float32)
            _dtype_users += 1
    try:
        yield
    finally:
        if changed:
            with _DTYPE_LOCK:
                _dtype_users -= 1
                if _dtype_users == 0:
                    torch.set_default_dtype(_dtype_before)


class TaskScorer:
    """Predicted per-device costs for one task (a fixed set of table pieces on `num_devices` devices).

    Used by the policy (rollouts) and the planners (candidates, search); it sits with the cost models so that
    neither of them imports the other."""

    def __init__(self, cost_model: CostEstimator, features: np.ndarray | None, num_devices: int,
                 enc: torch.Tensor | None = None, projected: torch.Tensor | None = None,
                 extra: np.ndarray | None = None):
        self.cost_model = cost_model
        self.num_devices = int(num_devices)
        if enc is None:
            with torch.no_grad():
                enc = cost_model.encode(np.asarray(features, dtype=np.float64)).float()
        self.model_enc = enc  # (N, H) the cost model's encodings
        self._fused = _fused_heads(cost_model, self.num_devices)
        # What device sums add up: the encodings, or their projections when the fused evaluator applies.
        # (`projected`: the caller's own projection of `enc`, e.g. a search state's with one piece cut.)
        self.enc = (self.model_enc if self._fused is None
                    else projected if projected is not None else self._fused.project(enc))
        self.projected = self.enc  # without the extra channel: what a search state's cut reuses
        # Additive ms per piece (replicas' communication, replica_extra_ms): one more channel of the sums.
        self.extra = None if extra is None else np.asarray(extra, dtype=np.float64)
        if self.extra is not None:
            self.enc = torch.cat([self.enc, torch.as_tensor(self.extra, dtype=self.enc.dtype).unsqueeze(1)], dim=1)
        self.dim = self.enc.shape[1]

    @property
    def has_members(self) -> bool:
        """Whether the cost model is an ensemble with more than one member (then it has an uncertainty)."""
        return self.cost_model.num_members > 1

    # No torch.no_grad() around the fused evaluator: its weights and every encoding are made without autograd,
    # and entering the context costs more than the op itself on the search's small tensors; the model's own
    # forward (another kind of model) runs under it.
    def member_totals(self, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """(K, ...) device totals per ensemble member (K = 1 for a single model); empty devices cost 0."""
        sums, add = self._split_extra(sums)
        if self._fused is not None:
            out = self._fused.member_totals(sums)
        else:
            with torch.no_grad():
                out = self.cost_model.member_totals_from_sums(sums, self.num_devices)
        if add is not None:
            out = out + add.to(out.dtype)
        return out.masked_fill(counts <= 0, 0.0)

    def _split_extra(self, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the model's sums, the summed additive ms or None)."""
        if self.extra is None:
            return sums, None
        return sums[..., :-1], sums[..., -1]

    def _mean_totals(self, sums: torch.Tensor, nonempty: bool = False) -> torch.Tensor:
        if self._fused is not None:
            return self._fused.mean_totals(sums, nonempty=nonempty)
        with torch.no_grad():
            return self.cost_model.totals_from_sums(sums, self.num_devices)

    def totals(self, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Device totals (ms) from summed encodings (..., H) and table counts (...); empty devices cost 0."""
        sums, add = self._split_extra(sums)
        # `counts` masks the empty devices below, so the fused evaluator need not mask them from the sums' count
        # channel too (the same devices: that channel is the sum of the pieces' ones).
        out = self._mean_totals(sums, nonempty=True)
        if add is not None:
            out = out + add.to(out.dtype)
        return out.masked_fill(counts <= 0, 0.0)

    def pair_totals(self, a: torch.Tensor, b: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
        """(P, Q) device totals of every sum a[p] + b[q] (a device's sum less one piece plus another: the search's
        swaps), on a device holding `count` pieces; the same as `totals` of the (P, Q, H) sums, without building
        them when the fused evaluator applies."""
        if self._fused is None:
            c = torch.as_tensor(count).expand(len(a), len(b))
            return self.totals(a.unsqueeze(1) + b.unsqueeze(0), c)
        (a, add_a), (b, add_b) = self._split_extra(a), self._split_extra(b)
        out = self._fused.pair_mean_totals(a, b, nonempty=int(count) > 0)
        if add_a is not None and add_b is not None:
            out = out + (add_a.unsqueeze(1) + add_b.unsqueeze(0)).to(out.dtype)
        return out if int(count) > 0 else torch.zeros_like(out)

    def totals_nonempty(self, sums: torch.Tensor) -> torch.Tensor:
        """`totals` of devices that each hold at least one piece (a rollout's or a greedy's candidates)."""
        sums, add = self._split_extra(sums)
        out = self._mean_totals(sums, nonempty=True)
        return out if add is None else out + add.to(out.dtype)

    def device_sums(self, assignment: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.as_tensor(np.asarray(assignment), dtype=torch.long)
        sums = torch.zeros(self.num_devices, self.dim).index_add_(0, a, self.enc)
        counts = torch.bincount(a, minlength=self.num_devices)
        return sums, counts

    def device_costs(self, assignment: np.ndarray) -> np.ndarray:
        sums, counts = self.device_sums(assignment)
        return self.totals(sums, counts).numpy().astype(np.float64)

    def single_costs(self) -> np.ndarray:
        """Predicted cost of each piece alone on a device."""
        return self.totals(self.enc, torch.ones(len(self.enc), dtype=torch.long)).numpy().astype(np.float64)


class _FusedHeads:
    """The device totals of a network cost model (CostModel, or a CostEnsemble of them) from PROJECTED sums.

    The heads' first layers (and their linear skips) are linear in the device sum, so a table can carry its
    encoding already multiplied by them: a device's sum of projections is the projection of its sum, and
    scoring a candidate device is then a relu, a small weighted sum, a softplus and a tiny matrix product (the
    model evaluates ~40 small modules and ops per member per call, which is what planning spent its time on). The
    projected channels are laid out [every member's fwd and bwd hidden units | every member's two skips | the
    table count | each member's dim-sum], so that each of those ops serves all members at once.
    Otherwise the same function as the model's `totals_from_sums`: fwd and bwd heads (MLP plus skip,
    softplus), the physical comm term, scaled, empty devices 0, per member. Used only when it reproduces the
    model on a probe (`_fused_heads`), so a change of the network falls back to the model itself."""

    def __init__(self, nets: list, num_devices: int):
        from .model import COUNT, DIMSUM, NUM_EXTRA

        k = self.k = len(nets)
        self.width = int(nets[0].fwd.skip.weight.shape[1])
        hh = self.hh = int(nets[0].fwd.mlp[0].weight.shape[0])
        self.nh = k * 2 * hh             # hidden channels of all members
        self.pw = self.nh + 2 * k        # projected channels: hidden units, then 2 skips per member
        self.dim = self.pw + 1 + k       # then the table count and each member's dim-sum channel
        self.count_col = self.width - NUM_EXTRA + COUNT
        self.dimsum_col = self.width - NUM_EXTRA + DIMSUM
        sp = torch.nn.functional.softplus
        with torch.no_grad():
            # Each head as relu units alone (a monotone head's concave units folded in: model._Head.relu_weights):
            # (W1, b1, w2, b2, skip) per member, fwd then bwd.
            heads = [(n.fwd.relu_weights(), n.bwd.relu_weights()) for n in nets]
            self.w1 = torch.stack([torch.cat([f[0], b[0], f[4], b[4]]).t() for f, b in heads]
                                  ).contiguous()  # (K, W, 2hh+2)
            self.b1 = torch.cat([torch.cat([f[1], b[1]]) for f, b in heads])  # (K*2hh,)
            # (2K, hh): member j's fwd, then bwd output weights. A multiply and a sum over the hidden units (MKL's
            # product with 2K output columns is ~10x slower on this machine's AMD CPU).
            self.w2 = torch.cat([torch.cat([f[2], b[2]]) for f, b in heads])
            self.b2 = torch.cat([torch.cat([f[3], b[3]]) for f, b in heads])  # (2K,)
            nd = torch.tensor(float(num_devices)).clamp(min=1.0)
            on = float(num_devices > 1)  # one device: no comm
            comm_rate = torch.stack([sp(n.comm_rate) * (nd - 1.0) / nd * on for n in nets])  # (K,)
            comm_lat = torch.stack([(sp(n.comm_latency) + sp(n.comm_latency_slope) * torch.log2(nd)) * on
                                    for n in nets])
            scale = torch.stack([n.target_scale.expand(3) for n in nets])  # (K, 3)
            # total_j = fwd_j * s_j0 + bwd_j * s_j1 + (dimsum_j * rate_j + lat_j) * s_j2: a (2K, K) product of
            # the softplus outputs, a per-member rate on the dim-sums and a constant.
            mix = torch.zeros(2 * k, k)
            for j in range(k):
                mix[2 * j, j] = scale[j, 0]
                mix[2 * j + 1, j] = scale[j, 1]
            self.mix = mix
            self.rate = (comm_rate * scale[:, 2]).contiguous()
            self.lat = (comm_lat * scale[:, 2]).contiguous()
            # The members' mean in one pass (`mean_totals`).
            self.mix_mean = (mix.sum(1) / k).unsqueeze(1)  # (2K, 1)
            self.rate_mean = (self.rate / k).unsqueeze(1)   # (K, 1)
            self.lat_mean = self.lat.mean().reshape(1)

    def project(self, enc: torch.Tensor) -> torch.Tensor:
        """(N, dim) projected encodings from the model's (N, K x W)."""
        n, k, hh = len(enc), self.k, self.hh
        x = enc.reshape(-1, k, self.width).transpose(0, 1)  # (K, N, W)
        h = torch.bmm(x, self.w1)  # (K, N, 2hh+2)
        hidden = h[..., : 2 * hh].transpose(0, 1).reshape(n, self.nh)
        skips = h[..., 2 * hh:].transpose(0, 1).reshape(n, 2 * k)
        return torch.cat([hidden, skips, x[0, :, self.count_col:self.count_col + 1], x[:, :, self.dimsum_col].t()],
                         dim=1)

    def _heads(self, p: torch.Tensor) -> torch.Tensor:
        """(M, 2K) softplus outputs (fwd, bwd per member) of projected sums (M, dim)."""
        # In place on the temporaries (the same values, fewer allocations: rollouts score hundreds of rows a step).
        hidden = torch.relu_(p[:, : self.nh] + self.b1).view(len(p), 2 * self.k, self.hh)
        return torch.nn.functional.softplus(hidden.mul_(self.w2).sum(-1).add_(self.b2).add_(p[:, self.nh:self.pw]))

    def member_totals(self, proj: torch.Tensor) -> torch.Tensor:
        """(K, ...) device totals per member from projected sums (..., dim)."""
        lead = proj.shape[:-1]
        p = proj.reshape(-1, self.dim)
        total = torch.addmm(self.lat, self._heads(p), self.mix) + p[:, self.pw + 1:] * self.rate  # (M, K)
        total = total * (p[:, self.pw:self.pw + 1] > 0.5)
        return total.t().reshape(self.k, *lead)

    def mean_totals(self, proj: torch.Tensor, nonempty: bool = False) -> torch.Tensor:
        """(...) the members' mean device total from projected sums (..., dim): member_totals(proj).mean(0).
        `nonempty`: every sum holds a piece (no empty-device mask needed)."""
        lead = proj.shape[:-1]
        p = proj.reshape(-1, self.dim)
        total = torch.addmm(self.lat_mean, self._heads(p), self.mix_mean)
        total = total.addmm_(p[:, self.pw + 1:], self.rate_mean)
        if not nonempty:
            total = total * (p[:, self.pw:self.pw + 1] > 0.5)
        return total.reshape(lead)

    def pair_mean_totals(self, a: torch.Tensor, b: torch.Tensor, nonempty: bool = False) -> torch.Tensor:
        """(P, Q) mean_totals of every a[p] + b[q] (projected, (P, dim) and (Q, dim)): only the hidden units are
        computed per pair (the skips, dim-sums and counts are linear, so added per row and per column).
        `nonempty`: every pair holds a piece (no empty-device mask needed)."""
        P, Q, nh = len(a), len(b), self.nh
        a_hidden, b_hidden = a[:, :nh] + self.b1, b[:, :nh].unsqueeze(0)
        # The (P, Q, nh) hidden units a block of rows at a time, each block small enough to stay in cache (one
        # pass over a grid of 100k pairs, 150 MB, was mostly memory traffic); the same values.
        rows = max(1, PAIR_BLOCK // max(Q * nh, 1))
        if rows >= P:  # one block: no copy
            hidden = torch.relu_(a_hidden.unsqueeze(1) + b_hidden)  # (P, Q, nh)
            pre = hidden.view(P, Q, 2 * self.k, self.hh).mul_(self.w2).sum(-1)  # (P, Q, 2K)
        else:  # a loop into one output (blocks joined by torch.cat measured 6x slower)
            pre = torch.empty(P, Q, 2 * self.k)
            for r in range(0, P, rows):
                hidden = torch.relu_(a_hidden[r:r + rows].unsqueeze(1) + b_hidden)
                pre[r:r + rows] = hidden.view(len(hidden), Q, 2 * self.k, self.hh).mul_(self.w2).sum(-1)
        pre += (a[:, nh:self.pw] + self.b2).unsqueeze(1) + b[:, nh:self.pw].unsqueeze(0)
        fb = torch.nn.functional.softplus(pre).view(P * Q, 2 * self.k)
        total = torch.addmm(self.lat_mean, fb, self.mix_mean).view(P, Q)
        total += a[:, self.pw + 1:] @ self.rate_mean + (b[:, self.pw + 1:] @ self.rate_mean).t()
        return total if nonempty else total * ((a[:, self.pw:self.pw + 1] + b[:, self.pw].unsqueeze(0)) > 0.5)


PAIR_BLOCK = 1 << 18  # floats of hidden units per block of pair_mean_totals (1 MiB: within a core's L2)


_FUSED_CACHE: dict[tuple[int, int], tuple[object, _FusedHeads | None]] = {}


def _fused_heads(cost_model, num_devices: int) -> _FusedHeads | None:
    """The fused evaluator of this model at D devices, or None (another kind of model, or it does not reproduce
    the model's totals to 1e-5 on a probe). Cached per model and D: planning builds many scorers."""
    key = (id(cost_model), int(num_devices))
    hit = _FUSED_CACHE.get(key)
    if hit is not None and hit[0] is cost_model:
        return hit[1]
    members = getattr(cost_model, "members", None) or [cost_model]
    nets = [getattr(m, "net", None) for m in members]
    fused = None
    try:
        if all(n is not None and hasattr(n, "fwd") and hasattr(n.fwd, "relu_weights") and hasattr(n, "comm_rate")
               for n in nets):
            # Ordinary tensors even when a planner asks under inference_mode: the cache outlives the plan, and
            # training (rollouts with autograd on) may read it later.
            with torch.inference_mode(False):
                fused = _FusedHeads(nets, num_devices)
            with torch.no_grad():
                gen = torch.Generator().manual_seed(0)
                probe = torch.rand(64, fused.k * fused.width, generator=gen) * 4
                probe[:8] = 0.0  # empty devices
                for j in range(1, fused.k):  # every member counts the same tables
                    probe[:, j * fused.width + fused.count_col] = probe[:, fused.count_col]
                want = cost_model.member_totals_from_sums(probe, num_devices)
                got = fused.member_totals(fused.project(probe))
                got_mean = fused.mean_totals(fused.project(probe))
                proj = fused.project(probe)
                got_pairs = fused.pair_mean_totals(proj[:8], proj[8:16])
                want_pairs = fused.mean_totals(proj[:8].unsqueeze(1) + proj[8:16].unsqueeze(0))
            if not (torch.allclose(got, want, rtol=1e-5, atol=1e-6)
                    and torch.allclose(got_mean, want.mean(0), rtol=1e-5, atol=1e-6)
                    and torch.allclose(got_pairs, want_pairs, rtol=1e-5, atol=1e-6)):
                fused = None
    except (AttributeError, IndexError, RuntimeError, TypeError):
        fused = None
    if len(_FUSED_CACHE) > 64:
        _FUSED_CACHE.clear()
    _FUSED_CACHE[key] = (cost_model, fused)
    return fused


def piece_features(tables: TableSet, shards: list[Shard], num_devices: int | None = None) -> np.ndarray:
    """Raw features of each placed piece (the same 21 features as a table; docs/contracts.md, "Shard kinds"):

    - a column slice is a table of dim col_size (same rows and accesses);
    - a row range [row_offset, row_offset + row_size) keeps the full dim (its device sends full-width partial
      pooled sums), holds row_size rows, and carries row_size / rows of the table's lookups: ids are hashed to
      rows, so hot and cold ids spread evenly over the ranges and the access-count bins keep their shape;
    - a replica serves only its device's share of the batch: 1 / num_devices of the lookups (`num_devices` is
      needed then).
    """
    base = tables.features()
    feats = base[[s.table for s in shards]].copy()
    for k, s in enumerate(shards):
        bpe = tables.bytes_per_element[s.table]
        if s.col_size is not None:
            feats[k, 0] = s.col_size
            feats[k, 3] = tables.rows[s.table] * s.col_size * bpe
        if s.row_size is not None:
            rows = int(tables.rows[s.table])
            feats[k, 1] = s.row_size
            feats[k, 2] = feats[k, 2] * s.row_size / rows
            feats[k, 3] = s.row_size * feats[k, 0] * bpe
        if s.kind == REPLICATED:
            if not num_devices:
                raise ValueError("replicated pieces need num_devices (each replica serves 1/D of the batch)")
            feats[k, 2] = feats[k, 2] / num_devices
    return feats


def replica_comm_model(cost_model: CostEstimator, num_devices: int, a2a_ms: float = 0.0, dim: int = 0,
                       latency_ms: float = 0.0):
    """The (latency, bandwidth) a replica's all-reduce is priced with (collectives.CommModel): the calibration the
    model's measurements used (its config's comm_calibration), else EMBSHARD_COMM_BANDWIDTH_GBPS/_LATENCY_US,
    else the constants implied by the model's own all-to-all head: `a2a_ms` (fwd + bwd) for `dim`-wide outputs
    at the model's batch size, `latency_ms` its comm head without them."""
    import os

    from ..collectives import NVLINK_DEFAULT, CommModel, exchanged_bytes

    cal = getattr(getattr(cost_model, "config", None), "comm_calibration", None)
    if cal and float(cal.get("bandwidth_Bps", 0)) > 0:
        return CommModel(float(cal["latency_s"]), float(cal["bandwidth_Bps"]), str(cal.get("source", "")))
    if os.environ.get("EMBSHARD_COMM_BANDWIDTH_GBPS"):
        return CommModel(float(os.environ.get("EMBSHARD_COMM_LATENCY_US", "0")) * 1e-6,
                         float(os.environ["EMBSHARD_COMM_BANDWIDTH_GBPS"]) * 1e9, "given")
    batch = float(getattr(getattr(cost_model, "config", None), "batch_size", None)
                  or getattr(cost_model, "batch_size", 0) or 0)
    if a2a_ms > 0 and dim > 0 and batch > 0 and num_devices > 1:
        one = a2a_ms / 2.0 * 1e-3  # the head holds the forward and the backward all-to-all
        return CommModel(max(latency_ms, 0.0) / 2.0 * 1e-3, exchanged_bytes(int(batch), dim, num_devices) / one,
                         "from the cost model's all-to-all head")
    return CommModel(NVLINK_DEFAULT["latency_s"], NVLINK_DEFAULT["bandwidth_Bps"], "constants:nvlink")


def _a2a_heads(cost_model: CostEstimator, feats: np.ndarray, num_devices: int) -> np.ndarray:
    """The comm head (ms) of each piece alone on a device (from the channels it reads, where the model says which)."""
    comm_encode, comm = getattr(cost_model, "comm_encode", None), getattr(cost_model, "comm_from_sums", None)
    with torch.no_grad():
        if comm_encode is not None and comm is not None:  # the comm head alone (CostModel, CostEnsemble)
            return comm(comm_encode(np.asarray(feats, dtype=np.float64)).float(), num_devices).double().numpy()
        enc = cost_model.encode(np.asarray(feats, dtype=np.float64)).float()
        return cost_model.heads_from_sums(enc, num_devices)[..., 2].double().numpy()


def replica_extra_ms(cost_model: CostEstimator, tables: TableSet, shards: list[Shard], num_devices: int,
                     feats: np.ndarray | None = None, cache: dict | None = None) -> np.ndarray | None:
    """Additive ms per piece (None when no piece is a replica): a replica's `replica_extras`, 0 for other pieces.
    `feats`: the pieces' features where the caller has them."""
    reps = [k for k, s in enumerate(shards) if s.kind == REPLICATED]
    if not reps:
        return None
    pieces = [shards[k] for k in reps]
    out = np.zeros(len(shards))
    out[reps] = replica_extras(cost_model, tables, np.array([s.table for s in pieces], dtype=np.int64),
                               np.array([_width(tables, s) for s in pieces], dtype=np.int64), num_devices,
                               cache=cache, pieces=pieces,
                               feats=None if feats is None else np.asarray(feats, dtype=np.float64)[reps])
    return out


def _width(tables: TableSet, s: Shard) -> int:
    return int(s.col_size) if s.col_size is not None else int(tables.dims[s.table])


def replica_extras(cost_model: CostEstimator, tables: TableSet, tabs: np.ndarray, widths: np.ndarray,
                   num_devices: int, cache: dict | None = None, pieces: list[Shard] | None = None,
                   feats: np.ndarray | None = None) -> np.ndarray:
    """The additive ms of replicas of tables `tabs` (`widths` wide; `pieces`: the replica pieces themselves, else
    whole replicas) asked together: the all-reduce of the table's gradient (collectives.CommModel.allreduce_ms
    with `replica_comm_model`, priced from the widest of them) minus the all-to-all the cost model charges for
    its width (its comm head with and without the width: a replica sends no outputs).

    `cache`, kept by a caller that asks again about the same tables of one task, holds each table's two comm
    heads (a piece is encoded alone, so its heads do not depend on the others asked with it); only tables not
    in it are encoded."""
    from ..collectives import replica_grad_bytes

    tabs = np.asarray(tabs, dtype=np.int64)
    cache = {} if cache is None else cache
    heads = cache.get("heads")
    if heads is None:
        heads = cache["heads"] = np.full((len(tables), 2), np.nan)
    _, first = np.unique(tabs, return_index=True)  # a table's first replica here: its copies have one feature row
    todo = np.sort(first[np.isnan(heads[tabs[first], 0])])
    if len(todo):
        f = (feats[todo] if feats is not None else piece_features(
            tables, [pieces[j] if pieces is not None else Shard(int(tabs[j]), 0, kind=REPLICATED) for j in todo],
            num_devices))
        no_dim = f.copy()
        no_dim[:, 0], no_dim[:, 3] = 0.0, 0.0
        h = _a2a_heads(cost_model, np.concatenate([f, no_dim]), num_devices)
        heads[tabs[todo], 0], heads[tabs[todo], 1] = h[: len(todo)], h[len(todo):]
    sent = heads[tabs]  # (R, 2): each replica's comm head with and without its width
    a2a = np.maximum(sent[:, 0] - sent[:, 1], 0.0)
    j = int(np.argmax(widths))
    model = replica_comm_model(cost_model, num_devices, float(a2a[j]), int(widths[j]), float(sent[j, 1]))
    grad = replica_grad_bytes(tables.rows[tabs].astype(np.float64), tables.dims[tabs].astype(np.float64),
                              tables.bytes_per_element[tabs])
    return model.allreduce_ms(grad, num_devices) - a2a


def placement_costs(cost_model: CostEstimator, placement: Placement) -> np.ndarray:
    """Predicted per-device total cost (ms) of any placement, column slices and replicas included."""
    with torch_defaults():
        feats = piece_features(placement.tables, placement.shards, placement.num_devices)
        scorer = TaskScorer(cost_model, feats, placement.num_devices,
                            extra=replica_extra_ms(cost_model, placement.tables, placement.shards,
                                                   placement.num_devices, feats))
        return scorer.device_costs(placement.device_of_shards())


def placement_split(cost_model: CostEstimator, placement: Placement) -> np.ndarray:
    """(D, 2) predicted ms of each device: its compute (forward + backward) and its communication (the all-to-all,
    and each replica's all-reduce less the outputs it does not send); their sum is `placement_costs`. On one device
    there is no communication: a plan on fewer devices may predict less than one on more (said where it is shown)."""
    with torch_defaults():
        feats = piece_features(placement.tables, placement.shards, placement.num_devices)
        extra = replica_extra_ms(cost_model, placement.tables, placement.shards, placement.num_devices, feats)
        with torch.no_grad():
            enc = cost_model.encode(np.asarray(feats, dtype=np.float64)).float()
        devices = placement.device_of_shards()
        D = placement.num_devices
        sums = torch.zeros(D, enc.shape[1]).index_add_(0, torch.as_tensor(devices, dtype=torch.long), enc)
        heads = cost_model.heads_from_sums(sums, D).double().numpy()  # (D, 3): fwd, bwd, comm
    comm = heads[:, 2] + (0.0 if extra is None else np.bincount(devices, weights=extra, minlength=D))
    out = np.stack([heads[:, 0] + heads[:, 1], comm], axis=1)
    out[np.bincount(devices, minlength=D) == 0] = 0.0  # an empty device costs nothing (as placement_costs)
    return out


def balanced_estimate(cost_model: CostEstimator, tables: TableSet, num_devices: int,
                      column_splits: bool = False, enc: torch.Tensor | None = None) -> float:
    """The balanced estimate under the model (docs/method.md, "Balanced estimate"): per cost head, the smaller of
    (all tables fused on one device) and (the sum of single-table costs), divided by D: what a device would cost if
    the task's work were spread evenly. An estimate, not a bound: measured plans can fall below it (fused,
    sub-additive compute of the tables a device really holds measured in its own context, and timer noise).

    All-on-one / D would bound the mean device cost if fused costs were sub-additive, the sum of singles / D if they
    were super-additive. Measured CPU costs are both (forward shares work as tables fuse, backward grows faster
    than linearly, the all-to-all pays its latency once per device), so each head takes the smaller of its two.
    A device holding the most expensive table costs at least that table alone (table-wise plans; column-wise
    splits can go below it, so they get the first term alone).

    `enc`: the tables' encodings by this model when the caller has them (a planner's task context), so that they
    are not computed twice.
    """
    with torch_defaults():
        if enc is None:
            enc = TaskScorer(cost_model, tables.features(), num_devices).model_enc
        with torch.no_grad():
            fused = cost_model.heads_from_sums(enc.sum(0, keepdim=True), num_devices)[0]
            singles = cost_model.heads_from_sums(enc, num_devices)
    # One device: all tables fused is the only plan there is (the min with the sum of singles would put the
    # estimate below it, and `place` had reported a +73% gap to balance on one device).
    estimate = (float(fused.sum()) if num_devices <= 1
                else float(torch.minimum(fused, singles.sum(0)).sum()) / num_devices)
    if not column_splits and num_devices > 1:
        estimate = max(estimate, float(singles.sum(1).max()))
    return float(estimate)
