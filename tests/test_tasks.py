import itertools
import random
import re

import pytest

from dapo.data import arith


def independent_value(problem: str) -> int:
    """Sum of products, computed from the text with no code shared with the task."""
    expr = problem.rstrip("=")
    total, sign = 0, 1
    for term in re.findall(r"[+-]?[^+-]+", expr):
        if term[0] in "+-":
            sign, term = (1 if term[0] == "+" else -1), term[1:]
        else:
            sign = 1
        product = 1
        for factor in term.split("*"):
            product *= int(factor)
        total += sign * product
    return total


def test_independent_value_helper():
    assert independent_value("7+3*4-2=") == 17
    assert independent_value("2*3*4-5-6=") == 13


@pytest.mark.parametrize("difficulty", ["demo", "hard", "long"])
def test_solutions_are_right_and_each_line_is_one_reduction(difficulty):
    for ex in arith.make_examples("train", 300, seed=1, difficulty=difficulty):
        expected = independent_value(ex.prompt)
        assert ex.ground_truth == str(expected)
        lines = arith.solution(ex.prompt).split("\n")
        assert lines[-1] == f"Answer: {expected}"
        steps = [ex.prompt.rstrip("=")] + lines[:-1]
        n_ops = len(re.findall(r"[+*-]", steps[0]))
        assert len(steps) == n_ops + 1  # one operation removed per line
        for before, after in zip(steps, steps[1:]):
            assert independent_value(after) == expected
            assert len(re.findall(r"[+*-]", after)) == len(re.findall(r"[+*-]", before)) - 1
        assert steps[-1] == str(expected)


def test_reduction_order_is_multiplication_first_then_left_to_right():
    assert arith.solution("7+3*4-2=") == "7+12-2\n19-2\n17\nAnswer: 17"
    assert arith.solution("9-4+2=") == "5+2\n7\nAnswer: 7"
    assert arith.compute("2*3*4-5-6") == 13


def test_splits_disjoint_and_deterministic():
    for difficulty in ("demo", "hard"):
        train = arith.make_examples("train", 3000, difficulty=difficulty)
        test = arith.make_examples("test", 500, difficulty=difficulty)
        assert not {e.prompt for e in train} & {e.prompt for e in test}
        assert len({e.prompt for e in train}) == 3000 and len({e.uid for e in test}) == 500
        assert all(arith.split_of(e.prompt) == "test" for e in test)
        assert arith.make_examples("test", 500, difficulty=difficulty) == test
    other_seed = arith.make_examples("train", 50, seed=1)
    assert [e.prompt for e in other_seed] != [e.prompt for e in arith.make_examples("train", 50, seed=0)]
    assert {e.data_source for e in other_seed} == {"arith"}


@pytest.mark.parametrize("difficulty, lo, hi", [("demo", 6, 6), ("hard", 10, 24), ("long", 8, 12)])
def test_prompt_length_bounds(difficulty, lo, hi):
    lengths = [len(e.prompt) for e in arith.make_examples("test", 400, difficulty=difficulty)]
    assert lo <= min(lengths) and max(lengths) <= hi
    assert all(isinstance(e.prompt, str) and e.prompt.endswith("=") for e in arith.make_examples("test", 5))


def test_hard_responses_are_longer_and_some_exceed_64_characters():
    demo = [len(arith.solution(e.prompt)) for e in arith.make_examples("train", 500, difficulty="demo")]
    hard = [len(arith.solution(e.prompt)) for e in arith.make_examples("train", 500, difficulty="hard")]
    assert max(demo) <= 39  # with EOS, demo responses fit in 40 tokens of the character tokenizer
    assert sum(hard) / len(hard) > 2 * sum(demo) / len(demo)
    share_over_64 = sum(n >= 64 for n in hard) / len(hard)
    assert 0.2 < share_over_64 < 0.7


