"""Prompts: the ``Example`` records (a problem, its ground truth, its data source), the prompt templates
(the DAPO paper's, the raw problem, the Python tool's) and the prompt encoder.

Data files and rows given in Python become ``Example``s in ``dapo.data.files``; ``dapo.data.prompt_order`` draws them.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from dapo.config.schema import Template

DAPO_PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

# how a problem says the Python tool is there (tools.python; docs/tools.md)
TOOL_PROMPT_SUFFIX = (
    "\n\nYou can run Python: write code in a ```python block and its output will be shown to you in an "
    '```output block. Put your final answer on its own line after "Answer:".'
)


class Message(dict):
    """One chat turn ``{"role", "content"}``: a real ``dict`` (chat templates and JSON accept it)
    that cannot be changed and can be hashed, so an ``Example`` holding messages stays hashable."""

    def __init__(self, role: str, content: str):
        super().__init__(role=role, content=content)

    def __hash__(self) -> int:  # type: ignore[override]
        return hash((self["role"], self["content"]))

    def _immutable(self, *args, **kwargs):
        raise TypeError("Message is immutable; build a new Message instead")

    __setitem__ = __delitem__ = __ior__ = _immutable  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _immutable  # type: ignore[assignment]

    def __reduce__(self):
        return (Message, (self["role"], self["content"]))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


@dataclass(frozen=True)
class Example:
    uid: str
    prompt: str | tuple  # final prompt text, or a tuple of ``Message``s
    ground_truth: str
    data_source: str

    def messages(self) -> list[dict]:
        """The prompt as chat messages (a plain string prompt becomes one user turn)."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [dict(m) for m in self.prompt]

    def text(self) -> str:
        """The prompt's text without any chat template: its user turns (every turn when it has none)."""
        if isinstance(self.prompt, str):
            return self.prompt
        user = [m["content"] for m in self.prompt if m["role"] == "user"]
        return "\n\n".join(user if user else [m["content"] for m in self.prompt])


def apply_template(problem: str, template: str) -> str:
    """Wrap ``problem`` in the named template. ``"dapo"`` leaves already-wrapped text alone."""
    check_template(template)
    if template == "raw":
        return problem
    if template == "tool":
        return problem if TOOL_PROMPT_SUFFIX in problem else problem + TOOL_PROMPT_SUFFIX
    if DAPO_PROMPT_PREFIX.strip() in problem:  # "dapo"
        return problem
    return DAPO_PROMPT_PREFIX + problem + DAPO_PROMPT_SUFFIX


def check_template(template: str) -> None:
    """A ValueError naming the choices unless ``template`` is one of ``Template``'s."""
    if template not in _templates():
        raise ValueError(f"unknown prompt template {template!r}; choose one of {list(_templates())}")


def _templates() -> tuple[str, ...]:
    return typing.get_args(Template)


def render_prompt(example: Example, tokenizer) -> str:
    """The exact text to feed the model: the tokenizer's chat template when it has one
    (with the generation prompt appended), else the plain prompt text."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(example.messages(), add_generation_prompt=True, tokenize=False)
    return example.text()


def make_encoder(tokenizer, max_prompt_tokens: int):
    """``encode(example) -> prompt token ids``: the example rendered (chat template or plain text),
    tokenised, and cut from the left to ``max_prompt_tokens`` (the question's end matters most)."""
    # No token spans more characters than the vocabulary's longest entry, so the kept tokens lie within
    # this many characters of the end (with a margin for the word cut in two): a prompt of megabytes
    # is cut before it is tokenised, which would otherwise take the whole text's time and memory.
    max_chars = (max_prompt_tokens + 16) * max(map(len, tokenizer.get_vocab()), default=1)
    cache: dict = {}

    def encode(example: Example) -> list[int]:
        if example not in cache:  # examples are frozen and hashable; templates render once each
            text = render_prompt(example, tokenizer)[-max_chars:]
            ids = tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None))["input_ids"]
            cache[example] = ids[-max_prompt_tokens:]
        return cache[example]

    return encode
