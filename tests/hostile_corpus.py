"""Hostile and pathological model responses for the graders.

Each entry is (name, response). Responses that try to run a command target `sentinel`, a path the
test checks is never created. None of them is a correct answer to the ground truth `TRUTH`.
"""

from __future__ import annotations

TRUTH = "42"
MB = 1_000_000


def hostile_responses(sentinel: str = "/tmp/pwned") -> list[tuple[str, str]]:
    s = sentinel
    deep = 10_000
    corpus = [
        # --- code injection: python --------------------------------------------------------
        ("py_import_system", f"Answer: __import__('os').system('touch {s}')"),
        ("py_import_system_boxed", f"\\boxed{{__import__('os').system('touch {s}')}}"),
        ("py_exec", f"Answer: exec(\"import os; os.system('touch {s}')\")"),
        ("py_eval_compile", f"Answer: eval(compile('open(\"{s}\", \"w\")', 'x', 'exec'))"),
        ("py_lambda", f"Answer: (lambda: __import__('os').system('touch {s}'))()"),
        ("py_open_write", f"Answer: open('{s}', 'w').write('1')"),
        ("py_subclasses", "Answer: ().__class__.__mro__[-1].__subclasses__()"),
        ("sympy_attr", "\\boxed{x.__class__.__init__.__globals__}"),
        ("sympy_function_call", f"Answer: Function('system')('touch {s}')"),
        ("pickle_payload", f"Answer: cos\nsystem\n(S'touch {s}'\ntR."),
        ("format_string", "Answer: {0.__class__.__mro__}%s%s%n"),
        # --- code injection: shell -----------------------------------------------------------
        ("shell_subst_rm", "Answer: $(rm -rf /)"),
        ("shell_subst_touch", f"Answer: $(touch {s})"),
        ("shell_backticks", f"Answer: `touch {s}`"),
        ("shell_semicolon", f"Answer: 1; touch {s}; echo 1"),
        # --- code injection: LaTeX -----------------------------------------------------------
        ("latex_input", "Answer: \\input{/etc/passwd}"),
        ("latex_input_boxed", "\\boxed{\\input{/etc/passwd}}"),
        ("latex_write18", f"Answer: \\immediate\\write18{{touch {s}}}"),
        ("latex_write18_boxed", f"\\boxed{{\\write18{{touch {s}}}}}"),
        ("latex_include_catcode", "\\boxed{\\catcode`\\{=12 \\include{/etc/shadow}}"),
        ("latex_def_loop", "\\boxed{\\def\\x{\\x\\x}\\x}"),
        *size_and_encoding_attacks(deep),
    ]
    names = [name for name, _ in corpus]
    assert len(names) == len(set(names)), "duplicate corpus names"
    return corpus


