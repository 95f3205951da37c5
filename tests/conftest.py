"""Test-wide set-up: tiny models are built fresh into a temporary cache for each run."""

from __future__ import annotations

import os
import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.postgres import Cluster, server_binaries, start_cluster
from tests.s3 import CREDENTIALS, S3Server, run_s3_server
from tests.threads import THREADS


def pytest_configure(config: pytest.Config) -> None:
    """Servers a test starts without `--num-threads` take torch's default, every core: under
    pytest-xdist they get this worker's share instead (`tests/threads.py` says why).

    Not in xdist's controller: it configures before it starts the workers, which inherit its
    environment, and it does not count as one of them (`THREADS` is every core there). Set
    there, every worker's servers ran two OpenMP threads beside the other worker's, and under
    load the threads spun waiting on each other: Ray Serve replicas took 60-160 s for a
    64x64 image."""
    controller = getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER")
    if not controller:
        os.environ["OMP_NUM_THREADS"] = str(THREADS)


# pytest-xdist hands each worker whole modules (`--dist loadfile`), and by default the
# modules with the most tests first. The Ray Serve module has few tests but takes about a
# third of the run's wall time: handed out late, it ran alone at the end while the other
# workers sat idle. So the modules are ordered here, the Ray Serve one first and the rest
# by their number of tests as xdist would, and scripts/test passes `--no-loadscope-reorder`.
RUN_FIRST = ("tests/e2e/test_ray_serve.py",)


@pytest.hookimpl(tryfirst=True)  # before pytest groups items by their fixtures' parameters
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    sizes = Counter(_module(item) for item in items)
    items.sort(key=lambda item: (_module(item) not in RUN_FIRST, -sizes[_module(item)], _module(item)))


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.fixture(scope="session", autouse=True)
def tiny_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Never read or write the user's cache; building each tiny model also tests the builder.

    Under pytest-xdist the run's workers share one cache beside their own temporary folders
    (`build_once` renames a finished build into place, so two workers building the same model
    at once keep one): each tiny model is built once per run, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        cache = base.parent / "diffbatch-cache"
        cache.mkdir(exist_ok=True)
    else:
        cache = tmp_path_factory.mktemp("diffbatch-cache")
    previous = os.environ.get("DIFFBATCH_CACHE_DIR")
    os.environ["DIFFBATCH_CACHE_DIR"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("DIFFBATCH_CACHE_DIR", None)
    else:
        os.environ["DIFFBATCH_CACHE_DIR"] = previous


@pytest.fixture(scope="session", autouse=True)
def forked_servers() -> Iterator[None]:
    """Servers a test starts through `bench.launch` are forked from a zygote that has done
    their imports once (tests/server_zygote.py says when it execs instead)."""
    import bench.launch
    from tests.server_zygote import Zygote

    zygote = Zygote()
    bench.launch.launcher = zygote.launch
    yield
    bench.launch.launcher = bench.launch.popen
    zygote.close()


@pytest.fixture(scope="session")
def standin_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weights folder with untrained stand-ins of `shapes` and `shapes-dit` (tests/standin.py):
    the shape of the shipped files, never their quality."""
    from tests.standin import build_standin_root

    return build_standin_root(tmp_path_factory.mktemp("standin-weights"))


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Cluster]:
    """One real PostgreSQL for the whole session (tests/postgres.py), stopped at its end."""
    if server_binaries() is None:
        # A failure, not a skip: a CI without the server would otherwise go green untested.
        pytest.fail(
            "PostgreSQL server binaries are missing: apt-get install postgresql (scripts/system_packages)"
        )
    cluster = start_cluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def database_url(postgres_cluster: Cluster) -> str:
    """A fresh database of the session's PostgreSQL, for one test."""
    return postgres_cluster.create_database(f"test_{secrets.token_hex(6)}")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One S3-compatible server (moto's server mode on loopback) for the whole session; each
    test makes its own bucket (`S3Server.new_bucket`)."""
    yield from run_s3_server()


@pytest.fixture
def s3_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The credentials boto3 reads from the environment, as a deployment would set them."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
