"""The job configuration: one dataclass per TOML section, a one-line docstring under every field.

The docstrings are the `--help` text and the source of docs/configuration.md. Key names follow torchtitan
v0.2.2's TOML schema wherever the concept is the same, so existing TOML files run unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Job:
    config_file: str = ""
    """TOML file whose values override the defaults (command-line overrides win over it)"""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: resolved config, metrics.jsonl, TensorBoard, checkpoints"""
    description: str = "torchtitan job"
    """Free-text description, printed at start"""
    print_config: bool = False
    """Also print the whole resolved config at start (rank 0); it is always saved to save_config_file"""
    save_config_file: str = "job_config.json"
    """File name, inside dump_folder, where the resolved config is saved ("" = do not save)"""


@dataclass
class Model:
    name: str = "llama3"
    """Architecture, a key of the model registry (torchtitan/models)"""
    flavor: str = "debugmodel"
    """Size preset of the architecture, e.g. debugmodel, 1B, 8B, 70B, 405B"""
    n_layers: int = 0
    """Transformer blocks (0 = the flavor's): the flavor's block shapes that many times, e.g. a 2-block 8B smoke test"""
    tokenizer_path: str = ""
    """tokenizer.json file or a folder holding one ("" = the default BPE trained on the embedded corpus)"""
    converters: list[str] = field(default_factory=list)
    """Model converters applied after building and before parallelisms: "float8" ([float8]), "lora" ([lora])"""
    attn_mask_type: str = "causal"
    """causal (every earlier token of the packed row) | block_causal (only its own document's; docs/data.md)"""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer: AdamW or Adam"""
    lr: float = 8e-4
    """Peak learning rate"""
    beta1: float = 0.9
    """Adam beta1"""
    beta2: float = 0.95
    """Adam beta2"""
    eps: float = 1e-8
    """Adam epsilon"""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW); applied to every parameter"""
    implementation: str = "fused"
    """fused | foreach | for-loop (fused falls back to foreach where the device has no fused kernel)"""
    early_step_in_backward: bool = False
    """Step each parameter during backward to save gradient memory (not available yet)"""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from near zero to optimizer.lr"""
    decay_ratio: float | None = None
    """Fraction of steps spent decaying at the end (None = decay over all steps after warmup; set = WSD)"""
    decay_type: str = "linear"
    """Shape of the decay: linear | sqrt | cosine"""
    min_lr_factor: float = 0.0
    """The LR decays to min_lr_factor * optimizer.lr"""


@dataclass
class Training:
    dataset: str = "python_stdlib"
    """Dataset name from the registry (python_stdlib = the embedded default corpus; python_stdlib_chat for chat)"""
    dataset_path: str = ""
    """Local file, folder or glob (json/jsonl/parquet/txt), hub dataset, or pre-tokenized folder; empty = registry"""
    dataset_mixture: list[str] = field(default_factory=list)
    """Weighted sources "name_or_path:weight[:column=NAME]", e.g. ["c4:0.7", "/data/qa.jsonl:0.3:column=answer"];
    replaces dataset/dataset_path"""
    dataset_text_column: str = "text"
    """Column (json/parquet/hub record field) holding each document's text"""
    dataset_split: str = "train"
    """Split of a hub or local dataset to read"""
    dataset_streaming: str = "auto"
    """auto | true | false: stream instead of loading into the datasets cache (auto: hub and local data > 1 GB)"""
    dataset_format: str = "text"
    """text (documents) | chat (messages) | prompt_response | alpaca | auto (from the fields): docs/finetuning.md"""
    chat_template: str = "auto"
    """Chat data: auto (the tokenizer's, else by its tokens) | tokenizer | llama3 | chatml | deepseek_v3 | a .jinja"""
    train_on: str = "assistant"
    """Chat data: assistant (labels on assistant replies and their end-of-turn token only) | all (every token)"""
    sft_packing: str = "pad"
    """Chat data: pad (one conversation per row) | pack (several per row; needs model.attn_mask_type block_causal)"""
    truncation: str = "truncate"
    """Chat data: a conversation over seq_len + 1 tokens is cut (truncate) or skipped (drop); both are counted"""
    num_workers: int = -1
    """Processes per rank that tokenize ahead of the step (0 = the training process does; -1 = 2 on GPU, 0 on CPU)"""
    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank"""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks (-1 = local_batch_size x DP degree; larger = accumulation)"""
    seq_len: int = 2048
    """Tokens per training sequence"""
    loss_chunks: int = 0
    """Token chunks in which the output projection and cross-entropy run (0 = auto: fp32 logits <= 256 MiB each)"""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value (<= 0 disables clipping, the norm is still logged)"""
    on_nonfinite: str = "stop"
    """stop | skip: on a NaN/inf loss or gradient norm, stop (naming the step and gradient) or skip the update"""
    steps: int = 10000
    """Number of optimizer steps to train"""
    enable_cpu_offload: bool = False
    """Offload parameters, gradients and optimizer state to CPU (not available yet)"""
    mixed_precision_param: str = "bfloat16"
    """Dtype of parameters during forward/backward under FSDP: bfloat16 | float32 (CPU always float32)"""
    mixed_precision_reduce: str = "float32"
    """Dtype of the gradient reduce-scatter / all-reduce: float32 | bfloat16"""
    tf32: bool = True
    """Use TF32 tensor cores for fp32 matmuls/convs on NVIDIA GPUs (false = full fp32); MFU uses the matching peak"""
    gc_freq: int = 50
    """Every gc_freq steps: Python's garbage collection (automatic collection is off) and, on CPU, heap trimming"""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas in data parallel (DDP when dp_shard is 1, HSDP when both are > 1)"""
    data_parallel_shard_degree: int = -1
    """Ranks that shard parameters with FSDP2 (-1 = all ranks left over by the other dimensions)"""
    fsdp_reshard_after_forward: str = "default"
    """default | always | never: free gathered parameters after forward (default: yes, except the last block)"""
    tensor_parallel_degree: int = 1
    """Tensor-parallel degree (innermost mesh dim; sequence parallel included): keep it within a node"""
    disable_loss_parallel: bool = False
    """Gather vocab-sharded logits before the loss instead of loss parallel (with tensor parallel)"""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with matmuls via inductor and symmetric memory (CUDA, needs compile.enable)"""
    pipeline_parallel_degree: int = 1
    """Pipeline-parallel degree: ranks the model's stages are spread over (outermost mesh dim)"""
    pipeline_parallel_schedule: str = "1F1B"
    """GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble | DualPipeV (or CSV, below)"""
    pipeline_parallel_schedule_csv: str = ""
    """Custom schedule: compute-only CSV, a row of actions (0F0, 1B0..) per pp rank; schedule PipelineScheduleMulti"""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch (local_batch_size / this = micro-batches per schedule step)"""
    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer blocks per pipeline stage (None = 1 stage per rank, 2 for multi-stage schedules, split evenly)"""
    module_fqns_per_model_part: list[list[str]] | None = None
    """Module names of each pipeline stage, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]"""
    context_parallel_degree: int = 1
    """Context-parallel degree: every sequence is split over this many ranks (2 chunks each, one early, one late)"""
    context_parallel_rotate_method: str = "allgather"
    """How context-parallel attention exchanges K/V: allgather (every rank gathers all K/V) | alltoall (not yet)"""
    expert_parallel_degree: int = 1
    """Ranks each MoE layer's experts are spread over (all-to-all); borrowed from dp_shard x cp, which it divides"""
    expert_tensor_parallel_degree: int = 1
    """1, or tensor_parallel_degree: split each expert's hidden units over the tp ranks (else tp ranks split tokens)"""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the newest complete one in folder"""
    folder: str = "checkpoint"
    """Checkpoint folder inside job.dump_folder"""
    interval: int = 500
    """Save every this many steps"""
    async_mode: str = "disabled"
    """disabled | async | async_with_pinned_mem"""
    keep_latest_k: int = 10
    """Keep only the newest k checkpoints (0 = keep all)"""
    load_step: int = -1
    """Step to resume from (-1 = newest complete checkpoint)"""
    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not restored on resume, e.g. ["optimizer", "dataloader"]"""
    last_save_model_only: bool = True
    """The final save holds only model weights"""
    export_dtype: str = "float32"
    """Dtype of the final exports, model-only (step-N-model) and Hugging Face (step-N-hf): float32 | bfloat16. The
    default keeps the weights as trained (the HF model's logits equal ours); bfloat16 halves the files.
    scripts/convert_checkpoint.py dcp-to-hf --dtype has the same default"""
    initial_load_path: str = ""
    """Checkpoint to initialise from when the run has none of its own"""
    initial_load_model_only: bool = True
    """Load only model weights from initial_load_path"""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face safetensors folder"""
    last_save_in_hf: bool = False
    """Write the final model-only save in Hugging Face format"""
    create_seed_checkpoint: bool = False
    """Write an initial checkpoint on one process and exit"""
    enable_first_step_checkpoint: bool = False
    """Also save right after step 1"""
    save_on_signal: str = "SIGTERM"
    """Signal that makes every rank save a checkpoint after the current step and exit: SIGTERM | SIGUSR1 | none"""


@dataclass
class ActivationCheckpoint:
    mode: str = "none"
    """none | selective | full: recompute block activations in backward to save memory"""
    selective_ac_option: str = "2"
    """Selective AC: "op" or N = checkpoint every Nth block"""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile the components below (the model per transformer block)"""
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What to compile: model, loss"""
    backend: str = "inductor"
    """torch.compile backend"""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps (and at step 1 and the last step)"""
    enable_tensorboard: bool = False
    """Write TensorBoard event files"""
    save_tb_folder: str = "tb"
    """TensorBoard folder inside job.dump_folder"""
    enable_wandb: bool = False
    """Log to Weights & Biases (WANDB_MODE=offline works without network)"""
    save_for_all_ranks: bool = False
    """Every rank writes its own metrics files (default: rank 0 only)"""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Process-group timeout until the first training step ends (covers initialisation)"""
    train_timeout_seconds: int = 100
    """Process-group timeout after the first step: a hung collective fails after this long"""
    trace_buf_size: int = 20000
    """Flight-recorder buffer entries for NCCL (0 = off)"""


@dataclass
class Debug:
    seed: int | None = None
    """Random seed for initialisation (None = 0; the same on every rank so every layout starts equal)"""
    deterministic: bool = False
    """Use deterministic algorithms (slower) so a rerun is bitwise identical"""


@dataclass
class Validation:
    enable: bool = False
    """Compute validation loss and perplexity every `freq` steps"""
    dataset: str = "python_stdlib_val"
    """Validation dataset name from the registry (python_stdlib_chat_val: held-out conversations for chat data)"""
    dataset_path: str = ""
    """Local path or hub name for validation data (same formats as training.dataset_path)"""
    dataset_split: str = "train"
    """Split to read with dataset_path (local files have only "train"; hub datasets often "validation")"""
    dataset_text_column: str = "text"
    """Column holding each validation document's text"""
    dataset_streaming: str = "auto"
    """auto | true | false, as training.dataset_streaming"""
    freq: int = 10
    """Validate every this many steps"""
    steps: int = -1
    """Validation batches per evaluation (-1 = one full pass over the validation dataset)"""
    local_batch_size: int = -1
    """Validation sequences per micro-batch on each data-parallel rank (-1 = training.local_batch_size)"""
    seq_len: int = -1
    """Validation tokens per sequence (-1 = training.seq_len)"""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Save a torch.profiler Chrome trace of every profile_freq-th step, one file per rank (docs/performance.md)"""
    save_traces_folder: str = "profile_traces"
    """Trace folder inside job.dump_folder: <folder>/iteration_<step>/rank<r>_trace.json"""
    profile_freq: int = 10
    """Trace (and snapshot) the steps that are multiples of this; each trace follows up to 2 warmup steps"""
    enable_memory_snapshot: bool = False
    """CUDA: record allocator history; snapshot to <dump_folder>/memory_snapshot every profile_freq steps and on OOM"""


@dataclass
class MemoryEstimation:
    enable: bool = False
    """Print rank 0's estimated peak memory for this layout and exit instead of training (no process group)"""
    disable_fake_mode: bool = False
    """Estimate with real tensors instead of fake ones (not available yet)"""
    expert_load_factor: float = 1.25
    """Expert parallel: rows each rank's experts receive, relative to perfectly balanced routing (its headroom)"""
    device_memory_gib: float = 0.0
    """Memory per device the verdict compares with, GiB (0 = this machine's: the GPU's, or the host's per local rank)"""


