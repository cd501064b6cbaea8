"""Convert model weights between DCP checkpoints, Hugging Face safetensors folders and single .pt files.

    python scripts/convert_checkpoint.py dcp-to-hf <step folder> <out folder> --flavor debugmodel [--model llama3]
                                                   [--dtype float32] [--tokenizer PATH | --no-tokenizer]
                                                   [--seq-len N]
    torchrun --nproc_per_node N scripts/convert_checkpoint.py dcp-to-hf ...   (each process holds 1/N of the model)
    python scripts/convert_checkpoint.py hf-to-dcp <hf folder> <out step folder> [--model qwen3 [--flavor 8B]]
    python scripts/convert_checkpoint.py dcp-to-pt <step folder> <out.pt>

Works for every registered model with a Hugging Face state-dict adapter (`--model`, as `model.name` in a
config). A DCP folder does not record its model, so `dcp-to-hf` takes `--model` (default llama3); `hf-to-dcp`
without `--model` uses the model whose adapter reads config.json. Runs on one process, no GPU or process group
needed; `dcp-to-hf` and `hf-to-dcp` also under torchrun (gloo, CPU), where each rank reads and writes only its FSDP
shard's rows, so no process holds the whole model. Only model weights are converted (never optimizer state). A DCP
folder is read from its own metadata, so any layout it was saved with (FSDP, DDP, one process) and any dtype work.
`dcp-to-hf` writes the same folder as a run's `checkpoint.last_save_in_hf`: its `--dtype` default is the trainer's
`checkpoint.export_dtype` default, `--tokenizer` takes what `model.tokenizer_path` takes (default: the default BPE,
sized to the model; `--no-tokenizer` writes none), and `--seq-len` is the run's `training.seq_len` (config.json's
max_position_embeddings where the model has no rope scaling; default: the flavor's).
`hf-to-dcp` writes a model-only float32 checkpoint with a completion marker that `checkpoint.initial_load_path` (or
a run's own checkpoint folder) can load.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

# Runnable as a plain script from a checkout: make the package importable without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

import torch  # noqa: E402

from torchtitan.components import checkpoint_io as cio  # noqa: E402
from torchtitan.config.job_config import Checkpoint  # noqa: E402
from torchtitan.tools import startup_gc  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ConvertError(Exception):
    pass


def _model_args(model: str, flavor: str):
    from torchtitan.models.registry import get_model_spec

    try:
        spec = get_model_spec(model)
    except KeyError as e:
        raise ConvertError(f"--model: {e.args[0]}") from None
    if flavor not in spec.flavors:
        raise ConvertError(f"--flavor: unknown '{flavor}' for {model}; known: {', '.join(sorted(spec.flavors))}")
    return spec, spec.flavors[flavor]


def _tokenizer(path: str, vocab_size: int):
    """The run's tokenizer, built as the trainer builds it (torchtitan/config/preflight.py, checked_tokenizer): the
    same cached default BPE for "" and a model of this vocabulary, so the folder's tokenizer files are the run's."""
    from torchtitan.data.tokenizer import build_tokenizer, default_cache_dir

    try:
        tokenizer = build_tokenizer(path, default_cache_dir(), vocab_size)
    except (OSError, ValueError) as e:
        reason = str(e).removeprefix("model.tokenizer_path: ")
        raise ConvertError(f"--tokenizer: {reason} (or --no-tokenizer)") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConvertError(f"--tokenizer: the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary "
                           f"{vocab_size}: not the run's tokenizer")
    return tokenizer


def _check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise ConvertError(f"{folder}: not a folder")
    if not (folder / cio.METADATA).is_file():
        raise ConvertError(f"{folder}: no {cio.METADATA}; not a DCP checkpoint, or its save never finished")
    if cio.read_marker(folder) is None:
        # DCP writes .metadata after every shard, so the tensors are all there; only our marker is missing.
        print(f"warning: {folder} has no valid {cio.MARKER} marker (not published by a run); converting anyway",
              file=sys.stderr)


def _read_dcp(folder: Path) -> dict[str, torch.Tensor]:
    _check_folder(folder)
    try:
        return cio.load_full_model_state(folder)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        raise ConvertError(f"{folder}: cannot read the checkpoint: {' '.join(str(e).split())[:300]}") from e


def _model_shapes(folder: Path) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(key prefix, our key -> shape) of a DCP folder's model tensors, from its metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _check_folder(folder)
    md = cio.read_metadata(folder)
    prefix = cio.model_prefix(md)
    shapes = {k[len(prefix):]: tuple(v.size) for k, v in md.state_dict_metadata.items()
              if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    if not shapes:
        raise ConvertError(f"{folder}: the checkpoint holds no model tensors")
    return prefix, shapes


def _process_group():
    """The launch's group under torchrun (each rank then converts its 1/world of the model), else None."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(minutes=30))
        return dist.group.WORLD
    return None


