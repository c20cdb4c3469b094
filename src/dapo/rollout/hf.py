"""Rollout with transformers ``generate`` and its KV cache; runs on CPU and on a GPU.

By default it shares the policy's model object, so a weight update costs nothing. Prompts are
sorted by length and generated in chunks of ``max_batch_size`` rows, so short and long prompts
are not padded to each other more than needed. Rows leave their chunk's batch as they end (dapo.rollout.hf_decode:
the tokens ``generate`` samples, without decoding the ended rows until the chunk's longest ends).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import GenerationConfig

from dapo.model import lora
from dapo.rollout import hf_decode
from dapo.rollout.base import Generation, SamplingParams, Sleepless, eos_token_ids, split_response

LOGPROB_CHUNK_FLOATS = 1 << 27  # logits held at once when computing log-probs (512 MiB in float32)


class HFRolloutEngine(Sleepless):
    backend = "hf"

    def __init__(self, model, tokenizer, *, max_batch_size: int = 512, logprobs: bool = False, compacting: bool = True):
        self.model = model
        self.logprobs = logprobs  # report each sampled token's log-prob (an engine apart from the trainer's weights)
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.compacting = compacting and hf_decode.decodes_here(model)  # ended rows leave the batch

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generation:
        rows = [p for p in prompt_ids for _ in range(params.n)]  # prompt-major
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        responses: list[list[int] | None] = [None] * len(rows)
        truncated = torch.zeros(len(rows), dtype=torch.bool)
        was_training = self.model.training
        self.model.train(False)
        device = self.device
        fork_devices = [device] if device.type == "cuda" else []
        # layers compiled for the trainer (train.kernels=[compile]) decode eagerly: with a KV cache, torch would
        # compile a graph per layer and per cache state until its recompile limit, then run them eagerly all the same
        with torch.random.fork_rng(devices=fork_devices), torch.compiler.set_stance("force_eager"):
            torch.manual_seed(params.seed)
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start : start + self.max_batch_size]
                input_ids, attention_mask = self._left_pad([rows[i] for i in chunk], device)
                for row, tokens in zip(chunk, self._sample(input_ids, attention_mask, params)):
                    responses[row], truncated[row] = split_response(tokens, self.eos_ids, params.max_new_tokens)
            logprobs = self._logprobs(rows, responses, params.temperature) if self.logprobs else None
        self.model.train(was_training)
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        return Generation(prompt_ids=rows, response_ids=responses, truncated=truncated, texts=texts, logprobs=logprobs)

    def _sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams) -> list[list[int]]:
        """Each row's new tokens: hf_decode's loop, which drops ended rows from the batch, where the model's cache
        allows it; else ``generate`` (its rows padded after their end, which ``split_response`` cuts)."""
        if self.compacting:
            return hf_decode.sample(
                self.model, input_ids, attention_mask, params, eos_ids=self.eos_ids, tokenizer=self.tokenizer
            )
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self._generation_config(params),
            tokenizer=self.tokenizer if params.stop else None,  # stop strings are matched on text
        )
        return out[:, input_ids.shape[1] :].tolist()

    def _logprobs(self, rows: list[list[int]], responses: list[list[int]], temperature: float) -> list[list[float]]:
        """Each response token's log-prob under the sampling distribution (softmax of logits / temperature, before
        top-p and top-k), from one forward pass over prompt + response per chunk of rows. Left-padded, every row
        ends at the last column, so the last R + 1 positions' logits cover every response (R: the longest)."""
        out: list[list[float]] = [[] for _ in rows]
        vocab = self.model.get_output_embeddings().weight.shape[0]
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]) + len(responses[i]), reverse=True)  # longest first
        start = 0
        while start < len(order):
            longest = max(len(rows[i]) + len(responses[i]) for i in order[start : start + 1])
            per_chunk = max(1, LOGPROB_CHUNK_FLOATS // (longest * vocab))  # rows whose logits fit the chunk's floats
            chunk = [i for i in order[start : start + per_chunk] if responses[i]]
            start += per_chunk
            if not chunk:
                continue
            ids, mask = self._left_pad([rows[i] + responses[i] for i in chunk], self.device)
            R = max(len(responses[i]) for i in chunk)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=R + 1).logits
            logp = torch.log_softmax(logits[:, :-1].float() / max(temperature, 1e-6), dim=-1)  # (B, R, V)
            for b, i in enumerate(chunk):
                r = len(responses[i])
                tokens = torch.tensor(responses[i], device=logp.device)
                out[i] = logp[b, R - r :].gather(-1, tokens[:, None]).squeeze(-1).tolist()
        return out

    def _left_pad(self, rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
        return ids.to(device), mask.to(device)

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        """Every sampling knob set explicitly: unset fields would fall back to the checkpoint's
        generation_config.json or to library defaults (top_k=50), and the samples would no longer
        come from the policy whose log-probs the loss uses."""
        greedy = params.temperature <= 0
        return GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else params.top_k or 0,  # None here would mean generate's default (50); 0 is off
            repetition_penalty=1.0,
            num_beams=1,
            num_return_sequences=1,
            use_cache=True,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
            stop_strings=list(params.stop) or None,
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if lora.is_adapted(self.model):
            # only a single-process LoRA run hands this engine a peft model: the trainer's own, whose live
            # adapters it samples with, so there is nothing to load (and the merged tensors need not be made)
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = params.get(name)
                if target is None:
                    raise KeyError(f"rollout model has no parameter {name!r}")
                if target.data_ptr() != tensor.data_ptr():  # shared weights need no copy
                    target.copy_(tensor.to(target.device, target.dtype))