@dataclass
class Moe:
    load_balance_coeff: float | None = None
    """Auxiliary-loss-free balancing: step of each expert's routing bias per optimizer step (unset = the flavor's)"""
    aux_loss_coeff: float | None = None
    """Weight of the MoE balance loss added to the training loss (unset = the flavor's; 0 = off; docs/models.md)"""
    aux_loss_scope: str | None = None
    """Tokens the balance loss counts over: sequence | microbatch | global_batch (unset = the flavor's)"""
    router_z_loss_coeff: float | None = None
    """Weight of the router z-loss, mean over tokens of logsumexp(router logits)^2 (unset = the flavor's; 0 = off)"""
    collapse_load_fraction: float = 0.75
    """Warn when a layer's busiest expert gets this fraction of its most possible load, num_experts/top_k x the mean"""
    collapse_warn_after_steps: int = 10
    """... for this many consecutive steps (then again every collapse_warn_every_steps while it lasts)"""
    collapse_warn_every_steps: int = 100
    """Steps between repeated warnings about a layer that stays near collapse"""


@dataclass
class Float8:
    recipe_name: str = "tensorwise"
    """Scaling of float8 matmuls (torchao): tensorwise | rowwise | rowwise_with_gw_hp (docs/float8.md)"""
    enable_fsdp_float8_all_gather: bool = False
    """tensorwise only: FSDP all-gathers float8 weights (half the bytes of bf16)"""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With the float8 all-gather: every weight's scale in one all-reduce after the optimizer step"""
    filter_fqns: list[str] = field(default_factory=list)
    """Linear layers kept in high precision: those whose name contains one of these (output and routers always)"""
    skip_small_layers: bool = True
    """Keep layers under torchao's size thresholds in high precision (false: convert all with dims divisible by 16)"""
    round_scales_to_power_of_2: bool | None = None
    """Round scales down to powers of 2 (exact rescaling; unset = the recipe's choice: rowwise yes, tensorwise no)"""


