

def test_a_median_interval_of_few_rounds_is_called_their_range():
    """A percentile bootstrap of the median of n < 6 values gives back their smallest and largest: a user read a
    "95% interval" of 3 rounds that holds the median 75% of the time."""
    from embshard import stats

    med, lo, hi = stats.median_ci([0.8697, 0.8946, 0.9162])
    assert (round(lo, 4), round(hi, 4)) == (0.8697, 0.9162)
    assert stats.interval_words(3) == "range of 3 rounds (covers the median 75% of the time)"
    assert stats.interval_words(5).endswith("94% of the time)") and stats.interval_words(6) == "95% interval"
