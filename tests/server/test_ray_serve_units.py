"""The Ray Serve pieces that need no cluster: `RemoteEngine` over a fake deployment handle
(admission, streaming, error mapping, abort), the replica watch over scripted Serve states,
the deployment options and arguments, and the shipped Serve and KubeRay configs. The real
cluster is in tests/e2e/test_ray_serve.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ray.exceptions import ActorDiedError
from ray.serve._private.common import DeploymentID, DeploymentStatus, DeploymentStatusTrigger, ReplicaState
from ray.serve.config import AutoscalingConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.schema import (
    ApplicationStatus,
    ApplicationStatusOverview,
    DeploymentStatusOverview,
    ServeDeploySchema,
    ServeStatus,
)

from engine.errors import QueueFullError, RequestAbortedError, WorkerCrashedError
from engine.models.model_set import ModelSet
from engine.outputs import DecodeRecord, ForwardRecord
from engine.request import GenerationRequest, InvalidRequestError, PartialImage, RequestOutput
from server.ray_serve import remote_engine
from server.ray_serve import watch as watch_module
from server.ray_serve.app import application, build_app, demands, gateway_settings, replica_options
from server.ray_serve.gateway_engine import gateway_engine
from server.ray_serve.gateways import GATEWAY_HEADER, GatewayHeader, check_shareable
from server.ray_serve.lane_devices import visible_gpus
from server.ray_serve.launch import Stopped, StopSignals, start_proxy
from server.ray_serve.messages import Finished, Progress, RemoteCall, ReplicaInfo
from server.ray_serve.placement import ClusterResources, unplaceable
from server.ray_serve.remote_engine import RemoteEngine
from server.ray_serve.router import post_routing_stats
from server.ray_serve.start import StartError, wait_until_running
from server.ray_serve.watch import ReplicaWatch, RoutingBoard
from server.settings import ServeSettings, SettingsError, load_settings
from tests.engine.fakes import FakeStepPipeline, make_request

ROOT = Path(__file__).resolve().parents[2]


class FakeReplicas:
    """Stands for a DeploymentHandle: `describe.remote()` and a streamed `run.remote(call)`
    whose behaviour the test picks per call."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls: list[RemoteCall] = []
        self.cancelled = 0
        self.describe = self
        self.run = self
        self._stream = False

    def options(self, stream: bool = False, **_: Any) -> FakeReplicas:
        self._stream = stream
        return self

    def remote(self, call: RemoteCall | None = None) -> Any:
        if call is None:
            return _ready(ReplicaInfo(FakeStepPipeline(), "step", "r0"))
        self.calls.append(call)
        return _Stream(self, self.answers.pop(0))


async def _ready(value: Any) -> Any:
    return value


class _Stream:
    def __init__(self, owner: FakeReplicas, answer: Any) -> None:
        self.owner, self.answer = owner, answer

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._events()

    async def _events(self) -> AsyncIterator[Any]:
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "forever":
            await asyncio.Event().wait()
        for event in self.answer:
            yield event

    def cancel(self) -> None:
        self.owner.cancelled += 1


async def started(
    *answers: Any, watch: ReplicaWatch | None = None, **settings: Any
) -> tuple[RemoteEngine, FakeReplicas]:
    replicas = FakeReplicas(*answers)
    engine = RemoteEngine(replicas, ServeSettings(**settings), watch)  # type: ignore[arg-type]
    await engine.start()
    return engine, replicas


