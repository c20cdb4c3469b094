"""The Python tool's text protocol (ToRL's): the model writes a fenced ```python block; the block's output comes
back as a fenced ```output block appended to the response, and the model goes on writing after it."""

from __future__ import annotations

import re

from dapo.tools.sandbox import ToolResult

# a complete call: an opening ```python line, the code, a closing ``` line; the last one in the text counts
_CALL = re.compile(r"```python[ \t]*\n(.*?)\n```[ \t]*(?:\n|$)", re.DOTALL)
# generation stops when a fenced block closes (the fence on a line of its own); the caller then checks that the
# block was a python one
STOP = ("\n```\n",)


def call_in(text: str) -> str | None:
    """The code of the python block that ``text`` ends with (the model just closed it), else None."""
    found = None
    for match in _CALL.finditer(text):
        found = match
    if found is None or text[found.end() :].strip():
        return None
    return found.group(1)


def output_block(result: ToolResult) -> str:
    """What is appended after a call: the output block, on lines of its own, and a newline to write on from."""
    body = result.output.rstrip("\n")
    return f"```output\n{body}\n```\n"
