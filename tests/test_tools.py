"""Multi-turn rollouts with the Python tool: token in, token out (its tokens in training:
tests/test_tools_training.py)."""

import pytest
import torch

from conftest import small_config
from dapo.algorithm.batch import RolloutBatch
from dapo.model import tiny
from dapo.rollout.base import Generation, SamplingParams
from dapo.rollout.multi_turn import ToolRollout
from dapo.tools import PythonTool, call_in
from dapo.tools.sandbox import Limits, Sandbox

needs_bwrap = pytest.mark.sandbox
TOK = tiny.build_tokenizer()  # one token per byte: a text's ids are its bytes + 2
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class ScriptedEngine:
    """Writes each row's next scripted turn, followed by what a real engine may add past a stop (the rest of a
    token, other text): the wrapper must cut it. Logs every request; log-prob of the k-th token sampled: -k/1000."""

    backend = "scripted"

    def __init__(self, script, tokenizer=TOK):
        self.script, self.requests, self.sampled, self.tok = script, [], 0, tokenizer

    def generate(self, prompt_ids, params):
        self.requests.append(([list(p) for p in prompt_ids], params))
        rows = [p for p in prompt_ids for _ in range(params.n)]
        responses, logps = [], []
        eos = self.tok.eos_token_id
        for i, prompt in enumerate(rows):
            text = self.script(prompt, i, len(self.requests) - 1)
            if text.endswith("<eos>"):
                out = self.tok.encode(text[:-5], add_special_tokens=False) + [eos]
            else:  # with what a real engine may sample past the stop, encoded together: must not be kept
                out = self.tok.encode(text + "JUNK", add_special_tokens=False)
            out = out[: params.max_new_tokens]
            responses.append(out)
            logps.append([-(self.sampled + k) / 1000 for k in range(len(out))])
            self.sampled += len(out)
        truncated = torch.tensor([len(r) >= params.max_new_tokens and r[-1] != eos for r in responses])
        texts = self.tok.batch_decode(responses, skip_special_tokens=True)
        return Generation(rows, responses, truncated, texts, logps)

    def update_weights(self, named_tensors):
        pass

    def sleep(self):
        pass

    def wake(self):
        pass


CALL = "Let me compute.\n```python\nprint(6 * 7)\n```\n"
OUT = "```output\n42\n```\n"


def tool_rollout(script, **kw):
    kw = {"max_turns": 4, "max_calls": 3, **kw}
    engine = ScriptedEngine(script)
    return ToolRollout(engine, TOK, PythonTool(Sandbox(Limits(wall_s=5.0, output_chars=64))), **kw), engine


def test_call_in_finds_the_block_the_text_ends_with():
    assert call_in(CALL) == "print(6 * 7)"
    assert call_in("```python\na = 1\nprint(a)\n```") == "a = 1\nprint(a)"
    assert call_in(CALL + "and then") is None  # the block is not the end: no call
    assert call_in("```text\nprint(1)\n```\n") is None  # not a python block
    assert call_in("```python\nprint(1)\n```\n" + OUT + "```python\nprint(2)\n```\n") == "print(2)"


@needs_bwrap
def test_a_call_runs_and_its_output_is_appended_as_tool_tokens_token_in_token_out():
    def script(prompt, row, call):
        return CALL if call == 0 else "So it is 42.<eos>"

    rollout, engine = tool_rollout(script)
    prompt = ids("Q: 6*7? ")
    gen = rollout.generate([prompt], SamplingParams(n=2, max_new_tokens=200, seed=3))
    expected = ids(CALL) + ids(OUT) + ids("So it is 42.") + [EOS]
    assert gen.response_ids == [expected, expected]
    assert gen.texts[0] == CALL + OUT + "So it is 42."
    assert gen.tool_mask[0] == [0] * len(ids(CALL)) + [1] * len(ids(OUT)) + [0] * (len(ids("So it is 42.")) + 1)
    assert not gen.truncated.any()
    # the second turn's prompts: the prompt ids + the response ids so far, exactly (never re-encoded text), n=1 each
    (first, p0), (second, p1) = engine.requests
    assert first == [prompt] and p0.n == 2 and p0.stop == ("\n```\n",)
    assert second == [prompt + ids(CALL) + ids(OUT)] * 2 and p1.n == 1
    assert p1.max_new_tokens == 200 - len(ids(CALL) + ids(OUT)) and p1.seed != p0.seed
    # the engine's log-probs kept on the model's tokens, in place; 0 (never read) on the tool's
    lp = gen.logprobs[0]
    n_call = len(ids(CALL))
    assert lp[:n_call] == [-k / 1000 for k in range(n_call)]
    assert lp[n_call : n_call + len(ids(OUT))] == [0.0] * len(ids(OUT))
    log = gen.tool_logs[0]
    assert (log.turns, log.calls, log.errors, log.timeouts, log.tool_tokens) == (2, 1, 0, 0, len(ids(OUT)))


