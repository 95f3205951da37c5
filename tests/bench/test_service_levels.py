"""Service levels from hand-made samples: SLO attainment (429s apart), figures per class,
priority and tenant, preemptions read from /metrics, deadlines resolved from alone times,
and the arms that send one trace several ways."""

from __future__ import annotations

import random

import pytest

from bench.alone_times import alone_shape, resolve_deadlines, shapes_needing_alone_times
from bench.arms import Arm, parse_arms
from bench.contenders import Load, RoundResult, ServerContender, _fields
from bench.drivers import Sample
from bench.mix_options import Deadline
from bench.report import Cell, LevelResult
from bench.server_metrics import ServerFigures, figures_between, parse_metrics
from bench.service_level_flags import client_keys
from bench.slo_report import attainment, behind_lines, group, groups_by, service_levels, slo_tables
from bench.workload import Mix, RequestSpec, parse_workload


def sample(
    latency: float,
    *,
    deadline: float | None = None,
    ok: bool = True,
    status: int | None = None,
    klass: str | None = None,
    priority: int | None = None,
    tenant: int | None = None,
) -> Sample:
    return Sample(
        0, 0.0, latency, ok, 1 if ok else 0, status=status, priority=priority, tenant=tenant,
        klass=klass, deadline_s=deadline,
    )  # fmt: skip


def test_attainment_counts_met_deadlines_and_a_refusal_as_missed_but_apart() -> None:
    samples = [
        sample(0.5, deadline=1.0),  # met
        sample(1.0, deadline=1.0),  # met: at the deadline
        sample(1.5, deadline=1.0),  # late
        sample(0.1, deadline=1.0, ok=False, status=429),  # refused
        sample(0.2, deadline=1.0, ok=False, status=504),  # failed
        sample(9.0),  # no deadline: not counted
    ]
    result = attainment(samples)
    assert (result.deadlines, result.met, result.refused, result.late_or_failed) == (5, 2, 1, 2)
    assert result.share == pytest.approx(0.4)
    assert attainment([sample(1.0)]).share is None


def test_group_figures_pool_latency_and_take_the_median_round_rate() -> None:
    rounds = [
        RoundResult([sample(float(i), klass="a") for i in range(1, 11)] + [sample(5.0, klass="b")], 10.0),
        RoundResult([sample(1.0, klass="a")] * 4, 2.0),  # 2 a/s
        RoundResult([sample(1.0, klass="a")] * 3 + [sample(1.0, klass="a", ok=False)], 1.0),  # 3 a/s
    ]
    figures = group(rounds, lambda s: s.klass == "a")
    assert (figures.requests, figures.ok) == (18, 17)
    assert figures.requests_per_s == 2.0  # rounds of 1, 2 and 3 a/s
    assert figures.p50_s == 2.0  # eight 1 s, then 2 s to 10 s
    assert figures.p99_s == pytest.approx(9.84)


def test_figures_by_priority_and_tenant_in_order() -> None:
    cell = Cell("server/priority")
    cell.rounds.append(
        RoundResult(
            [sample(1.0, priority=10, tenant=2), sample(0.2, priority=0, tenant=1), sample(0.4, priority=-5)],
            1.0,
        )
    )
    assert list(groups_by(cell, lambda s: s.priority)) == [-5, 0, 10]
    assert list(groups_by(cell, lambda s: s.tenant)) == [1, 2, None]
    figures = service_levels(cell)
    assert figures["by_priority"]["10"]["p50_s"] == 1.0
    assert figures["preemptions"] is None  # this server counts none


def test_the_tables_show_each_class_and_the_preemptions_counted() -> None:
    prioritized, fifo = Cell("server/priority"), Cell("server/fifo")
    preempting = ServerFigures(preemptions=3, paused_max=2.0)
    prioritized.rounds.append(
        RoundResult(
            [
                sample(0.5, deadline=1.0, klass="interactive", priority=0),
                sample(4.0, klass="batch", priority=10),
            ],
            4.0,
            preempting,
        )
    )
    fifo.rounds.append(
        RoundResult(
            [
                sample(1.5, deadline=1.0, klass="interactive", priority=0),
                sample(3.0, klass="batch", priority=0),
            ],
            3.0,
            ServerFigures(),
        )
    )
    text = "\n".join(
        slo_tables(LevelResult("80%", 2.0, {"server/priority": prioritized, "server/fifo": fifo}), "images")
    )
    assert "| server/priority | interactive | 1 | 100.0% (1/1) | 0 | 0 | 500 | 500 |" in text
    assert "| server/fifo | interactive | 1 | 0.0% (0/1) | 0 | 1 | 1500 | 1500 |" in text
    assert "| server/fifo | batch | 1 | - | 0 | - | 3000 |" in text
    assert "server/priority: 3 preemptions, at most 2 requests paused at once" in text
    assert "| contender | priority |" in text and "| contender | tenant |" not in text
    assert slo_tables(LevelResult("8", 8, {"direct": Cell("direct")}), "images") == []