async def test_the_modules_a_description_needs_are_imported_in_a_thread_before_asking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading a replica's description imports its spec's modules (torch, diffusers: seconds
    that stalled every request on the gateway's event loop): imported first, in a thread."""
    probe = "tests.server.spec_probe"
    monkeypatch.setattr(remote_engine, "SPEC_MODULE", probe)
    monkeypatch.delitem(sys.modules, probe, raising=False)
    imported_when_asked: list[bool] = []

    class Describing(FakeReplicas):
        def remote(self, call: RemoteCall | None = None) -> Any:
            if call is None:
                imported_when_asked.append(probe in sys.modules)
            return super().remote(call)

    engine = RemoteEngine(Describing(), ServeSettings(**{}), None)  # type: ignore[arg-type]
    await engine.start()
    assert imported_when_asked == [True]
    assert sys.modules[probe].IMPORTED_IN is not threading.current_thread()


def output(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, ("image",), (1,))


async def test_a_request_streams_its_previews_then_its_output_and_the_replicas_forwards_and_decodes() -> None:
    forwards = (ForwardRecord(3, 3, 0.1, ok=True),)
    decodes = (DecodeRecord(3, 3, 0.05, ok=True),)
    preview = PartialImage("a", 0, ("preview",), 1, 2)
    engine, replicas = await started([preview, Finished("r0", output("a"), None, forwards, decodes)])
    seen: list[ForwardRecord | DecodeRecord] = []

    class Observer:
        def on_forward(self, record: ForwardRecord) -> None:
            seen.append(record)

        def on_decode(self, record: DecodeRecord) -> None:
            seen.append(record)

    engine.observers.append(Observer())  # type: ignore[arg-type]
    handle = engine.submit(make_request("a", size=64, seed=None))
    events = [event async for event in handle.events()]
    assert events == [preview, output("a")]
    (call,) = replicas.calls
    assert call.request.params.seed is not None  # drawn once, at the gateway
    assert call.batch_key == (64, 64)  # the step key: the replicas step
    assert seen == [*forwards, *decodes] and engine.answers_by_replica == {"r0": 1}


async def test_a_video_requests_progress_reaches_the_observers() -> None:
    engine, _ = await started([Progress(2, 8), Progress(8, 8), Finished("r0", output("a"))])
    seen: list[tuple[list[str], int, int]] = []

    class Observer:
        def on_progress(self, request_ids: list[str], done: int, total: int) -> None:
            seen.append((request_ids, done, total))

    engine.observers.append(Observer())  # type: ignore[arg-type]
    assert await engine.generate(make_request("a")) == output("a")
    assert seen == [(["a"], 2, 8), (["a"], 8, 8)]


async def test_bad_input_is_refused_before_anything_is_sent() -> None:
    engine, replicas = await started()
    with pytest.raises(InvalidRequestError, match="width"):
        engine.submit(make_request("a", size=2048))  # the model's own validation
    assert replicas.calls == []


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        ([Finished("r0", None, QueueFullError(4, 3.0))], QueueFullError),  # the replica's own error
        (BackPressureError(10, 10, retry_after_s=2.0), QueueFullError),  # Serve shed it: 429
        (ActorDiedError(), WorkerCrashedError),  # the replica died: 503
    ],
)
async def test_failures_map_to_the_errors_of_one_server(answer: Any, error: type[Exception]) -> None:
    engine, _ = await started(answer)
    with pytest.raises(error):
        await engine.generate(make_request("a"))
    assert engine.num_running == 0 and engine.input_bytes == 0


async def test_with_retry_a_request_whose_replica_died_is_sent_once_more() -> None:
    engine, replicas = await started(
        ActorDiedError(), [Finished("r1", output("a"))], retry_on_worker_crash=True
    )
    assert await engine.generate(make_request("a")) == output("a")
    assert len(replicas.calls) == 2


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the event loop turn until `condition` holds (turns, not seconds: no clock)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def test_aborting_cancels_the_call_to_the_replica() -> None:
    engine, replicas = await started("forever")
    handle = engine.submit(make_request("a"))
    await until(lambda: bool(replicas.calls), "the call is under way")
    assert engine.num_running == 1
    assert engine.abort("a")
    with pytest.raises(RequestAbortedError):
        await handle.result()
    await until(lambda: replicas.cancelled == 1, "the call to the replica is cancelled")
    assert engine.num_running == 0


def test_a_call_moves_the_request_onto_the_replicas_clock() -> None:
    request = GenerationRequest.create("a cat", make_request("a").params, timeout_s=30)
    call = RemoteCall(request, (64, 64), sent_at=request.arrival_time - 1000.0)  # another clock
    moved = call.on_this_clock()
    assert moved.deadline is not None and request.deadline is not None
    assert moved.deadline - moved.arrival_time == pytest.approx(30)
    assert moved.arrival_time == pytest.approx(request.arrival_time + 1000, abs=1)


def test_replica_options_autoscale_shed_load_and_route_by_key() -> None:
    fixed = replica_options(load_settings(overrides={"replicas": 3, "max_queue_len": 50}))
    assert fixed["num_replicas"] == 3 and fixed["max_queued_requests"] == 50
    assert fixed["ray_actor_options"] == {"num_gpus": 0, "num_cpus": 1}
    assert "BatchKeyRouter" in fixed["request_router_config"].request_router_class
    scaled = replica_options(
        load_settings(overrides={"replicas": 1, "max_replicas": 4, "device": "cuda", "max_num_seqs": 6})
    )
    autoscaling = scaled["autoscaling_config"]
    assert isinstance(autoscaling, AutoscalingConfig) and "num_replicas" not in scaled
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 4)
    assert autoscaling.target_ongoing_requests == 6
    assert scaled["ray_actor_options"]["num_gpus"] == 1
    default = replica_options(load_settings(overrides={"ray_router": "default"}))
    # Ray's own router, which also posts the replicas' routing stats for the gateway.
    assert default["request_router_config"].request_router_class.endswith(":DefaultRouter")
    assert default["request_router_config"].request_routing_stats_period_s <= 1.0


def test_the_shipped_serve_config_is_valid_and_builds() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "ray-serve.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "server.ray_serve:build_app"
    build_app(app["args"])  # settings valid, deployments bound (nothing started)


def test_a_database_password_is_never_bound_into_the_deployments() -> None:
    with pytest.raises(SettingsError, match="PGPASSWORD"):
        application(load_settings(overrides={"database_url": "postgresql://app:hunter2@db/diffbatch"}))
    application(load_settings(overrides={"database_url": "postgresql://app@db/diffbatch"}))


