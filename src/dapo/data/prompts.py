"""Prompts: the ``Example`` records (a problem, its ground truth, its data source), the prompt templates
(the DAPO paper's, the raw problem, the Python tool's) and the prompt encoder.

Data files and rows given in Python become ``Example``s in ``dapo.data.files``; ``dapo.data.prompt_order`` draws them.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass

from dapo.config.schema import ConfigError, Template

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


def make_encoder(tokenizer, max_prompt_tokens: int) -> PromptEncoder:
    """``encode(example) -> prompt token ids``: the example rendered (chat template or plain text), tokenised, and
    cut from the left to ``max_prompt_tokens`` (the question's end matters most); ``encode.cut(example)`` says
    whether it was cut."""
    return PromptEncoder(tokenizer, max_prompt_tokens)


class PromptEncoder:
    """Examples into prompt token ids, each rendered and tokenised once (see ``make_encoder``)."""

    def __init__(self, tokenizer, max_prompt_tokens: int):
        self.tokenizer, self.max_prompt_tokens = tokenizer, max_prompt_tokens
        # No token spans more characters than the vocabulary's longest entry, so the kept tokens lie within
        # this many characters of the end (with a margin for the word cut in two): a prompt of megabytes
        # is cut before it is tokenised, which would otherwise take the whole text's time and memory.
        self.max_chars = (max_prompt_tokens + 16) * max(map(len, tokenizer.get_vocab()), default=1)
        self.cache: dict = {}  # example -> (its ids, whether they were cut); examples are frozen and hashable

    def _encoded(self, example: Example) -> tuple[list[int], bool]:
        if example not in self.cache:
            self.encode_all([example])
        return self.cache[example]

    def encode_all(self, examples: Sequence[Example]) -> None:
        """Tokenise those of ``examples`` not yet cached, in one call of the tokenizer (a fast tokenizer's batch runs
        in Rust: a data set of thousands of prompts in a fraction of the time of one call each)."""
        new = list(dict.fromkeys(ex for ex in examples if ex not in self.cache))
        if not new:
            return
        texts = [render_prompt(ex, self.tokenizer)[-self.max_chars :] for ex in new]
        # verbose=False: a text longer than the tokenizer's model_max_length is cut here, on purpose
        encoded = self.tokenizer(
            texts, add_special_tokens=not getattr(self.tokenizer, "chat_template", None), verbose=False
        )["input_ids"]
        for ex, ids in zip(new, encoded):
            self.cache[ex] = (ids[-self.max_prompt_tokens :], len(ids) > self.max_prompt_tokens)

    def __call__(self, example: Example) -> list[int]:
        return self._encoded(example)[0]

    def cut(self, example: Example) -> bool:
        """Whether ``example``'s prompt is longer than max_prompt_tokens (its start cut)."""
        return self._encoded(example)[1]


def model_context(model_config) -> int | None:
    """The positions a model holds (its config's max_position_embeddings or n_positions); None where it says none."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def prompt_limit(
    max_prompt_tokens: int, context: int | None, response_tokens: int, response_key: str
) -> tuple[int, str | None]:
    """The prompt limit a run keeps, and the line saying it was capped: ``max_prompt_tokens``, at most the model's
    ``context`` less the ``response_tokens`` a response may take (``response_key`` sets them). A response budget that
    fills the context alone is a ConfigError naming ``response_key``."""
    if context is None or max_prompt_tokens + response_tokens <= context:
        return max_prompt_tokens, None
    room = context - response_tokens
    if room < 1:
        raise ConfigError(
            f"{response_key}={response_tokens:,}: responses that long fill the model's context of {context:,} "
            f"tokens and leave no room for a prompt; set {response_key} below {context:,}"
        )
    return room, (
        f"data.max_prompt_tokens={max_prompt_tokens:,} capped at {room:,}: the model holds {context:,} tokens, "
        f"{response_tokens:,} of them for the response ({response_key})"
    )


def fit_prompts(label: str, examples: list, encode: PromptEncoder, rule: str) -> tuple[list, str | None]:
    """The examples a run keeps under data.overlong_prompts ``rule`` (truncate: all, their start cut; drop: those
    within the limit), and the line counting the prompts over the limit (None: none is)."""
    encode.encode_all(examples)
    over = sum(encode.cut(ex) for ex in examples)
    if not over:
        return examples, None
    said = f"{label}: {over:,} of {len(examples):,} prompts are longer than {encode.max_prompt_tokens:,} tokens"
    if rule == "truncate":
        return (
            examples,
            f"{said}; their start is cut (data.overlong_prompts=truncate, as the reference; drop leaves them out)",
        )
    kept = [ex for ex in examples if not encode.cut(ex)]
    if not kept:
        raise ConfigError(
            f"{said}, every one: data.overlong_prompts=drop leaves nothing; raise data.max_prompt_tokens (the model's "
            "context allowing) or set data.overlong_prompts=truncate"
        )
    return kept, f"{said}; left out (data.overlong_prompts=drop)"
