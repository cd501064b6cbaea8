"""Tokenize a dataset once into token shards that training reads by index (docs/data.md, 'Pre-tokenized data').

    python scripts/pretokenize.py --output /data/tok/stdlib                     # python_stdlib, default BPE
    python scripts/pretokenize.py --dataset-path /data/web --tokenizer-path /models/llama3 --workers 16 \\
        --output /data/tok/web

The source is named as in the training config (`--dataset`, `--dataset-path`, `--text-column`, `--split`,
`--streaming`), the tokenizer as `model.tokenizer_path` (empty: the default BPE; give `--model-vocab-size` when
the model's vocab_size is below 8192, since the default then shrinks to fit it). Then train with
`training.dataset_path = "<output>"`. An interrupted run continues where it stopped when run again with the
same arguments; the output bytes are the same for any `--workers`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from project_python import use_project_python  # noqa: E402

use_project_python()  # the system Python re-runs this under the project's (scripts/project_python.py)

from torchtitan.tools import startup_gc  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="folder for the shards (created; an unfinished one is resumed)")
    p.add_argument("--dataset", default="python_stdlib", help="registry name, as training.dataset")
    p.add_argument("--dataset-path", default="", help="local files or a hub name, as training.dataset_path")
    p.add_argument("--text-column", default="text", help="as training.dataset_text_column")
    p.add_argument("--split", default="train", help="as training.dataset_split")
    p.add_argument("--streaming", default="auto", help="auto | true | false, as training.dataset_streaming")
    p.add_argument("--tokenizer-path", default="", help="as model.tokenizer_path (empty: the default BPE)")
    p.add_argument("--model-vocab-size", type=int, default=None,
                   help="the model's vocab_size (only sizes the default BPE, as training does)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (0: tokenize in this process); default: one per CPU")
    p.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 2^27)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from torchtitan.data.datasets import build_document_source
    from torchtitan.data.pretokenize import DEFAULT_SHARD_TOKENS, pretokenize
    from torchtitan.data.tokenizer import build_tokenizer, default_cache_dir
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    tokenizer = build_tokenizer(args.tokenizer_path, default_cache_dir(), args.model_vocab_size)
    source = build_document_source(dataset=args.dataset, dataset_path=args.dataset_path,
                                   text_column=args.text_column, split=args.split, streaming=args.streaming,
                                   cache_dir=str(default_cache_dir() / "datasets"), key_prefix="pretokenize")
    # What the data is, for the manifest and for refusing a rerun that names other data.
    info = {"dataset": "" if args.dataset_path else args.dataset, "dataset_path": args.dataset_path,
            "text_column": args.text_column, "split": args.split}  # fmt: skip
    start = time.perf_counter()
    manifest = pretokenize(source, tokenizer, args.output, source_info=info, workers=args.workers,
                           shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    logger.info(f"pretokenize: {manifest['num_tokens']:,} tokens, {manifest['num_documents']:,} documents in "
                f"{len(manifest['shards'])} shards under {args.output}, {seconds:.1f} s "
                f"({manifest['num_tokens'] / seconds:,.0f} tokens/s, counting resumed shards)")
    return manifest


if __name__ == "__main__":
    startup_gc.freeze_and_resume()  # the imports above ran with collection paused (scripts/project_python.py)
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        # Configuration problems are one line, as in training.
        sys.exit(f"error: {e}")
