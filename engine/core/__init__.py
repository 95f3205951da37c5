"""The engine of one served model: `AsyncEngine` and the collaborators it holds (its
admission queue, lane loops and deadline guard), its lanes, and `EngineService`, what the
server needs of an engine. Imports the executors and everything below."""
