"""Rollout with vLLM (``rollout.backend=vllm``): paged KV cache and continuous batching, on a GPU or a CPU.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a weight push is
a function call, not a copy through another process. ``update_weights`` streams the trainer's
``(name, tensor)`` pairs, one at a time, into vLLM's in-place reload (``initialize_layerwise_reload``,
the model's own ``load_weights``, ``finalize_layerwise_reload``): vLLM fuses q/k/v and gate/up
itself and re-packs each layer as soon as all of its tensors arrived, so no second full copy of
the weights is ever built. With tensor parallelism (``rollout.tensor_parallel_size > 1``) in a
single process, the workers are other processes and each tensor travels to them through ``collective_rpc``.

Under FSDP (torchrun or Ray, torch.distributed initialised) with ``tensor_parallel_size = k > 1``,
every rank builds the same engine with vLLM's ``external_launcher`` backend: ranks r..r+k-1
(r a multiple of k) form one engine, each holding its 1/k shard of the weights, using the trainer's
process group. They must be given the same prompts and seeds, and then return the same outputs
(see ``ShardedRollout``). A weight push needs no messages: every rank already gathers each full
tensor, and loads it into its own shard.

Colocated with training, ``sleep()`` frees the weights and the KV cache while the trainer runs
(vLLM sleep mode, level 2: the next ``update_weights`` rewrites every weight anyway) and
``wake()`` re-allocates them. Sleep mode exists only on CUDA/ROCm/XPU; vLLM refuses it on CPU,
so there ``sleep``/``wake`` do nothing. (In this process vLLM's CPU worker also turns
``torch.set_num_threads`` into a no-op: set the thread count before building the engine.)

Each sampled token comes with the log-prob vLLM sampled it from (``logprobs_mode=processed_logprobs``:
after temperature, top-k and top-p), so the loop can measure how far the trainer's recomputed
``old_logp`` is from the distribution that actually produced the sample.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterable

import numpy as np
import torch

# vLLM configures its logger (a handler on stdout) when imported unless told not to; the run's
# logging setup (dapo.runtime.libraries) then sends its records to train.log and its warnings to the console
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

from vllm import LLM  # noqa: E402
from vllm import SamplingParams as VLLMSamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from dapo.rollout.base import Generation, SamplingParams, eos_token_ids, split_response  # noqa: E402
from dapo.runtime.parallel import full_tensors  # noqa: E402

SLEEP_LEVEL = 2  # discard weights and KV cache: update_weights after wake() refills the weights


@contextlib.contextmanager
def preserved_rng():
    """vLLM seeds and draws from the global RNGs (python, numpy, torch); the trainer's streams must not notice."""
    py, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        yield
    random.setstate(py)
    np.random.set_state(np_state)


class WeightSync:
    """Mixed into vLLM's worker class (``worker_extension_cls``): in-place reload split in three calls,
    so weights can arrive in pieces from another process under tensor parallelism."""

    def dapo_begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.model_runner.get_model()
        self.dapo_tied_head = _tied_head(model)  # asked before the reload moves the weights to the meta device
        initialize_layerwise_reload(model)

    def dapo_load_weights(self, named_tensors) -> None:
        self.model_runner.get_model().load_weights(named_tensors)

    def dapo_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self.model_runner.get_model()
        head = getattr(self, "dapo_tied_head", None)
        for layer in model.modules():
            # Two kinds of layer receive no tensor, rightly, and vLLM would warn "<Layer>: Failed to load
            # weights" for each at every push before putting its old tensors back, which is correct for them:
            # - a tied LM head: the model's load_weights skips lm_head.weight (sent or not); its weight is
            #   the embedding's storage, which the reload has just refreshed in place;
            # - a layer with buffers only (RotaryEmbedding's cos/sin cache): computed from the config, in no
            #   checkpoint, unchanged by training.
            # Saying they had nothing to load puts the same tensors back without the false alarm; a layer
            # with parameters of its own that received nothing still warns.
            info = get_layerwise_info(layer)
            if info.can_load() and info.load_numel == 0 and info.kernel_tensors is not None:
                params, _ = info.kernel_tensors
                if layer is head or not params:
                    info.load_numel_total = 0
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            # A tied LM head shares the embedding's weight but on CPU keeps its own packed copy of it,
            # which the layerwise reload never refreshes (no tensor is loaded under lm_head's name).
            if head is not None and current_platform.is_cpu():
                head.quant_method.process_weights_after_loading(head)


