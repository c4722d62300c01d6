"""The remote store's ledger, which needs no server: its read-busy clock counts only the time
reads were in flight (the read bandwidth the planner learns is bytes read over it)."""

from __future__ import annotations

import pytest

from tieredkv.tiers.remote import ledger as ledger_module
from tieredkv.tiers.remote.ledger import Ledger
from tieredkv.tiers.remote.value_format import ValueLayout


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(ledger_module.time, "monotonic", lambda: now[0])
    return now


def test_read_busy_time_counts_only_time_with_reads_in_flight(clock):
    ledger = Ledger(ValueLayout.for_block(4096, 16, 7), budget_bytes=0)
    ledger.reading()
    clock[0] += 2.0
    ledger.reads_done(1)
    assert ledger.read_busy_s() == 2.0
    clock[0] += 5.0  # idle: no read in flight
    ledger.failed([11, 12], num_reads=0)  # a pipeline of writes that did not run
    ledger.reads_done(0)
    assert ledger.read_busy_s() == 2.0
    ledger.reading()
    clock[0] += 1.0
    ledger.failed([], num_reads=1)  # a read that did not run ends its busy time too
    assert ledger.read_busy_s() == 3.0
