"""The Grafana dashboard plots only what the services export.

Each tier's real metrics object is built and fed one of everything (a tiny
random verifier runs real engine steps); the sample names they expose
(with ``_total``, ``_bucket``, ``_sum``, ``_count``) must hold every metric
name in every panel's PromQL, and every label a panel matches or groups by
must be one of theirs or one Prometheus adds to each scraped target. The
queries are parsed by a PromQL parser, so a syntax error fails here too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from prometheus_client import CollectorRegistry

from coordinator.admission import AdmissionController
from coordinator.metrics import CoordinatorMetrics
from coordinator.rounds import FinishReason, GenerationStats
from draft_service.config import DrafterConfig
from draft_service.drafter import NGRAM_SOURCES
from draft_service.main import build_drafter
from draft_service.metrics import DrafterMetrics
from specserve.sampling import SamplingParams
from specserve.token_tree import TokenTree
from target_service.metrics import VerifierMetrics
from target_service.verifier import Verifier
from tests.conftest import tiny_llama

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "specserve" / "dashboards" / "specserve.json"
# Labels Prometheus puts on every series of a target the ServiceMonitor scrapes, and histograms' own.
TARGET_LABELS = {"namespace", "pod", "service", "job", "instance", "container", "endpoint", "le"}
# What Grafana puts in place of the dashboard's variables before Prometheus sees a query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$namespace": ".*"}


def parse(expr: str) -> promql_parser.Expr:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return promql_parser.parse(expr)


def metric_names(expr: str) -> set[str]:
    """Names of the metrics a PromQL expression selects (not its functions, keywords, labels or numbers)."""
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(parse(expr), visit)
    return names


def label_names(expr: str) -> set[str]:
    """Label names the expression matches on (``{...}``) or groups by (``by``, ``on``, ``ignoring``, ``group_left``)."""
    labels: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            labels.update(matcher.name for matcher in node.matchers.matchers)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                labels.update(node.modifier.matching.labels)
            labels.update(node.modifier.group_labels or [])

    promql_parser.walk(parse(expr), visit)
    return labels


def exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows' nested panels included."""
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                yield inner["title"], target["expr"]


def unexported(dashboard: dict[str, Any], exported: set[str]) -> dict[str, set[str]]:
    """Panel title -> metric names its queries use that no service exports."""
    missing: dict[str, set[str]] = {}
    for title, expr in exprs(dashboard):
        if names := metric_names(expr) - exported:
            missing.setdefault(title, set()).update(names)
    return missing


def samples(registry: CollectorRegistry) -> tuple[set[str], set[str]]:
    """Sample names and label names the registry exposes now."""
    names: set[str] = set()
    labels: set[str] = set()
    for metric in registry.collect():
        for sample in metric.samples:
            names.add(sample.name)
            labels.update(sample.labels)
    return names, labels


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


