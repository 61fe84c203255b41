"""Every metric key an end-to-end run logs is documented on the metrics page (docs/reference/metrics.md)."""

from __future__ import annotations

import json
import time

import pytest

from tests.unit.test_docs import undocumented_metrics


@pytest.fixture(autouse=True)
def logged_metrics_are_documented(tmp_path_factory):
    """After each test: the keys of every metrics.jsonl written under the session's temp folder during it (its own
    runs and the module-scoped ones it started) must be on the metrics page; a missing one fails the test."""
    start = time.time()
    yield
    keys: list[str] = []
    for path in tmp_path_factory.getbasetemp().rglob("metrics.jsonl"):
        if path.stat().st_mtime >= start:
            for line in path.read_text().splitlines():
                keys += [k for k in json.loads(line) if k != "step"]
    missing = undocumented_metrics(keys)
    assert not missing, f"metric keys logged but not on docs/reference/metrics.md: {missing}"