def serve_status(states: dict[ReplicaState, int], status: DeploymentStatus) -> ServeStatus:
    deployment = DeploymentStatusOverview(
        status, DeploymentStatusTrigger.HEALTH_CHECK_FAILED, states, "Traceback: /secret/path"
    )
    app = ApplicationStatusOverview(ApplicationStatus.RUNNING, "", 0.0, {"EngineReplica": deployment})
    return ServeStatus(applications={"diffbatch": app})


async def test_health_and_waiting_follow_serves_replica_states_and_their_routing_stats() -> None:
    answers = [
        serve_status({ReplicaState.RUNNING: 2}, DeploymentStatus.HEALTHY),
        serve_status({ReplicaState.STARTING: 2, ReplicaState.STOPPING: 1}, DeploymentStatus.UNHEALTHY),
        ServeStatus(),  # the application is being deleted: the last states stand
        # As `serve.status()` really returns them: strings, not Ray's enums.
        serve_status({"RUNNING": 1, "STARTING": 1}, "UPSCALING"),  # type: ignore[dict-item,arg-type]
    ]
    board = RoutingBoard()
    watch = ReplicaWatch("diffbatch", "EngineReplica", lambda: answers.pop(0), board, period_s=3600)
    engine, _ = await started(watch=watch)
    assert (engine.unavailable, engine.workers_up, engine.num_waiting) == (None, 2, 0)

    board.post("diffbatch", "EngineReplica", {"a": {"waiting": 3}, "b": {"waiting": 1}})
    assert engine.num_waiting == 4

    await watch.refresh()
    reason = engine.unavailable
    assert reason == "no engine replica is running (2 starting, 1 stopping; deployment unhealthy)"
    assert "secret" not in reason and engine.workers_up == 0  # Serve's message is only logged
    await watch.refresh()
    assert engine.unavailable == reason
    await watch.refresh()
    assert engine.unavailable is None and engine.workers_up == 1
    await engine.stop()


class StubReplica:
    def __init__(self, name: str, waiting: int) -> None:
        self.replica_id = type("ReplicaID", (), {"unique_id": name})()
        self.routing_stats = {"waiting": waiting, "running": 1}


class StubRouter:
    """What `post_routing_stats` reads of Serve's router: its application and deployment."""

    def __init__(self, app: str, deployment: str) -> None:
        self.app_name = app
        self._deployment_id = DeploymentID(name=deployment, app_name=app)


@pytest.mark.parametrize("router", ["batch-key", "default"])
def test_a_router_as_serve_ships_it_posts_the_routing_stats_on_the_gateways_board(router: str) -> None:
    config = replica_options(load_settings(overrides={"ray_router": router}))["request_router_config"]
    shipped = config.get_request_router_class()  # Serve pickles the router's module by value
    post = shipped.update_replicas.__globals__["post_routing_stats"]
    post(StubRouter(f"app-{router}", "EngineReplica"), [StubReplica("a", 3), StubReplica("b", 1)])
    assert watch_module.ROUTING_BOARD.waiting(f"app-{router}", "EngineReplica") == 4


def test_routing_stats_are_kept_per_deployment_even_in_one_app() -> None:
    """One engine deployment per model in one application: each model's watch reads only
    its own deployment's replicas (their stats never mix)."""
    for deployment, waiting in (("EngineReplica-a", 3), ("EngineReplica-b", 5)):
        router = StubRouter("app-two-models", deployment)
        replicas: list[Any] = [StubReplica(f"{deployment}-r", waiting)]
        post_routing_stats(router, replicas)  # type: ignore[arg-type]
    for deployment, waiting in (("EngineReplica-a", 3), ("EngineReplica-b", 5)):
        assert ReplicaWatch("app-two-models", deployment).waiting == waiting


async def test_multiplexed_models_count_each_engine_replica_once() -> None:
    """Two models on one multiplexed deployment of two replicas: the gateway counts two
    workers up and the replicas' own waiting requests, not each again for every model."""
    board = RoutingBoard()
    settings = load_settings(overrides={"models": ["a=tiny-sd", "b=tiny-flux"], "ray_models_per_replica": 2})
    status = serve_status({ReplicaState.RUNNING: 2}, DeploymentStatus.HEALTHY)
    engine = gateway_engine(settings, FakeReplicas(), "diffbatch", lambda: status, board)  # type: ignore[arg-type]
    assert isinstance(engine, ModelSet)
    await engine.start()
    for name in ("a", "b"):
        await engine.engine_for(name)
    board.post("diffbatch", "EngineReplica", {"r1": {"waiting": 3}, "r2": {"waiting": 1}})
    assert (engine.workers_up, engine.num_waiting) == (2, 4)
    await engine.stop()