def test_long_problems_have_one_digit_operands_and_a_quarter_run_past_40_tokens():
    examples = arith.make_examples("train", 1000, seed=0, difficulty="long")
    operands = [arith.parse(e.prompt)[0] for e in examples]
    assert {len(n) for n in operands} == {4, 5, 6}
    assert all(1 <= x <= 9 for n in operands for x in n)
    assert all(0 <= int(e.ground_truth) <= 99 for e in examples)
    tokens = [len(arith.solution(e.prompt)) + 1 for e in examples]  # byte tokenizer: characters + EOS
    share_over_40 = sum(n > 40 for n in tokens) / len(tokens)
    assert 0.15 < share_over_40 < 0.4  # the ablation's 40-token limit truncates some correct solutions
    assert sorted(tokens)[len(tokens) // 2] < 36  # but most fit


def split_expr(line: str):
    tokens = re.findall(r"\d+|[+*-]", line)
    return [int(t) for t in tokens[0::2]], tokens[1::2]


def check_steps(problem: str, response: str) -> tuple[int, int]:
    """Checks each line rewrites the previous one at the right operation; returns (steps, slips)."""
    lines = response.split("\n")
    assert re.fullmatch(r"Answer: \d+", lines[-1]) and lines[-1] == f"Answer: {lines[-2]}"
    steps = slips = 0
    before = problem.rstrip("=")
    for after in lines[:-1]:
        nums, ops = split_expr(before)
        new_nums, new_ops = split_expr(after)
        i = ops.index("*") if "*" in ops else 0
        assert new_ops == ops[:i] + ops[i + 1 :]
        assert new_nums[:i] == nums[:i] and new_nums[i + 1 :] == nums[i + 2 :]
        steps += 1
        slips += new_nums[i] != independent_value(f"{nums[i]}{ops[i]}{nums[i + 1]}")
        before = after
    return steps, slips


def test_noisy_solution_slips_at_the_given_rate_and_continues_from_the_slip():
    rng = random.Random(0)
    problems = [e.prompt for e in arith.make_examples("train", 400, seed=2)]
    for p in problems:
        assert arith.noisy_solution(p, rng, 0.0) == arith.solution(p)
    totals = {}
    for rate in (1.0, 0.3):
        steps = slips = wrong_answers = 0
        for p in problems:
            response = arith.noisy_solution(p, rng, rate)
            s, k = check_steps(p, response)
            steps, slips = steps + s, slips + k
            wrong_answers += response.rsplit(" ", 1)[1] != str(independent_value(p))
            assert "\n-" not in "\n" + response  # no negative intermediate values
        totals[rate] = (slips / steps, wrong_answers / len(problems))
    # A slip is skipped only when every candidate would make a later value negative: rare.
    # Two slips can cancel out (+1 then -1), which leaves some answers right even at rate 1.
    assert totals[1.0][0] > 0.97 and totals[1.0][1] > 0.8
    assert 0.25 < totals[0.3][0] < 0.35
    assert 0.42 < totals[0.3][1] < 0.6  # two steps: 1 - 0.7 ** 2 = 0.51


def test_plausible_mistakes_are_close_or_one_digit_off():
    rng = random.Random(1)
    for value in (0, 7, 10, 42, 99, 365):
        for _ in range(50):
            wrong = arith.plausible_mistake(value, rng)
            assert wrong >= 0 and wrong != value
            digits_differ = sum(a != b for a, b in zip(str(wrong), str(value)))
            assert abs(wrong - value) <= 2 or (len(str(wrong)) == len(str(value)) and digits_differ == 1)


def _demo_space() -> list[str]:
    """Every "demo" problem, enumerated here without the task's code: three operands 1..9, two of
    + - *, kept when each value the worked solution writes (multiplication first, else left to
    right) stays within 0..99."""
    out = []
    for a, b, c in itertools.product(range(1, 10), repeat=3):
        for op1, op2 in itertools.product("+-*", repeat=2):
            if op2 == "*" and op1 != "*":  # b*c first, then a op1 (b*c)
                first = b * c
                values = [first, independent_value(f"{a}{op1}{first}=")]
            else:  # a op1 b first, then (a op1 b) op2 c
                first = independent_value(f"{a}{op1}{b}=")
                values = [first, independent_value(f"{first}{op2}{c}=")]
            if all(0 <= v <= 99 for v in values):
                out.append(f"{a}{op1}{b}{op2}{c}=")
    return out


def test_demo_split_sizes_and_over_asking():
    # The split sizes are counts of the enumerated space, split by the problem-text hash that
    # defines the splits (split_of; its disjointness is tested above).
    space = _demo_space()
    assert len(space) == len(set(space)) > 9**3  # most of the 9^3 * 3^2 = 6561 candidates pass
    n_train = sum(arith.split_of(p) == "train" for p in space)
    n_test = len(space) - n_train
    assert 0.7 < n_train / len(space) < 0.9  # one hash bucket of five is "test"
    train = arith.make_examples("train", n_train)
    test = arith.make_examples("test", n_test)
    assert {e.prompt for e in train} | {e.prompt for e in test} == set(space)
    assert len(train) == n_train and len(test) == n_test
    too_many = rf"'demo' train split has only {n_train} distinct problems, {n_train + 1} were asked"
    with pytest.raises(ValueError, match=too_many):
        arith.make_examples("train", n_train + 1)
    with pytest.raises(ValueError, match=rf"'demo' test split has only {n_test} distinct problems"):
        arith.make_examples("test", n_test + 1)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match=r"not an arith problem: '7\+\+2='"):
        arith.solution("7++2=")
    with pytest.raises(ValueError, match=r"not an arith problem"):
        arith.compute("__import__('os')")
    with pytest.raises(ValueError, match=r"unknown split 'dev'; choose one of \['train', 'test'\]"):
        arith.make_examples("dev", 3)
    with pytest.raises(ValueError, match=r"unknown arith difficulty 'easy'"):
        arith.make_examples("train", 3, difficulty="easy")
    with pytest.raises(ValueError, match="n must be a positive integer"):
        arith.make_examples("train", 0)