@pytest.fixture(scope="module")
def exported() -> tuple[set[str], set[str]]:
    """What the three tiers export after one of everything has been observed."""
    coordinator = CoordinatorMetrics()
    coordinator.track_admission(AdmissionController())
    coordinator.admitted(0.01)
    coordinator.rejected("queue_full")
    coordinator.observe_first_token(0.05)
    coordinator.observe_inter_token(0.01)
    coordinator.observe_request_error("INVALID_ARGUMENT")
    coordinator.drafter_failed("timeout")
    coordinator.drafter_circuit.set(1)
    stats = GenerationStats(
        num_prompt_tokens=5,
        num_generated_tokens=8,
        num_rounds=4,
        num_drafts=3,
        num_draft_tokens=9,
        num_accepted_tokens=4,
        num_accepted_tokens_per_pos=[3, 1],
        num_reprefills=1,
        num_drafter_trees=3,
        num_predraft_hits=1,
        predraft_hidden_ns=10**6,
        finish_reason=FinishReason.STOP,
        drafter_error="drafter dropped: test",
    )
    coordinator.observe_finished(stats, 0.5)
    constrained = GenerationStats(
        num_generated_tokens=6,
        num_rounds=2,
        num_accepted_tokens=4,
        finish_reason=FinishReason.EOS,
        constrained=True,
        constraint_kind="json_schema",
        constraint_complete=True,
        num_forced_tokens=3,
        mask_ns_per_round=[40_000, 90_000],
    )
    coordinator.observe_finished(constrained, 0.2)
    coordinator.grammar_cache_lookup(hit=False)
    coordinator.grammar_compiled("json_schema", 0.002)
    coordinator.grammar_refused("regex", "regex_syntax")

    verifier_metrics = VerifierMetrics()
    verifier = Verifier(tiny_llama(vocab_size=48), "fp", max_tree_nodes=4)
    verifier_metrics.track(verifier)
    try:
        with verifier_metrics.in_flight():
            verifier.prefill("s", [1, 2, 3], SamplingParams())
            verifier.verify("s", 3, TokenTree.chain([4, 5]))
        verifier_registry = samples(verifier_metrics.registry)
    finally:
        verifier.close()

    drafter, pools = build_drafter(DrafterConfig(sources=NGRAM_SOURCES))
    drafter.open_session("s", [1, 2, 3], "fp")
    drafter_metrics = DrafterMetrics(drafter.memory, pools, drafter.predraft_counts, drafter.gate_counts)

    names: set[str] = set()
    labels: set[str] = set()
    for registry_names, registry_labels in (
        samples(coordinator.registry),
        verifier_registry,
        samples(drafter_metrics.registry),
    ):
        names |= registry_names
        labels |= registry_labels
    return names, labels


def test_the_dashboard_is_grafana_json_with_queries(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "specserve" and dashboard["title"]
    panel_ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    queries = list(exprs(dashboard))
    assert len(queries) >= 20 and all(expr.strip() for _, expr in queries)
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert {"datasource", "namespace"} <= variables


def test_every_metric_a_panel_plots_is_exported(dashboard: dict[str, Any], exported: tuple[set[str], set[str]]) -> None:
    names, _ = exported
    assert unexported(dashboard, names) == {}
    # Every tier is on the dashboard, and structured output.
    used = {name for _, expr in exprs(dashboard) for name in metric_names(expr)}
    for prefix in (
        "specserve_spec_decode_",
        "specserve_verifier_",
        "specserve_drafter_predraft",
        "specserve_spec_decode_num_forced_tokens",
        "specserve_constrained_requests",
        "specserve_constraint_mask_seconds",
        "specserve_grammar_",
    ):
        assert any(name.startswith(prefix) for name in used), prefix


def test_every_label_a_panel_matches_or_groups_by_is_exported(
    dashboard: dict[str, Any], exported: tuple[set[str], set[str]]
) -> None:
    _, labels = exported
    for title, expr in exprs(dashboard):
        assert label_names(expr) <= labels | TARGET_LABELS, title


def test_the_check_catches_a_name_no_service_exports(
    dashboard: dict[str, Any], exported: tuple[set[str], set[str]]
) -> None:
    names, _ = exported
    broken = json.loads(json.dumps(dashboard))
    target = broken["panels"][1]["targets"][0]
    target["expr"] = target["expr"].replace("specserve_generation_tokens_total", "specserve_generated_tokens_total")
    assert unexported(broken, names) == {broken["panels"][1]["title"]: {"specserve_generated_tokens_total"}}


def test_metric_names_skip_functions_keywords_labels_and_variables() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, call) (rate(a_seconds_bucket{namespace=~"$namespace", '
        'call!="x"}[$__rate_interval])))'
    )
    assert metric_names(expr) == {"a_seconds_bucket"}
    assert label_names(expr) == {"le", "call", "namespace"}
    expr = "1 + sum(rate(b_total[5m])) / ignoring(position) group_left sum(c) * 1e3 > bool 0.5 unless d:recorded"
    assert metric_names(expr) == {"b_total", "c", "d:recorded"}
    assert label_names(expr) == {"position"}
    assert metric_names("max by (pod) (up) or vector(0)") == {"up"}


def test_a_query_that_does_not_parse_fails() -> None:
    with pytest.raises(ValueError):
        metric_names("sum(rate(a_total[5m])")
