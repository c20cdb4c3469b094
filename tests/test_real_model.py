"""Real models: a real tokenizer (SmolLM2's, shipped under tests/assets), GGUF import, and a run
that learns nothing still ending with its evaluation and checkpoint.

The SmolLM2 tokenizer is what real instruct models look like and the built-in byte tokenizer is
not: a 49,152-token vocabulary, ``<|im_end|>`` as both EOS and pad, a chat template that adds a
default system prompt. Tests that need the 135M model's weights run only where ``make smollm2``
has put them in the cache.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console

from dapo.algorithm.batch import RolloutBatch
from dapo.data.prompts import Example, render_prompt
from dapo.rollout.base import SamplingParams, split_response

REPO = Path(__file__).resolve().parents[1]
SMOL_TOKENIZER = REPO / "tests" / "assets" / "smollm2-tokenizer"
SMOL_CACHE = Path("~/.cache/dapo/models").expanduser()
SMOL_MODEL = SMOL_CACHE / "SmolLM2-135M-Instruct"
SMOL_GGUF = SMOL_CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_END = 2  # <|im_end|>: EOS and pad
# the real 135M model in the tests costs minutes on 2 cores, and tiny models of the same architecture check the same
# paths in make test: these run with `make test-real` (DAPO_REAL_MODEL_TESTS=1)
REAL_MODEL_TESTS = os.environ.get("DAPO_REAL_MODEL_TESTS") == "1"
needs_smollm2 = pytest.mark.skipif(
    not REAL_MODEL_TESTS or not (SMOL_MODEL / "config.json").exists(),
    reason="the real SmolLM2-135M-Instruct: `make test-real` (after `make smollm2`)",
)


def smol_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOL_TOKENIZER, trust_remote_code=False)


def build_tiny(arch: str, path: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A small randomly initialised model of ``arch`` (llama | qwen2) with SmolLM2's real tokenizer.
    Heads are 32 wide: vLLM's CPU attention has kernels for 32 and up."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    tok = smol_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=IM_END,
        pad_token_id=IM_END,
        tie_word_embeddings=True,
    )
    config = LlamaConfig(**common, head_dim=32) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=IM_END, pad_token_id=IM_END, bos_token_id=tok.bos_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------
# the real tokenizer


def test_smollm2_tokenizer_facts():
    tok = smol_tokenizer()
    assert len(tok) == 49152
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.eos_token_id == tok.pad_token_id == IM_END


def test_rendered_prompt_has_default_system_prompt_and_generation_prompt():
    tok = smol_tokenizer()
    ex = Example(uid="0", prompt="Tom has 3 apples. How many?", ground_truth="3", data_source="w")
    text = render_prompt(ex, tok)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nTom has 3 apples. How many?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_long_prompt_is_cut_from_the_left():
    from dapo.data.prompts import make_encoder

    tok = smol_tokenizer()
    ex = Example(
        uid="0",
        prompt="Tom has many apples. " * 100 + "How many apples does Tom have?",
        ground_truth="1",
        data_source="w",
    )
    full = tok(render_prompt(ex, tok), add_special_tokens=False)["input_ids"]
    cut = make_encoder(tok, 40)(ex)
    assert len(full) > 400 and len(cut) == 40
    assert cut == full[-40:]  # the question and the assistant turn's opening survive
    assert tok.decode(cut).endswith("How many apples does Tom have?<|im_end|>\n<|im_start|>assistant\n")


def test_eos_equal_to_pad_is_kept_once_and_trained():
    """generate pads finished rows with pad == EOS: the response ends at the first EOS, which is
    kept (and trained on: the model must learn to stop), and nothing after it is."""
    assert split_response([17, 42, IM_END, IM_END, IM_END], {IM_END}, 5) == ([17, 42, IM_END], False)
    assert split_response([IM_END, IM_END], {IM_END}, 2) == ([IM_END], False)  # an empty answer still has its EOS
    assert split_response([17, 42, 43], {IM_END}, 3) == ([17, 42, 43], True)  # truncated: no EOS to train
    responses = [[17, 42, IM_END], [IM_END], [17, 42, 43]]
    batch = RolloutBatch.of_responses([[1]] * 3, responses, group_size=3, truncated=torch.tensor([False, False, True]))
    mask = batch.response_mask()  # (3, 3)
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 1]]
    assert batch.response_lengths.tolist() == [3, 1, 3]


def test_hf_rollout_on_real_tokenizer_masks_by_length_not_by_pad(tmp_path):
    """A tiny Llama with the real tokenizer, made to stop early: every stopped row ends with exactly
    one EOS, truncated rows have none, and the mask covers each row's tokens, EOS included."""
    from dapo.model.loading import load_model_and_tokenizer
    from dapo.rollout.hf import HFRolloutEngine

    model, tok = load_model_and_tokenizer(build_tiny("llama", tmp_path / "m"))
    bias = torch.zeros(len(tok))
    bias[IM_END] = 8.0  # EOS about 6% likely at each token: about half of the rows stop within 12 tokens
    model.lm_head.register_forward_hook(lambda m, i, out: out + bias.to(out.dtype))
    engine = HFRolloutEngine(model, tok)
    assert engine.eos_ids == {IM_END} and engine.pad_id == IM_END
    ex = Example(uid="0", prompt="Ben has 4 cards and buys 3 more. How many cards?", ground_truth="7", data_source="w")
    prompt = tok(render_prompt(ex, tok), add_special_tokens=False)["input_ids"]
    gen = engine.generate([prompt], SamplingParams(n=16, temperature=1.0, max_new_tokens=12, seed=3))
    stopped = [r for r, t in zip(gen.response_ids, gen.truncated.tolist()) if not t]
    assert 0 < len(stopped) < 16
    for ids, trunc in zip(gen.response_ids, gen.truncated.tolist()):
        assert ids.count(IM_END) == (0 if trunc else 1) and (trunc or ids[-1] == IM_END)
        assert trunc == (len(ids) == 12 and IM_END not in ids)
    batch = RolloutBatch.from_generation(gen, group_size=16)
    assert batch.response_mask().sum(dim=1).tolist() == [len(r) for r in gen.response_ids]


