"""The layout matrix: every parallel layout the parity suite trains, each against a 1-process reference.

Every layout trains the same global batch (8 sequences of 64 tokens) of the small debug model for STEPS steps in
fp32, with validation after each step (so a step follows a validation), and must match its reference in
loss, gradient norm, validation loss and every parameter (tests/integration/parity.py, docs/testing.md).
Every data-parallel layout accumulates gradients (local batch x DP degree < 8) unless it says otherwise.
"""

from __future__ import annotations

from pathlib import Path

from tests.integration.parity import Layout

GLOBAL_BATCH = 8
# 2 steps: step 1's gradients come from equal weights, step 2's from one update and after a validation; the
# parameters are compared after each update (the second one's moments hold step 1's gradients) and AdamW's moments
# after the last, which a third step would have shown only through its update. Most of a layout's time is its steps
# (DTensor and FSDP Python overhead times the ranks on two cores): a third cost 40-50% more per layout, and every
# planted bug of the harness's tests fails at 2 steps as at 3 (2026-11-27).
STEPS = 2
# The parity runs (train_parity in tests/integration/conftest.py): COMMON, then these.
PARITY = ("--training.steps", str(STEPS), "--validation.freq", "1")

# Blocks of the small models in every integration run (model.n_layers; the flavors have 4, DeepSeek's 3): blocks are
# identical, so a second one already shows everything that crosses blocks (FSDP's prefetch and per-block units,
# every-other-block AC, a block per pipeline stage), and most of a layout's time is its blocks' DTensor and FSDP
# Python overhead: 2 blocks cost about a quarter less than 4 (2026-11-27, docs/testing.md). Multi-stage pipeline
# schedules need 4 stages over 2 ranks: those layouts and their references train the flavor's 4 (deep() below).
BLOCKS = 2
FOUR_BLOCKS = ("--model.n_layers", "4")

# What every integration run of the small model shares; the other test files' runs set their own steps on top.
COMMON = (
    "--model.flavor", "debugmodel_small",
    "--model.n_layers", str(BLOCKS),
    "--training.steps", "3",
    "--training.seq_len", "64",
    "--training.global_batch_size", str(GLOBAL_BATCH),
    "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1",
    "--lr_scheduler.warmup_steps", "2",
    # The gradient norm stays around 0.6 in these steps: clipping binds at every step (except where turned off).
    "--training.max_norm", "0.2",
    "--debug.seed", "11",
    "--job.print_config", "false",
    "--comm.init_timeout_seconds", "60",
    "--comm.train_timeout_seconds", "60",
    # the first 8 validation sequences, the same 8 in every layout (validation.local_batch_size = 8 / DP degree), after
    # steps 2 and 3 (the parity runs: after each step)
    "--validation.enable", "true",
    "--validation.freq", "2",
    "--validation.steps", "1",
)


