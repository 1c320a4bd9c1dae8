"""benchmarks/max_batch.py: the search for the largest batch, and its refusal without CUDA."""

from __future__ import annotations

import pytest
import torch

from benchmarks import max_batch


@pytest.mark.parametrize("largest", [0, 1, 5, 16, 37, 100, 1000, 4096])
@pytest.mark.parametrize(("start", "granularity"), [(1, 1), (8, 1), (16, 8), (64, 4)])
def test_finds_the_largest_batch_that_fits(largest, start, granularity):
    probes: list[int] = []

    def fits(batch: int) -> bool:
        probes.append(batch)
        return batch <= largest

    found = max_batch.largest_fitting(fits, start=start, limit=4096, granularity=granularity)
    assert found <= largest and fits(found or 1) == bool(found)
    assert largest - found < granularity or (largest == 0 and found == 0)
    assert bool(found) == bool(largest)  # never "nothing fits" while batch 1 does, whatever the granularity
    assert len(probes) <= 2 * 13  # doubling + bisection: logarithmic, not a scan


def test_the_limit_caps_the_search():
    assert max_batch.largest_fitting(lambda b: True, start=3, limit=40) == 40
    with pytest.raises(ValueError):
        max_batch.largest_fitting(lambda b: True, start=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        max_batch.main(["--scenario", "bart-base"])
