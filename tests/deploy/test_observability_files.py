"""Dashboards and alert rules: promtool accepts the rules; the dashboard queries only metrics we export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from blockspec.common.telemetry.metrics import RouterMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def exported_names() -> set[str]:
    """Every series name RouterMetrics can export (counters end in _total, histograms in _bucket/_sum/_count)."""
    registry = CollectorRegistry()
    RouterMetrics(registry)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    return {m.name + s for m in registry.collect() for s in suffixes.get(m.type, ("",))}


def test_alert_rules_pass_promtool():
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (.ci/run installs Debian's prometheus package)")
    proc = subprocess.run(["promtool", "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 7 rules found" in proc.stdout


def test_the_saturation_alert_fires_only_with_every_slot_held_and_requests_waiting(tmp_path):
    """promtool's rule unit test: replica 0 full with a queue fires after 5 minutes; replica 1 full without one
    does not."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (.ci/run installs Debian's prometheus package)")
    (tmp_path / "test.yml").write_text(f"""
rule_files: [{DEPLOY / "prometheus" / "alerts.yml"}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'blockspec_kv_cache_usage_perc{{replica="0"}}'
        values: '1x10'
      - series: 'blockspec_requests_waiting{{replica="0"}}'
        values: '3x10'
      - series: 'blockspec_kv_cache_usage_perc{{replica="1"}}'
        values: '1x10'
      - series: 'blockspec_requests_waiting{{replica="1"}}'
        values: '0x10'
    alert_rule_test:
      - eval_time: 3m
        alertname: BlockspecSaturated
        exp_alerts: []
      - eval_time: 8m
        alertname: BlockspecSaturated
        exp_alerts:
          - exp_labels: {{severity: warning, replica: "0"}}
            exp_annotations:
              summary: "Replica 0 has held every KV cache slot with requests waiting for 5 minutes"
""")
    proc = subprocess.run(["promtool", "test", "rules", str(tmp_path / "test.yml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_and_rules_use_exported_metrics():
    names = exported_names() | {"up"}
    exprs = [t["expr"] for p in json.loads((DEPLOY / "grafana" / "dashboards" / "blockspec.json").read_text())["panels"]
             for t in p["targets"]]
    exprs += [r["expr"] for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in re.findall(r"\b(blockspec_\w+|up)\b", e)}
    assert used and used <= names, f"unknown metrics: {sorted(used - names)}"
    titles = " ".join(p["title"] for p in json.loads((DEPLOY / "grafana" / "dashboards" / "blockspec.json").read_text())["panels"])
    for what in ("Acceptance rate", "tau", "per draft position", "Time to first token", "P99", "Memory per role", "fallbacks", "Rate-limited"):
        assert what in titles
