"""Tools a response may call while it is generated (multi-turn rollouts, ``dapo.rollout.multi_turn``).

An environment is what the rollout asks at the end of each turn::

    class Environment(Protocol):
        stop: tuple[str, ...]          # texts after which a turn ends (checked on the response's text)
        def step(self, response: str) -> str | ToolResult | Done | None:
            ...                        # the text to append after the turn (encoded alone, trained on never;
                                       # a ToolResult is shown as an ```output block and counted as a call that
                                       # failed or not), DONE to end the response, or None to let it write on

``PythonTool`` is the built-in one, with ToRL's text protocol: the model writes a fenced ```python block, which
runs in the sandbox (``dapo.tools.sandbox``); its output comes back as a fenced ```output block appended to the
response, and the model goes on writing after it. A user's own environment (``dapo.api.train(..., tool_env=...)``)
gets the same token handling, masking and limits (``tools.max_turns``, ``tools.max_calls``, ``tools.output_chars``,
and ``tools.timeout_s`` per step).
"""

from __future__ import annotations

import re
from typing import Protocol

from dapo.tools.sandbox import Limits, Sandbox, ToolResult

# a complete call: an opening ```python line, the code, a closing ``` line; the last one in the text counts
_CALL = re.compile(r"```python[ \t]*\n(.*?)\n```[ \t]*(?:\n|$)", re.DOTALL)
# generation stops when a fenced block closes (the fence on a line of its own); the caller then checks that the
# block was a python one
STOP = ("\n```\n",)


def call_in(text: str) -> str | None:
    """The code of the python block that ``text`` ends with (the model just closed it), else None."""
    calls = list(_CALL.finditer(text))
    found = calls[-1] if calls else None
    if found is None or text[found.end() :].strip():
        return None
    return found.group(1)


def output_block(result: ToolResult) -> str:
    """What is appended after a call: the output block, on lines of its own, and a newline to write on from."""
    body = result.output.rstrip("\n")
    return f"```output\n{body}\n```\n"


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
