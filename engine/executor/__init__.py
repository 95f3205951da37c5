"""Executors, the seam between the engine loop and the hardware: a thread of this process,
or worker processes (their supervisor, messages and shared memory). Imports the worker
side, the scheduling policy and the leaves."""
