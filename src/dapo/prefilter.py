"""Skip, before generating it, a training prompt that dynamic sampling would very likely drop (``algo.prefilter``).

Dynamic sampling (DAPO sec. 3.2) drops a group whose G responses are all right or all wrong, after paying for
its generation. A prompt's groups are strongly consistent from one draw to the next (GRESO, arXiv 2506.02177):
one that came back uninformative the last k times it was drawn is likely to do so again. The rule:

* **Record.** Per training prompt: times drawn, generated and skipped, its last ``RECENT`` group accuracies, its
  streak (how many of its last groups in a row were all-correct, > 0, or all-wrong, < 0; 0 after an informative
  group or before any) and the step it was last generated at.
* **Skip.** A drawn prompt with a streak of k of one kind is generated with probability
  ``max(floor, explore[kind] ** k)`` and skipped otherwise. A prompt whose last group was informative (or that
  was never generated) is always generated. The probability falls geometrically with the evidence, as GRESO's.
  With ``algo.prefilter_level`` a last informative group at accuracy a is partial evidence: a run of
  a^G + (1 - a)^G, the chance that a prompt staying at a comes back all one way (7/8 right at G = 8: 0.34).
* **Floor.** Never below ``algo.prefilter_floor``: no prompt is retired for good, so one the policy has
  unlearned (all-correct turning mixed) or become able to learn (all-wrong turning mixed) comes back; the
  first informative group resets its streak. Unlike a retirement pool (prime-rl), the floor bounds how long
  that takes: a prompt is generated on average at least once in 1/floor of its draws.
* **Steering.** ``explore`` has one base per kind, both steered after each step towards a target share of
  informative groups among the groups generated (``algo.prefilter_target``): below it, the kinds that were
  dropped lose ``algo.prefilter_step`` in proportion to their share of the dropped groups (skip more of what
  was wasted); above it both regain the step (skip less: the target is met, explore). All-correct prompts
  grow and all-wrong ones shrink as the policy learns, so one shared base would skip the wrong kind.
* **Its own evidence.** Every generated group is counted under the state its prompt's record was in when drawn
  (``STATES``), informative or not, so each run logs how well the record predicts on its own data: the share of
  groups that came back informative after a run of k all-correct ones, after a 7/8, and so on.
* **Determinism.** Whether a draw is skipped is a hash of (seed, prompt, how many times it was drawn), not a
  random stream: the record and the two bases are the whole state, so a resumed run skips exactly as an
  uninterrupted one, at any world size (every rank holds the same sampler and sees every group's outcome).

Held-out prompts are never touched: only the training sampler has a prefilter.
"""

from __future__ import annotations

import copy
import hashlib
import struct
from dataclasses import dataclass, field

RECENT = 4  # group accuracies kept per prompt (the rule uses the streak and, with level, the last one)
START_EXPLORE = 0.5  # each base's value before any steering: a prompt uninformative once is generated half the time
# what a checkpoint keeps: the record and the two bases (the rule's settings come from the config)
STATE_KEYS = ("seed", "drawn", "generated", "skipped", "streak", "last_step", "recent", "explore", "steps")


def _uniform(seed: int, index: int, draw: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, prompt index, draw number)."""
    digest = hashlib.blake2b(f"{seed}:{index}:{draw}".encode(), digest_size=8).digest()
    return (struct.unpack("<Q", digest)[0] >> 11) / float(1 << 53)


# What the record can know of a prompt when it is drawn: every generated group is counted under one of these, with
# whether it was informative, so a run shows how well its own record predicts (``prefilter_floor=1`` records without
# skipping). "one_wrong"/"one_right": the last group was informative, one answer from all right / all wrong.
STATES = (
    "unseen",
    "after_mixed",
    "after_one_wrong",
    "after_one_right",
    "correct_run_1",
    "correct_run_2",
    "correct_run_3plus",
    "wrong_run_1",
    "wrong_run_2",
    "wrong_run_3plus",
)


@dataclass
class SkipCounts:
    """Prompts skipped since the last ``take``, by the kind of their streak; and the groups generated, and how many
    of them were informative, by the state of their prompt's record when it was drawn (``STATES``)."""

    all_correct: int = 0
    all_wrong: int = 0
    groups: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES, 0))
    informative: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES, 0))


