"""Where the pipeline runs, each a flag and a YAML key (`ServeSettings` inherits these
groups): a thread or worker processes, one per device, and what happens when a worker dies
(a model's own); or Ray Serve replicas behind one gateway or several (the server's). When
several gateways may serve: `server/ray_serve/gateways.py`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipelines.parallel.seat import LaneShape, SequenceMode
from server.settings.section import MODEL_SECTION, Section
from server.settings.switches import Switch


class WorkerSettings(Section):
    help_section = MODEL_SECTION
    each_model = True

    executor: Literal["auto", "thread", "process"] = Field(
        "auto",
        description="where the pipeline runs: thread (a thread of the server process) or process "
        "(a worker process: results through shared memory, restarted if it dies); auto: thread "
        "with one worker, process with --data-parallel-size above 1",
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="worker processes, each with its own copy of the pipeline on its own device "
        "(--device cuda gives cuda:0..N-1, or list them: cuda:0,cuda:2; on cpu --num-threads is "
        "split between them); their batches run in parallel",
    )
    cfg_parallel: int = Field(
        1,
        ge=1,
        le=2,
        description="2: each lane is two worker processes on two devices (a torch.distributed "
        "group: NCCL on CUDA, gloo on cpu) that share every step, a guided request's negative "
        "rows on one and its positive rows on the other, for the latency of one request; step "
        "batching only, on Stable Diffusion and FLUX (devices: 2 per lane, x --data-parallel-size)",
    )
    sequence_parallel: int = Field(
        1,
        ge=1,
        description="N: each forward's tokens are split between N worker processes on N devices "
        "(a torch.distributed group, as --cfg-parallel's) with diffusers' context parallelism, for "
        "the latency of one large image; step batching only, on FLUX; combines with --cfg-parallel "
        "2 (2 x N devices per lane, x --data-parallel-size)",
    )
    sp_mode: SequenceMode = Field(
        "ulysses",
        description="how --sequence-parallel devices share the attention: ulysses (an all-to-all "
        "from token shares to head shares: the heads must divide by N) or ring (keys and values "
        "passed round, merged by their log-sum-exp: on the CPU, or CUDA with --attention-backend "
        "cudnn, flash or sage; not for a family with a text mask: Qwen-Image, LTX)",
    )
    retry_on_worker_crash: bool = Field(
        False,
        description="a request whose worker process died, or whose result from it could not be "
        "read, runs once more (on another worker if there is one) instead of failing with 503 "
        "worker_restarting (500)",
    )
    worker_start_timeout_s: float = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="how long a worker process may take to load the model (at start and after a "
        "restart) before it is killed: the start fails, or the restart is tried again; the log "
        "says what it loads while it loads",
    )
    device: str = Field(
        "cpu",
        description="torch device for the pipeline: cpu, cuda, cuda:1, ...; with data parallelism "
        "a comma-separated list, one per worker",
    )
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice)")
    flush_denormal: Switch = Field(
        "on",
        description="on: subnormal floats become zero on CPU (flush-to-zero, denormals-are-zero) in "
        "every thread and worker process that runs the pipeline, so a request whose activations "
        "drift below 1e-38 does not run tens of times slower; off: IEEE subnormals, as torch's "
        "default (default: on)",
    )

    @model_validator(mode="after")
    def _workers(self) -> WorkerSettings:
        if self.data_parallel_size > 1 and self.executor == "thread":
            raise ValueError(
                "data_parallel_size above 1 runs each pipeline in its own worker process: "
                "use executor process (or auto)"
            )
        if self.lane_shape.size > 1 and self.executor == "thread":
            raise ValueError(
                f"{self.lane_shape.flags()} runs each device's pipeline in its own worker process: "
                "use executor process (or auto)"
            )
        self.worker_devices()  # raises if the devices do not fit the workers
        return self

    @property
    def lane_shape(self) -> LaneShape:
        """The devices of each lane and how they share a step (one: a lane of one device)."""
        return LaneShape(self.cfg_parallel, self.sequence_parallel, self.sp_mode)

    @property
    def executor_kind(self) -> Literal["thread", "process"]:
        if self.executor == "auto":
            return "process" if self.data_parallel_size * self.lane_shape.size > 1 else "thread"
        return self.executor

    def worker_devices(self) -> list[str]:
        """The device of each worker: lane by lane, each lane's members in turn."""
        workers = self.data_parallel_size * self.lane_shape.size
        devices = [d.strip() for d in self.device.split(",") if d.strip()]
        if len(devices) == workers:
            return devices
        if len(devices) == 1 and workers > 1:
            if devices[0] == "cpu":
                return ["cpu"] * workers
            if devices[0] in ("cuda", "xpu", "npu"):
                return [f"{devices[0]}:{i}" for i in range(workers)]
        raise ValueError(
            f"device {self.device!r} does not name one device per worker for {workers} workers "
            "(data_parallel_size x cfg_parallel x sequence_parallel): give cpu, cuda "
            f"(cuda:0..{workers - 1}) or {workers} devices separated by commas"
        )


class RayServeSettings(Section):
    """Serving through Ray Serve: a gateway in front of engine replicas, each replica an
    engine of its own (`server/ray_serve/`)."""

    help_section = MODEL_SECTION
    each_model = False

    ray_address: str | None = Field(
        None,
        description="serve through Ray Serve on this cluster (auto, or host:port of its head) "
        "instead of in this process: a gateway with these routes in front of --replicas engine "
        "replicas (needs the [ray] extra)",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="Ray Serve: engine replicas, one device each (with --cfg-parallel or "
        "--sequence-parallel, a placement group of one bundle per worker)",
    )
    max_replicas: int | None = Field(
        None,
        ge=1,
        description="Ray Serve: autoscale between --replicas and this many replicas on "
        "ongoing requests (target: max-num-seqs per replica)",
    )
    ray_router: Literal["batch-key", "default"] = Field(
        "batch-key",
        description="Ray Serve: batch-key (requests that can share forwards go to the same "
        "replica while it has room) or default (Ray's power of two choices)",
    )


class GatewaySettings(Section):
    help_section = "several gateways on Ray Serve"
    each_model = False

    gateway_replicas: int = Field(
        1,
        ge=1,
        description="Ray Serve: gateway replicas (the HTTP routes in front of the engine "
        "replicas) behind Serve's proxy; more than one needs --database-url (PostgreSQL) and "
        "--output-url (a bucket), else one runs and the log says why",
    )
