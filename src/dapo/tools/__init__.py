"""Tools a response may call while it is generated (multi-turn rollouts, ``dapo.rollout.multi_turn``).

An environment is what the rollout asks at the end of each turn::

    class Environment(Protocol):
        stop: tuple[str, ...]          # texts after which a turn ends (checked on the response's text)
        def step(self, response: str) -> str | ToolResult | Done | None:
            ...                        # the text to append after the turn (encoded alone, trained on never;
                                       # a ToolResult is shown as an ```output block and counted as a call that
                                       # failed or not), DONE to end the response, or None to let it write on

``PythonTool`` is the built-in one: a ```python block the model closes runs in the sandbox. A user's own
environment (``dapo.api.train(..., tool_env=...)``) gets the same token handling, masking and limits
(``tools.max_turns``, ``tools.max_calls``, ``tools.output_chars``, and ``tools.timeout_s`` per step).
"""

from __future__ import annotations

from typing import Protocol

from dapo.tools.python_tool import STOP, call_in, output_block  # noqa: F401
from dapo.tools.sandbox import Limits, Sandbox, ToolResult


class Done:
    """What ``step`` returns to end the response after this turn."""

    def __repr__(self) -> str:
        return "DONE"


DONE = Done()


class Environment(Protocol):
    stop: tuple[str, ...]

    def step(self, response: str) -> str | ToolResult | Done | None: ...


class PythonTool:
    """Runs the ```python block a turn ended with in ``sandbox``; the model is shown an ```output block."""

    stop = STOP

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        self.timeout_s = sandbox.limits.wall_s  # the sandbox ends a call at its limit; the rollout waits that long

    def step(self, response: str) -> ToolResult | None:
        code = call_in(response)
        return None if code is None else self.sandbox.run(code)


__all__ = ["DONE", "Done", "Environment", "Limits", "PythonTool", "Sandbox", "ToolResult"]
