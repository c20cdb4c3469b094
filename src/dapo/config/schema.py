"""The typed config tree: every setting with its default, its comment and what it accepts.

A setting with a fixed set of values is typed as a ``Literal`` (named below, so the CLI, the code that acts on it
and the error messages read its choices from one place); ``None`` (YAML null) means unset. What else one setting
accepts is declared on it with ``field`` (``dapo.config.declare``'s, a ``dataclasses.field`` that also takes a
``Rule``)::

    eps_low: float = field(0.2, gt=0, lt=1, why="the paper uses 0.2")  # "must be in (0, 1); the paper ..."
    top_k: int | None = field(None, gt=0, null="no top-k")  # "must be > 0, or null (no top-k)"

The rules between settings are ``dapo.config.rules``'s; reading presets and overrides into this tree is
``dapo.config.read``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dapo.config.declare import ConfigError, Rule, field, resolve_type  # noqa: F401  (read from here too)

Dtype = Literal["float32", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]
Task = Literal["arith"]
TaskDifficulty = Literal["demo", "hard", "long"]
Backend = Literal["hf", "vllm", "auto"]
Grader = Literal["auto", "dapo", "dapo_relaxed", "math", "gsm8k", "arith"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KlKind = Literal["k1", "k2", "k3"]
Objective = Literal["dapo", "gspo", "cispo"]
RolloutIsMode = Literal["token_truncate", "token_mask", "token_m2", "sequence_truncate", "sequence_mask"]
FilterMetric = Literal["acc", "reward"]
OnMaxGenRounds = Literal["train", "fail"]
OldLogpSource = Literal["recompute", "engine"]
TeacherSignal = Literal["sampled", "full"]
PackSequences = Literal["auto", "true", "false"]
LogLevel = Literal["debug", "info", "warning", "error"]
Logger = Literal["console", "tensorboard", "wandb", "mlflow"]
ResumeDamaged = Literal["skip", "refuse"]
WandbMode = Literal["online", "offline", "disabled"]
ToolSandbox = Literal["bwrap", "none"]
# prompt templates: the paper's, the problem text as it is, or the problem and how to call the Python tool
Template = Literal["dapo", "raw", "tool"]
OnBadRow = Literal["stop", "skip"]
OverlongPrompts = Literal["truncate", "drop"]
# the columns a data row's layout is read from, which data.columns may rename a column to
COLUMN_NAMES = ("prompt", "problem", "question", "ground_truth", "answer", "solution", "data_source", "id")

# A data-file row's size limit, in characters (data.max_row_chars). The longest row of the data sets in data/ has
# about 10k; a million keeps any real problem and stops a hostile or broken row before it costs memory and time.
DEFAULT_MAX_ROW_CHARS = 1_000_000

# the linear layers of a Llama / Qwen2 / Mistral decoder layer: attention and MLP
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    # LoRA rank r: train low-rank adapters (peft) on the target layers and freeze every base weight; null: off
    # (every weight trains). LoRA usually wants a learning rate about 10x the full fine-tuning one (train.lr).
    rank: int | None = field(None, gt=0, null="off: every weight trains")
    # the adapters' output is scaled by alpha / rank; null: 2 x rank (scale 2)
    alpha: float | None = field(None, gt=0, null="2 x rank")
    # dropout on the adapters' input in the update's forward passes only; 0 keeps the trained policy the one that
    # sampled (log-probs are computed without dropout), so the first update's ratio is exactly 1
    dropout: float = field(0.0, ge=0, lt=1)
    # names of the decoder layers' linear modules that get adapters (the model's own names; the LM head and the
    # embeddings stay frozen)
    target_modules: list[str] = field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS),
        check=lambda names: len(names) > 0 and all(names),
        must="name at least one linear layer, e.g. [q_proj,v_proj]",
    )

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def lora_alpha(self) -> float:
        """alpha as peft takes it, the null default resolved."""
        return float(2 * self.rank) if self.alpha is None else self.alpha


@dataclass
class ModelConfig:
    # a Hugging Face causal-LM directory, or a model id on the Hugging Face Hub (Qwen/Qwen2.5-0.5B-Instruct), fetched
    # into the Hugging Face cache (HF_HOME, HF_HUB_CACHE; HF_HUB_OFFLINE=1: the cache only); a local directory of
    # the same name wins
    path: str = "assets/arith-base"
    # a hub model's branch, tag or commit (model.path a hub id); null: its default branch. A local directory has none
    revision: str | None = None
    dtype: Dtype = "float32"  # training dtype; under FSDP the compute dtype (float32 master weights)
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    device: Device = "auto"  # auto: cuda if available
    trust_remote_code: bool = False  # run Python files shipped in model.path (auto_map); only for directories you trust
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (off by default)
    # false: every dropout of the model is off in the policy's and the reference's passes, as the reference trains
    # (with dropout, pi / pi_old compares two random masks); true keeps the model's own dropout, a departure from the
    # reference that the Fidelity page lists
    keep_dropout: bool = False


@dataclass
class DataConfig:
    task: Task = "arith"  # built-in task used when train_files is empty
    task_difficulty: TaskDifficulty = "demo"  # built-in task difficulty
    task_train_size: int = 3000  # problems drawn for the built-in task's train split (demo has ~3.6k distinct)
    # .jsonl, .json, .parquet (.jsonl.gz, .json.gz) files, folders of them, or Hugging Face dataset ids
    # (ORG/NAME[:CONFIG[:SPLIT]], e.g. openai/gsm8k:main:train), in the layouts of the manual's own-data page
    train_files: list[str] = field(default_factory=list)
    # columns renamed before a row's layout is read, THEIRS=OURS, e.g. [instruction=problem,output=answer]
    columns: list[str] = field(
        default_factory=list,
        check=lambda items: all(
            i.count("=") == 1 and i.split("=")[0] and i.split("=")[1] in COLUMN_NAMES for i in items
        ),
        must=f"give THEIRS=OURS items, OURS one of {', '.join(COLUMN_NAMES)}, e.g. data.columns=[instruction=problem]",
    )
    # a row that fits no layout or breaks its file's: stop (the run stops at load naming the first 10 and how many
    # there are) or skip (it loads without them and says how many)
    on_bad_row: OnBadRow = "stop"
    # prompt template for data files: dapo (the paper's: the problem between the instructions to reason step by step
    # and end with a line "Answer: ..."), raw (the problem text as it is: for data that bring their own
    # instructions) or tool (the problem and how to call the Python tool, for tools.python=true)
    template: Template = "dapo"
    # the longest prompt, in tokens (the paper's 2,048); capped at start at the model's context less the response
    # budget, with a line saying so
    max_prompt_tokens: int = field(2048, gt=0)
    # a longer prompt: drop (leave it out, as verl's filter_overlong_prompts) or truncate (keep its last
    # max_prompt_tokens tokens, as the reference); counted at start either way, never cut silently
    overlong_prompts: OverlongPrompts = "drop"
    # a data-file row longer than this (1M characters) stops the run at load
    max_row_chars: int = field(DEFAULT_MAX_ROW_CHARS, gt=0)
    seed: int = 0  # prompt order


@dataclass
class RolloutConfig:
    backend: Backend = "hf"  # hf (transformers generate, CPU or GPU), vllm, or auto (vllm where installed, else hf)
    group_size: int = field(8, ge=2, why="group-relative advantages need two responses")  # G: responses per prompt
    max_response_tokens: int = field(48, gt=0)  # L_max: generation limit per response
    # sampling temperature; log-probs are computed at the same temperature
    temperature: float = field(1.0, gt=0, why="log-probs divide by it")
    top_p: float = field(1.0, gt=0, le=1)  # nucleus sampling: only the likeliest tokens holding top_p of the mass
    top_k: int | None = field(None, gt=0, null="no top-k")  # sample among the k likeliest tokens only
    seed: int = 0  # base seed; each generation round derives its own
    gpu_memory_utilization: float = field(0.6, gt=0, le=1)  # vllm: share of GPU memory for weights + KV cache
    tensor_parallel_size: int = field(1, ge=1)  # vllm: GPUs one engine's weights are split over
    # vllm: KV-cache size in GiB; null: what gpu_memory_utilization leaves on a GPU, 1 GiB on CPU
    kv_cache_gib: float | None = field(None, gt=0, null="sized from rollout.gpu_memory_utilization")
    # k > 0: the engine runs in a process of its own and collects the next steps' batches while the trainer updates;
    # step t's responses are sampled with the weights of up to k updates before, corrected by algo.rollout_is_cap.
    # 0: the synchronous loop (the paper's): generate, then train. Try 1 or 2 where generation and the update each
    # take a large share of a step (see the manual's Asynchronous rollout page)
    max_staleness: int = field(0, ge=0, le=8)
    # with max_staleness > 0: the CPU threads the rollout process computes with; null: half the cores, the trainer
    # the rest
    engine_threads: int | None = field(None, ge=1, null="half the cores")
    # with max_staleness > 0 under torchrun or `dapo launch-ray`: the last `ranks` ranks of the job (one GPU each)
    # only generate, each with a full copy of the weights; the others train. 0: the rollout process beside a
    # single trainer (several training ranks and no rollout ranks are refused)
    ranks: int = field(0, ge=0)


@dataclass
class RewardConfig:
    # auto: by data_source, routed as the reference does (math_dapo, math, aime* -> dapo); dapo: exactly verl's
    # math_dapo ("025" != "25"); dapo_relaxed: dapo + equal integers in any spelling ("025" == "25"); math, gsm8k, arith
    grader: Grader = "auto"
    num_workers: int = field(2, ge=1)  # grading worker processes
    # per-response limit in the grading worker's CPU seconds (a busy machine gives the same verdicts); a response
    # that runs out is graded once more with twice the limit, then given up on (reward.ungraded)
    timeout_s: float = field(5.0, gt=0, unit="CPU seconds")
    # a response whose grading was given up on: leave_out leaves it out of its group's advantage and of the loss (its
    # group's baseline is the others'); wrong scores it as a wrong answer. Counted in reward/timeouts either way
    ungraded: Literal["leave_out", "wrong"] = "leave_out"
    # your own reward instead of reward.grader, as MODULE:FUNCTION: a module's name (my_rewards:reward) or a .py file
    # (rewards/mine.py:reward); the function takes (response, ground_truth) and returns a score (correct when > 0)
    # or (score, correct); it runs in the grading workers under reward.timeout_s; null: off
    function: str | None = field(
        None,
        check=lambda spec: bool(spec.rpartition(":")[0].strip()) and spec.rpartition(":")[2].isidentifier(),
        must="give MODULE:FUNCTION, a module's name or a .py file and the function's name, e.g. "
        "reward.function=my_rewards:reward or reward.function=rewards/mine.py:reward",
        null="off",
    )


@dataclass
class AlgoConfig:
    # lower clip: ratio >= 1 - eps_low (DAPO sec. 3.1); 1 sets no lower bound (CISPO's setting)
    eps_low: float = field(0.2, gt=0, le=1, why="the paper uses 0.2; 1 sets no lower bound")
    eps_high: float = field(0.28, gt=0, le=10, why="the paper uses 0.28")  # upper clip: ratio <= 1 + eps_high
    # bound on the loss of negative-advantage tokens (reference recipe); null disables
    dual_clip: float | None = field(10.0, gt=1, null="off")
    # token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO)
    loss_agg: LossAgg = "token-mean"
    # the surrogate: dapo (the clipped token ratio: the paper's and the reference's), gspo (the clipped sequence
    # ratio, arXiv 2507.18071; preset configs/gspo.yaml) or cispo (the clipped, detached token weight, arXiv
    # 2506.13585; preset configs/cispo.yaml). eps_low / eps_high are each one's clip range; the Fidelity page lists
    # how each departs from the paper
    objective: Objective = "dapo"
    scale_adv_by_std: bool = True  # false gives Dr. GRPO's advantage (no division by the group std)
    kl_coef: float = field(0.0, ge=0)  # KL-loss weight to the initial policy; 0 means no reference model (DAPO)
    kl_kind: KlKind = "k3"  # the KL estimator (Schulman's k1, k2 or k3) used with kl_coef > 0
    correct_reward: float = 1.0  # rule reward for an equivalent answer (eq. 7)
    wrong_reward: float = -1.0  # rule reward otherwise
    soft_overlong_punishment: bool = True  # add eq. 13's length penalty to the reward
    overlong_buffer_tokens: int = 8  # L_cache: the penalty ramps over the last this-many tokens
    overlong_penalty_factor: float = field(1.0, ge=0)  # the penalty at L_max
    # mask truncated responses out of the loss (sec. 3.4); the reference implementation does not
    overlong_filtering: bool = False
    # with overlong_filtering: masked truncated responses still set their group's mean and std (true: the paper
    # masks only their loss) or the baseline comes from the untruncated responses alone (false)
    truncated_in_group_stats: bool = True
    dynamic_sampling: bool = True  # drop groups whose accuracies are all equal and sample again (sec. 3.2)
    filter_metric: FilterMetric = "acc"  # what must vary within a group: acc (raw correctness) or reward (shaped)
    max_gen_rounds: int | None = field(10, gt=0, null="no cap")  # cap on generation rounds per training step
    on_max_gen_rounds: OnMaxGenRounds = "train"  # when the cap is hit: train (on what was kept, with a warning) or fail
    oversample: float = field(1.0, ge=1)  # prompts generated per round = missing prompts * this (>= 1)
    adaptive_oversample: bool = False  # also divide by the measured keep rate, so most steps need one round
    # n: each prompt first gets n responses, and the other G - n only where those disagree; a prompt whose n agree is
    # dropped after n responses instead of G. 0: off (the paper's dynamic sampling alone). Saves generation on data
    # whose prompts are mostly always right or always wrong; try G/2 and see algo.screen_audit
    screen_samples: int = field(0, ge=0, why="a count of responses, 0 for off")
    screen_audit: float = field(0.0, ge=0, le=1)  # share of screened-out prompts completed anyway, never trained
    # surplus informative groups (beyond train.prompts_per_step) held over for the next step; 0: none, as the
    # reference. Named algo.buffer_max_groups before
    held_over_max_groups: int = field(0, ge=0, why="0 holds over no surplus groups")
    # where a held-over group's old log-probs (those of the weights that sampled it) come from: recompute (a pass
    # when it is held over) or engine (vLLM's sampling log-probs). Named algo.buffer_logp (trainer|engine) before
    held_over_logp_source: OldLogpSource = "recompute"
    # where a step's old log-probs come from: recompute (a forward pass over the batch before the update, the
    # reference) or engine (vLLM's sampling log-probs, no pass; float32 only). Named algo.old_logp before
    old_logp_source: OldLogpSource = "recompute"
    # true: the first optimizer update's old log-probs are its own forward's (detached), and the pass before the
    # update computes only the later updates' rows (on the demo, half the pass). The same weights give the same
    # log-probs, so the ratio is 1 as the pass's would be, to float rounding. It does nothing where every old
    # log-prob is needed before the update (algo.rollout_is_cap, teacher.signal=sampled with teacher.coef > 0),
    # where the update's forward is not the pass's (model.keep_dropout), or with algo.old_logp_source=engine (no
    # pass); false: a pass over every row, as the reference
    old_logp_from_update: bool = False
    # C: each token's loss x min(pi_old / pi_rollout, C), the correction for the gap between the engine that sampled
    # (its own log-probs) and the trainer; null: off (the reference). Left out with rollout.max_staleness > 0 it is
    # 2, as the run's config.yaml shows. With rollout.backend=vllm, turn it on (2 is a usual start) when the logged
    # rollout/logprob_abs_diff_mean is well above float noise: bf16 sampling on GPUs, long responses, large models
    rollout_is_cap: float | None = field(None, ge=1, null="off", why="a cap below 1 would shrink every token")
    # how rollout_is_cap corrects: token_truncate min(r, C), token_mask (r, 0 above C), token_m2
    # (min(r, C), 0 on the largest (log r)^2 until their mean <= rollout_is_m2), sequence_truncate / sequence_mask
    # (a response's rho = prod r: min(rho, C) / 1 inside [1/C, C], 0 outside)
    rollout_is_mode: RolloutIsMode = "token_truncate"
    # token_m2's bound on the mean (log ratio)^2 of the tokens kept (M2PO's tau)
    rollout_is_m2: float = field(0.04, gt=0)


@dataclass
class TeacherConfig:
    # on-policy distillation (the manual's Distillation page): a frozen teacher scores every sampled token and adds
    # teacher.coef x (log p_teacher - log p_student) to that token's advantage; a Hugging Face causal-LM directory or
    # Hub id with the student's tokenizer, loaded as model.path is (the same offline rules); null: no teacher
    path: str | None = None
    # a hub teacher's branch, tag or commit (teacher.path a hub id); null: its default branch
    revision: str | None = None
    # the weight of the teacher's per-token term; 0: off (no teacher loads, whatever teacher.path says), and the run
    # is DAPO's exactly
    coef: float = field(0.0, ge=0, why="0 turns the teacher off")
    # true: the reward's group advantage (eq. 9) plus the teacher's term (DAPO + teacher); false: the teacher's term
    # alone (pure distillation), where no group needs varied rewards, so dynamic sampling's filter is off
    reward_advantage: bool = True
    # sampled: the term above, on each sampled token's advantage (the student's sampled token only); full: the exact
    # KL(student || teacher) over the whole vocabulary at each response position, added to the loss (its token mean
    # over the mini-batch, x teacher.coef) with no term in the advantage; the teacher then runs in the update, on each
    # micro-batch, holding 4 bytes x vocabulary per response token of the micro-batch
    signal: TeacherSignal = "sampled"
    # the teacher's weights and forward pass; null: model.dtype. bfloat16 halves its memory (its log-probs then carry
    # bfloat16's rounding)
    dtype: Dtype | None = None


@dataclass
class TrainConfig:
    total_steps: int = field(60, ge=0)  # training steps (one rollout batch and its optimizer updates each)
    prompts_per_step: int = field(32, gt=0)  # P: prompts in a training batch (the paper: 512)
    # prompts per optimizer update; P / this = updates per step (the paper: 32 -> 16)
    mini_batch_prompts: int = field(8, gt=0)
    # token budget of one forward/backward pass (padded rows x longest, or packed)
    max_tokens_per_micro_batch: int = field(8192, gt=0, why="tokens per forward pass")
    # optional cap on responses per forward/backward pass; null: the token budget alone
    micro_batch_size: int | None = field(None, gt=0, null="no cap on rows")
    # auto (pack when the model uses flash-attention varlen kernels), true or false
    pack_sequences: PackSequences = "auto"
    # run each distinct prompt of a micro-batch once and let its responses attend to that one copy of its keys and
    # values (the G rows of a group share it) instead of recomputing the prompt per row; padded rows only (eager or
    # sdpa attention, full-attention models). Off: the reference recomputes the prompt for every row
    share_prompt_prefix: bool = False
    ppo_epochs: int = field(1, ge=1)  # passes over the rollout batch
    lr: float = field(1e-6, gt=0)  # AdamW learning rate after warmup (constant)
    warmup_steps: int = field(20, ge=0)  # linear warmup, in training steps
    weight_decay: float = field(0.1, ge=0)  # AdamW's decoupled weight decay, on every trained weight
    # AdamW's (beta1, beta2): the decay rates of its gradient and squared-gradient averages
    betas: list[float] = field(
        default_factory=lambda: [0.9, 0.999],
        check=lambda b: len(b) == 2 and all(0 <= x < 1 for x in b),
        must="two numbers in [0, 1)",
    )
    grad_clip: float = field(1.0, gt=0)  # max gradient norm; a step with a non-finite norm is skipped
    seed: int = 0  # model init / dropout / everything not seeded elsewhere
    # FSDP (several ranks) only: keep parameter shards, gradients and AdamW state in CPU memory
    cpu_offload: bool = False
    # faster kernels for the trainer's log-prob and update passes, each exact to its dtype's rounding: compile
    # (torch.compile per decoder layer; the run's first update pays the compilation), liger (Liger Kernel's RMSNorm,
    # SwiGLU and RoPE; CUDA only); []: eager PyTorch, as the reference. On a CPU compile does not pay; it is meant
    # for GPUs, where the work outside the matmuls that it fuses is a larger share
    kernels: list[str] = field(
        default_factory=list,
        check=lambda ks: set(ks) <= {"compile", "liger"},
        must="must list only compile and liger ([]: eager)",
    )


@dataclass
class EvalConfig:
    every_steps: int | None = field(None, gt=0, null="only at the end")  # evaluate every N training steps
    before_train: bool = True  # evaluate the initial model
    benchmarks: list[str] = field(default_factory=lambda: ["arith"])  # built-in task name, benchmark name or file
    # the first N problems of each benchmark; null: all (the built-in task: 200)
    num_problems: int | None = field(None, gt=0, null="all problems")
    # sampling; null: the benchmark's own setting (AIME: n=32, top_p 0.7, 20,480 tokens, as the paper reports it;
    # arith: n=4, top_p 1.0), and for a data file n=4, temperature 1.0, top_p 1.0
    n: int | None = field(None, gt=0, null="the benchmark's own")  # samples per problem (avg@n)
    # sampling temperature; 0: greedy decoding
    temperature: float | None = field(None, ge=0, null="the benchmark's own", why="0 = greedy")
    top_p: float | None = field(None, gt=0, le=1, null="the benchmark's own")  # nucleus sampling's top-p
    # null: the benchmark's own limit in `dapo eval`, and rollout.max_response_tokens during training (the
    # rollout engine is sized for the run's lengths) and for a data file
    max_response_tokens: int | None = field(None, gt=0, null="the benchmark's own or the rollout's")
    seed: int = 1234  # seed of the evaluation's sampling and of its bootstrap intervals


@dataclass
class ToolsConfig:
    # multi-turn rollouts with a Python tool: a ```python block the model closes runs in the sandbox and its output
    # comes back as an ```output block the model continues from; off: single-turn, the paper's setting. With data
    # files, data.template=tool tells the model how to call it
    python: bool = False
    max_turns: int = field(4, ge=1)  # stretches of the model's own writing per response (so at most 3 calls)
    max_calls: int = field(3, ge=1)  # code runs per response; a call past it is answered "no tool calls left"
    # sandboxed calls run at once (each its own process, most of it interpreter start-up: CPU-bound)
    workers: int | None = field(None, ge=1, null="one per CPU core, at most 32")
    # mask out of the loss the responses with a void turn (SimpleTIR, arXiv 2509.02479): one that ended at a closed
    # block that was not code, or a last turn that ended without an answer; they still count in their group's stats
    filter_void_turns: bool = False
    # where code a model wrote runs: bwrap, a bubblewrap sandbox per call (no network, a read-only Python and
    # nothing else of the host, a private /tmp); none, a bare process with the same limits (trusted setups only: it
    # can read and write what the trainer can). `dapo tool-run FILE` checks that this machine can sandbox
    sandbox: ToolSandbox = "bwrap"
    # CPU seconds per call: the limit a busy machine does not change (RLIMIT_CPU: the code is ended past it)
    cpu_s: int = field(5, ge=1, unit="seconds")
    # wall-clock seconds per call, a backstop for code that waits off the CPU (sleeps, reads): 4 x cpu_s, so a call
    # within its CPU time passes on a machine busy enough to give it a quarter of a core; the sandbox is killed past it
    timeout_s: float = field(20.0, gt=0, le=600, unit="seconds")
    memory_mb: int = field(1024, ge=64, unit="MiB")  # address space per call
    processes: int = field(16, ge=1)  # processes and threads per call (fork bombs end here)
    file_mb: int = field(16, ge=1, unit="MiB")  # largest file a call may write, and the size of its /tmp
    output_chars: int = field(512, gt=0)  # characters of stdout the model sees per call, and of an error line


@dataclass
class WandbConfig:
    project: str | None = None  # null: WANDB_PROJECT, else "dapo"
    entity: str | None = None  # team or user; null: WANDB_ENTITY, else your default entity
    name: str | None = None  # the run's display name; null: run.name
    # online, offline (files under <run>/wandb/, uploaded later by `wandb sync`) or disabled; null: WANDB_MODE, else
    # online
    mode: WandbMode | None = None


@dataclass
class MlflowConfig:
    experiment: str | None = None  # null: MLFLOW_EXPERIMENT_NAME, else "dapo"
    # null: MLFLOW_TRACKING_URI, else MLflow's default (sqlite:///mlflow.db in the working directory)
    tracking_uri: str | None = None


WATCHDOG_OFF = "switch the watchdog off with run.watchdog=false"


@dataclass
class RunConfig:
    name: str = field(
        "demo",
        # the run lives in run.dir/run.name: '..', '/x' or 'a/b' would write into (or over) another directory
        check=lambda name: name not in ("", ".", "..") and not any(c in name for c in "/\\\0"),
        must="must be one plain directory name (not empty, '.' or '..', no '/' or '\\'), e.g. run.name=demo2; "
        "put the parent directory in run.dir",
    )
    dir: str = "runs"  # the run lives in <dir>/<name>
    save_every: int | None = field(20, gt=0, null="only at the end")  # checkpoint every N steps (and at the end)
    keep_checkpoints: int = field(2, ge=1)  # newest checkpoints kept
    # write single-process checkpoints in a background thread: at the step's end the loop copies only the small
    # trainer state (prompt order, held-over groups, RNG); the weights and AdamW state are written from live memory,
    # and the next step waits for the write before its update changes them (generation and old log-probs overlap
    # with it). The directory still appears under its name only when whole; the end of the run waits for the write
    # and raises its error. false: write before going on. Under FSDP (several ranks): always synchronous.
    async_checkpoint: bool = False
    resume: bool = True  # continue from the run directory's latest checkpoint
    # a checkpoint that fails its manifest's check on resume: skip (move it aside to damaged.step_*, resume from the
    # newest that verifies) or refuse (stop, leaving it where it is, to look first)
    resume_damaged: ResumeDamaged = "skip"
    # on SIGTERM, SIGUSR1 or SIGINT the run checkpoints its last completed step and exits with code 75; past this many
    # seconds from the signal it exits without that checkpoint (the previous one is whole): below the scheduler's
    # grace period (Slurm's KillWait and Kubernetes' terminationGracePeriodSeconds are 30 s by default)
    preempt_grace_s: float = field(25.0, gt=0, unit="seconds")
    overwrite: bool = False  # with resume=false: move an earlier run in the directory aside (<name>.<date-time>) first
    samples_per_step: int = 4  # decoded responses written to samples/ each step
    # where metrics go besides metrics.jsonl (always written): console (one line per step), tensorboard
    # (<run>/tensorboard/), wandb (Weights & Biases, pip install 'dapo[wandb]'), mlflow (pip install 'dapo[mlflow]');
    # rank 0 only
    loggers: list[Logger] = field(default_factory=lambda: ["console", "tensorboard"])
    wandb: WandbConfig = field(default_factory=WandbConfig)  # with wandb in run.loggers
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)  # with mlflow in run.loggers
    progress: bool = True  # console progress bar (with console in run.loggers)
    # library messages (vLLM, Ray, transformers) on the console: debug, info, warning or error; train.log has them all
    log_level: LogLevel = "warning"
    # the step watchdog (see the manual's Reliability page): a phase of a step (generate, reward, old_logprob,
    # update, weight_sync, checkpoint, eval) that runs past watchdog_factor x its slowest completed run (at least
    # watchdog_floor_s; its first run: watchdog_first_s) writes every thread's stack to the rank's train.log and
    # prints one line naming the rank and the phase; past watchdog_exit_factor x that limit the process ends with
    # exit code 124, to be restarted into a resume
    watchdog: bool = True
    # a phase's late limit: this many times its slowest completed run (at least watchdog_floor_s)
    watchdog_factor: float = field(
        5.0, ge=1, why=f"a phase is late past this multiple of its slowest completed run; {WATCHDOG_OFF}"
    )
    watchdog_floor_s: float = field(600.0, gt=0, unit="seconds", why=WATCHDOG_OFF)  # no phase is late sooner
    # the limit of a phase that has not completed once yet (first generation, evaluation)
    watchdog_first_s: float = field(1800.0, gt=0, unit="seconds", why=WATCHDOG_OFF)
    # a phase's exit limit: this many times its late limit; past it the process ends with exit code 124
    watchdog_exit_factor: float = field(
        3.0,
        gt=1,
        why=f"the process ends at this multiple of a phase's limit, after the late line and the stacks; {WATCHDOG_OFF}",
    )
    # optimizer updates in a row whose loss or gradient norm is not finite (each skipped, the weights and AdamW state
    # left as they were) before the run stops saying what to check; null: skip them and go on (the reference)
    max_nonfinite_in_a_row: int | None = field(5, gt=0, null="never stop, skip them all")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name
