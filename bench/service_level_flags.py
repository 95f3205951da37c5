"""`diffbatch bench`'s service-level flags (issue 30): the arms each server is driven with
side by side (`--compare priority,fifo`), the tenants' API keys, and whether each request's
deadline is sent to the server as its `timeout`."""

from __future__ import annotations

import argparse

from bench.arms import Arm, parse_arms
from bench.workload import Workload
from server.api_keys import parse_api_keys


def add_service_level_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--compare",
        metavar="ARMS",
        help="drive each server with these variants of the same trace, side by side: priority (as "
        "drawn), fifo (every priority 0, same arrivals), alone:T (tenant T's requests only), e.g. "
        "priority,fifo",
    )
    add(
        "--tenant-keys",
        metavar="ENTRIES",
        help="the API keys of tenants=K, comma-separated, as `diffbatch serve --api-key` takes them "
        "(KEY or KEY:setting=value; tenant i sends the i-th key). Servers this run starts get them "
        "as --api-key; default tenant-1,...,tenant-K",
    )
    add(
        "--send-deadlines",
        action="store_true",
        help="send each request's deadline (deadline=) as its `timeout` field, for a server that "
        "plans for deadlines (without it the deadline is the bench's own measure)",
    )


def arms_of(args: argparse.Namespace) -> tuple[Arm, ...]:
    return parse_arms(args.compare) if args.compare else ()


def tenant_entries(args: argparse.Namespace, workloads: list[Workload], remote: bool) -> tuple[str, ...]:
    """The `--api-key` entries of the tenants the workloads name (none when they name none)."""
    tenants = max((len(w.mix.tenant_rates) for w in workloads), default=0)
    if args.tenant_keys is None:
        if tenants and remote:
            raise ValueError(f"tenants={tenants} against --url needs --tenant-keys (the server's keys)")
        return tuple(f"tenant-{i}" for i in range(1, tenants + 1))
    entries = tuple(entry.strip() for entry in args.tenant_keys.split(",") if entry.strip())
    parse_api_keys(",".join(entries))  # refused here, naming the entry, rather than by each server
    if len(entries) < tenants:
        raise ValueError(f"--tenant-keys: tenants={tenants} needs {tenants} keys, got {len(entries)}")
    return entries


def client_keys(entries: tuple[str, ...]) -> tuple[str, ...]:
    """The keys themselves, as clients send them (an entry's settings are the server's)."""
    return tuple(key.key for key in parse_api_keys(",".join(entries)))
