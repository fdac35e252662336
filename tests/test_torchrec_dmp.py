"""The exported TorchRec plan trains for real: 4 gloo CPU processes (2 hosts x 2 local ranks) shard an
EmbeddingBagCollection through DistributedModelParallel with a plan holding a table-wise, a column-wise, a
row-wise, a table-row-wise and a data-parallel table, and every rank's pooled lookups equal the unsharded
model's."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.slow

WORLD, LOCAL = 4, 2
# (rows, dim) per table; each fits a row_blocks cut over 4 ranks and over one host's 2 ranks.
SIZES = [(40, 8), (36, 16), (50, 8), (30, 8), (24, 4)]
BATCH = 3


def _has_torchrec() -> bool:
    try:
        from embshard.torchrec_compat import require_torchrec

        require_torchrec()
        return True
    except Exception:
        return False


def _tables():
    from embshard.tableset import TableSet

    return TableSet.from_frame(_tables_frame())


def _tables_frame() -> pd.DataFrame:
    from embshard import schemas
    from embshard.ingest.synthetic import generate_tables

    df = generate_tables(len(SIZES), seed=3, bins_batch_size=256)
    df["rows"] = [r for r, _ in SIZES]
    df["dim"] = [d for _, d in SIZES]
    df["bytes_per_element"] = 4
    df["size_bytes"] = df["rows"] * df["dim"] * 4
    df["table_id"] = [f"t{i}" for i in range(len(SIZES))]
    return schemas.validate(pd.DataFrame(df), "tables")


def _placement():
    from embshard.placement import Placement, Shard
    from embshard.types import DeviceTopology, row_blocks

    tables = _tables()
    shards = [Shard(0, 1),                                   # table_wise on rank 1
              Shard(1, 0, 0, 8), Shard(1, 3, 8, 8)]          # column_wise: ranks 0 and 3 (two hosts)
    shards += [Shard(2, d, row_offset=o, row_size=n) for d, (o, n) in enumerate(row_blocks(50, WORLD))]
    shards += [Shard(3, 2 + d, row_offset=o, row_size=n) for d, (o, n) in enumerate(row_blocks(30, LOCAL))]
    shards += [Shard(4, d, kind="replicated") for d in range(WORLD)]
    mem = int(tables.size_bytes.sum())
    return Placement(tables, WORLD, mem, shards, planner="test", task_id="dmp",
                     topology=DeviceTopology(WORLD, mem, hosts=(0, 0, 1, 1)))


def _batch(rank: int):
    """This rank's local batch: BATCH bags per feature, 0-3 ids each (seeded by rank)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = np.random.default_rng(100 + rank)
    keys, lengths, values = [], [], []
    for i, (rows, _) in enumerate(SIZES):
        keys.append(f"f_t{i}")
        n = rng.integers(0, 4, BATCH)
        lengths += n.tolist()
        values += rng.integers(0, rows, int(n.sum())).tolist()
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                                               lengths=torch.tensor(lengths, dtype=torch.int32))