@dataclass
class Prefilter:
    """The record of every training prompt and the rule above. ``keep(i)`` decides a draw of prompt ``i``,
    ``observe(i, group_acc)`` records its generated group, ``steer(informative, correct, wrong)``
    ends a step."""

    num_prompts: int
    seed: int
    target: float = 0.9
    floor: float = 0.05
    step_size: float = 0.05
    group_size: int = 8  # G, for the level rule
    level: bool = False  # algo.prefilter_level: a last informative group's accuracy is partial evidence
    drawn: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    streak: list[int] = field(default_factory=list)
    last_step: list[int] = field(default_factory=list)
    recent: list[list[float]] = field(default_factory=list)
    explore: dict[str, float] = field(
        default_factory=lambda: {"all_correct": START_EXPLORE, "all_wrong": START_EXPLORE}
    )
    steps: int = 0  # training steps ended (``steer``): the step a prompt was last generated at is counted in these
    counts: SkipCounts = field(default_factory=SkipCounts)

    def __post_init__(self):
        n = self.num_prompts
        self.drawn = self.drawn or [0] * n
        self.generated = self.generated or [0] * n
        self.skipped = self.skipped or [0] * n
        self.streak = self.streak or [0] * n
        self.last_step = self.last_step or [-1] * n
        self.recent = self.recent or [[] for _ in range(n)]

    def keep_probability(self, index: int) -> float:
        """The probability that the next draw of prompt ``index`` is generated."""
        run = self.streak[index]
        if run == 0:
            if not (self.level and self.recent[index]):
                return 1.0
            a, g = self.recent[index][-1], self.group_size  # the last group: informative, a in (0, 1)
            evidence = a**g + (1 - a) ** g  # how likely, at accuracy a, the next group is all one way
            base = self.explore["all_correct" if a >= 0.5 else "all_wrong"]
            return max(self.floor, base**evidence)
        base = self.explore["all_correct" if run > 0 else "all_wrong"]
        return max(self.floor, base ** abs(run))

    def state(self, index: int) -> str:
        """What the record knows of prompt ``index`` now: one of ``STATES``."""
        run = self.streak[index]
        if run:
            kind = "correct" if run > 0 else "wrong"
            return f"{kind}_run_{abs(run)}" if abs(run) < 3 else f"{kind}_run_3plus"
        if not self.recent[index]:
            return "unseen"
        right = round(self.recent[index][-1] * self.group_size)
        return {self.group_size - 1: "after_one_wrong", 1: "after_one_right"}.get(right, "after_mixed")

    def keep(self, index: int) -> bool:
        """Decide a draw of prompt ``index``: True to generate it, False to skip it (counted)."""
        draw = self.drawn[index]
        self.drawn[index] += 1
        if _uniform(self.seed, index, draw) < self.keep_probability(index):
            return True
        self.skipped[index] += 1
        if self.streak[index] > 0 or (self.streak[index] == 0 and self.recent[index][-1] >= 0.5):
            self.counts.all_correct += 1
        else:
            self.counts.all_wrong += 1
        return False

    def observe(self, index: int, group_acc: float, informative: bool | None = None) -> None:
        """Record prompt ``index``'s generated group: its mean accuracy, and whether dynamic sampling kept it
        (None: kept unless all-correct or all-wrong; with algo.filter_metric=reward a group of equal accuracies
        may still be kept, and a kept group is informative whatever its accuracies)."""
        state = self.state(index)
        if informative is None:
            informative = 0.0 < group_acc < 1.0
        self.counts.groups[state] += 1
        self.counts.informative[state] += bool(informative)
        self.generated[index] += 1
        self.last_step[index] = self.steps
        self.recent[index] = [*self.recent[index], float(group_acc)][-RECENT:]
        run = self.streak[index]
        if informative:
            self.streak[index] = 0
        elif group_acc >= 1.0:
            self.streak[index] = run + 1 if run > 0 else 1
        else:
            self.streak[index] = run - 1 if run < 0 else -1

    def steer(self, *, informative: int, all_correct: int, all_wrong: int) -> None:
        """Move both bases after a step that generated ``informative + all_correct + all_wrong`` groups."""
        self.steps += 1
        generated = informative + all_correct + all_wrong
        if generated == 0:
            return
        dropped = all_correct + all_wrong
        if informative / generated < self.target and dropped:
            for kind, n in (("all_correct", all_correct), ("all_wrong", all_wrong)):
                self.explore[kind] = max(self.floor, self.explore[kind] - self.step_size * n / dropped)
        elif informative / generated >= self.target:
            for kind in self.explore:
                self.explore[kind] = min(1.0, self.explore[kind] + self.step_size)

    def take_counts(self) -> SkipCounts:
        counts, self.counts = self.counts, SkipCounts()
        return counts

    def state_dict(self) -> dict:
        return copy.deepcopy({k: getattr(self, k) for k in STATE_KEYS})

    def load_state_dict(self, state: dict) -> None:
        if len(state["streak"]) != self.num_prompts:
            raise ValueError(
                f"prefilter state was saved for {len(state['streak'])} prompts but this data set has "
                f"{self.num_prompts}; resume with the same data files and options"
            )
        for k in STATE_KEYS:
            setattr(self, k, copy.deepcopy(state[k]))
        self.counts = SkipCounts()
