"""Workload specs and request traces: parsing, errors that name the problem, repeatability."""

from __future__ import annotations

import random
import statistics

import pytest

from bench.contenders import _fields
from bench.mix_options import Deadline
from bench.workload import Level, Mix, parse_workload, poisson_arrivals, with_option


def test_closed_loop_spec_with_levels() -> None:
    workload = parse_workload("closed:8,16", Mix())
    assert workload.kind == "closed"
    assert workload.levels == (Level(8), Level(16))
    assert workload.axis() == "concurrency"


def test_poisson_levels_may_be_absolute_or_a_share_of_capacity() -> None:
    workload = parse_workload("poisson:2.5,50%", Mix())
    assert workload.levels == (Level(2.5), Level(0.5, fraction=True))
    assert [level.label() for level in workload.levels] == ["2.5", "50%"]


def test_options_override_the_runs_mix_for_this_workload_only() -> None:
    base = Mix(steps=(4,))
    workload = parse_workload(
        "poisson:80% steps=4,8,16,32 size=64x64,128x96 guidance=default,7.5 n=1,4 negative=none,blurry "
        "partials=0,3 strength=0.3,default",
        base,
    )
    assert workload.mix.steps == (4, 8, 16, 32)
    assert workload.mix.sizes == ((64, 64), (128, 96))
    assert workload.mix.guidance == (None, 7.5)
    assert workload.mix.n == (1, 4)
    assert workload.mix.negative == (None, "blurry")
    assert workload.mix.partials == (0, 3)
    assert "partials=0,3" in workload.mix.describe()
    assert {spec.partial_images for spec in workload.mix.draw(50, random.Random(0))} == {0, 3}
    assert workload.mix.strength == (0.3, None) and "strength=0.3,default" in workload.mix.describe()
    assert {spec.strength for spec in workload.mix.draw(50, random.Random(0))} == {0.3, None}
    assert base.steps == (4,)
    own = parse_workload("closed:8 steps=default,8", base)
    assert own.mix.steps == (None, 8) and "steps=default,8" in own.mix.describe()


def test_a_strength_option_leaves_the_rest_of_the_trace_as_it_was() -> None:
    """Strength is drawn only when asked for, so traces recorded before it stay the same."""
    plain = Mix(steps=(4, 8, 16, 32)).draw(20, random.Random(5))
    assert all(spec.strength is None for spec in plain)
    assert plain == Mix(steps=(4, 8, 16, 32), strength=(None,)).draw(20, random.Random(5))
    with_strength = Mix(steps=(4, 8, 16, 32), strength=(0.5,)).draw(1, random.Random(5))
    assert with_strength[0].steps == plain[0].steps and with_strength[0].strength == 0.5


def test_lone_is_one_client() -> None:
    assert parse_workload("lone", Mix()).levels == (Level(1),)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("open:4", "kind must be"),
        ("closed", "needs levels"),
        ("closed:2.5", "positive integer"),
        ("closed:50%", "bad level"),
        ("burst:0", "positive integer"),
        ("lone:3", "takes no levels"),
        ("closed:8 steps", "key=value"),
        ("closed:8 sizes=64x64", "unknown mix option"),
        ("closed:8 size=64", "64x64"),
        ("closed:8 steps=0", ">= 1"),
        ("closed:8 partials=4", "0 to 3"),
        ("closed:8 strength=1.5", "at most 1"),
        ("closed:8 strength=0", "above 0"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_workload(spec, Mix())


def test_the_same_seed_draws_the_same_trace() -> None:
    mix = with_option(with_option(Mix(), "steps", "4,8,16,32"), "n", "1,2,3,4")
    first = mix.draw(50, random.Random("0/1"))
    assert first == mix.draw(50, random.Random("0/1"))
    assert first != mix.draw(50, random.Random("0/2"))
    # Every choice is drawn, so a mixed trace really mixes.
    assert {spec.steps for spec in first} == {4, 8, 16, 32}
    assert {spec.n for spec in first} == {1, 2, 3, 4}


def test_auto_size_leaves_the_size_to_the_model() -> None:
    spec = Mix().draw(1, random.Random(0))[0]
    assert (spec.width, spec.height) == (None, None)
    assert "size=auto" in Mix().describe()


def test_poisson_arrivals_have_the_asked_rate() -> None:
    offsets = poisson_arrivals(4000, rate=5.0, rng=random.Random(1))
    assert offsets == sorted(offsets)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.05)


def test_a_model_mix_names_a_model_per_request_and_leaves_other_traces_as_they_were() -> None:
    workload = parse_workload("closed:4 model=a,b", Mix())
    assert workload.mix.models == ("a", "b") and "model=a,b" in workload.mix.describe()
    assert {spec.model for spec in workload.mix.draw(40, random.Random(0))} == {"a", "b"}
    plain = Mix().draw(10, random.Random(3))
    assert all(spec.model is None for spec in plain)
    assert plain == Mix(models=(None,)).draw(10, random.Random(3))


