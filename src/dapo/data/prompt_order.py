"""The prompt order: the resumable, seeded stream of training prompts (which prompt comes next; dynamic sampling
decides what is kept of their responses, ``SamplingParams`` how tokens are drawn)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from dapo.data.prompts import Example


class PromptOrder:
    """Endless, seeded stream of examples: each epoch is a fresh permutation of all examples.

    The order of epoch ``e`` depends only on ``(seed, e)``, so the state is just three integers
    and a resumed run continues with exactly the examples the interrupted one would have drawn.
    """

    def __init__(self, examples: Sequence[Example], *, seed: int, shuffle: bool = True):
        if len(examples) == 0:
            raise ValueError("PromptOrder needs at least one example; the data set is empty")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self._examples = list(examples)
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._pos = 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self._examples)

    @property
    def epoch(self) -> int:
        """Number of completed passes over the examples (0 during the first pass)."""
        return self._epoch

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self._examples)))
        if self._shuffle:
            # the text keeps the class's earlier name: the same seed gives the same order as in earlier runs
            random.Random(f"dapo-sampler:{self._seed}:{epoch}").shuffle(order)
        return order

    def next(self, n: int) -> list[Example]:
        """The next ``n`` examples, continuing into the next epoch (reshuffled) when one ends."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be a non-negative integer, got {n!r}")
        handed: list[int] = []
        while len(handed) < n:
            if self._pos == len(self._order):
                self._epoch += 1
                self._pos = 0
                self._order = self._permutation(self._epoch)
            take = min(n - len(handed), len(self._order) - self._pos)
            handed.extend(self._order[self._pos : self._pos + take])
            self._pos += take
        return [self._examples[i] for i in handed]

    def __iter__(self) -> Iterator[Example]:
        while True:
            yield self.next(1)[0]

    def state_dict(self) -> dict:
        return {
            "seed": self._seed,
            "shuffle": self._shuffle,
            "epoch": self._epoch,
            "position": self._pos,
            "num_examples": len(self._examples),
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"seed", "shuffle", "epoch", "position", "num_examples"} - set(state)
        if missing:
            raise ValueError(f"prompt order state is missing {sorted(missing)}; pass the dict from state_dict()")
        if state["num_examples"] != len(self._examples):
            raise ValueError(
                f"prompt order state was saved for {state['num_examples']} examples but this data set has "
                f"{len(self._examples)}; resume with the same data files and options"
            )
        if not 0 <= int(state["position"]) <= len(self._examples):
            raise ValueError(f"prompt order state has position {state['position']} outside the data set")
        self._seed = int(state["seed"])
        self._shuffle = bool(state["shuffle"])
        self._epoch = int(state["epoch"])
        self._pos = int(state["position"])
        self._order = self._permutation(self._epoch)
