"""The scorer's fused evaluator (costmodel.scoring): device sums of projected encodings give the model's own
device totals, for a single network and an ensemble, and it is actually used (a silent fallback to the model
would only make planning slow again)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from embshard.costmodel.ensemble import CostEnsemble
from embshard.costmodel.model import CostModel, CostModelConfig
from embshard.costmodel.scoring import TaskScorer
from embshard.features import FeatureScaler
from embshard.ingest.synthetic import generate_tables
from embshard.tableset import TableSet


@pytest.mark.parametrize("monotone", [False, True])
@pytest.mark.parametrize("members", [1, 3])
@pytest.mark.parametrize("devices", [1, 2, 16])
def test_fused_totals_match_the_model(members, devices, monotone):
    torch.manual_seed(members)
    ts = TableSet.from_frame(generate_tables(40, seed=3, bins_batch_size=512))
    scaler = FeatureScaler.fit(ts.features())
    models = [CostModel.create(CostModelConfig(monotone=monotone), scaler) for _ in range(members)]
    if monotone:  # biases that put some units on either side of their kink (fresh ones are near zero)
        with torch.no_grad():
            for m in models:
                for head in (m.net.fwd, m.net.bwd):
                    head.mlp[0].bias.uniform_(-2.0, 2.0)
    model = models[0] if members == 1 else CostEnsemble(models)
    sc = TaskScorer(model, ts.features(), devices)
    assert sc._fused is not None
    assignment = np.arange(40) % devices
    sums, counts = sc.device_sums(assignment)
    model_sums = torch.zeros(devices, sc.model_enc.shape[1]).index_add_(0, torch.as_tensor(assignment), sc.model_enc)
    want = model.totals_from_sums(model_sums, devices)
    assert torch.allclose(sc.totals(sums, counts), want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(sc.member_totals(sums, counts), model.member_totals_from_sums(model_sums, devices),
                          rtol=1e-5, atol=1e-6)
    single = model.totals_from_sums(sc.model_enc, devices).numpy()
    assert np.allclose(sc.single_costs(), single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("members", [1, 3])
def test_the_search_shortcuts_match_totals_with_and_without_replica_extras(members):
    """pair_totals (a swap's sums without building them) and totals_nonempty give what totals gives, also when
    pieces carry an additive extra channel (a replica's all-reduce, replica_extra_ms)."""
    torch.manual_seed(members)
    ts = TableSet.from_frame(generate_tables(30, seed=4, bins_batch_size=512))
    scaler = FeatureScaler.fit(ts.features())
    models = [CostModel.create(CostModelConfig(), scaler) for _ in range(members)]
    model = models[0] if members == 1 else CostEnsemble(models)
    for extra in (None, np.linspace(0.0, 2.0, 30)):
        sc = TaskScorer(model, ts.features(), 4, extra=extra)
        a, b = sc.enc[:5], sc.enc[10:17]
        want = sc.totals(a.unsqueeze(1) + b.unsqueeze(0), torch.ones(5, 7, dtype=torch.long))
        assert torch.allclose(sc.pair_totals(a, b, 1), want, rtol=1e-5, atol=1e-5)
        sums = sc.enc[:6] + sc.enc[6:12]
        assert torch.allclose(sc.totals_nonempty(sums), sc.totals(sums, torch.ones(6, dtype=torch.long)),
                              rtol=1e-5, atol=1e-5)
        if extra is not None:  # the extra is added on top of the model's totals
            plain = TaskScorer(model, ts.features(), 4)
            assert np.allclose(sc.single_costs(), plain.single_costs() + extra, rtol=1e-5, atol=1e-5)
