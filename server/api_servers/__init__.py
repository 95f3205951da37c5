"""Several API processes in front of one engine process (`--api-server-count N`), as vLLM's
API servers in front of its engine core: the supervisor binds the port once and starts the
engine process (`engine_process`: the `AsyncEngine` or `ModelSet` and its workers, served by
an `EngineHost` over a Unix socket) and N API processes (`api_process`: the same FastAPI app
over an `EngineClient`, which implements `EngineService` across the socket). With N = 1 none
of this runs: the engine is in the server's own process."""