def test_a_controlnet_mix_controls_a_share_of_the_requests_with_an_image_each() -> None:
    workload = parse_workload("closed:4 controlnet=none,edges", Mix())
    assert "controlnet=none,edges" in workload.mix.describe()
    specs = workload.mix.draw(40, random.Random(0))
    assert {spec.controlnet for spec in specs} == {None, "edges"}
    controlled = next(spec for spec in specs if spec.controlnet)
    entry = _fields(controlled)["controlnet"][0]
    assert entry["name"] == "edges" and entry["image"].startswith("data:image/png;base64,")
    assert "controlnet" not in _fields(next(spec for spec in specs if not spec.controlnet))
    assert Mix().draw(10, random.Random(3)) == Mix(controlnets=(None,)).draw(10, random.Random(3))


def test_a_class_mix_draws_each_class_with_its_own_options_and_share() -> None:
    workload = parse_workload(
        "poisson:80% size=32x32 class=interactive share=3 steps=4,8 priority=0 deadline=2x "
        "class=batch steps=32 priority=10",
        Mix(),
    )
    interactive, batch = workload.mix.classes
    assert (interactive.name, interactive.share, batch.name, batch.share) == (
        "interactive",
        3.0,
        "batch",
        1.0,
    )
    assert interactive.mix.steps == (4, 8) and interactive.mix.priorities == (0,)
    assert interactive.mix.deadlines == (Deadline(2.0, relative=True),)
    assert batch.mix.steps == (32,) and batch.mix.priorities == (10,) and batch.mix.deadlines == (None,)
    assert interactive.mix.sizes == batch.mix.sizes == ((32, 32),)  # options before class= are shared
    specs = workload.mix.draw(400, random.Random(0))
    by_class = {name: [s for s in specs if s.klass == name] for name in ("interactive", "batch")}
    assert len(by_class["interactive"]) / len(specs) == pytest.approx(0.75, abs=0.06)
    assert {s.steps for s in by_class["interactive"]} == {4, 8}
    assert {(s.steps, s.priority, s.deadline) for s in by_class["batch"]} == {(32, 10, None)}
    assert specs == workload.mix.draw(400, random.Random(0))
    described = workload.mix.describe()
    assert "class=interactive share=3 (" in described and "priority=0 deadline=2x" in described


def test_tenants_draw_at_their_relative_rates() -> None:
    mix = parse_workload("poisson:80% tenants=2 rates=10:1", Mix()).mix
    assert mix.tenant_rates == (10.0, 1.0) and "tenants=2 rates=10:1" in mix.describe()
    tenants = [spec.tenant for spec in mix.draw(2200, random.Random(1))]
    assert tenants.count(2) / len(tenants) == pytest.approx(1 / 11, abs=0.02)
    assert parse_workload("closed:4 tenants=3", Mix()).mix.tenant_rates == (1.0, 1.0, 1.0)


def test_priority_and_deadline_options_and_traces_without_them_unchanged() -> None:
    mix = parse_workload("closed:4 priority=0,10,default deadline=1.5,3x,none", Mix()).mix
    assert mix.priorities == (0, 10, None)
    assert mix.deadlines == (Deadline(1.5), Deadline(3.0, relative=True), None)
    assert "priority=0,10,default deadline=1.5,3x,none" in mix.describe()
    plain = Mix(steps=(4, 8)).draw(20, random.Random(2))
    assert all(
        s.priority is None and s.deadline is None and s.tenant is None and s.klass is None for s in plain
    )
    assert plain == Mix(steps=(4, 8), priorities=(None,), deadlines=(None,)).draw(20, random.Random(2))


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("closed:8 share=2", "follows the class=NAME"),
        ("closed:8 class=a class=a", "a name of its own"),
        ("closed:8 class=", "a name of its own"),
        ("closed:8 class=a share=0", "share must be a positive number"),
        ("closed:8 tenants=0", "tenants must be a positive integer"),
        ("closed:8 tenants=two", "tenants must be a positive integer"),
        ("closed:8 tenants=2 rates=10:1:1", "one rate per tenant"),
        ("closed:8 rates=10:1", "one rate per tenant"),
        ("closed:8 tenants=2 rates=10:-1", "rates must be a positive number"),
        ("closed:8 priority=high", "priority must be an integer"),
        ("closed:8 deadline=0", "deadline must be seconds"),
        ("closed:8 deadline=twox", "deadline must be seconds"),
        ("closed:8 deadline=-2x", "deadline must be seconds"),
        ("closed:8 class=a steps=0", ">= 1"),
    ],
)
def test_bad_service_level_specs_say_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_workload(spec, Mix())
