"""The two test tiers are complements: every collected test is in exactly one of them."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import ROOT

FAST = []                        # pyproject's addopts: -m 'not (slow or integration)'
REST = ["-m", "slow or integration"]
EVERY = ["-m", ""]               # an empty expression selects every test


def collected(args: list[str]) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode in (0, 5), result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_fast_and_rest_partition_every_collected_test():
    with ThreadPoolExecutor(3) as pool:
        fast, rest, every = pool.map(collected, [FAST, REST, EVERY])
    assert fast and rest, "one tier is empty"
    assert len(set(fast)) == len(fast) and len(set(rest)) == len(rest)
    assert not set(fast) & set(rest), f"in both tiers: {sorted(set(fast) & set(rest))[:5]}"
    assert set(fast) | set(rest) == set(every), \
        f"in no tier: {sorted(set(every) - set(fast) - set(rest))[:5]}"