@needs_bwrap
def test_errors_limits_and_blocks_that_are_not_calls():
    scripts = {
        0: ["```python\nprint(1 / 0)\n```\n", "Oops.<eos>"],
        1: ["```text\nnot code\n```\n", "Done.<eos>"],  # a closed non-python block: no call, no output
        2: [CALL, CALL, "x<eos>"],  # max_calls=1: the second call is told no calls are left
    }

    seen = {}

    def script(prompt, row, call):  # each row's next scripted turn, by its prompt ("P0: " ...)
        key = TOK.decode(prompt[:4])
        turn = seen[key] = seen.get(key, -1) + 1
        return scripts[int(key[1])][turn]

    prompts = [ids("P0: "), ids("P1: "), ids("P2: ")]
    rollout, _ = tool_rollout(script, max_calls=1)
    gen = rollout.generate(prompts, SamplingParams(n=1, max_new_tokens=300))
    assert gen.texts[0] == "```python\nprint(1 / 0)\n```\n```output\nZeroDivisionError: division by zero\n```\nOops."
    assert (gen.tool_logs[0].calls, gen.tool_logs[0].errors) == (1, 1)
    assert gen.texts[1] == "```text\nnot code\n```\nDone." and not any(gen.tool_mask[1])
    assert gen.tool_logs[1].calls == 0 and gen.tool_logs[1].turns == 2
    limit = "```output\nToolLimit: no tool calls left (1 per response)\n```\n"
    assert gen.texts[2] == CALL + OUT + CALL + limit + "x"
    assert gen.tool_logs[2].calls == 1


@needs_bwrap
def test_the_budget_counts_tool_tokens_and_the_last_turn_has_no_stop():
    def script(prompt, row, call):
        return CALL

    budget = len(ids(CALL)) + 5  # the output block does not fit: cut, and the response is truncated
    rollout, engine = tool_rollout(script)
    gen = rollout.generate([ids("Q")], SamplingParams(n=1, max_new_tokens=budget))
    assert gen.response_ids[0] == ids(CALL) + ids(OUT)[:5] and gen.truncated[0]
    assert gen.tool_mask[0][-5:] == [1] * 5
    rollout, engine = tool_rollout(script, max_turns=2)
    gen = rollout.generate([ids("Q")], SamplingParams(n=1, max_new_tokens=400))
    assert engine.requests[1][1].stop == ()  # the last turn: nothing stops it but EOS and the budget
    assert gen.response_ids[0] == ids(CALL) + ids(OUT) + ids(CALL) + ids("JUNK")  # kept as sampled


def test_concat_keeps_tool_masks_aligned_with_rows_that_have_none():
    def rows(tool_mask):
        return RolloutBatch.of_responses([[1]], [[5, 6, 7]], group_size=1, tool_mask=tool_mask)

    joined = RolloutBatch.concat([rows([]), rows([[0, 1, 0]])])
    assert joined.tool_mask == [[0, 0, 0], [0, 1, 0]]
    assert joined.response_mask().tolist() == [[1, 1, 1], [1, 0, 1]]
    assert joined.select_rows([1]).tool_mask == [[0, 1, 0]]
    assert RolloutBatch.concat([rows([]), rows([])]).tool_mask == []


