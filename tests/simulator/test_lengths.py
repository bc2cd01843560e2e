"""Response-length distributions: the forms they are given in, their moments, deterministic samples."""

import pytest
from pydantic import ValidationError

from hybridflow.simulator import Workload
from hybridflow.simulator.vocabulary.lengths import LengthDistribution


def test_quantiles_read_as_a_piecewise_linear_quantile_function():
    d = LengthDistribution(quantiles={0.0: 100, 0.5: 300, 1.0: 1100})
    assert d.quantile(0.25) == 200 and d.quantile(0.75) == 700 and d.longest == 1100
    assert d.mean == pytest.approx(0.5 * 200 + 0.5 * 700)  # each linear piece's midpoint
    assert d.mean_square == pytest.approx(0.5 * (300**3 - 100**3) / (3 * 200) + 0.5 * (1100**3 - 300**3) / (3 * 800))
    assert d.sample(4) == [150, 250, 500, 1100]  # shares 1/8, 3/8, 5/8, then the longest


def test_histogram_and_observed_forms():
    h = LengthDistribution(histogram={"lengths": [1000, 2000, 4000], "counts": [5, 3, 2]})
    assert h.quantiles == {0.5: 1000, 0.8: 2000, 1.0: 4000}
    o = LengthDistribution(observed=[5, 1, 3, 9])
    assert o.mean == pytest.approx(4.5) and o.longest == 9


def test_a_fixed_length_is_a_one_point_distribution():
    d = LengthDistribution.fixed(1024)
    assert d.mean == 1024 and d.mean_square == 1024**2 and d.sample(3) == [1024] * 3


@pytest.mark.parametrize("bad", [{"quantiles": {0.5: 100}}, {"quantiles": {0.5: 300, 1.0: 200}},
                                 {"quantiles": {1.5: 100, 1.0: 200}},
                                 {"histogram": {"lengths": [2, 1], "counts": [1, 1]}}, {"observed": []}])
def test_bad_distributions_are_refused(bad):
    with pytest.raises(ValidationError):
        LengthDistribution.model_validate(bad)


def test_the_workload_sizes_memory_for_the_longest_and_counts_real_tokens():
    w = Workload(prompts=10, prompt_len=100, response_lengths={"quantiles": {0.0: 100, 1.0: 300}})
    assert w.response_len == 300 and w.seq_len == 400  # the budget: the longest
    assert w.mean_response_len == 200 and w.tokens_per_iteration == 10 * (100 + 200)
    assert w.kv_seq_len == 300  # a slot holds the prompt and a mean-length response
    assert hash(w) == hash(Workload.model_validate_json(w.model_dump_json()))
    fixed = Workload(prompts=10, prompt_len=100, response_len=300)
    assert fixed.tokens_per_iteration == 10 * 400  # the paper's metric, unchanged
    with pytest.raises(ValidationError, match="beyond response_len 200"):
        Workload(response_len=200, response_lengths={"quantiles": {1.0: 300}})


def test_recorded_quantiles_average_over_iterations():
    from hybridflow.simulator.vocabulary.lengths import RECORDED_QUANTILES

    a = dict(zip(RECORDED_QUANTILES, [10, 20, 30, 40, 50, 60, 70, 80], strict=True))
    b = dict(zip(RECORDED_QUANTILES, [30, 40, 50, 60, 70, 80, 90, 120], strict=True))
    d = LengthDistribution.from_recorded([a, b])
    assert d.quantiles == {0.0: 20, 0.1: 30, 0.25: 40, 0.5: 50, 0.75: 60, 0.9: 70, 0.99: 80, 1.0: 100}
    with pytest.raises(ValueError):
        LengthDistribution.from_recorded([])


@pytest.mark.parametrize("mean,longest", [(932, 3968), (3078, 3968), (1500, 4000), (100, 16000)])
def test_max_entropy_lengths_keep_the_stated_mean_and_maximum(mean, longest):
    d = LengthDistribution(mean=mean, max=longest)
    assert d.mean == pytest.approx(mean, rel=5e-3) and d.longest == longest
    below = mean < (1 + longest) / 2  # a decreasing density below the midpoint: the median under the mean
    assert (d.quantile(0.5) < mean) == below
    with pytest.raises(ValidationError):
        LengthDistribution(mean=longest + 1, max=longest)