def _sharded_model(spec, args, pg) -> torch.nn.Module:
    """The model with only this rank's shards in memory: built on meta, FSDP over every rank of the launch (each
    block, then the rest), then materialised empty; one process holds it whole."""
    import torch.distributed as dist

    with torch.device("meta"):
        model = spec.model_cls(args)
    world = dist.get_world_size(pg) if pg is not None else 1
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model.to_empty(device="cpu")


def _check_against_model(sd: dict[str, tuple[int, ...]], spec, args, flavor: str, where: str) -> None:
    """Names and shapes must be exactly those of the registry's model, built on meta (no memory)."""
    # Named in every error: the default --model llama3 on another model's checkpoint is the likely mistake.
    which = f"--model {spec.name} --flavor {flavor}"
    with torch.device("meta"):
        model = spec.model_cls(args)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if args.tie_word_embeddings and "output.weight" not in sd:
        expected.pop("output.weight", None)
    for key, shape in expected.items():
        if key not in sd:
            raise ConvertError(f"{where}: missing '{key}' for {which}")
        if tuple(sd[key]) != shape:
            raise ConvertError(f"{where}: '{key}' has shape {tuple(sd[key])}, {which} expects {shape}")
    extra = sorted(set(sd) - set(expected))
    if extra:
        raise ConvertError(f"{where}: unexpected '{extra[0]}' for {which}")


