"""Registry of integration flavors: each is a layout launched through run_train.sh on CPU (gloo).

Every flavor trains the same global batch (8 sequences of 64 tokens) for the same steps in fp32, so its
per-step loss must match the 1-process reference (see docs/architecture.md, 'Every layout matches one
process'). New parallelisms add flavors here.
"""

from __future__ import annotations

from dataclasses import dataclass

GLOBAL_BATCH = 8
STEPS = 10


@dataclass(frozen=True)
class Flavor:
    name: str
    """test id"""
    nproc: int
    """processes launched by torchrun"""
    overrides: tuple[str, ...]
    """config overrides on top of the common ones"""
    reference: str = "single_process"
    """the 1-process flavor (in REFERENCES) whose losses this one must match"""


# The model and schedule shared by every flavor: small enough for seconds per run on 2 cores.
COMMON = (
    "--training.steps", str(STEPS),
    "--training.seq_len", "64",
    "--training.global_batch_size", str(GLOBAL_BATCH),
    "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1",
    "--lr_scheduler.warmup_steps", "2",
    "--debug.seed", "7",
    "--job.print_config", "false",
    # Validation on the held-out corpus: the first 2 global batches of 8 sequences, so every layout evaluates
    # the same 16 sequences (each flavor sets validation.local_batch_size = 8 / DP degree).
    "--validation.enable", "true",
    "--validation.freq", "5",
    "--validation.steps", "2",
)


def _val(dp_degree: int) -> tuple[str, str]:
    return ("--validation.local_batch_size", str(GLOBAL_BATCH // dp_degree))


REFERENCES = {
    "single_process": Flavor("single_process", 1, ("--training.local_batch_size", "8", *_val(1))),
    # Tied embedding/output (the 1B/3B layout) lives in FSDP's root unit: check it separately.
    "single_process_tied": Flavor("single_process_tied", 1, ("--training.local_batch_size", "8", *_val(1),
                                                             "--model.flavor", "debugmodel_tied")),
}

# Knobs that do not interact share a flavor: each run costs ~15-30 s of the CI budget (15 minutes in all).
FLAVORS = [
    # FSDP 2, plus knobs that cannot mask an FSDP error: accumulation, reshard-never, deterministic mode.
    Flavor("fsdp2_accum_reshard_never_deterministic", 2, ("--training.local_batch_size", "2", *_val(2),
                                                          "--parallelism.fsdp_reshard_after_forward", "never",
                                                          "--debug.deterministic", "true")),
    Flavor("fsdp2_full_ac_data_workers", 2, ("--training.local_batch_size", "4", *_val(2),
                                             "--activation_checkpoint.mode", "full", "--training.num_workers", "2")),
    # (FSDP 4 runs in the checkpoint tests: 20 steps straight, then resumed bitwise.)
    Flavor("hsdp2x2", 4, ("--training.local_batch_size", "2", *_val(4),
                          "--parallelism.data_parallel_replicate_degree", "2")),
    Flavor("ddp2", 2, ("--training.local_batch_size", "4", *_val(2),
                       "--parallelism.data_parallel_replicate_degree", "2",
                       "--parallelism.data_parallel_shard_degree", "1")),
    # Tied embedding/output lives in FSDP's root unit; every-2nd-block AC rides along.
    Flavor("fsdp2_tied_selective_ac_every2", 2, ("--training.local_batch_size", "4", *_val(2),
                                                 "--model.flavor", "debugmodel_tied",
                                                 "--activation_checkpoint.mode", "selective",
                                                 "--activation_checkpoint.selective_ac_option", "2"),
           reference="single_process_tied"),
    # Tensor parallel (with sequence parallel): TP ranks read the same data, so the DP degree is world / tp.
    Flavor("fsdp2_tp2_selective_ac_op", 4, ("--training.local_batch_size", "4", *_val(2),
                                            "--parallelism.tensor_parallel_degree", "2",
                                            "--activation_checkpoint.mode", "selective",
                                            "--activation_checkpoint.selective_ac_option", "op")),
    Flavor("hsdp2x1_tp2_no_loss_parallel", 4, ("--training.local_batch_size", "4", *_val(2),
                                               "--parallelism.tensor_parallel_degree", "2",
                                               "--parallelism.data_parallel_replicate_degree", "2",
                                               "--parallelism.disable_loss_parallel", "true")),
    # torch.compile per block (inductor; a cold compile costs ~30 s of CI time, so one flavor), on TP 2 with loss
    # parallel: DTensor blocks, the loss kept eager under loss parallel, validation run eagerly. TP 2 without
    # compile is the two flavors above; TP with tied embeddings is covered by gradient unit tests.
    Flavor("tp2_compile", 2, ("--training.local_batch_size", "8", *_val(1), "--compile.enable", "true",
                              "--parallelism.tensor_parallel_degree", "2")),
]
