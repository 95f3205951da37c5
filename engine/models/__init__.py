"""Several served models in one server, one engine each: loaded on use, unloaded by one
memory budget, parked in host memory. The top of the engine: imports the core and below."""