def dp(local_batch: int, dp_degree: int) -> tuple[str, ...]:
    """Training and validation batch for a data-parallel degree (validation: one global batch of 8)."""
    return ("--training.local_batch_size", str(local_batch),
            "--validation.local_batch_size", str(GLOBAL_BATCH // dp_degree))


# Document masking: attention within each packed document, rotary positions restarting in each. On short documents
# (one sentence each, tests/integration/data/make_short_documents.py) every 64-token row packs several of them.
_SHORT_DOCUMENTS_FILE = str(Path(__file__).parent / "data" / "short_documents.jsonl")
SHORT_DOCUMENTS = ("--training.dataset_path", _SHORT_DOCUMENTS_FILE, "--validation.dataset_path", _SHORT_DOCUMENTS_FILE)
_BLOCK_CAUSAL = (*SHORT_DOCUMENTS, "--model.attn_mask_type", "block_causal")

# Mixture of experts: a small Qwen3 MoE (8 experts, top-2, auxiliary-loss-free balancing whose expert load is summed
# over the data ranks after every step, so the routing biases equal one process's).
_QWEN3 = ("--model.name", "qwen3", "--model.flavor", "debugmodel_small")
_EP2 = ("--parallelism.expert_parallel_degree", "2")
_ETP2 = ("--parallelism.expert_tensor_parallel_degree", "2")
_MOE = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small")
# ... with the sequence-level balance loss too, whose gradient is a mean over the global batch's sequences.
_MOE_AUX = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small_aux")
# ... with the balance loss over the global batch instead (its expert counts summed over every rank that holds tokens
# of the micro-step: dp x cp x tp) and the router z-loss. Without accumulation: with it, the scope is each
# micro-step's tokens, which a 1-process run of one micro-batch does not have.
_MOE_GLOBAL = (*_MOE_AUX, "--moe.aux_loss_scope", "global_batch", "--moe.router_z_loss_coeff", "0.1")

REFERENCES = {
    "single_process": Layout("single_process", 1, dp(8, 1)),
    "single_process_tied": Layout("single_process_tied", 1, (*dp(8, 1), "--model.flavor", "debugmodel_small_tied")),
    "single_process_no_clip": Layout("single_process_no_clip", 1, (*dp(8, 1), "--training.max_norm", "0")),
    "single_process_block_causal": Layout("single_process_block_causal", 1, (*dp(8, 1), *_BLOCK_CAUSAL)),
    "single_process_qwen3": Layout("single_process_qwen3", 1, (*dp(8, 1), *_QWEN3)),
    "single_process_moe": Layout("single_process_moe", 1, (*dp(8, 1), *_MOE)),
    "single_process_moe_aux": Layout("single_process_moe_aux", 1, (*dp(8, 1), *_MOE_AUX)),
    "single_process_moe_global": Layout("single_process_moe_global", 1, (*dp(8, 1), *_MOE_GLOBAL)),
    "single_process_short_documents": Layout("single_process_short_documents", 1, (*dp(8, 1), *SHORT_DOCUMENTS)),
}

# The output projection and loss in 3 token chunks (torchtitan/models/decoder.py: each chunk's logits recomputed in
# the backward), against references that score all tokens at once: under FSDP (the tied weight in the root unit),
# TP with and without loss parallel, and the pipeline's last stage; training and validation.
CHUNKED_LOSS = ("--training.loss_chunks", "3")
_REPLICATE = ("--parallelism.data_parallel_replicate_degree",)
_TP2 = ("--parallelism.tensor_parallel_degree", "2")

LAYOUTS = [
    # FSDP 2 with knobs that cannot mask an FSDP error: reshard-never, deterministic mode.
    Layout("fsdp2_accum_reshard_never_deterministic", 2, (*dp(2, 2),
           "--parallelism.fsdp_reshard_after_forward", "never", "--debug.deterministic", "true")),
    Layout("fsdp2_full_ac_data_workers", 2, (*dp(4, 2), "--activation_checkpoint.mode", "full",
                                             "--training.num_workers", "2")),
    # Tied embedding/output lives in FSDP's root unit; every-2nd-block AC rides along.
    Layout("fsdp2_tied_ac_every2_accum_chunked_loss", 2, (*dp(2, 2), "--model.flavor", "debugmodel_small_tied",
                                                          *CHUNKED_LOSS,
                                             "--activation_checkpoint.mode", "selective",
                                             "--activation_checkpoint.selective_ac_option", "2"),
           reference="single_process_tied"),
    Layout("ddp2_accum", 2, (*dp(2, 2), *_REPLICATE, "2", "--parallelism.data_parallel_shard_degree", "1")),
    Layout("hsdp2x2_accum", 4, (*dp(1, 4), *_REPLICATE, "2")),
    # Tensor parallel (sequence parallel included): TP ranks read the same data, so the DP degree is world / tp.
    Layout("tp2_no_loss_parallel_accum_chunked_loss", 2, (*dp(4, 1), *_TP2, "--parallelism.disable_loss_parallel",
                                                          "true", *CHUNKED_LOSS)),
    Layout("fsdp2_tp2_op_ac_accum_chunked_loss", 4, (*dp(2, 2), *_TP2, *CHUNKED_LOSS,
                                                     "--activation_checkpoint.mode", "selective",
                                        "--activation_checkpoint.selective_ac_option", "op")),
    Layout("hsdp2x1_tp2_accum", 4, (*dp(2, 2), *_TP2, *_REPLICATE, "2")),
    # Eight ranks on a 3-D mesh (replicate x shard x tp); one micro-batch to stay within the budget.
    Layout("hsdp2x2_tp2", 8, (*dp(2, 4), *_TP2, *_REPLICATE, "2")),
    # torch.compile per block on TP 2 with loss parallel (the loss eager there, validation eager): the one
    # compiled layout, since a cold inductor compile costs ~15 s of CI time.
    Layout("tp2_compile", 2, (*dp(8, 1), *_TP2, "--compile.enable", "true")),
    # Clipping off: the global gradient norm is logged but not applied.
    Layout("fsdp2_no_clip_accum", 2, (*dp(2, 2), "--training.max_norm", "0"), reference="single_process_no_clip"),
]

def deep(layout: Layout) -> Layout:
    """`layout` with 4 blocks, against its reference's 4-block twin (registered here on first use)."""
    reference = f"{layout.reference}_4blocks"
    if reference not in REFERENCES:
        REFERENCES[reference] = Layout(reference, 1, (*REFERENCES[layout.reference].overrides, *FOUR_BLOCKS))
    overrides = layout.overrides if FOUR_BLOCKS[0] in layout.overrides else (*layout.overrides, *FOUR_BLOCKS)
    return Layout(layout.name, layout.nproc, overrides, reference=reference)


def deep_if_set(layout: Layout) -> Layout:
    """deep(layout) when its overrides already ask for 4 blocks (a layout derived from a deep one), else layout."""
    return deep(layout) if FOUR_BLOCKS[0] in layout.overrides else layout


# Pipeline parallel: the loss lives on the last stage; FQNs, init and the optimizer state follow the whole model.
_PP2 = ("--parallelism.pipeline_parallel_degree", "2")


def pp(schedule: str) -> tuple[str, ...]:
    return (*_PP2, "--parallelism.pipeline_parallel_schedule", schedule)


PP_LAYOUTS = [
    Layout("pp2_gpipe", 2, (*dp(8, 1), *pp("GPipe"))),
    Layout("pp2_1f1b_accum_mb2_chunked_loss", 2, (*dp(4, 1), *pp("1F1B"), *CHUNKED_LOSS,
                                                  "--parallelism.pipeline_parallel_microbatch_size", "2")),
    # Multi-stage schedules: 2 stages per rank, one block each (the V schedules place them in a V), so 4 blocks.
    deep(Layout("pp2_interleaved1f1b", 2, (*dp(8, 1), *pp("Interleaved1F1B")))),
    deep(Layout("pp2_loopedbfs", 2, (*dp(8, 1), *pp("LoopedBFS")))),
    deep(Layout("pp2_interleaved_zero_bubble", 2, (*dp(8, 1), *pp("InterleavedZeroBubble")))),
    deep(Layout("pp2_zbv_zero_bubble", 2, (*dp(8, 1), *pp("ZBVZeroBubble")))),
    deep(Layout("pp2_dualpipev", 2, (*dp(8, 1), *pp("DualPipeV")))),
    deep(Layout("pp2_csv_gpipe", 2, (*dp(8, 1), *pp("PipelineScheduleMulti"),
                                     "--parallelism.pipeline_parallel_schedule_csv",
                                     str(Path(__file__).parent / "data" / "pp2_gpipe_8mb.csv")))),
    deep(Layout("pp2_explicit_split_full_ac", 2, (*dp(8, 1), *pp("1F1B"), "--activation_checkpoint.mode", "full",
                                                  "--parallelism.module_fqns_per_model_part",
                                                  '[["tok_embeddings", "layers.0"], ["layers.1", "layers.2", '
                                                  '"layers.3", "norm", "output"]]'))),
    deep(Layout("pp2_fsdp2_interleaved", 4, (*dp(4, 2), *pp("Interleaved1F1B")))),
    Layout("pp2_tp2_chunked_loss", 4, (*dp(8, 1), *pp("1F1B"), *_TP2, *CHUNKED_LOSS)),
    # torch's input-gradient backward detaches stage outputs in place: TP's stage outputs must not be views
    deep(Layout("pp2_tp2_zbv_zero_bubble", 4, (*dp(8, 1), *pp("ZBVZeroBubble"), *_TP2))),
    # torch's stage keeps FSDP parameters unsharded and gradients unreduced until the stage's last backward
    deep(Layout("pp2_fsdp2_interleaved_zero_bubble", 4, (*dp(4, 2), *pp("InterleavedZeroBubble")))),
    Layout("pp2_hsdp2x2", 8, (*dp(2, 4), *pp("1F1B"), *_REPLICATE, "2")),
    Layout("pp2_fsdp2_tp2", 8, (*dp(4, 2), *pp("1F1B"), *_TP2)),
]

# Context parallel: every sequence split over the cp ranks (two chunks each); cp ranks read the same data, so the
# DP degree is world / (cp x tp), and FSDP shards over dp_shard x cp.
_CP2 = ("--parallelism.context_parallel_degree", "2")

# The mesh work (the K/V all-gather over cp, FSDP over dp_shard x cp, sequence parallel inside each cp shard, the
# chunk order) is the same with and without document masking; only the mask and where positions come from differ.
# So each mesh runs once, with the masks where they add to it (below), and causal attention keeps the layouts where
# its own positions path differs: CP alone, HSDP x CP, and later pipeline stages' positions from the cp rank.
_CP_MESHES = [
    Layout("cp2", 2, (*dp(8, 1), *_CP2)),
    Layout("cp4_accum_full_ac", 4, (*dp(4, 1), "--parallelism.context_parallel_degree", "4",
                                    "--activation_checkpoint.mode", "full")),
    Layout("fsdp2_cp2_accum", 4, (*dp(2, 2), *_CP2)),
    Layout("tp2_cp2", 4, (*dp(8, 1), *_CP2, *_TP2)),
    Layout("hsdp2x1_cp2", 4, (*dp(4, 2), *_CP2, *_REPLICATE, "2")),
    # later stages take hidden states: their rotary positions come from the cp rank, as the first stage's do
    deep(Layout("pp2_cp2_interleaved", 4, (*dp(8, 1), *_CP2, *pp("Interleaved1F1B")))),
]
CP_LAYOUTS = [layout for layout in _CP_MESHES if layout.name in ("cp2", "hsdp2x1_cp2", "pp2_cp2_interleaved")]

# Under CP every rank keeps the whole sequence's document ids (its keys come from every rank); under PP they reach
# every stage.
# HSDP x CP adds nothing to that: the replicate dimension does not touch document ids, and the data ranks' own
# document ids are covered by fsdp2_cp2_accum_block_causal.
BLOCK_CAUSAL_LAYOUTS = [
    deep_if_set(Layout(f"{layout.name}_block_causal", layout.nproc, (*layout.overrides, *_BLOCK_CAUSAL),
                       reference="single_process_block_causal"))
    for layout in _CP_MESHES if layout.name != "hsdp2x1_cp2"
]

# Dense Qwen3 under tensor parallel: its per-head q/k norms run sharded on the heads, their weight gradients summed
# over tp (without that the layouts fail).
# One layout: FSDP 2 x TP 2 with accumulation holds everything TP 2 with accumulation tested, on a 2-D mesh.
QWEN3_LAYOUTS = [Layout("qwen3_fsdp2_tp2_accum", 4, (*dp(2, 2), *_TP2, *_QWEN3), reference="single_process_qwen3")]

# FSDP with accumulation, TP 2 with accumulation and FSDP 2 x EP 2 with accumulation run with the balance loss on top
# (moe_aux_*, below): the same reductions of the bias update plus the loss's, in one layout each.
MOE_LAYOUTS = [Layout(name, nproc, (*overrides, *_MOE), reference="single_process_moe") for name, nproc, overrides in (
    ("moe_hsdp2x2_full_ac", 4, (*dp(2, 4), *_REPLICATE, "2", "--activation_checkpoint.mode", "full")),
    ("moe_pp2_1f1b", 2, (*dp(8, 1), *pp("1F1B"))),
    ("moe_fsdp2_cp2", 4, (*dp(4, 2), *_CP2)),
    # expert parallel: each rank holds half (a quarter) of every layer's experts; tokens travel by all-to-all
    ("moe_pp2_fsdp2_ep2", 4, (*dp(4, 2), *pp("1F1B"), *_EP2)),
    ("moe_fsdp2_cp2_ep4", 4, (*dp(4, 2), *_CP2, "--parallelism.expert_parallel_degree", "4")),
    # FSDP shards the experts again over the ranks EP leaves (efsdp 2), and HSDP replicates them over dp_replicate
    ("moe_fsdp4_ep2", 4, (*dp(2, 4), *_EP2)),
    ("moe_hsdp2x2_ep2", 4, (*dp(2, 4), *_REPLICATE, "2", *_EP2)),
    # tensor parallel: each tp rank runs the MoE layers on its own sequence shard, FSDP sums their gradients over tp
    ("moe_fsdp2_tp2_ep2", 4, (*dp(4, 2), *_TP2, *_EP2)),
    # tensor parallel inside the experts: each tp rank holds half of every expert's hidden units and computes them
    # for the rows of both tp ranks
    ("moe_tp2_etp2", 2, (*dp(4, 1), *_TP2, *_ETP2)),
    ("moe_fsdp2_tp2_etp2", 4, (*dp(4, 2), *_TP2, *_ETP2)),
    ("moe_fsdp2_tp2_ep2_etp2", 4, (*dp(4, 2), *_TP2, *_EP2, *_ETP2)),
)] + [deep_if_set(Layout(name, nproc, (*overrides, *_MOE_AUX), reference="single_process_moe_aux"))
      for name, nproc, overrides in (
    ("moe_aux_fsdp2_accum", 2, dp(2, 2)),
    ("moe_aux_pp2_interleaved", 2, (*dp(8, 1), *pp("Interleaved1F1B"), *FOUR_BLOCKS)),
    # tensor and context parallel split each sequence: its expert counts are summed over cp x tp in the forward
    ("moe_aux_tp2_accum", 2, (*dp(4, 1), *_TP2)),
    ("moe_aux_cp2_full_ac", 2, (*dp(8, 1), *_CP2, "--activation_checkpoint.mode", "full")),
    ("moe_aux_fsdp2_tp2_accum", 4, (*dp(2, 2), *_TP2)),
    ("moe_aux_fsdp2_ep2_accum", 2, (*dp(2, 2), *_EP2)),
)] + [Layout(name, nproc, (*overrides, *_MOE_GLOBAL), reference="single_process_moe_global")
      for name, nproc, overrides in (
    ("moe_global_tp2", 2, (*dp(8, 1), *_TP2)),
    ("moe_global_cp2", 2, (*dp(8, 1), *_CP2)),
    ("moe_global_fsdp2_tp2", 4, (*dp(4, 2), *_TP2)),
    ("moe_global_fsdp2_ep2_full_ac", 2, (*dp(4, 2), *_EP2, "--activation_checkpoint.mode", "full")),
)]

ALL_LAYOUTS = LAYOUTS + PP_LAYOUTS + CP_LAYOUTS + BLOCK_CAUSAL_LAYOUTS + QWEN3_LAYOUTS + MOE_LAYOUTS

# DeepSeek-V3 under tensor parallel: multi-head latent attention split over its heads, the low-rank projections and
# latent norms sequence parallel, the normed latent and the shared rotary key k_pe all-gathered (k_pe's gradient
# summed over the ranks' heads by the gather's reduce-scatter), a dense first block then MoE blocks with a shared
# expert on each rank's sequence shard. Without and with the low-rank query path (wq_a -> q_norm -> wq_b); the latter
# under FSDP 2 x TP 2 only, which holds all that TP 2 alone tested.
# A higher learning rate than the default: at 8e-4 the loss moved by only 0.07 in 6 steps, and a reference must
# visibly learn (test_reference_learns).
_DEEPSEEK_LR = ("--model.name", "deepseek_v3", "--optimizer.lr", "3e-3")
_DEEPSEEK = (*_DEEPSEEK_LR, "--model.flavor", "debugmodel_small")
_DEEPSEEK_QLORA = (*_DEEPSEEK_LR, "--model.flavor", "debugmodel_small_qlora")
REFERENCES["single_process_deepseek"] = Layout("single_process_deepseek", 1, (*dp(8, 1), *_DEEPSEEK))
REFERENCES["single_process_deepseek_qlora"] = Layout("single_process_deepseek_qlora", 1,
                                                     (*dp(8, 1), *_DEEPSEEK_QLORA))
DEEPSEEK_LAYOUTS = [
    Layout("deepseek_tp2_accum", 2, (*dp(4, 1), *_TP2, *_DEEPSEEK), reference="single_process_deepseek"),
    Layout("deepseek_qlora_fsdp2_tp2", 4, (*dp(4, 2), *_TP2, *_DEEPSEEK_QLORA),
           reference="single_process_deepseek_qlora"),
    Layout("deepseek_pp2_tp2", 4, (*dp(8, 1), *pp("1F1B"), *_TP2, *_DEEPSEEK), reference="single_process_deepseek"),
]
ALL_LAYOUTS += DEEPSEEK_LAYOUTS

# Float8 (torchao's tensorwise recipe, real float8 matmuls on CPU). The debug model's layers are all below torchao's
# size thresholds, so every eligible layer is forced to convert (every block's 7; the output projection stays in fp32).
# An activation's scale comes from the rows of the forward that casts it: a data-parallel rank's local batch, a
# pipeline micro-batch (TP reduces it over the tp ranks). So each layout is compared with the 1-process float8 run
# whose forwards take the same rows, in training and validation; CP, whose ranks scale their own part of each
# sequence, has no such run and is compared with the plain one. Scales are rounded down to powers of 2: with
# torchao's unrounded ones, float32 reduction-order noise moves a scale by an ulp and flips float8 roundings, up
# to 1e-5 in the loss and 4e-2 in one tensor's values, too coarse to see a wrong reduction (docs/float8.md).
_FLOAT8 = ("--model.converters", "float8", "--float8.skip_small_layers", "false",
           "--float8.round_scales_to_power_of_2", "true")
_FLOAT8_ALL_GATHER = ("--float8.enable_fsdp_float8_all_gather", "true",
                      "--float8.precompute_float8_dynamic_scale_for_fsdp", "true")


def _float8_reference(rows: int, val_rows: int) -> str:
    """The 1-process float8 run whose forwards take `rows` sequences (`val_rows` in validation, over as many
    validation steps as cover the same 8 sequences), registered."""
    name = "single_process_float8" if (rows, val_rows) == (8, 8) else f"single_process_float8_rows{rows}_val{val_rows}"
    REFERENCES[name] = Layout(name, 1, ("--training.local_batch_size", str(rows), "--validation.local_batch_size",
                                        str(val_rows), "--validation.steps", str(GLOBAL_BATCH // val_rows), *_FLOAT8))
    return name


FLOAT8_LAYOUTS = [Layout(name, nproc, (*overrides, *_FLOAT8), reference=_float8_reference(rows, val_rows))
                  for name, nproc, rows, val_rows, overrides in (
    # weights all-gathered in float8, their scales precomputed in one all-reduce after each optimizer step
    ("float8_fsdp2_all_gather_accum", 2, 2, 4, (*dp(2, 2), *_FLOAT8_ALL_GATHER)),
    ("float8_hsdp2x2_all_gather", 4, 2, 2, (*dp(2, 4), *_REPLICATE, "2", *_FLOAT8_ALL_GATHER)),
    ("float8_tp2", 2, 8, 8, (*dp(8, 1), *_TP2)),
    ("float8_fsdp2_tp2_all_gather_op_ac", 4, 4, 4, (*dp(4, 2), *_TP2, *_FLOAT8_ALL_GATHER,
                                                    "--activation_checkpoint.mode", "selective",
                                                    "--activation_checkpoint.selective_ac_option", "op")),
    # pipeline micro-batches of 1 sequence (pipeline_parallel_microbatch_size), in validation too
    ("float8_pp2_1f1b", 2, 1, 1, (*dp(8, 1), *pp("1F1B"))),
    ("float8_cp2", 2, 8, 8, (*dp(8, 1), *_CP2)),
)]
# torchao's rowwise recipe (a scale per row, rounded to a power of 2 by the recipe itself): under TP the row-parallel
# layers' rows are split over the tp ranks, so each row's amax must be reduced over them.
_FLOAT8_ROWWISE = ("--model.converters", "float8", "--float8.skip_small_layers", "false", "--float8.recipe_name",
                   "rowwise")
REFERENCES["single_process_float8_rowwise_rows4"] = Layout(
    "single_process_float8_rowwise_rows4", 1, ("--training.local_batch_size", "4", "--validation.local_batch_size",
                                               "4", "--validation.steps", "2", *_FLOAT8_ROWWISE))
FLOAT8_LAYOUTS.append(Layout("float8_rowwise_fsdp2_tp2", 4, (*dp(4, 2), *_TP2, *_FLOAT8_ROWWISE),
                             reference="single_process_float8_rowwise_rows4"))
ALL_LAYOUTS += FLOAT8_LAYOUTS

# LoRA (docs/finetuning.md): rank-4 adapters on every block projection, everything else frozen (the harness checks
# that frozen parameters get no gradient and keep their initial values bit for bit). B starts at zero, so step 1
# trains B alone; at the default learning rate the adapters hardly move the loss in 2 steps, hence 3e-2 (the
# validation loss falls by 2.7e-3 at 2 blocks; 6.5e-4 at 1e-2, too little for test_reference_learns, 2026-11-27).
LORA = ("--model.converters", "lora", "--lora.target_modules", "all-linear", "--lora.rank", "4", "--lora.alpha", "8",
         "--optimizer.lr", "3e-2")
REFERENCES["single_process_lora"] = Layout("single_process_lora", 1, (*dp(8, 1), *LORA))
LORA_LAYOUTS = [Layout(name, nproc, (*overrides, *LORA), reference="single_process_lora")
                for name, nproc, overrides in (
    # column-wise bases keep A whole and shard B's rows, row-wise ones shard A's columns and keep B whole; FSDP
    # shards both again and reduces the adapters' gradients only
    ("lora_fsdp2_tp2_op_ac_accum", 4, (*dp(2, 2), *_TP2, "--activation_checkpoint.mode", "selective",
                                       "--activation_checkpoint.selective_ac_option", "op")),
    ("lora_pp2_1f1b_full_ac", 2, (*dp(4, 1), *pp("1F1B"), "--activation_checkpoint.mode", "full")),
    # FSDP 2 alone, with every other block recomputed: adapters and frozen weights sharded in the same units
    ("lora_fsdp2_ac_every2", 2, (*dp(4, 2), "--activation_checkpoint.mode", "selective",
                                 "--activation_checkpoint.selective_ac_option", "2")),
    # DDP's gradient hook over a model of mostly frozen parameters, with accumulation
    ("lora_ddp2_accum", 2, (*dp(2, 2), *_REPLICATE, "2", "--parallelism.data_parallel_shard_degree", "1")),
    # HSDP 2x2 with accumulation: frozen weights sharded over dp_shard and replicated without a gradient, the
    # adapters' gradients reduce-scattered over the shards and all-reduced over the replicas (hsdp2x2_accum's mesh)
    ("lora_hsdp2x2_accum", 4, (*dp(1, 4), *_REPLICATE, "2")),
)]
ALL_LAYOUTS += LORA_LAYOUTS