async def test_the_watch_keeps_the_last_states_while_serve_cannot_be_read() -> None:
    def broken() -> ServeStatus:
        raise ConnectionError("the controller is gone")

    watch = ReplicaWatch("diffbatch", "EngineReplica", broken, RoutingBoard(), period_s=3600)
    await watch.refresh()
    assert watch.states is None and watch.unavailable is None  # unknown is not a reason


KEY = "sk-not-for-ray-0123456789"


def bound_deployments(app: Any) -> list[Any]:
    """The application's deployments, its ingress first."""
    nested = [arg for arg in app._bound_deployment.init_args if hasattr(arg, "_bound_deployment")]
    return [app._bound_deployment] + [d for n in nested for d in bound_deployments(n)]


def bound_args(app: Any) -> list[Any]:
    """Every argument the application's deployments are bound with, as Ray stores them."""
    args = list(app._bound_deployment.init_args)
    nested = [arg for arg in args if hasattr(arg, "_bound_deployment")]
    return [arg for arg in args if arg not in nested] + [a for n in nested for a in bound_args(n)]


@pytest.mark.parametrize("source", ["value", "file"])
def test_no_deployment_is_bound_with_the_api_key(source: str, tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    given = {"api_key": KEY} if source == "value" else {"api_key_file": str(key_file)}
    args = bound_args(application(load_settings(overrides=given)))
    assert KEY not in repr(args)
    gateway_values, required, replica_values = args
    assert required is True  # the gateway must find the key itself
    assert "api_key" not in replica_values and "api_key_file" not in replica_values
    assert gateway_values["api_key_file"] == (str(key_file) if source == "file" else None)
    assert gateway_settings(gateway_values, required, {"DIFFBATCH_API_KEY": KEY}).api_keys == (KEY,)


def test_the_gateway_reads_its_key_from_its_file_or_environment_or_refuses_to_start(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("from-file\n")
    values = load_settings().model_dump(mode="json", exclude={"api_key"})
    assert gateway_settings(values, False, {}).api_key is None
    assert gateway_settings(values, True, {"DIFFBATCH_API_KEY": "from-env"}).api_key == "from-env"
    with_file = {**values, "api_key_file": str(key_file)}
    assert gateway_settings(with_file, True, {"DIFFBATCH_API_KEY": "from-env"}).api_key == "from-file"
    with pytest.raises(SettingsError, match="DIFFBATCH_API_KEY"):
        gateway_settings(values, True, {})  # never serve without the key that was set


def ray_start_resources(group: dict[str, Any]) -> dict[str, float]:
    """A KubeRay group's custom resources: `resources` of rayStartParams, JSON quoted twice."""
    quoted = group.get("rayStartParams", {}).get("resources")
    return json.loads(json.loads(quoted)) if quoted else {}


def container_env(group: dict[str, Any]) -> dict[str, dict[str, str]]:
    """A group's environment: each variable's secret reference {name, key}."""
    (container,) = group["template"]["spec"]["containers"]
    return {env["name"]: env["valueFrom"]["secretKeyRef"] for env in container.get("env", ())}


def test_the_kuberay_service_runs_two_gateways_on_state_from_a_secret_with_its_keys_out_of_ray() -> None:
    (service,) = yaml.safe_load_all((ROOT / "deploy" / "rayservice.yaml").read_text())
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    args = app["args"]
    assert not {"api_key", "api_key_file", "database_url", "output_url"} & set(args)  # Ray shows them
    assert "deployments" not in app  # what each deployment asks Ray for is in its settings
    cluster = service["spec"]["rayClusterConfig"]
    groups = {group["groupName"]: group for group in cluster["workerGroupSpecs"]}
    # The state's URLs come from the secret wherever Serve may build the application; the
    # credentials and the API key only where the gateways run.
    state = {"DIFFBATCH_DATABASE_URL", "DIFFBATCH_OUTPUT_URL"}
    for group in [cluster["headGroupSpec"], *groups.values()]:
        env = container_env(group)
        assert state <= set(env) and all(env[name]["name"] == "diffbatch-state" for name in state)
    credentials = {"PGPASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "DIFFBATCH_API_KEY"}
    assert credentials <= set(container_env(groups["gateway"]))
    assert not credentials & set(container_env(groups["gpu"]) | container_env(cluster["headGroupSpec"]))
    # Built with those variables, the application runs the two gateways.
    environ = {
        "DIFFBATCH_DATABASE_URL": "postgresql://diffbatch@db/jobs",
        "DIFFBATCH_OUTPUT_URL": "s3://media/x",
    }
    built = load_settings(overrides={k: v for k, v in args.items() if k != "config"}, environ=environ)
    deployed = {deployment.name: deployment for deployment in bound_deployments(application(built))}
    assert set(deployed) == {"Gateway", "EngineReplica"}
    assert deployed["Gateway"].num_replicas == 2
    # Each engine replica is a lane of two GPUs, which one pod of the gpu group offers.
    engine = deployed["EngineReplica"]
    assert engine.ray_actor_options == {"num_cpus": 0, "num_gpus": 1}
    assert engine._replica_config.placement_group_bundles == [{"GPU": 1}, {"GPU": 1}]
    assert engine._replica_config.placement_group_strategy == "STRICT_PACK"
    (gpu_pod,) = groups["gpu"]["template"]["spec"]["containers"]
    assert gpu_pod["resources"]["limits"]["nvidia.com/gpu"] == 2
    # Each gateway asks for a resource one pod of the gateway group offers once: one per pod.
    gateway = deployed["Gateway"].ray_actor_options
    pinned = gateway["resources"]
    offered = {name: ray_start_resources(group) for name, group in groups.items()}
    offered["head"] = ray_start_resources(cluster["headGroupSpec"])
    assert [name for name, resources in offered.items() if set(pinned) & set(resources)] == ["gateway"]
    assert all(offered["gateway"][name] == n for name, n in pinned.items())
    assert float(groups["gateway"]["rayStartParams"]["num-cpus"]) >= gateway["num_cpus"] == 1
    assert groups["gateway"]["minReplicas"] >= args["gateway_replicas"] == 2
    # The cluster as KubeRay starts it (each group's `replicas` pods) passes the start's check.
    pods = [(node_resources(group), group["replicas"]) for group in groups.values()]
    pods.append((node_resources(cluster["headGroupSpec"]), 1))
    free = {name: sum(pod.get(name, 0.0) * n for pod, n in pods) for name in ("CPU", "GPU", *pinned)}
    assert unplaceable(demands(built), ClusterResources(free, [pod for pod, _ in pods])) is None


def node_resources(group: dict[str, Any]) -> dict[str, float]:
    """What Ray finds on a pod of a KubeRay group: num-cpus (else the CPU limit), the GPU
    limit, the custom resources."""
    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    params = group.get("rayStartParams", {})
    cpus = float(params.get("num-cpus", limits["cpu"]))
    return {"CPU": cpus, "GPU": float(limits.get("nvidia.com/gpu", 0)), **ray_start_resources(group)}


@pytest.mark.parametrize(
    ("shared", "missing"),
    [
        ({}, ["--database-url", "--output-url"]),
        ({"database_url": "postgresql://diffbatch@db/jobs"}, ["--output-url"]),
        ({"output_url": "s3://media/x"}, ["--database-url"]),
    ],
)
def test_several_gateways_without_shared_state_run_as_one_and_the_log_says_why(
    shared: dict[str, str], missing: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    settings = load_settings(overrides={"gateway_replicas": 3, **shared})
    with caplog.at_level("WARNING", logger="server.ray_serve.gateways"):
        (gateway, _) = bound_deployments(application(settings))
    assert gateway.name == "Gateway" and gateway.num_replicas == 1
    (line,) = caplog.messages
    assert line.startswith("--gateway-replicas 3: running 1 gateway, as several cannot share this state")
    assert all(flag in line for flag in missing) and len(line.split(";")) == len(missing)
    # A gateway started as one of several anyway (a Serve config's num_replicas) refuses.
    with pytest.raises(SettingsError, match="the Gateway deployment runs 2 replicas"):
        check_shareable(settings, world_size=2)
    check_shareable(settings, world_size=1)


def test_gateways_on_a_database_and_a_bucket_scale_and_name_themselves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shared = {"database_url": "postgresql://diffbatch@db/jobs", "output_url": "s3://media/x"}
    settings = load_settings(overrides={"gateway_replicas": 3, **shared})
    with caplog.at_level("WARNING"):
        (gateway, _) = bound_deployments(application(settings))
    assert gateway.num_replicas == 3 and not caplog.messages
    check_shareable(settings, world_size=3)

    async def hello(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"a", b"b")]})
        await send({"type": "http.response.body", "body": b"hi"})

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=GatewayHeader(hello, gateway_id="g1"))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.get("/")

    answer = asyncio.run(get())
    assert answer.headers[GATEWAY_HEADER] == "g1" and answer.headers["a"] == "b" and answer.text == "hi"


