"""One error type for bad input: the CLI prints its one line and exits with code 2."""

from __future__ import annotations


class SmdInputError(Exception):
    """Bad input (artifact, parameter, dataset line). The message is one line naming file and field."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class SmdRankError(SmdInputError):
    """One process of a multi-process stage failed: every process raises this, naming the first failing rank
    (the CLI prints it from rank 0 only). Exit code 2 when that rank's error was bad input, else 1."""

    def __init__(self, rank: int | None, world: int, message: str, exit_code: int = 1, host: str | None = None):
        # The host is named when the processes span several nodes (rank None: a rank that cannot be told apart).
        who = f"rank {rank}" if rank is not None else "a rank"
        super().__init__(f"{who} of {world}{f' on {host}' if host else ''} failed: {message}")
        self.rank = rank
        self.host = host
        self.exit_code = exit_code
