"""The command line: every `diffbatch bench` line of the README and the docs pages is
valid, and bad flags are refused with a message that names them."""

from __future__ import annotations

import shlex

import pytest

from bench.cli import build_parser, parse_plan
from bench.plan import Plan
from tests.doc_pages import code_blocks


def documented_commands() -> list[str]:
    commands = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            command = line.split("  #")[0].strip()  # without a trailing comment
            if command.startswith("diffbatch bench") and command not in commands:
                commands.append(command)
    return commands


def plan_of(argv: list[str]) -> Plan:
    return parse_plan(build_parser().parse_args(argv), argv)


def test_the_docs_show_the_command() -> None:
    assert len(documented_commands()) >= 5


@pytest.mark.parametrize("command", documented_commands())
def test_documented_command_parses(command: str) -> None:
    argv = shlex.split(command)[2:]
    plan = plan_of(argv)
    assert plan.workloads and plan.command == "diffbatch bench " + shlex.join(argv)


def test_defaults_compare_direct_server_and_no_batching() -> None:
    plan = plan_of([])
    assert plan.direct and plan.servers == {"server": "", "server-seq1": "--max-num-seqs 1"}
    assert [w.spec for w in plan.workloads] == ["closed:8"]


def test_named_contenders_and_remote_servers() -> None:
    plan = plan_of(["--contender", "wait20=--request-batch-max-wait-ms 20", "--url", "http://h:8000/"])
    assert not plan.direct and plan.servers == {"wait20": "--request-batch-max-wait-ms 20"}
    assert plan.remotes == {"remote": "http://h:8000"}
    assert plan.serve_args("--max-num-seqs 4")[-2:] == ["--max-num-seqs", "4"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--contenders", "direct,fast"], "unknown"),
        (["--contender", "noflags"], "NAME="),
        (["--contenders", "server", "--contender", "server=--max-num-seqs 2"], "must differ"),
        (["--url", "http://a", "--url", "http://b"], "must differ"),
        (["--contenders", ""], "nothing to measure"),
        (["--workload", "closed"], "needs levels"),
        (["--compare", "priority,lifo"], "unknown arm"),
        (["--contenders", "direct", "--compare", "fifo"], "--compare drives servers"),
        (["--url", "http://h", "--workload", "closed:2 tenants=2"], "needs --tenant-keys"),
        (["--workload", "closed:2 tenants=3", "--tenant-keys", "a,b"], "needs 3 keys"),
        (["--workload", "closed:2 tenants=2", "--tenant-keys", "a:colour=red,b"], "unknown setting"),
    ],
)
def test_bad_flags_are_refused_by_name(argv: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        plan_of(argv)


@pytest.mark.slow
def test_the_modality_is_the_endpoint_every_request_can_use_and_what_it_brings() -> None:
    from bench.machine import detect_modality

    assert detect_modality("tiny-flux2-klein") == "image"  # FLUX.2: references are optional
    assert detect_modality("tiny-sd") == "image" and detect_modality("tiny-wan") == "video"
    # Image-to-video: its requests bring the picture to animate (`input_reference`).
    assert detect_modality("tiny-wan-i2v") == "image-to-video"


def test_tenants_get_their_own_keys_and_the_started_servers_know_them() -> None:
    workload = ["--workload", "poisson:80% tenants=2 rates=10:1"]
    plan = plan_of(["--contenders", "server", "--compare", "priority,fifo,alone:2", *workload])
    assert [arm.name for arm in plan.arms] == ["priority", "fifo", "alone:2"]
    assert plan.tenant_keys == ("tenant-1", "tenant-2")
    assert plan.serve_args("")[-2:] == ["--api-key", "tenant-1,tenant-2"]
    given = plan_of(["--contenders", "server", "--tenant-keys", "heavy:priority=5,light", *workload])
    assert given.serve_args("")[-2:] == ["--api-key", "heavy:priority=5,light"]
    assert plan_of(["--contenders", "server"]).tenant_keys == ()  # no tenants: no keys asked for