def _tied_head(model):
    """The model's LM head when it shares its weight with another module (tied embeddings), else None."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    tied = weight is not None and any(m is not head and getattr(m, "weight", None) is weight for m in model.modules())
    return head if tied else None


def _whole_prefill_settings(max_model_len: int) -> dict:
    """Scheduler settings under which no seeded request ever has a sampled token thrown away.

    vLLM discards the token it sampled for a request whose prompt is only partly prefilled in a
    step (chunked prefill) and then rewinds that request's own generator by moving its Philox
    offset back. CUDA generators have an offset; CPU generators (Mersenne Twister) have none, so
    on CPU the rewind raises ("CPU Generator does not use offset") as soon as one batch's prompts
    exceed the prefill budget. Where the rewind cannot work, every prompt is prefilled whole:
    chunked prefill off and a step budget that holds the longest sequence, so seeded samples stay
    reproducible however vLLM batches them. On GPUs chunked prefill stays on (it keeps decode
    steps flowing beside long prefills).
    """
    if current_platform.is_cuda_alike():
        return {}
    budget = max(8192, max_model_len)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget, "long_prefill_token_threshold": 0}


class VLLMRolloutEngine:
    backend = "vllm"

    def __init__(self, cfg, model, tokenizer, *, owner: bool | None = None, max_model_len: int | None = None):
        """cfg: RolloutConfig; model: the trainer's HF model (its directory and dtype are used).

        ``max_model_len``: the longest prompt + response the run asks for; the KV cache and the
        scheduler are sized for it instead of the model's whole context (None = the model's).

        ``owner``: whether this process holds an engine (by default yes; under FSDP every rank
        samples its share). Others only take part in the collective gathers of ``update_weights``.
        """
        import torch.distributed as dist

        self.tokenizer = tokenizer
        self.tensor_parallel_size = cfg.tensor_parallel_size
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.owner = True if owner is None else owner
        # one engine over each group of tensor_parallel_size consecutive ranks of the trainer's world
        self.external_launcher = dist.is_initialized() and dist.get_world_size() > 1 and cfg.tensor_parallel_size > 1
        context = getattr(model.config, "max_position_embeddings", None) or 0
        if max_model_len and context:
            max_model_len = min(max_model_len, context)  # a prompt cut to fit still fits the model
        self.llm = None
        self.asleep = self.kv_asleep = self.weights_discarded = False
        self.sleep_level = 0
        if not self.owner:
            return
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: weights by reference
        if current_platform.is_sleep_mode_available():
            self.sleep_level = SLEEP_LEVEL
        kv_cache_gib = cfg.kv_cache_gib or (0.0 if current_platform.is_cuda_alike() else 1.0)
        if self.external_launcher and torch.cuda.is_available():
            # vLLM's worker takes cuda:LOCAL_RANK; under Ray a rank sees only its own GPU, as index 0
            os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
        with preserved_rng():
            self.llm = LLM(
                model=str(model.name_or_path),
                dtype=str(model.dtype).removeprefix("torch."),
                skip_tokenizer_init=True,  # prompts arrive as ids; responses are decoded with the trainer's tokenizer
                use_tqdm_on_load=False,  # no progress bar on the console for a load of a second or two
                generation_config="vllm",  # the checkpoint's sampling defaults must not leak into RL samples
                logprobs_mode="processed_logprobs",  # log-probs of the distribution actually sampled from
                tensor_parallel_size=cfg.tensor_parallel_size,
                distributed_executor_backend="external_launcher" if self.external_launcher else None,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                kv_cache_memory_bytes=int(kv_cache_gib * 2**30) or None,
                enable_sleep_mode=self.sleep_level > 0,
                enforce_eager=not current_platform.is_cuda_alike(),
                worker_extension_cls=f"{__name__}.WeightSync",
                seed=cfg.seed,
                max_model_len=max_model_len,
                **_whole_prefill_settings(max_model_len or context),
                # the trainer built its model from the directory's own code only where model.trust_remote_code
                # allowed it; vLLM reads the same directory and gets the same answer
                trust_remote_code=type(model).__module__.startswith("transformers_modules."),
            )

    def _require_owner(self) -> None:
        if self.llm is None:
            raise RuntimeError("this process does not hold a vLLM engine (built with owner=False)")

    def _ensure_awake(self) -> None:
        self.wake()
        if self.kv_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.kv_asleep = False

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generation:
        self._require_owner()
        if self.weights_discarded:
            raise RuntimeError("the engine slept with its weights discarded; call update_weights() before generate()")
        self._ensure_awake()
        rows = [p for p in prompt_ids for _ in range(params.n)]  # prompt-major
        greedy = params.temperature <= 0
        # one request per row, each with its own seed: the same seed gives the same samples however
        # vLLM batches them, and rows of one prompt share its cached prefix
        requests = [
            VLLMSamplingParams(
                n=1,
                seed=(params.seed * 1_000_003 + i) % 2**63,
                max_tokens=params.max_new_tokens,
                min_tokens=0,
                temperature=0.0 if greedy else params.temperature,
                top_p=1.0 if greedy else params.top_p,
                top_k=0 if greedy or not params.top_k else params.top_k,
                repetition_penalty=1.0,
                stop_token_ids=sorted(self.eos_ids),
                ignore_eos=False,
                logprobs=0,
                stop=list(params.stop) or None,
                include_stop_str_in_output=True,
                detokenize=bool(params.stop),  # stop strings are matched on text
            )
            for i in range(len(rows))
        ]
        with preserved_rng():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], requests, use_tqdm=False)
        responses, logprobs = [], []
        truncated = torch.zeros(len(rows), dtype=torch.bool)
        for i, out in enumerate(outputs):
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            responses_i, truncated[i] = split_response(tokens, self.eos_ids, params.max_new_tokens)
            responses.append(responses_i)
            logprobs.append([step[tok].logprob for step, tok in zip(sample.logprobs, responses_i)])
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        return Generation(prompt_ids=rows, response_ids=responses, truncated=truncated, texts=texts, logprobs=logprobs)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream the trainer's weights in, one tensor at a time (every rank must call this)."""
        stream = full_tensors(named_tensors)  # one whole tensor at a time, whether sharded or not
        if self.llm is None:
            for _ in stream:  # take part in every gather; the owner loads
                pass
            return
        self.wake()
        rpc = self.llm.collective_rpc
        rpc("dapo_begin_weight_update")
        # the worker is in this process (under external_launcher: this rank's shard): hand it the generator
        if self.tensor_parallel_size == 1 or self.external_launcher:
            rpc("dapo_load_weights", args=(stream,))
        else:  # workers in other processes: one (CPU) tensor per message
            for name, tensor in stream:
                rpc("dapo_load_weights", args=([(name, tensor.cpu())],))
        rpc("dapo_finish_weight_update")
        self.weights_discarded = False
        self._ensure_awake()
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def sleep(self) -> None:
        """Free weights and KV cache for the trainer (CUDA only; a no-op where vLLM has no sleep mode)."""
        if self.llm is not None and self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep, self.weights_discarded = True, self.sleep_level >= 2

    def wake(self) -> None:
        """Re-allocate the weights; the KV cache follows after update_weights (or before generating),
        so weights and cache never sit beside the trainer's gathered tensors at once."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep, self.kv_asleep = False, True
