"""Models in and out of the project: loading Hugging Face model directories, and GGUF files to them.

``load_model_and_tokenizer`` reads a model directory, or a Hugging Face Hub model through the Hugging Face cache
(``model_dir``, dapo.model.directory: checked first, a broken one stopped in one line);
``weightless_model`` builds its architecture without weights, for an engine that reads them itself.
``dapo import-model SRC.gguf OUT_DIR`` reads any GGUF whose architecture transformers can load
(Llama, Qwen2, Mistral, ...) with transformers' own GGUF reader, de-quantises it, and writes a
directory every other part of the project (and vLLM) reads: safetensors weights, config,
generation config, tokenizer and chat template.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from dapo.model.directory import check_tokenizer, model_dir, no_tokenizer, tokenizer_files
from dapo.runtime.files import readable_as_umask

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # float16: refused (dapo.config.rules.REFUSED_CHOICES)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device=cuda but no CUDA device is visible; use model.device=cpu")
    return torch.device(name)


def load_tokenizer(path: str | Path, *, revision: str | None = None, trust_remote_code: bool = False):
    """A model's tokenizer (``path``, ``revision``: as ``model_dir`` takes them), padding with EOS where it has no
    pad token (as every part of a run sees it)."""
    from transformers import AutoTokenizer

    directory = model_dir(path, revision)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (ValueError, OSError) as e:
        # without tokenizer files some tokenizer classes (Llama's) try to convert a slow tokenizer and fail there
        if not tokenizer_files(directory):
            raise no_tokenizer(directory, str(path)) from e
        raise
    check_tokenizer(tokenizer, directory, str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_and_tokenizer(
    path: str | Path,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    keep_dropout: bool = False,
):
    """A model's tokenizer and causal LM (``path``, ``revision``: a model directory, or a hub model at a revision,
    as ``model_dir`` takes them). Python files it ships (config.json's auto_map) run
    only with ``trust_remote_code``; said explicitly, because left unset transformers asks on the
    terminal, where a stray 'y' (or a pipe) runs them. Dropout is switched off (``disable_dropout``)
    unless ``keep_dropout``."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path, revision=revision, trust_remote_code=trust_remote_code)
    directory = model_dir(path, revision)  # resolved once: the same directory as the tokenizer's
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    if not keep_dropout:
        disable_dropout(model)
    return model.to(device), tokenizer


def _is_dropout_name(name: str) -> bool:
    return "dropout" in name or "pdrop" in name


def _configs(config) -> list[tuple[tuple[str, ...], object]]:
    """A config and every sub-config inside it (a multimodal model's text_config, ...), with its key path."""
    from transformers import PretrainedConfig

    return [((), config)] + [((k,), v) for k, v in vars(config).items() if isinstance(v, PretrainedConfig)]


def disable_dropout(model) -> None:
    """Switch off every dropout of ``model``: ``nn.Dropout`` modules, the probabilities attention layers copy
    from the config, and the config's own (some forwards read it as they run).

    RL compares the log-probs of the same tokens under two passes (the ratio pi / pi_old, the engine's
    against the trainer's): with dropout on, each pass draws its own mask and the ratio is noise. The
    reference trains with dropout off. Saved checkpoints keep the config's own values
    (``checkpoint.restore_dropout``)."""
    saved = model.__dict__.setdefault("_dapo_dropout", {})
    for path, cfg in _configs(model.config):
        for name, value in list(vars(cfg).items()):
            if _is_dropout_name(name) and isinstance(value, float) and value > 0:
                saved[(*path, name)] = value
                setattr(cfg, name, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_dropout_name(name) and isinstance(value, float):
                setattr(module, name, 0.0)


def decoder_of(lm) -> torch.nn.Module:
    """The causal LM's decoder stack: ``get_decoder()``, except where that returns the causal LM itself
    (Llama 4's text model), whose base model is then the decoder."""
    decoder = lm.get_decoder()
    if decoder is lm:
        decoder = getattr(lm, lm.base_model_prefix, None) or lm.model
    return decoder


def decoder_layers(decoder) -> list[torch.nn.Module]:
    """The decoder's stack of layers, whatever its family calls it (``layers``, GPT-2's ``h``, MPT's
    ``blocks``, BERT's ``encoder.layer``...): its ``layers``, else the first list of modules in it as long
    as the config's layer count, else its longest list of modules (none: an empty list)."""
    if isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        return list(decoder.layers)
    lists = [m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList)]
    config = getattr(decoder, "config", None)
    count = getattr(config.get_text_config(decoder=True), "num_hidden_layers", None) if config is not None else None
    for modules in lists:
        if len(modules) == count:
            return list(modules)
    return list(max(lists, key=len)) if lists else []


def weightless_model(path, dtype: str, *, revision: str | None = None, trust_remote_code: bool = False):
    """The model on the meta device: vLLM reads the checkpoint itself and needs only its directory (its
    ``name_or_path``: the local directory ``model_dir`` gives), dtype and generation config (a full copy here
    would cost every GPU the whole model)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = model_dir(path, revision)
    with torch.device("meta"):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    if (Path(path) / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def import_gguf(src: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32") -> Path:
    """Convert ``src`` (a .gguf file) into a Hugging Face model directory at ``out_dir``.

    The directory is written under a temporary name and renamed, so a killed import never leaves
    a half-written model behind. Raises FileNotFoundError / FileExistsError / ValueError with one line.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out_dir = Path(src), Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no such GGUF file; give the path of a .gguf model file")
    if src.suffix.lower() != ".gguf":
        raise ValueError(f"{src}: expected a .gguf file (dapo import-model converts GGUF checkpoints)")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new OUT_DIR or delete it first")
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it; fail with the install hint)
    except ImportError as err:
        raise ImportError("dapo import-model needs the gguf package: pip install gguf accelerate") from err

    where = dict(pretrained_model_name_or_path=str(src.parent), gguf_file=src.name, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    # A GGUF-loaded model carries a quantization config that makes save_pretrained refuse; the
    # weights are already de-quantised, so rebuild the model from its config without it.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = out_dir.name
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], trust_remote_code=False)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{src}: weights do not match the {config.model_type} architecture "
            f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    model.tie_weights()
    del loaded

    gen = model.generation_config
    # EOS and pad as the tokenizer knows them: a GGUF's own ids can be absent or partial
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    gen.eos_token_id = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = tokenizer.bos_token_id

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # mkdtemp makes the directory private and save_pretrained its weights: the model follows the user's umask
        readable_as_umask([tmp, *tmp.rglob("*")])
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
