"""The Grafana dashboard in examples/ queries only metrics the Prometheus instrument exports,
and shows every one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from aioready.telemetry.prometheus import METRIC_NAMES

BOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "aioready.json"


def test_grafana_board_uses_the_exported_metric_names() -> None:
    board = json.loads(BOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\baioready_[a-z_]+", e)}
    # counters are exposed with a _total suffix (METRIC_NAMES lists them so)
    assert used == set(METRIC_NAMES), (used ^ set(METRIC_NAMES))
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in board["panels"])