def test_preemption_metrics_are_read_when_present_and_absent_otherwise() -> None:
    page = '# TYPE diffbatch_preemptions counter\ndiffbatch_preemptions_total{model="m"} %s\n'
    page += '# TYPE diffbatch_paused_requests gauge\ndiffbatch_paused_requests{model="m"} %s\n'
    figures = figures_between(parse_metrics(page % (2, 0)), parse_metrics(page % (7, 1)))
    assert (figures.preemptions, figures.paused_max) == (5, 1.0)
    bare = figures_between(parse_metrics(""), parse_metrics(""))
    assert (bare.preemptions, bare.paused_max) == (None, None)
    assert (figures + bare).preemptions == 5 and (bare + bare).preemptions is None


def test_deadlines_resolve_from_the_alone_time_of_their_shape() -> None:
    mix = parse_workload("closed:4 steps=4,8 deadline=2x,1.5,none", Mix()).mix
    specs = mix.draw(30, random.Random(0))
    shapes = shapes_needing_alone_times(specs, known=())
    assert {shape.steps for shape in shapes} == {4, 8}
    alone = {shape: 0.1 * shape.steps for shape in shapes}  # type: ignore[operator]
    assert shapes_needing_alone_times(specs, known=alone) == set()
    for spec in resolve_deadlines(specs, alone):
        expected = {None: None, Deadline(1.5): 1.5, Deadline(2.0, True): 2 * 0.1 * (spec.steps or 0)}
        assert spec.deadline_s == pytest.approx(expected[spec.deadline])
    # The same shape whatever its prompt, seed and service-level fields.
    one = RequestSpec("a cat", 32, 32, 4, None, 1, seed=1, priority=0, tenant=2, klass="i")
    assert alone_shape(one) == alone_shape(RequestSpec("a dog", 32, 32, 4, None, 1, seed=2))


def test_arms_send_the_trace_as_drawn_with_priority_zero_or_one_tenant_alone() -> None:
    assert [arm.name for arm in parse_arms("priority,fifo,alone:2")] == ["priority", "fifo", "alone:2"]
    specs = [
        RequestSpec("a", None, None, 4, None, 1, seed=i, priority=10 * (i % 2), tenant=1 + (i % 2))
        for i in range(4)
    ]
    load = Load("poisson", 2.0, (0.1, 0.2, 0.3, 0.4))
    assert Arm("priority").apply(load, specs) == (load, specs)
    _, fifo = Arm("fifo").apply(load, specs)
    assert [s.priority for s in fifo] == [0, 0, 0, 0] and [s.seed for s in fifo] == [0, 1, 2, 3]
    alone_load, alone = Arm("alone", 2).apply(load, specs)
    assert [s.seed for s in alone] == [1, 3] and alone_load.offsets == (0.2, 0.4)


@pytest.mark.parametrize(
    ("text", "says"),
    [("lifo", "unknown arm"), ("alone", "unknown arm"), ("alone:0", "unknown arm"), ("fifo,fifo", "once")],
)
def test_bad_arms_are_refused_by_name(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_arms(text)


def test_each_tenant_sends_its_own_key_and_fields_carry_priority_and_deadline() -> None:
    assert client_keys(("heavy:priority=5", "light")) == ("heavy", "light")
    server = ServerContender("server", "http://h", "image", tenant_keys=("heavy", "light"))
    spec = RequestSpec("a", None, None, 4, None, 1, seed=0, priority=10, deadline_s=1.5, tenant=2)
    assert server._tenant_header(spec) == {"Authorization": "Bearer light"}
    assert server._tenant_header(RequestSpec("a", None, None, 4, None, 1, seed=0)) == {}
    assert _fields(spec)["priority"] == 10 and "timeout" not in _fields(spec)
    assert _fields(spec, send_deadline=True)["timeout"] == 1.5


def test_rounds_that_outlast_their_arrivals_are_called_an_overload() -> None:
    behind, kept_up = Cell("server/fifo"), Cell("server/priority")
    arrivals = [Sample(i, float(i), float(i) + 0.5, True, 1, klass="a") for i in range(11)]  # sent 0-10 s
    behind.rounds.append(RoundResult(arrivals, 30.0))
    kept_up.rounds.append(RoundResult(arrivals, 10.5))
    lines = behind_lines({"server/fifo": behind, "server/priority": kept_up})
    assert lines == [
        "server/fifo: rounds lasted 3.0-3.0x their arrivals' span: the server fell behind the offered rate, "
        "so this is an overload rather than the level asked for"
    ]


def test_without_classes_or_deadlines_there_is_no_class_table() -> None:
    cell = Cell("server/fifo")
    cell.rounds.append(
        RoundResult([sample(1.0, priority=0, tenant=1), sample(2.0, priority=0, tenant=2)], 2.0)
    )
    text = "\n".join(slo_tables(LevelResult("80%", 1.0, {"server/fifo": cell}), "images"))
    assert "| class |" not in text and "| contender | tenant |" in text
    assert "| server/fifo | 2 | 1 | 2000 | 2000 | 0.50 |" in text
