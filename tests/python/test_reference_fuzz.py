"""A fixed range of the random cases of fuzz_reference.py: cuflash on the CPU against the NumPy
reference over random combinations of options, forward and backward."""

from __future__ import annotations

import pytest

import fuzz_reference

SEEDS = range(100000, 100240)


@pytest.mark.parametrize("start", range(SEEDS.start, SEEDS.stop, 40), ids=lambda s: f"seeds_{s}")
def test_random_option_combinations(start):
    failures = []
    for seed in range(start, start + 40):
        result = fuzz_reference.run_case(seed)
        if result is None:  # a case the generator drops as too large
            continue
        if result["error"]:
            failures.append(f"seed {seed}: {result['error']}")
        failures += [f"seed {seed}: {problem}" for problem in result["problems"] if problem["kind"] != "tight"]
    assert not failures, "\n".join(failures[:10]) + "\n(python3 fuzz_reference.py --seed N --verbose re-runs one)"