def _load_reference_weights(model, reference) -> None:
    """Each rank's pieces of the unsharded reference's weights into the sharded model (the same weights on every
    rank, so the sharded lookups can be compared with the reference's)."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    full = reference.state_dict()
    with torch.no_grad():
        for name, local in model.state_dict().items():
            glob = full[name.removeprefix("module.")]
            if isinstance(local, ShardedTensor):
                for shard in local.local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(glob[r0:r0 + nr, c0:c0 + nc])
            else:
                local.copy_(glob)


def _worker(rank: int, plan_path: str, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from embshard.export.torchrec_plan import build_module, plan_from_json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(LOCAL), LOCAL_RANK=str(rank % LOCAL), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        tables = _tables()
        torch.manual_seed(0)
        reference = build_module(tables, device="cpu")
        for p in reference.parameters():  # the same weights on every rank
            torch.nn.init.uniform_(p, -1.0, 1.0)
        # The pickle-free plan, checked against the tables and the world as a training job would load it.
        plan = plan_from_json(plan_path, tables=tables, world_size=WORLD)
        model = DistributedModelParallel(build_module(tables, device="meta"), device=torch.device("cpu"), plan=plan,
                                         sharders=[EmbeddingBagCollectionSharder()], init_data_parallel=False)
        _load_reference_weights(model, reference)
        kjt = _batch(rank)
        got = model(kjt)
        got = got.wait() if hasattr(got, "wait") else got
        want = reference(kjt)
        g, w = got.to_dict(), want.to_dict()
        diffs = {k: float((g[k] - w[k]).abs().max()) for k in w}
        types = {n: ps.sharding_type for n, ps in plan.plan[""].items()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"diffs": diffs, "types": types, "shape": list(got.values().shape),
                       "norm": float(want.values().abs().sum())}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(not _has_torchrec(), reason="torchrec extra not installed")
def test_exported_plan_shards_through_dmp_and_matches_the_unsharded_model(tmp_path):
    import torch.multiprocessing as mp

    from embshard import schemas
    from embshard.jobs.export import run as export

    # The plan a training job gets: placements.parquet through `embshard export --compute-device cpu`.
    placement = _placement()
    schemas.write(_tables_frame(), tmp_path / "tables.parquet", "tables")
    schemas.write(placement.to_frame(), tmp_path / "placements.parquet", "placements")
    result = export(str(tmp_path / "placements.parquet"), str(tmp_path / "tables.parquet"), str(tmp_path / "out"),
                    compute_device="cpu")
    path = result["plans"]["dmp"]["torchrec_plan_json"]
    text = Path(path).read_text()
    assert "/cpu" in text and "cuda" not in text
    mp.start_processes(_worker, args=(str(path), _free_port(), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="spawn")
    for rank in range(WORLD):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["types"] == {"t0": "table_wise", "t1": "column_wise", "t2": "row_wise", "t3": "table_row_wise",
                                "t4": "data_parallel"}
        assert res["shape"] == [BATCH, sum(d for _, d in SIZES)]
        assert res["norm"] > 1.0  # real lookups, not empty bags
        assert max(res["diffs"].values()) < 1e-5, (rank, res["diffs"])


@pytest.mark.skipif(not _has_torchrec(), reason="torchrec extra not installed")
def test_a_table_row_wise_plan_is_refused_in_a_job_whose_hosts_are_another_size(tmp_path, monkeypatch):
    """t3 is cut table-row-wise over hosts of 2 ranks. A job that groups its ranks otherwise (LOCAL_WORLD_SIZE 4 or
    1, or unset: TorchRec then takes the world) failed inside DistributedModelParallel (an IndexError in TorchRec's
    table-row-wise sharding, or 'Number of local shards (0) does not match'); it is one line naming the fix."""
    from embshard import schemas
    from embshard.errors import EmbshardError
    from embshard.export.torchrec_plan import plan_from_json
    from embshard.jobs.export import run as export

    schemas.write(_tables_frame(), tmp_path / "tables.parquet", "tables")
    schemas.write(_placement().to_frame(), tmp_path / "placements.parquet", "placements")
    path = export(str(tmp_path / "placements.parquet"), str(tmp_path / "tables.parquet"), str(tmp_path / "out"),
                  compute_device="cpu")["plans"]["dmp"]["torchrec_plan_json"]
    for k in ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert plan_from_json(path, world_size=WORLD)  # outside a job (evaluate --plan, a laptop): nothing to compare
    assert plan_from_json(path, world_size=WORLD, local_world_size=LOCAL)
    # a torchrun job that loads its plan before init_process_group: its launcher's LOCAL_WORLD_SIZE is the job's
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(EmbshardError, match="hold 1 \\(TorchRec's ranks per host from LOCAL_WORLD_SIZE=1\\)"):
        plan_from_json(path, world_size=WORLD)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(LOCAL))
    assert plan_from_json(path, world_size=WORLD)
    with pytest.raises(EmbshardError) as err:
        plan_from_json(path, world_size=WORLD, local_world_size=4)
    line = str(err.value)
    assert "\n" not in line and "field 'local_world_size'" in line and "hosts of 2 ranks" in line
    assert "LOCAL_WORLD_SIZE=2" in line and "--devices-per-host 4" in line
    # In a job, TorchRec's own get_local_size decides: unset, it is 8 where that divides the world, else the world
    # (here a process group of 1), not the plan's 2.
    import torch.distributed as dist

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(EmbshardError, match="hold 1 \\(TorchRec's ranks per host: LOCAL_WORLD_SIZE is not set"):
            plan_from_json(path, world_size=WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not _has_torchrec(), reason="torchrec extra not installed")
def test_a_plan_loaded_before_init_process_group_is_checked_against_the_launchers_world(tmp_path, monkeypatch):
    """A torchrun script that loads its plan before init_process_group, without world_size=: a 2-device plan ran
    on 4 ranks (2 idle) without a word, an 8-device plan failed with an IndexError inside TorchRec. torchrun's
    WORLD_SIZE is the world: one line naming it, and world_size= still decides when given."""
    from embshard import schemas
    from embshard.errors import EmbshardError
    from embshard.export.torchrec_plan import plan_from_json
    from embshard.jobs.export import run as export

    schemas.write(_tables_frame(), tmp_path / "tables.parquet", "tables")
    schemas.write(_placement().to_frame(), tmp_path / "placements.parquet", "placements")
    path = export(str(tmp_path / "placements.parquet"), str(tmp_path / "tables.parquet"), str(tmp_path / "out"),
                  compute_device="cpu")["plans"]["dmp"]["torchrec_plan_json"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(LOCAL))
    monkeypatch.setenv("WORLD_SIZE", str(2 * WORLD))
    with pytest.raises(EmbshardError) as err:
        plan_from_json(path)
    line = str(err.value)
    assert "\n" not in line and "field 'world_size'" in line
    assert f"a world of {WORLD} ranks, not {2 * WORLD} (the launcher's WORLD_SIZE={2 * WORLD})" in line
    assert plan_from_json(path, world_size=WORLD)  # given: it decides
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    assert plan_from_json(path)
    monkeypatch.delenv("WORLD_SIZE")
    assert plan_from_json(path)  # no launcher, no group: a laptop reading a job's plan


# --- one plan, a model of two EBCs (TorchRec's is_weighted is per EBC) ------------------------------------------
WEIGHTED = ("t3", "t4")  # looked up with per-id weights, in an EBC of their own


def _two_ebcs(tables, device: str):
    """sparse.ebc (t0-t2) and sparse.webc (t3, t4: is_weighted), as a model with weighted features holds them."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    def ebc(names, weighted):
        return EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name=n, feature_names=[f"f_{n}"], num_embeddings=int(tables.rows[i]), embedding_dim=int(tables.dims[i]))
            for i, n in enumerate(tables.table_ids) if n in names], is_weighted=weighted, device=torch.device(device))

    class Sparse(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = ebc([n for n in tables.table_ids if n not in WEIGHTED], False)
            self.webc = ebc(WEIGHTED, True)

        def forward(self, kjt, weighted_kjt):
            return self.ebc(kjt), self.webc(weighted_kjt)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = Sparse()

        def forward(self, kjt, weighted_kjt):
            return self.sparse(kjt, weighted_kjt)

    return Model()


def _split_batch(kjt):
    """The rank's batch as (unweighted features, weighted features with weights in [0.5, 1.5))."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    d = kjt.to_dict()
    plain = [k for k in d if k.removeprefix("f_") not in WEIGHTED]
    weighted = [k for k in d if k.removeprefix("f_") in WEIGHTED]

    def of(keys, weights: bool):
        values = torch.cat([d[k].values() for k in keys])
        g = torch.Generator().manual_seed(int(values.sum()))
        return KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=values, lengths=torch.cat([d[k].lengths() for k in keys]),
            weights=0.5 + torch.rand(len(values), generator=g) if weights else None)

    return of(plain, False), of(weighted, True)


def _two_ebc_worker(rank: int, plan_path: str, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from embshard.export.torchrec_plan import plan_from_json

    torch.set_grad_enabled(False)  # lookups only
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        tables = _tables()
        torch.manual_seed(0)
        reference = _two_ebcs(tables, "cpu")
        for p in reference.parameters():
            torch.nn.init.uniform_(p, -1.0, 1.0)
        meta = _two_ebcs(tables, "meta")
        # One plan exported without --module-path: each table goes to the EBC of the model holding it; the world
        # size is the process group's.
        plan = plan_from_json(plan_path, module=meta)
        model = DistributedModelParallel(meta, device=torch.device("cpu"), plan=plan,
                                         sharders=[EmbeddingBagCollectionSharder()], init_data_parallel=False)
        _load_reference_weights(model, reference)
        kjt, wkjt = _split_batch(_batch(rank))
        got = [g.wait() if hasattr(g, "wait") else g for g in model(kjt, wkjt)]
        want = reference(kjt, wkjt)
        diffs = {k: float((g.to_dict()[k] - w.to_dict()[k]).abs().max()) for g, w in zip(got, want)
                 for k in w.to_dict()}
        # The weights matter: with weights of 1 the weighted sums differ (so they were checked with theirs).
        ones = reference.sparse.webc(_with_unit_weights(wkjt))
        ignored = float((ones.values() - want[1].values()).abs().max())
        with open(os.path.join(out_dir, f"two-rank{rank}.json"), "w") as f:
            json.dump({"diffs": diffs, "modules": {p: sorted(m) for p, m in plan.plan.items()},
                       "weights_matter": ignored}, f)
    finally:
        dist.destroy_process_group()


def _with_unit_weights(kjt):
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                               weights=torch.ones_like(kjt.weights()))


@pytest.mark.skipif(not _has_torchrec(), reason="torchrec extra not installed")
def test_one_plan_shards_a_model_with_a_weighted_and_an_unweighted_ebc(tmp_path):
    """A model whose weighted features sit in an EBC of their own (TorchRec's is_weighted is per EBC) loads one
    exported plan: plan_from_json(path, module=model) puts each table under its EBC, and both EBCs' pooled lookups,
    weighted ones included, equal the unsharded model's on 2 gloo ranks."""
    import torch.multiprocessing as mp

    from embshard import schemas
    from embshard.jobs.export import run as export
    from embshard.placement import Placement, Shard

    tables = _tables()
    shards = [Shard(0, 0), Shard(1, 0, 0, 8), Shard(1, 1, 8, 8), Shard(2, 1), Shard(3, 0), Shard(4, 1)]
    placement = Placement(tables, 2, int(tables.size_bytes.sum()), shards, planner="test", task_id="two")
    schemas.write(_tables_frame(), tmp_path / "tables.parquet", "tables")
    schemas.write(placement.to_frame(), tmp_path / "placements.parquet", "placements")
    result = export(str(tmp_path / "placements.parquet"), str(tmp_path / "tables.parquet"), str(tmp_path / "out"),
                    compute_device="cpu")
    path = result["plans"]["two"]["torchrec_plan_json"]
    mp.start_processes(_two_ebc_worker, args=(str(path), _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        res = json.loads((tmp_path / f"two-rank{rank}.json").read_text())
        assert res["modules"] == {"sparse.ebc": ["t0", "t1", "t2"], "sparse.webc": ["t3", "t4"]}
        assert set(res["diffs"]) == {f"f_t{i}" for i in range(5)}
        assert max(res["diffs"].values()) < 1e-5, (rank, res["diffs"])
        assert res["weights_matter"] > 1e-3  # the weighted lookups were checked with their weights
