"""The search of ``bench/bench_limits.py`` (doubling, then bisection to 1/8), on predicates with a known limit, and
the CPU allocator's peak that the benchmarks report beside RSS."""

import pytest
import torch

from bench.bench_limits import GRANULE, search


@pytest.mark.parametrize("limit, start", [(13000, 4096), (4096, 4096), (40960, 4096), (1500, 4096), (700, 2048)])
def test_search_brackets_the_limit_within_an_eighth(limit, start):
    asked = []

    def passes(n):
        asked.append(n)
        return n <= limit

    low, high = search(passes, start)
    assert low <= limit < high
    assert high - low <= max(low / 8, GRANULE)
    assert all(n % GRANULE == 0 for n in asked) and len(asked) == len(set(asked))


def test_search_stops_at_an_unknown_run():
    assert search(lambda n: True if n < 16384 else None, 4096) == (8192, None)


def test_search_reports_a_start_below_the_smallest_step():
    assert search(lambda n: False, 1024) == (None, GRANULE)


def test_peak_allocated_counts_the_tensors_alive_together():
    """The CPU allocator's peak: two 4 MiB tensors alive at once and one more after both are freed peak at 8 MiB
    (plus small bookkeeping), not 12."""
    from bench.common import peak_allocated_above

    def work():
        a = torch.ones(2**20)  # 4 MiB of float32
        b = a * 2
        del a, b
        return torch.zeros(2**20).sum()

    peak = peak_allocated_above(work)
    assert 8 * 2**20 <= peak < 9 * 2**20


def test_table_marks_a_budget_not_searched():
    from bench.bench_limits import table

    limits = [{"peer": "long-short", "time": {"longest_pass": 28160, "shortest_fail": 30720}}]
    row = table(limits, memory_budget=8 * 2**30, time_budget=30.0).splitlines()[-1]
    assert row == "| long-short | not searched | 28160 (fails at 30720) |"
