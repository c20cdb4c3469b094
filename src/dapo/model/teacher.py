"""The teacher of on-policy distillation: a second causal LM, frozen, that scores the tokens the student sampled.

It is a ``LogProbModel`` like the policy and the reference, so its log-probs come from the same micro-batches,
masks, packing, shared prompts and temperature as the student's old log-probs, and under FSDP it is sharded over
the trainer's ranks as the policy is. It never trains: no gradient, no optimizer, nothing of it in a checkpoint
(a resumed run loads it again from teacher.path).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from dapo.algorithm.batch import RolloutBatch
from dapo.config import ConfigError, LoraConfig
from dapo.model.logprobs import LogProbModel
from dapo.model.micro_batch import MicroBatch
from dapo.runtime import parallel

if TYPE_CHECKING:
    from dapo.config import ModelConfig, TeacherConfig, TrainConfig

# errors of reading a model directory that say what to fix (dapo.model.directory, transformers' own)
LOAD_ERRORS = (FileNotFoundError, NotADirectoryError, PermissionError, ValueError, OSError)


def teacher_model_config(teacher_cfg: TeacherConfig, student_cfg: ModelConfig) -> ModelConfig:
    """The teacher's model settings: its own path, revision and dtype (null: the student's), the student's device
    and trust in remote code, no adapters and no dropout (its log-probs are one distribution, not a random one)."""
    return dataclasses.replace(
        student_cfg,
        path=teacher_cfg.path,
        revision=teacher_cfg.revision,
        dtype=teacher_cfg.dtype or student_cfg.dtype,
        gradient_checkpointing=False,
        lora=LoraConfig(),
        keep_dropout=False,
    )


class TeacherModel(LogProbModel):
    """The frozen teacher: log-probs of the sampled tokens under its weights (``logprobs``), checked at load to
    share the student's tokenizer."""

    path_key = "teacher.path"

    def __init__(
        self,
        teacher_cfg: TeacherConfig,
        student_cfg: ModelConfig,
        train_cfg: TrainConfig,
        dist: parallel.Dist | None = None,
        *,
        student_tokenizer,
        **logprob_kw,
    ):
        model_cfg = teacher_model_config(teacher_cfg, student_cfg)
        try:
            super().__init__(model_cfg, train_cfg, dist, **logprob_kw)
        except ConfigError:
            raise
        except LOAD_ERRORS as err:
            raise ConfigError(load_error_line(teacher_cfg.path, err)) from err
        if why := tokenizer_difference(self.tokenizer, student_tokenizer):
            raise ConfigError(
                f"teacher.path={teacher_cfg.path}: its tokenizer differs from model.path={student_cfg.path}'s ({why}); "
                "distillation compares the two models' log-probs of the same token ids, so give a teacher with the "
                "student's tokenizer (the same model family)"
            )

    def _prepare(self, lm):
        return lm.requires_grad_(False).train(False)

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """(N, T) log-probs of the sampled tokens under the teacher, at the sampling temperature."""
        return self.compute_logprobs(batch)[0]

    @torch.no_grad()
    def full_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """(n, V) log-probs of every vocabulary entry at the n response positions of the student's micro-batch
        ``mb`` (its ``token_index`` order), at the sampling temperature: teacher.signal=full's target."""
        return self.logprob_pass(mb, temperature=self.temperature, full_logp=True)


def load_error_line(path: str, err: Exception) -> str:
    """One line for a teacher directory that cannot load: the directory checks' own line, which names model.path,
    said of teacher.path; or the library's error, shortened, with the fix."""
    text = " ".join(str(err).split())
    if "model.path=" in text or "model.revision=" in text:
        return text.replace("model.path=", "teacher.path=").replace("model.revision=", "teacher.revision=")
    return (
        f"teacher.path={path!r} cannot be loaded ({type(err).__name__}: {text[:300]}); give a Hugging Face causal-LM "
        "directory (config.json, weights, tokenizer) or Hub id that transformers can load"
    )


def tokenizer_difference(teacher, student) -> str | None:
    """What differs between two tokenizers that must give the same ids (None: nothing): the vocabulary, then the
    special tokens (end of text, padding, the chat template's markers)."""
    teacher_vocab, student_vocab = teacher.get_vocab(), student.get_vocab()
    if teacher_vocab != student_vocab:
        differing = {
            t for t in teacher_vocab.keys() | student_vocab.keys() if teacher_vocab.get(t) != student_vocab.get(t)
        }
        return f"{len(teacher_vocab)} tokens against {len(student_vocab)}, {len(differing)} with different ids"
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(teacher, name) != getattr(student, name):
            return f"{name} {getattr(teacher, name)} against {getattr(student, name)}"
    if sorted(teacher.all_special_tokens) != sorted(student.all_special_tokens):
        extra = set(teacher.all_special_tokens) ^ set(student.all_special_tokens)
        return f"special tokens {sorted(extra)[:5]} in one and not the other"
    return None
