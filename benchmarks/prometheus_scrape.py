"""Read one counter from Ray's metrics endpoint, summed by one label, for benchmark reports."""

from __future__ import annotations

import collections

import httpx
from prometheus_client.parser import text_string_to_metric_families


def counter_by_label(metrics_port: int, name: str, label: str) -> dict[str, float]:
    """``name``'s samples on ``127.0.0.1:metrics_port`` summed per value of ``label``.

    ``name`` is the name as scraped (``ray_..._total``); Ray's per-process series of the same
    label value (one per replica or router) are added up.
    """
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
    totals: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                totals[sample.labels.get(label, "")] += sample.value
    return dict(totals)
