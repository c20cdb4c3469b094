"""Two-phase screening inside a step (``algo.screen_samples`` = n; off by default, the paper's behaviour).

Dynamic sampling (DAPO sec. 3.2) pays for a whole group of G responses before it knows whether the group is
informative. Screened, each drawn prompt first gets n responses. A prompt whose n values agree (by
``algo.filter_metric``) is dropped there, having cost n responses instead of G. A prompt whose n disagree is
informative whatever the other G - n say (a group with two different values never has a zero std), so it is
completed: its G - n responses go into the engine call that screens the next prompts, and the group of G is
graded, shaped and trained exactly as dynamic sampling's (advantages over all G). Every call of a step runs
with the step's one weights version, so no group mixes versions (SPEED-RL, arXiv 2506.09016, screens the same
way and runs one batch's continuation with the next batch's screening).

Per call: the continuations of the prompts screened in by the call before, and new prompts to screen while the
step is short of groups. A step's last call holds only continuations. Prompts screened in beyond what the step
needs are not completed (``surplus``: n responses spent, G - n saved). With ``algo.screen_audit`` = p, a share p
of the screened-out prompts, drawn with the call's seed, is completed as well and never trained on: how often
the whole group would have been informative, the signal screening gives up.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from dapo.algorithm.batch import RolloutBatch


@dataclass
class _Pending:
    example: object
    first: RolloutBatch  # its first n responses, graded
    audit: bool = False  # completed only to measure what screening gave up


@dataclass
class _Call:
    """One engine call: the continuations of ``pending``, then ``new`` prompts to screen."""

    pending: list[_Pending]
    new: list = field(default_factory=list)


def fill_screened(
    sampling, num_prompts: int, kept: list[RolloutBatch], *, round_seed, keep_rate_estimate: float, stats
) -> None:
    """Append to ``kept`` informative groups of G until it holds ``num_prompts`` (or the round cap stops new
    screening), screening each prompt with n responses first. ``sampling``: the step's ``DynamicSampling``, whose
    ``draw`` gives the prompts, ``sample`` makes each engine call and ``at_round_cap`` counts them; ``stats``: the
    step's CollectStats, whose ``screen`` gets this step's counts."""
    a, G = sampling.algo, sampling.sampling.n
    n = a.screen_samples
    call, capped = _Call(pending=[]), False
    while True:
        short = num_prompts - len(kept) - sum(not p.audit for p in call.pending)
        capped = capped or (short > 0 and sampling.at_round_cap(stats, num_prompts - short, num_prompts))
        if short > 0 and not capped:  # the cap stops new screening; what was screened in is still completed
            call.new = sampling.draw(short, keep_rate_estimate)
        if not call.new and not call.pending:
            return
        seed = round_seed(stats.rounds)
        examples = [p.example for p in call.pending] + call.new
        counts = [G - n] * len(call.pending) + [n] * len(call.new)
        part, gen_s = sampling.sample(examples, counts, seed, stats)
        rest = len(call.pending) * (G - n)
        dropped_tokens = _complete(sampling, call.pending, part.select_rows(list(range(rest))), kept, stats)
        # the new prompts' rows, n each (the call's part has group_size 1 where counts differ)
        screened = replace(part.select_rows(list(range(rest, len(part)))), group_size=n) if call.new else None
        nxt, screened_out_tokens = _screen(sampling, call.new, screened, short, seed, stats)
        dropped_tokens += screened_out_tokens
        stats.seconds_dropped += gen_s * dropped_tokens / max(int(part.response_lengths.sum()), 1)
        stats.tokens_in_dropped_groups += dropped_tokens
        call = _Call(pending=nxt)


def _complete(sampling, pending: list[_Pending], rest: RolloutBatch, kept: list, stats) -> int:
    """Join each pending prompt's first n responses with its G - n new ones: a group for training, or for the
    audit. Returns the tokens that will not be trained (the audit's)."""
    G, n = sampling.sampling.n, sampling.algo.screen_samples
    not_trained = 0
    for i, p in enumerate(pending):
        more = rest.select_rows(list(range(i * (G - n), (i + 1) * (G - n))))
        group = replace(RolloutBatch.concat([p.first, more]), group_size=G)
        informative = bool(sampling.informative(group, G)[0])
        if p.audit:
            stats.screen.audited += 1
            stats.screen.audit_informative += int(informative)
            tokens = int(more.response_lengths.sum())
            stats.screen.audit_tokens += tokens
            not_trained += tokens
            continue
        assert informative, "a group whose first responses disagree is informative"  # eq. 11 on a superset
        stats.screen.completed += 1
        kept.append(group)
    return not_trained


def _screen(sampling, new: list, part: RolloutBatch | None, short: int, seed: int, stats) -> tuple[list, int]:
    """Each new prompt's first n responses: screened out where they agree (some audited), pending completion
    where they disagree, up to the ``short`` groups the step still needs. Returns the pending prompts and the
    tokens of the screened-out prompts' responses."""
    if not new:
        return [], 0
    a, n = sampling.algo, sampling.algo.screen_samples
    passed = sampling.informative(part, n)  # (P,)
    acc = part.acc.view(-1, n).mean(dim=1)  # (P,)
    tokens = part.response_lengths.view(-1, n).sum(dim=1)  # (P,)
    audit = torch.rand(len(new), generator=torch.Generator().manual_seed(seed)) < a.screen_audit  # (P,)
    pending, out_tokens, s, to_train = [], 0, stats.screen, 0
    for i, example in enumerate(new):
        if passed[i] and to_train < short:
            pending.append(_Pending(example, part.select_groups([i])))
            to_train += 1
            continue
        out_tokens += int(tokens[i])
        if passed[i]:
            s.surplus += 1
            s.surplus_tokens += int(tokens[i])
            continue
        s.out_all_correct += int(acc[i] == 1)
        s.out_all_wrong += int(acc[i] == 0)
        s.out_tokens += int(tokens[i])
        if audit[i]:
            pending.append(_Pending(example, part.select_groups([i]), audit=True))
    s.screened += len(new)
    stats.count_groups(acc, passed)  # a screen's "group" is its first n responses
    return pending, out_tokens
