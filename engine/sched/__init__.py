"""Scheduling policy, pure and synchronous: which requests form a batch or step together,
who joins, pauses and passes, in what order (priority, fair share, deadlines), within which
budgets. No I/O, no event loop, no clock of its own, no torch; imports only the leaves."""
