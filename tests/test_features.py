"""The 21 features (docs/method.md): the 17 access bins checked against hand-computed examples."""
from __future__ import annotations

import numpy as np
import pytest

from embshard import features, schemas
from embshard.ingest.synthetic import table_bins


def _bins(**frac):
    out = np.zeros(schemas.NUM_BINS)
    for k, v in frac.items():
        out[int(k[1:])] = v
    return out


def test_bin_edges_by_hand():
    # bin k holds counts in (2**(k-1), 2**k]; bin 0 = (0, 1]; the last bin (16) holds counts > 32768
    counts = [1, 2, 3, 4, 5, 8, 9, 16, 17, 1024, 1025, 32768, 32769, 10**6]
    expect = [0, 1, 2, 2, 3, 3, 4, 4, 5, 10, 11, 15, 16, 16]
    assert features.bin_of_count(np.array(counts)).tolist() == expect


def test_bins_of_a_small_batch_by_hand():
    # index 7 once (bin 0), index 1 twice (bin 1), index 3 five times (bin 3), index 9 three times (bin 2)
    idx = np.array([7, 1, 1, 3, 3, 3, 3, 3, 9, 9, 9])
    got = features.access_bins(idx)
    np.testing.assert_allclose(got, _bins(b0=0.25, b1=0.25, b2=0.25, b3=0.25))
    np.testing.assert_allclose(features.access_bins(np.array([4, 4, 4, 4, 4, 4, 4, 4, 2])),
                               _bins(b0=0.5, b3=0.5))  # counts 8 -> (4,8] = bin 3; 1 -> bin 0


def test_hot_index_goes_to_last_bin():
    idx = np.concatenate([np.zeros(40000, dtype=np.int64), np.arange(1, 4)])  # one index 40,000 times
    np.testing.assert_allclose(features.access_bins(idx), _bins(b0=0.75, b16=0.25))


def test_empty_table_is_cold_and_counts_must_be_positive():
    np.testing.assert_allclose(features.access_bins(np.array([], dtype=np.int64)), _bins(b0=1.0))
    with pytest.raises(ValueError):
        features.bin_of_count(np.array([0, 1]))


@pytest.mark.parametrize("rows", [10, 1000, 10**7])
def test_fast_bins_equal_the_definition(rows):
    rng = np.random.default_rng(rows)
    idx = (rng.zipf(1.3, size=20000) - 1) % rows  # skewed, with some hot ids
    np.testing.assert_array_equal(table_bins(idx, rows), features.access_bins(idx))


def test_feature_matrix_order_and_size(small_tables_df):
    df = small_tables_df
    x = features.feature_matrix(df)
    assert x.shape == (len(df), features.NUM_FEATURES) == (len(df), 21)
    assert features.FEATURE_NAMES[:4] == ["dim", "rows", "pooling_factor", "size_bytes"]
    np.testing.assert_array_equal(x[:, 0], df["dim"])
    np.testing.assert_array_equal(x[:, 1], df["rows"])
    np.testing.assert_array_equal(x[:, 3], df["rows"] * df["dim"] * df["bytes_per_element"])
    np.testing.assert_allclose(x[:, 4:].sum(axis=1), 1.0)