def size_and_encoding_attacks(deep: int) -> list[tuple[str, str]]:
    """Huge numbers, sizes and nestings, backtracking bait and odd encodings: what must end within the time limit."""
    return [
        # --- enormous numbers -------------------------------------------------------------
        ("pow_python_tower", "Answer: 9**9**9**9"),
        ("pow_python_tower_boxed", "\\boxed{9**9**9**9}"),
        ("pow_latex_tower", "\\boxed{10^{10^{10^{10}}}}"),
        ("pow_latex_tower_9", "The answer is $\\boxed{9^{9^{9^{9}}}}$"),
        ("pow_latex_tower_2", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}"),
        ("pow_latex_right_assoc", "\\boxed{2^3^4^5^6}"),
        ("pow_huge_exponent", "\\boxed{10^{1000000000}}"),
        ("pow_braced_tower", "\\boxed{10^{{10}^{10}}}"),
        ("factorial_million", "\\boxed{1000000!}"),
        ("factorial_expr", "\\boxed{(10^{10})!}"),
        ("factorial_answer_line", "Answer: 1000000!"),
        ("double_factorials", "\\boxed{10!!!!!!!!!!}"),
        ("exp_tower", "\\boxed{e^{e^{e^{e^{e}}}}}"),
        ("sum_huge", "\\boxed{\\sum_{n=1}^{10^{10}} n}"),
        ("product_huge", "\\boxed{\\prod_{k=1}^{10^{9}} k}"),
        ("binomial_huge", "\\boxed{\\binom{1000000000}{500000000}}"),
        ("product_shifted", "\\boxed{\\prod_{k=1}^{10^{9}} (k+1)}"),
        ("sum_factorials", "\\boxed{\\sum_{n=1}^{10^{10}} n!}"),
        ("gamma_huge", "\\boxed{\\Gamma(10^{100})}"),
        ("pow_of_pow", "\\boxed{(10^{100000})^{100000}}"),
        ("pi_tower", "\\boxed{\\pi^{\\pi^{\\pi^{\\pi}}}}"),
        ("float_overflow", "Answer: 1e999999999"),
        ("inf_nan", "\\boxed{\\infty - \\infty} Answer: nan"),
        ("divide_by_zero", "\\boxed{\\frac{1}{0}}"),
        # --- size and nesting -------------------------------------------------------------
        ("nested_braces_10k", "\\boxed{" + "{" * deep + "1" + "}" * deep + "}"),
        ("nested_parens_10k", "Answer: " + "(" * deep + "1" + ")" * deep),
        ("nested_frac_5k", "\\boxed{" + "\\frac{1}{" * 5000 + "2" + "}" * 5000 + "}"),
        ("nested_sqrt_5k", "\\boxed{" + "\\sqrt{" * 5000 + "2" + "}" * 5000 + "}"),
        ("digits_1mb_answer", "Answer: " + "9" * MB),
        ("digits_1mb_boxed", "\\boxed{" + "7" * MB + "}"),
        ("digits_1mb_bare", "3" * MB),
        ("unterminated_boxed", "so the result is \\boxed{\\frac{1}{2"),
        ("unterminated_boxed_long", "\\boxed{" + "1" * 5000),
        ("many_boxes", "\\boxed{1}" * 100_000),
        ("many_answer_lines", "Answer:\n" * 100_000),
        ("answer_then_spaces", "Answer:" + " " * MB),
        ("answer_no_colon", "answer " * 100_000),
        ("dollars_1mb", "$" * MB),
        ("text_open_50k", "\\text{" * 50_000),
        ("frac_repeated", "Answer: " + "frac" * 100_000),
        ("equals_1mb", "Answer: " + "=" * MB),
        ("long_answer_line", "Answer: " + "x+" * 10_000 + "1"),
        ("big_matrix", "\\boxed{\\begin{pmatrix}" + "\\\\".join(["&".join(["x"] * 20)] * 20) + "\\end{pmatrix}}"),
        # --- inputs that make careless regexes backtrack (each within one grader's tail) ----
        ("regex_caret_spaces", "\\boxed{^" + " " * 990 + "x}"),
        ("regex_paren_carets", "\\boxed{(" + "^" * 990 + "}"),
        ("regex_digits_no_bang", "\\boxed{" + "1" * 990 + "x}"),
        ("regex_dollar_run", "Answer: $" + "a" * 290),
        ("regex_spaces_then_x", "Answer: 1" + " " * 280 + "x"),
        # --- encoding oddities ------------------------------------------------------------
        ("lone_surrogate", "Answer: \ud800"),
        ("lone_surrogate_boxed", "\\boxed{\udfff\ud800}"),
        ("nul_bytes", "Answer: 4\x002"),
        ("nul_1mb", "\x00" * MB),
        ("fullwidth_digits", "Answer: \uff14\uff12\uff10"),
        ("rtl_override", "Answer: \u202e24"),
        ("zero_width", "Answer: 4\u200b2\u200b0"),
        ("combining_marks", "Answer: 1" + "\u0301" * 100_000),
        ("empty", ""),
        ("whitespace_only", " \n\t" * 1000),
    ]


def prescreen_worst_inputs(n: int) -> list[str]:
    """Texts of about `n` characters shaped to make the `math` grader's own regexes backtrack
    (overlapping `\\s*` runs, nested scans); `n` is the grader's tail length less a little."""
    return [
        "^" + " " * n,
        "^" + " " * (n - 1) + "x",
        "(" + "^" * n,
        "{" + "^" * n,
        "(" * (n // 2) + "^" * (n // 2),
        "1" * n + "x",
        ")" + " " * (n - 1) + "^",
        "(" + ")^" * (n // 2),
        "^1" + "." * (n - 1),
        "**" + " " * n,
        "\\binom" + "a" * (n - 6),
        "1" + " " * (n - 1) + "x",
        "$" + " " * n,
        "\\frac{" + " " * n,
    ]