def test_no_deployment_is_bound_with_the_webhook_secret() -> None:
    secret = "whsec_" + "c2VjcmV0IG9mIHRoZSBnYXRld2F5IQ=="
    given = {"webhook_url": "https://hooks.example.com/x", "webhook_secret": secret}
    gateway_values, required, replica_values = bound_args(application(load_settings(overrides=given)))
    assert secret not in repr([gateway_values, replica_values])
    assert not {"webhook_url", "webhook_secret", "allowed_webhook_hosts"} & set(replica_values)
    settings = gateway_settings(gateway_values, required, {"DIFFBATCH_WEBHOOK_SECRET": secret})
    assert settings.webhook_secret == secret and settings.webhook_url == "https://hooks.example.com/x"
    with pytest.raises(SettingsError, match="DIFFBATCH_WEBHOOK_SECRET"):
        gateway_settings(gateway_values, required, {})  # never send unsigned events


def test_a_gateway_builds_its_settings_without_the_quantization_packages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the replicas load the model (and check its packages there); the gateway (the
    head node, a CPU pod) need not have torchao, bitsandbytes or gguf installed."""
    from pipelines.memory import options

    monkeypatch.setattr(options, "installed", lambda package: False)
    values = {"model": "tiny-sd", "quantization": "torchao:int8wo", "transformer_file": "x.gguf"}
    assert gateway_settings(values, False, {}).quantization == "torchao:int8wo"


def test_multiplexed_models_are_one_deployment_on_serves_own_router() -> None:
    """`--ray-models-per-replica`: one engine deployment for every model, on Ray's default
    router (ours does not read the multiplexed model id), bound without the API key."""
    settings = load_settings(
        overrides={
            "models": ["a=tiny-sd", "b=tiny-flux"],
            "ray_models_per_replica": 1,
            "api_key": KEY,
        }
    )
    _, replicas = bound_deployments(application(settings))
    assert replicas.func_or_class.__name__ == "MultiplexedReplica"
    assert replicas.name == "EngineReplica"
    router = replicas._deployment_config.request_router_config.request_router_class
    assert router.endswith(":DefaultRouter")
    assert KEY not in repr(bound_args(application(settings)))


HINT = (
    " (set --replicas, --replica-cpus, --replica-gpus or --gateway-cpus to fit, or "
    "--ray-resource-check warn to deploy and wait for nodes)"
)
TWO_CPUS = ClusterResources({"CPU": 2.0, "memory": 8e9}, [{"CPU": 2.0, "memory": 8e9}])


def test_the_resource_check_refuses_two_one_cpu_replicas_and_a_one_cpu_gateway_on_two_cpus() -> None:
    """README's example on a 2-CPU machine, with the gateway asking for a CPU (Serve's default,
    once ours): one line naming what cannot be placed. With our defaults it fits."""
    settings = load_settings(overrides={"replicas": 2, "gateway_cpus": 1})
    assert unplaceable(demands(settings), TWO_CPUS) == (
        "cannot place the application on this Ray cluster: 3 CPU asked (EngineReplica 2 x 1, "
        "Gateway 1 x 1), 2 free (1 short)" + HINT
    )
    assert unplaceable(demands(load_settings(overrides={"replicas": 2})), TWO_CPUS) is None
    # What others use counts: with one CPU taken, one replica fits and two do not.
    busy = ClusterResources({"CPU": 1.0}, TWO_CPUS.nodes)
    assert unplaceable(demands(load_settings(overrides={"replicas": 1})), busy) is None
    assert unplaceable(demands(load_settings(overrides={"replicas": 2})), busy) == (
        "cannot place the application on this Ray cluster: 2 CPU asked (EngineReplica 2 x 1), "
        "1 free (1 short)" + HINT
    )


def test_the_resource_check_names_a_replica_no_node_can_hold_and_each_models_deployment() -> None:
    # Two GPUs free in all, but each replica (--data-parallel-size 2) wants both on one node.
    gpu = load_settings(overrides={"device": "cuda", "data_parallel_size": 2})
    two_nodes = ClusterResources({"CPU": 4.0, "GPU": 2.0}, [{"CPU": 2.0, "GPU": 1.0}] * 2)
    assert unplaceable(demands(gpu), two_nodes) == (
        "cannot place the application on this Ray cluster: each EngineReplica replica asks for "
        "2 GPU, which no node has (the most on one node: 1 GPU)" + HINT
    )
    halves = load_settings(overrides={"device": "cuda", "replicas": 4, "replica_gpus": 0.5})
    assert unplaceable(demands(halves), two_nodes) is None  # two replicas on each GPU
    models = load_settings(
        overrides={
            "models": ["img=tiny-sd", "vid=tiny-wan"],
            "replicas": 2,
            "gateway_resources": ["pinned=1"],
        }
    )
    assert unplaceable(demands(models), TWO_CPUS) == (
        "cannot place the application on this Ray cluster: each Gateway replica asks for 1 pinned, "
        "which no node has (the most on one node: 0 pinned); 4 CPU asked (EngineReplica-img 2 x 1, "
        "EngineReplica-vid 2 x 1), 2 free (2 short)" + HINT
    )


@pytest.mark.parametrize(
    ("lanes", "workers"),
    [
        ({"cfg_parallel": 2}, 2),
        ({"sequence_parallel": 2}, 2),
        ({"cfg_parallel": 2, "sequence_parallel": 2}, 4),
    ],
)
def test_a_replica_of_lanes_is_a_placement_group_of_a_bundle_per_worker_on_one_node(
    lanes: dict[str, int], workers: int
) -> None:
    """Each worker of a replica's lanes has a bundle of one GPU (on the CPU, a CPU), all on
    the replica's node (its worker processes share memory); the replica runs in the first.
    Serve takes the options, and the resource check counts the whole group on one node."""
    gpu = load_settings(overrides={"device": "cuda", "replicas": 2, **lanes})
    options = replica_options(gpu)
    assert options["placement_group_bundles"] == [{"GPU": 1.0}] * workers
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"] == {"num_cpus": 0.0, "num_gpus": 1.0}
    (_, replicas) = bound_deployments(application(gpu))  # Serve's own checks of the group
    assert replicas._replica_config.placement_group_bundles == [{"GPU": 1.0}] * workers
    # Two lanes of a replica: a bundle for each of their workers; the CPUs asked for each.
    cpu = load_settings(overrides={"data_parallel_size": 2, "replica_cpus": 0.5, **lanes})
    assert replica_options(cpu)["placement_group_bundles"] == [{"CPU": 0.5}] * (2 * workers)
    assert replica_options(cpu)["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    # Enough GPUs in the cluster for both replicas, but no node with a replica's.
    nodes = ClusterResources({"GPU": 2.0 * workers}, [{"GPU": workers - 1.0}] * 2 + [{"GPU": 1.0}] * 2)
    assert unplaceable(demands(gpu), nodes) == (
        "cannot place the application on this Ray cluster: each EngineReplica replica asks for "
        f"{workers} GPU, which no node has (the most on one node: {workers - 1} GPU)" + HINT
    )
    nodes = ClusterResources({"GPU": 2.0 * workers}, [{"GPU": float(workers)}] * 2)
    assert unplaceable(demands(gpu), nodes) is None
    # One-device lanes: one actor with every device, as before.
    assert "placement_group_bundles" not in replica_options(load_settings(overrides={"device": "cuda"}))


def test_a_replicas_workers_see_the_gpus_of_its_bundles_in_order() -> None:
    """Worker i's cuda:i is bundle i's GPU: the replica's own, then each holder's."""
    assert visible_gpus(["3"], [["1"], ["5"], ["0"]]) == "3,1,5,0"
    assert visible_gpus([], [[]]) is None  # on the CPU: nothing to name


def test_models_multiplexed_on_a_replica_refuse_lanes_of_several_devices() -> None:
    settings = load_settings(
        overrides={"models": ["a=tiny-sd", "b=tiny-sd"], "ray_models_per_replica": 1, "cfg_parallel": 2}
    )
    with pytest.raises(SettingsError, match=r"cannot serve a, b with lanes of several devices"):
        application(settings)


def test_serve_stops_and_replaces_replicas_without_its_long_default_waits() -> None:
    """Serve's defaults: a stopping replica sleeps 2 s before it first looks whether it has
    requests left (every delete of the application took that long with none), and a dead
    replica is noticed, so replaced, only at the next health check, 10 s apart."""
    settings = load_settings()
    for deployment in bound_deployments(application(settings)):
        config = deployment._deployment_config
        assert config.graceful_shutdown_wait_loop_s <= 0.5, deployment.name
        assert config.health_check_period_s <= 2, deployment.name
        if deployment.name == "EngineReplica":  # requests in flight still get the whole grace
            assert config.graceful_shutdown_timeout_s == settings.shutdown_timeout_s


def test_each_deployment_asks_ray_for_what_its_settings_say() -> None:
    settings = load_settings(
        overrides={"replica_cpus": 2, "gateway_cpus": 0.5, "gateway_resources": ["diffbatch-gateway=1"]}
    )
    gateway, replicas = bound_deployments(application(settings))
    assert replicas.ray_actor_options == {"num_cpus": 2, "num_gpus": 0}
    assert gateway.ray_actor_options == {
        "num_cpus": 0.5,
        "num_gpus": 0,
        "resources": {"diffbatch-gateway": 1},
    }
    # By default the gateway asks for nothing (Serve would give it a CPU).
    gateway, _ = bound_deployments(application(load_settings()))
    assert gateway.ray_actor_options == {"num_cpus": 0, "num_gpus": 0}
    env = load_settings(environ={"DIFFBATCH_GATEWAY_RESOURCES": "a=1,b=0.5"})
    assert env.gateway_resources == {"a": 1.0, "b": 0.5}
    with pytest.raises(SettingsError, match=r"gateway_resources: CPU: use --gateway-cpus"):
        load_settings(overrides={"gateway_resources": ["CPU=1"]})
    with pytest.raises(SettingsError, match=r"ray_start_timeout_s cannot differ between models"):
        load_settings(overrides={"models": [{"name": "a", "model": "tiny-sd", "ray_start_timeout_s": 5}]})


def deploying(deployments: dict[str, DeploymentStatusOverview], status: ApplicationStatus) -> ServeStatus:
    app = ApplicationStatusOverview(status, "", 0.0, deployments)
    return ServeStatus(applications={"diffbatch": app})


def starting(message: str = "") -> DeploymentStatusOverview:
    return DeploymentStatusOverview(
        DeploymentStatus.UPDATING,
        DeploymentStatusTrigger.CONFIG_UPDATE_STARTED,
        {ReplicaState.STARTING: 1},
        message,
    )


# What Serve says of a replica no node can take (Ray 2.60's words, deployment_state.py).
UNSCHEDULED = (
    "Deployment 'Gateway' in application 'diffbatch' has 1 replicas that have taken more than 30s "
    "to be scheduled. This may be due to waiting for the cluster to auto-scale or for a runtime "
    'environment to be installed. Resources required for each replica: {"CPU": 1.0}, total '
    "resources available: {}. Use `ray status` for more details."
)
RUNNING_ENGINE = DeploymentStatusOverview(
    DeploymentStatus.HEALTHY, DeploymentStatusTrigger.CONFIG_UPDATE_COMPLETED, {ReplicaState.RUNNING: 2}, ""
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_start_gives_up_after_its_timeout_with_serves_reason_relayed_as_it_came(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The gateway waits for a CPU: Serve's message reaches the log when Serve says it (once),
    and the start gives up at its timeout with it."""
    waiting = ApplicationStatus.DEPLOYING
    answers = [
        ServeStatus(),  # not listed yet
        deploying({"Gateway": starting(), "EngineReplica": starting()}, waiting),
        deploying({"Gateway": starting(), "EngineReplica": RUNNING_ENGINE}, waiting),
        *[deploying({"Gateway": starting(UNSCHEDULED), "EngineReplica": RUNNING_ENGINE}, waiting)] * 20,
    ]
    clock = FakeClock()
    with caplog.at_level("INFO", logger="server.ray_serve.start"), pytest.raises(StartError) as failed:
        wait_until_running(
            "diffbatch", 10, lambda: answers.pop(0), clock=clock, sleep=clock.sleep, period_s=1
        )
    assert clock.now == 10
    assert str(failed.value) == (
        "the application is not running after 10 s (--ray-start-timeout-s): Gateway updating "
        f"(1 starting): {UNSCHEDULED}"
    )
    assert caplog.messages == [
        "Serve: EngineReplica updating (1 starting)",
        "Serve: Gateway updating (1 starting)",
        "Serve: EngineReplica healthy (2 running)",
        f"Serve: Gateway updating (1 starting): {UNSCHEDULED}",
    ]
    assert caplog.records[-1].levelname == "WARNING"