def test_eos_comes_from_generation_config_else_tokenizer(tmp_path):
    from dapo.model.loading import load_model_and_tokenizer
    from dapo.rollout.hf import HFRolloutEngine

    model, tok = load_model_and_tokenizer(build_tiny("qwen2", tmp_path / "m"))
    model.generation_config.eos_token_id = [IM_END, 0]  # a list, as several instruct models ship it
    assert HFRolloutEngine(model, tok).eos_ids == {IM_END, 0}
    model.generation_config.eos_token_id = None
    assert HFRolloutEngine(model, tok).eos_ids == {tok.eos_token_id} == {IM_END}


# ---------------------------------------------------------------------------------------------
# GGUF import


def _permute_for_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """GGUF's Llama q/k layout: within each head the two rotary halves are interleaved row by row
    (transformers' GGUF reader undoes exactly this)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, tokenizer_dir: Path, path: Path) -> None:
    """Write ``model`` (a transformers Llama) and the tokenizer in ``tokenizer_dir`` as a float32 GGUF."""
    import gguf

    c = model.config
    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tj["added_tokens"] if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(IM_END)
    w.add_pad_token_id(IM_END)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template((tokenizer_dir / "chat_template.jinja").read_text())
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q = _permute_for_gguf(torch.from_numpy(sd[p + "self_attn.q_proj.weight"]), c.num_attention_heads).numpy()
        k = _permute_for_gguf(torch.from_numpy(sd[p + "self_attn.k_proj.weight"]), c.num_key_value_heads).numpy()
        for name, value in [
            ("attn_norm", sd[p + "input_layernorm.weight"]),
            ("attn_q", q),
            ("attn_k", k),
            ("attn_v", sd[p + "self_attn.v_proj.weight"]),
            ("attn_output", sd[p + "self_attn.o_proj.weight"]),
            ("ffn_norm", sd[p + "post_attention_layernorm.weight"]),
            ("ffn_gate", sd[p + "mlp.gate_proj.weight"]),
            ("ffn_up", sd[p + "mlp.up_proj.weight"]),
            ("ffn_down", sd[p + "mlp.down_proj.weight"]),
        ]:
            w.add_tensor(f"blk.{i}.{name}.weight", value)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_import_gguf_round_trips_logits_and_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.model.loading import import_gguf

    src_dir = build_tiny("llama", tmp_path / "src", hidden=64, layers=2, seed=5)
    original = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    gguf_path = tmp_path / "tiny.gguf"
    write_llama_gguf(original, SMOL_TOKENIZER, gguf_path)
    out = import_gguf(gguf_path, tmp_path / "out")
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in out.iterdir()
    }
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == IM_END
    imported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 520, 7000, 33, 49000, 2, 15]])
    with torch.no_grad():
        a, b = original(ids).logits, imported(ids).logits  # (1, 7, V)
    assert (a - b).abs().max().item() < 1e-5  # q/k un-permuted, tied head, norms: the same function
    tok, ref = AutoTokenizer.from_pretrained(out), smol_tokenizer()
    text = "Mia has 12 stamps. She gives 5 to Ben.\nHow many are left?"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    assert tok.eos_token_id == tok.pad_token_id == IM_END
    msgs = [{"role": "user", "content": "2+2?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_import_model_cli_errors_in_one_line(tmp_path, capsys):
    """`dapo import-model`'s refusals, through the command's own entry point (the console script's process, one line
    and exit code 2 for any command's error: tests/test_cli.py)."""
    from dapo import cli

    def run(*args) -> tuple[int, str]:
        code = cli.main(["import-model", *map(str, args)])
        return code, capsys.readouterr().err

    code, err = run(tmp_path / "nope.gguf", tmp_path / "out")
    assert code == 2 and err.strip().startswith("error:") and "no such GGUF file" in err
    assert len(err.strip().splitlines()) == 1
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    code, err = run(tmp_path / "x.gguf", tmp_path / "full")
    assert code == 2 and "not empty" in err and (tmp_path / "full" / "keep.txt").read_text() == "mine"


@pytest.mark.skipif(
    not REAL_MODEL_TESTS or not SMOL_GGUF.exists(),
    reason="the real SmolLM2 GGUF: `make test-real` (after `make smollm2`)",
)
def test_import_real_smollm2_gguf(tmp_path):
    """The real 4-bit file: the written model computes what transformers' own GGUF load computes."""
    from transformers import AutoModelForCausalLM

    from dapo.model.loading import import_gguf

    out = import_gguf(SMOL_GGUF, tmp_path / "smol")
    direct = AutoModelForCausalLM.from_pretrained(SMOL_GGUF.parent, gguf_file=SMOL_GGUF.name, dtype=torch.float32)
    imported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 9690, 198, 20, 30, 2]])
    with torch.no_grad():
        assert (direct(ids).logits - imported(ids).logits).abs().max().item() < 1e-5
    assert imported.config.vocab_size == 49152 and imported.config.model_type == "llama"