def dcp_to_hf(ns: argparse.Namespace) -> None:
    """By shard (torchtitan/components/hf_sharded.py): each rank of the launch reads its rows of the checkpoint
    and writes them; under `torchrun --nproc_per_node N` a rank holds 1/N of the model."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from torchtitan.components.hf_sharded import save_hf_sharded
    from torchtitan.components.model_parts import model_state_dict

    spec, args = _model_args(ns.model, ns.flavor)
    src = Path(ns.src)
    prefix, shapes = _model_shapes(src)
    _check_against_model(shapes, spec, args, ns.flavor, str(src))
    if ns.seq_len is not None:
        if ns.seq_len <= 0:
            raise ConvertError(f"--seq-len must be positive, got {ns.seq_len}")
        args = dataclasses.replace(args, max_seq_len=ns.seq_len)  # as the trainer's model_args_for does
    # After the checks, so a wrong --model or --flavor is reported before the default tokenizer is built.
    tokenizer = None if ns.no_tokenizer else _tokenizer(ns.tokenizer, args.vocab_size)
    pg = _process_group()
    model = _sharded_model(spec, args, pg)
    state = model_state_dict([model])
    try:
        dcp.load({"model": state} if prefix else state, checkpoint_id=str(src), planner=cio.SafeLoadPlanner(),
                 process_group=pg, no_dist=pg is None)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        raise ConvertError(f"{src}: cannot read the checkpoint: {' '.join(str(e).split())[:300]}") from e
    out = save_hf_sharded(ns.out, state, args, dtype=ns.dtype, model=ns.model, pg=pg, tokenizer=tokenizer)
    if pg is None or dist.get_rank(pg) == 0:
        which = "no tokenizer" if tokenizer is None else f"tokenizer {tokenizer.path}"
        print(f"wrote {out} ({len(shapes)} tensors, {ns.model}, {ns.dtype}, {which})")


def hf_to_dcp(ns: argparse.Namespace) -> None:
    """By shard, as dcp-to-hf: each rank of the launch reads its rows of the Hugging Face files into its FSDP shard
    and DCP writes the shards; the folder holds float32 weights (what a run's parameters are)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from torchtitan.components import hf_io
    from torchtitan.components.hf_sharded import load_hf_sharded
    from torchtitan.components.model_parts import model_state_dict
    from torchtitan.models.registry import get_model_spec

    args = None
    if ns.flavor:
        if ns.model is None:  # flavor names repeat across models (debugmodel), so a flavor alone is ambiguous
            raise ConvertError("--flavor: needs --model too")
        _, args = _model_args(ns.model, ns.flavor)
    # With args, config.json must match the flavor; with neither, the model is the one that reads config.json.
    adapter, args = hf_io.resolve_folder(Path(ns.src), args, ns.model)
    name = ns.model or hf_io.model_name_of(adapter)
    out = Path(ns.out)
    if out.exists():
        raise ConvertError(f"{out}: already exists; remove it or pick another folder")
    pg = _process_group()
    model = _sharded_model(get_model_spec(name), args, pg)
    load_hf_sharded(ns.src, [model], args, model=adapter, pg=pg)
    sd = model_state_dict([model])
    dcp.save({"model": sd}, checkpoint_id=str(out), process_group=pg, no_dist=pg is None)
    if pg is not None and dist.get_rank(pg) != 0:
        return
    step = int(out.name[5:]) if out.name.startswith("step-") and out.name[5:].isdigit() else 0
    world = dist.get_world_size(pg) if pg is not None else 1
    cio.write_marker(out, {"step": step, "world_size": world, "model_only": True, "dtype": "float32",
                           "source": str(Path(ns.src).resolve())})
    print(f"wrote {out} ({len(sd)} tensors, model only)")
    if not ns.flavor:
        # What config.json cannot describe is absent (e.g. MoE routing biases), and a run whose model has it
        # fails to load the folder; the flavor's args add it (as zeros).
        print("note: weights as config.json describes them; pass --model and --flavor to match a run's model")


def dcp_to_pt(ns: argparse.Namespace) -> None:
    sd = _read_dcp(Path(ns.src))
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        torch.save(sd, tmp)  # a dict of plain tensors: loadable with torch.load(..., weights_only=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {out} ({len(sd)} tensors)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("dcp-to-hf", help="DCP step folder -> Hugging Face safetensors folder")
    a.add_argument("src", help="DCP checkpoint folder, e.g. outputs/checkpoint/step-1000")
    a.add_argument("out", help="output folder (replaced atomically if it exists)")
    a.add_argument("--model", default="llama3", help="registered model name, as model.name (default llama3)")
    a.add_argument("--flavor", required=True)
    # One default for both exports: the trainer's checkpoint.export_dtype (float32: the weights as trained).
    a.add_argument("--dtype", default=Checkpoint.export_dtype, choices=sorted(_DTYPES),
                   help=f"weights' dtype (default {Checkpoint.export_dtype}, as checkpoint.export_dtype)")
    a.add_argument("--tokenizer", default="", help="the run's model.tokenizer_path (default: the default BPE sized "
                   "to the model, as a run with no model.tokenizer_path uses), written beside the weights")
    a.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files (and null BOS/EOS ids)")
    a.add_argument("--seq-len", type=int, default=None, help="the run's training.seq_len, or validation.seq_len if "
                   "longer: the model's max_seq_len (default: the flavor's)")
    a.set_defaults(fn=dcp_to_hf)
    b = sub.add_parser("hf-to-dcp", help="Hugging Face folder -> model-only DCP step folder")
    b.add_argument("src", help="folder with config.json and *.safetensors")
    b.add_argument("out", help="new DCP folder, e.g. seed/step-0")
    b.add_argument("--model", default=None, help="registered model name (default: the one that reads config.json)")
    b.add_argument("--flavor", default=None, help="if given (with --model), config.json must match this flavor")
    b.set_defaults(fn=hf_to_dcp)
    c = sub.add_parser("dcp-to-pt", help="DCP step folder -> one torch.save file of model weights")
    c.add_argument("src")
    c.add_argument("out")
    c.set_defaults(fn=dcp_to_pt)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        ns.fn(ns)
    except (ConvertError, ValueError, KeyError, FileNotFoundError, FileExistsError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    sys.exit(main())