def greedy_in_turns(engine, tokenizer, prompts, monkeypatch, max_new_tokens=24):
    """Greedy responses in one go, and again in turns cut at a stop text taken from them: with greedy decoding,
    continuing from the kept ids must give the very same tokens (token in, token out)."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    whole = engine.generate(prompts, params)
    stop = whole.texts[0][2:4]  # two characters the greedy response writes early
    assert stop and all(stop in t for t in whole.texts[:1])

    class GoOn:  # turns end at the stop text, and the environment appends nothing: the rows just go on
        def __init__(self):
            self.stop = (stop,)

        def step(self, response):
            return None

    turns = ToolRollout(engine, tokenizer, GoOn(), max_turns=4, max_calls=1).generate(prompts, params)
    return whole, turns


def test_hf_turns_continue_exactly_where_the_engine_stopped(monkeypatch):
    from pathlib import Path

    from dapo.model.loading import load_model_and_tokenizer
    from dapo.rollout.hf import HFRolloutEngine

    model, tokenizer = load_model_and_tokenizer(
        Path(__file__).resolve().parents[1] / "assets" / "arith-base", "float32", "cpu"
    )
    engine = HFRolloutEngine(model, tokenizer)
    prompts = [tokenizer(p)["input_ids"] for p in ("2+7*4=", "9=", "7-")]
    whole, turns = greedy_in_turns(engine, tokenizer, prompts, monkeypatch)
    assert turns.response_ids == whole.response_ids
    assert torch.equal(turns.truncated, whole.truncated)
    assert turns.tool_logs[0].turns >= 2  # it did stop at the text and went on
    assert not any(any(m) for m in turns.tool_mask)


class ArithToolUser(ScriptedEngine):
    """A 'model' that computes with the tool: turn 1 prints the problem's value, turn 2 answers with what the
    tool said (rows of even index) or one more (odd): half of each group right, half wrong."""

    def __init__(self):
        super().__init__(self.write)

    @staticmethod
    def write(prompt, row, call):
        text = TOK.decode(prompt)
        if "```output" not in text:
            return f"```python\nprint({text.split('=')[0]})\n```\n"
        value = int(text.split("```output\n")[-1].split("\n")[0])
        return f"Answer: {value + row % 2}<eos>"


class Lookup:
    """A user's own tool: a line ending in '?' is looked up in a table; 'bye' ends the response."""

    stop = ("?\n", "bye")

    def __init__(self, table):
        self.table, self.asked = table, []

    def step(self, response):
        from dapo.tools import DONE

        self.asked.append(response)
        if response.endswith("bye"):
            return DONE
        key = response.rsplit("\n", 2)[-2].rstrip("?")
        if key == "hang":
            import time

            time.sleep(3)
        return f"[{self.table[key]}]\n"  # a KeyError is the model's to see


def test_a_users_environment_gets_the_same_turns_masks_and_limits():
    scripts = {
        "A": ["x\nsize?\n", "it is 7 bye", "never written"],
        "B": ["colour?\n", "ok<eos>"],
        "C": ["weight?\n", "hm<eos>"],
        "D": ["hang?\n", "late<eos>"],
    }
    seen = {}

    def script(prompt, row, call):
        key = TOK.decode(prompt[:1])
        turn = seen[key] = seen.get(key, -1) + 1
        return scripts[key][turn]

    env = Lookup({"size": 7, "colour": "red and more"})  # cut to output_chars
    engine = ScriptedEngine(script)
    rollout = ToolRollout(engine, TOK, env, max_turns=3, max_calls=2, timeout_s=1.0, output_chars=6)
    gen = rollout.generate([ids(k) for k in "ABCD"], SamplingParams(n=1, max_new_tokens=100))
    assert gen.texts[0] == "x\nsize?\n[7]\nit is 7 bye" and not gen.truncated[0]  # DONE ends it, not truncated
    assert gen.tool_mask[0] == [0] * 8 + [1] * 4 + [0] * 11
    assert gen.texts[1] == "colour?\n[red a" + "ok"  # 6 characters of "[red and more]\n"
    assert gen.texts[2] == "weight?\n```output\nKeyError: 'weight'\n```\nhm" and gen.tool_logs[2].errors == 1
    assert (
        gen.texts[3].startswith("hang?\n```output\nTimeoutError: the tool ran past 1 s") and gen.tool_logs[3].timeouts
    )
    assert engine.requests[1][0][0] == ids("A") + ids("x\nsize?\n[7]\n")  # token in: prompt + ids so far
    rollout.close()


@needs_bwrap
def test_dapo_eval_with_the_tool_and_the_tool_template(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import json

    import dapo.rollout.build
    from dapo.cli import main
    from dapo.data.prompts import TOOL_PROMPT_SUFFIX

    prompts = []

    class Recorded(ArithToolUser):
        @staticmethod
        def write(prompt, row, call):
            text = TOK.decode(prompt)
            prompts.append(text)
            return ArithToolUser.write(
                TOK.encode(text.replace(TOOL_PROMPT_SUFFIX, ""), add_special_tokens=False), row, call
            )

    monkeypatch.setattr(dapo.rollout.build, "engine_on", lambda *a, **k: Recorded())
    bench = tmp_path / "mini.jsonl"
    bench.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in (("2+3=", "5"), ("4*2=", "8"))))
    out = tmp_path / "out"
    args = ["eval", "--model", str(tiny_model_dir), f"eval.benchmarks=[{bench}]", "eval.n=2", "reward.grader=arith"]
    args += ["data.template=tool", "tools.python=true", "eval.max_response_tokens=200", "--out", str(out)]
    assert main(args) == 0
    assert prompts[0] == "2+3=" + TOOL_PROMPT_SUFFIX
    assert json.loads((out / "eval.json").read_text())["mini"]["avg"] == 0.5  # the even rows answer what it printed
    responses = [json.loads(x) for x in (out / "mini.responses.jsonl").read_text().splitlines()]
    assert responses[0]["response"] == "```python\nprint(2+3)\n```\n```output\n5\n```\nAnswer: 5"
    assert [r["tool_calls"] for r in responses] == [1, 1, 1, 1]
    tools = json.loads((out / "eval.json").read_text())["mini"]["tools"]  # every response called; the even ones helped
    assert tools == {
        "tool_call_frac": 1.0,
        "tool_helped_frac": 0.5,
        "tool_errors_per_call": 0.0,
        "acc_with_tool_call": 0.5,
    }