@dataclass
class Lora:
    rank: int = 8
    """Rank r of each adapter: A is [r, in_features], B is [out_features, r] (docs/finetuning.md, LoRA)"""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank"""
    dropout: float = 0.0
    """Dropout probability on the adapter's input (the base projection sees the undropped input)"""
    target_modules: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo"])
    """Linear layers that get adapters, by the last part of their name (e.g. wq, w1), or ["all-linear"]; never output"""
    save_adapter_only: bool = False
    """Checkpoints hold the trainable parameters (adapters), their optimizer and the training state, not the base"""


@dataclass
class Rl:
    enable: bool = False
    """GRPO post-training (docs/rl.md); set by `python -m torchtitan.rl.train`, refused by the pretraining trainer"""
    group_size: int = 4
    """Completions sampled per prompt (G); advantages compare the completions of one prompt"""
    prompts_per_step: int = 8
    """Prompts drawn and rolled out per step (all ranks together)"""
    train_groups: int = 0
    """Groups drawn from the buffer for each RL step's policy update (0: prompts_per_step)"""
    ppo_epochs: int = 1
    """Passes over each step's drawn groups; each pass makes one optimizer step per mini-batch"""
    mini_batch_size: int = 0
    """Groups per optimizer step: the drawn groups make ceil(groups / this) steps per pass (0: one step per pass)"""
    shuffle_mini_batches: bool = True
    """Each pass cuts the drawn groups into mini-batches in a fresh order, seeded by run seed, step and pass"""
    micro_batch_size: int = 0
    """Completions per forward/backward on each data-parallel rank, gradients accumulated (0: its whole share)"""
    max_new_tokens: int = 64
    """Tokens generated per completion at most; prompt + max_new_tokens must fit training.seq_len"""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0)"""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts: the smallest set of tokens whose probability reaches top_p (1: off)"""
    clip_low: float = 0.2
    """The importance ratio is clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """The importance ratio is clipped above at 1 + clip_high (larger than clip_low: DAPO's clip higher)"""
    kl_coeff: float = 0.0
    """Weight of the k3 KL penalty to the frozen initial policy (0: no reference model is built)"""
    loss_aggregation: str = "token"
    """token: sum over response tokens / their count | sequence: mean per completion, then over completions"""
    std_normalize: bool = True
    """Divide each group's centred rewards by the group's standard deviation (+1e-6)"""
    buffer_sampling: str = "fifo"
    """fifo (each group trains once) | uniform | prioritized (by mean |advantage|): docs/rl.md"""
    buffer_capacity: int = 0
    """Groups the replay buffer holds at most; the oldest go first (0: unbounded)"""
    buffer_max_lag: int = 0
    """Groups generated more than this many policy versions ago are evicted (-1: never; 0: on-policy only)"""
    drop_zero_variance: bool = True
    """Keep groups whose rewards are all equal (zero advantages) out of the buffer, counting them"""
    rewards: list[str] = field(default_factory=lambda: ["exact_answer"])
    """Reward functions, built in (exact_answer, format) or module:function, summed with reward_weights"""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per entry of rewards (empty: all 1)"""
    task: str = "synthetic"
    """synthetic (arithmetic generated from the seed, offline) | gsm8k (question/answer records, rl.dataset_path)"""
    dataset_path: str = ""
    """gsm8k: a local .jsonl file with question and answer fields, or a hub dataset name (openai/gsm8k)"""
    dataset_config: str = "main"
    """gsm8k from the hub: the dataset's config name"""
    dataset_split: str = "train"
    """gsm8k from the hub: the split"""
    synthetic_digits: int = 2
    """synthetic: digits of each operand"""
    synthetic_ops: str = "+-"
    """synthetic: the operators drawn from, among + - *"""
    chat_template: str = ""
    """Render each question as a user turn with this chat template (as training.chat_template); empty: plain text"""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    moe: Moe = field(default_factory=Moe)
    float8: Float8 = field(default_factory=Float8)
    lora: Lora = field(default_factory=Lora)
    rl: Rl = field(default_factory=Rl)