QWEN_CODER_GGUF = SMOL_CACHE / "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
QWEN_CODER = SMOL_CACHE / "Qwen2.5-Coder-0.5B-Instruct"


@pytest.mark.skipif(
    not (QWEN_CODER_GGUF.exists() and (QWEN_CODER / "config.json").exists()),
    reason="Qwen2.5-Coder-0.5B-Instruct is not cached: run `make qwen-coder`",
)
def test_imported_qwen_coder_is_its_gguf(tmp_path):
    """`make qwen-coder`'s directory computes what transformers' own load of the Q4_K_M GGUF computes
    (Q5_0/Q4_K/Q6_K/Q8_0 blocks de-quantised, attention biases, the untied Q8_0 head), and renders
    Qwen's chat template with its default system prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    imported = AutoModelForCausalLM.from_pretrained(QWEN_CODER, dtype=torch.float32)
    assert (imported.config.model_type, imported.config.num_hidden_layers, imported.config.vocab_size) == (
        "qwen2",
        24,
        151936,
    )
    assert not imported.config.tie_word_embeddings
    assert sum(p.numel() for p in imported.parameters()) == 630_167_424  # 494M + the untied 136M head
    tok = AutoTokenizer.from_pretrained(QWEN_CODER)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 6 * 7?"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        mine = imported(torch.tensor([ids])).logits
    del imported
    direct = AutoModelForCausalLM.from_pretrained(
        QWEN_CODER_GGUF.parent, gguf_file=QWEN_CODER_GGUF.name, dtype=torch.float32
    )
    with torch.no_grad():
        assert (direct(torch.tensor([ids])).logits - mine).abs().max().item() < 1e-4
    assert tok.decode(mine[0, -1].argmax().item()).strip()  # a real next token, not padding


# ---------------------------------------------------------------------------------------------
# a run that finds nothing to learn from still finishes properly


def test_steps_without_informative_groups_still_log_evaluate_and_save(tmp_path, tiny_model_dir):
    """A random model is wrong on every arith problem: every group is all wrong, no step trains,
    yet every step is logged, the last one evaluates and checkpoints, and the run says what to change."""
    from conftest import small_config
    from dapo.checkpoint import latest_checkpoint
    from dapo.reporting.run_log import read_metrics
    from dapo.training import train

    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        "train.total_steps=4",
        "algo.dynamic_sampling=true",
        "algo.max_gen_rounds=1",
        "run.save_every=null",
    )
    out = io.StringIO()
    train(cfg, console=Console(file=out, width=400))
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["sampling/all_wrong_frac"] == 1.0 and r["sampling/groups_kept"] == 0 for r in rows)
    assert "eval/arith/avg@2" in rows[-1] and not any("eval/arith/avg@2" in r for r in rows[:-1])
    assert latest_checkpoint(cfg.run_dir).name == "step_000004"
    text = out.getvalue()
    advice = [line for line in text.splitlines() if "in a row" in line]
    assert advice == [
        "no informative group for 3 steps in a row: 100% of groups all wrong, 0% all right; the data is "
        "too hard for this model: use easier problems, a larger group (rollout.group_size=4) or longer "
        "responses (rollout.max_response_tokens=16)"
    ]
    shutil.rmtree(cfg.run_dir)


def test_word_problems_route_to_the_number_grader():
    from dapo.evaluation import load_benchmark
    from dapo.rewards import grade, grader_for

    bench, examples = load_benchmark("word", template="raw", num_problems=3)
    assert (bench.n, bench.temperature, bench.max_response_tokens) == (4, 0.7, 96) and len(examples) == 3
    assert grader_for("word_problems") == grader_for("word") == "gsm8k"
    assert examples[0].prompt.endswith("\nReply with the final answer as a number.")
    assert grade("There are 8 x 7 = 56 marbles in total.", "56", "gsm8k").acc
    assert not grade("8 jars, so the answer is 15. Wait, 8 + 7", "56", "gsm8k").acc