def test_the_start_ends_when_the_application_runs_or_fails_to_deploy() -> None:
    clock = FakeClock()
    answers = [
        deploying({"EngineReplica": starting()}, ApplicationStatus.DEPLOYING),
        deploying({"EngineReplica": RUNNING_ENGINE}, ApplicationStatus.RUNNING),
    ]
    wait_until_running("diffbatch", 10, lambda: answers.pop(0), clock=clock, sleep=clock.sleep, period_s=1)
    assert clock.now == 1
    failed_app = ApplicationStatusOverview(
        ApplicationStatus.DEPLOY_FAILED, "Traceback ...\nValueError: no such model", 0.0, {}
    )
    with pytest.raises(StartError, match=r"^Serve could not deploy the application: Traceback"):
        wait_until_running(
            "diffbatch",
            10,
            lambda: ServeStatus(applications={"diffbatch": failed_app}),
            clock=clock,
            sleep=clock.sleep,
        )


def test_the_start_waits_on_while_serve_cannot_be_read(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> ServeStatus:
        raise ConnectionError("the controller is restarting")

    clock = FakeClock()
    with caplog.at_level("WARNING"), pytest.raises(StartError, match="Serve does not list it yet"):
        wait_until_running("diffbatch", 5, broken, clock=clock, sleep=clock.sleep, period_s=1)
    assert caplog.messages == ["cannot read the application's status from Serve"]  # once a streak


def test_a_signal_stops_the_start_and_a_second_one_during_the_teardown_leaves_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)  # (a real exit would end the test run)
    signals = StopSignals()
    with pytest.raises(Stopped, match="SIGTERM"):
        signals._on_signal(signal.SIGTERM, None)
    signals._on_signal(signal.SIGTERM, None)  # on its way down already: nothing more
    signals.taking_down()
    signals._on_signal(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]
    # After a failed start the teardown runs without a signal: the first one is noted.
    failed_start = StopSignals()
    failed_start.taking_down()
    failed_start._on_signal(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGINT]
    failed_start._on_signal(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGINT, 128 + signal.SIGTERM]


def test_a_proxy_ray_gives_up_on_ends_the_start_with_one_line_naming_it() -> None:
    """On a busy node Serve's ProxyActor can miss Ray's own start timeout and die: the start
    says so in one line (the launcher logs a StartError and exits 1), not with Ray's traceback."""
    settings = load_settings(overrides={"host": "127.0.0.1", "port": 8123})

    def proxy_died(**_: Any) -> None:
        raise ActorDiedError()

    with pytest.raises(StartError) as failed:
        start_proxy(settings, proxy_died)
    message = str(failed.value)
    assert message.startswith("Ray Serve's HTTP proxy did not start on 127.0.0.1:8123 (ActorDiedError: ")
    assert "\n" not in message
    started: list[dict[str, Any]] = []
    start_proxy(settings, lambda **options: started.append(options))
    assert started == [{"http_options": {"host": "127.0.0.1", "port": 8123}}]
