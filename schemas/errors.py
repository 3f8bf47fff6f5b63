"""One error type for bad input: the CLI prints its one line and exits with code 2."""

from __future__ import annotations


class SmdInputError(Exception):
    """Bad input (artifact, parameter, dataset line). The message is one line naming file and field."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