def test_held_out_tool_use_figures_on_hand_counted_responses():
    from dapo.evaluation import tool_use

    # 5 responses: two called and were right, one called twice (one error) and was wrong, two did not call (one right)
    calls, errors, accs = [1, 1, 2, 0, 0], [0, 0, 1, 0, 0], [True, True, False, True, False]
    assert tool_use(calls, errors, accs) == {
        "tool_call_frac": 3 / 5,
        "tool_helped_frac": 2 / 5,
        "tool_errors_per_call": 1 / 4,
        "acc_with_tool_call": 2 / 3,
        "acc_without_tool_call": 1 / 2,
    }


@needs_bwrap
def test_the_real_smollm2_tokenizer_cuts_at_the_fence_and_encodes_only_the_output_block():
    from pathlib import Path

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(__file__).parent / "assets" / "smollm2-tokenizer")
    call = "Let's compute it.\n```python\nx = 17 * 23 + 4\nprint(x)\n```\n"

    def script(prompt, row, turn):
        return call if turn == 0 else "So the answer is 395.\nAnswer: 395<eos>"

    engine = ScriptedEngine(script, tok)
    rollout = ToolRollout(engine, tok, PythonTool(Sandbox()), max_turns=3, max_calls=2)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "17*23+4?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok.encode(text, add_special_tokens=False)
    gen = rollout.generate([prompt], SamplingParams(n=1, max_new_tokens=200))
    sampled = engine.requests  # what the engine was given back: the prompt and the ids it sampled, as sampled
    first_turn = tok.encode(call + "JUNK", add_special_tokens=False)
    kept = gen.response_ids[0][: gen.tool_mask[0].index(1)]  # the first turn, as the response holds it
    assert kept == first_turn[: len(kept)] and tok.decode(kept) == call  # cut after the fence's token
    block = tok.encode("```output\n395\n```\n", add_special_tokens=False)
    assert gen.response_ids[0][len(kept) : len(kept) + len(block)] == block  # the output block, encoded alone
    assert gen.tool_mask[0] == [0] * len(kept) + [1] * len(block) + [0] * (
        len(gen.response_ids[0]) - len(kept) - len(block)
    )
    assert sampled[1][0] == [prompt + kept + block]  # the next turn: ids in, never re-encoded text
    assert gen.texts[0] == call + "```output\n395\n```\nSo the answer is 395.\nAnswer: 395"


def test_tools_with_a_tensor_parallel_engine_are_refused_in_one_line(tmp_path, tiny_model_dir):
    from types import SimpleNamespace

    from dapo.config import ConfigError
    from dapo.rollout.build import training_engine

    cfg = small_config(tmp_path, tiny_model_dir, "tools.python=true", "rollout.backend=vllm")
    cfg.rollout.tensor_parallel_size = 2
    dist = SimpleNamespace(sharded=True, world_size=2, rank=0)
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=2 with tools: .* use rollout.tensor_parallel"):
        training_engine(cfg, None, dist)


def test_the_python_api_trains_with_a_users_environment(tiny_model_dir, tmp_path, monkeypatch):
    import dapo.rollout.build
    from dapo import api

    class AskOnce(ScriptedEngine):  # asks the table once, then answers with what it was told (or one more)
        def __init__(self):
            super().__init__(self.write)

        @staticmethod
        def write(prompt, row, call):
            text = TOK.decode(prompt)
            if "[" not in text:
                return f"{text.split('=')[0]}?\n"
            return f"Answer: {int(text.rsplit('[', 1)[1].split(']')[0]) + row % 2}<eos>"

    class Calculator:  # a user's tool: the line before '?' is an arith expression of the built-in task
        stop = ("?\n",)

        def step(self, response):
            from dapo.data import arith

            return f"[{arith.compute(response.rsplit(chr(10), 2)[-2].rstrip('?') + '=')}]\n"

    monkeypatch.setattr(dapo.rollout.build, "engine_on", lambda *a, **k: AskOnce())
    cfg = small_config(tmp_path, tiny_model_dir, "rollout.max_response_tokens=32", "train.total_steps=1")
    result = api.train(cfg, tool_env=Calculator())
    (m,) = [r for r in result.history if "tools/calls_per_response" in r]
    assert m["tools/calls_per_response"] == 1.0 and m["tools/errors_per_response"] == 0.0
    assert m["reward/acc_mean"] == 0.5 and m["tools/tokens_masked"] > 0
