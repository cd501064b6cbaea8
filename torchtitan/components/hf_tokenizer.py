"""The files that make a Hugging Face export folder's tokenizer and generation settings loadable by transformers.

Both exporters (hf_io.save_hf, hf_sharded.save_hf_sharded) write exactly `tokenizer_files(...)`: with the run's
tokenizer the folder is self-contained, `AutoTokenizer.from_pretrained(folder)` encodes text to the ids the model
was trained on (BOS first, spelled-out special tokens as plain text), and config.json / generation_config.json carry
its BOS/EOS ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchtitan.tools.logging import logger

GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_NAME = "special_tokens_map.json"


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    """Write `tokenizer_files`' result into a folder that is not published yet (data on disk before the rename)."""
    for name, data in files.items():
        with open(folder / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())



# Encoded against the converted tokenizer before it is written: letters, contractions, digit runs (split by 3),
# punctuation runs, whitespace runs and newlines, non-ASCII letters and symbols are each their own pre-token rule.
_PROBE = ("Hello, world! It's 12345 apples\n\n\tdef f(x):\n        return x**2  # don't \u00fcn\u00efc\u00f6d\u00e9 "
          "\u65e5\u672c\u8a9e \U0001f642 \u2026 'LL 3.14159 <|begin_of_text|> end  \r\n")


def special_ids(tokenizer: Any, bos_id: int | None, eos_id: int | None) -> tuple[int | None, int | None]:
    """The BOS/EOS ids the folder states: those given, else the tokenizer's. An id that contradicts the tokenizer is
    refused: the folder would encode prompts with one token and generate with another."""
    if tokenizer is None:
        return bos_id, eos_id
    ids = []
    for kind, given, own in (("bos_id", bos_id, tokenizer.bos_id), ("eos_id", eos_id, tokenizer.eos_id)):
        if given is not None and given != own:
            raise ValueError(f"{kind}={given} contradicts the tokenizer's {kind} ({own})")
        ids.append(int(own))
    return ids[0], ids[1]


def _byte_chars() -> list[str]:
    """GPT-2's byte -> character map, in which byte-level BPE vocabularies (tokenizers' ByteLevel) spell tokens:
    printable Latin-1 bytes stand for themselves, the other bytes for the characters from U+0100 on, in order."""
    own = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, extra = [], 0
    for b in range(256):
        if b in own:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + extra))
            extra += 1
    return chars


def _tiktoken_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges, in priority order, of a BPE that tokenizes like tiktoken with these ranks.

    tiktoken merges, within a pre-token, the adjacent pair whose concatenation has the lowest rank. So each token of
    rank r is made from the two parts that tiktoken's own procedure, stopped before rank r, leaves of its bytes, and
    ordering merges by r gives a `tokenizers` BPE the same choices (the conversion Llama 3's tokenizer.json is from).
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            found = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
            best, i = min(found)
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise ValueError(f"token of rank {rank} is not a merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _from_tiktoken(tokenizer: Any) -> Any:
    """A `tokenizers.Tokenizer` equal to a TikTokenTokenizer (torchtitan/data/tiktoken_tokenizer.py): byte-level BPE
    with the recovered merges, Llama 3's split pattern, its 256 special tokens at their ids. Checked on a probe."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from torchtitan.data.tiktoken_tokenizer import LLAMA3_PATTERN, _read_ranks

    ranks = _read_ranks(str(tokenizer.path))
    chars = _byte_chars()

    def spell(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = [(spell(a), spell(b)) for a, b in _tiktoken_merges(ranks)]
    # ignore_merges: a pre-token that is itself in the vocabulary is one token, as tiktoken does before any merge.
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    special = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
    backend.add_special_tokens([tokenizers.AddedToken(name, special=True, normalized=False) for name, _ in special])
    if any(backend.token_to_id(name) != token_id for name, token_id in special):
        raise ValueError("the special tokens do not follow the vocabulary")
    backend.encode_special_tokens = True  # for the probe only: as ours, spelled-out special tokens are text
    if backend.encode(_PROBE, add_special_tokens=False).ids != tokenizer.encode(_PROBE, add_bos=False, add_eos=False):
        raise ValueError("the converted tokenizer encodes a probe text differently")
    backend.encode_special_tokens = False
    return backend


def _tokenizer_part(tokenizer: Any, bos_id: int, eos_id: int, model_max_length: int | None,
                    chat_template: str | None = None) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json (see `tokenizer_files`)."""
    import tokenizers
    from tokenizers import processors

    from torchtitan.data.tiktoken_tokenizer import TikTokenTokenizer
    from torchtitan.data.tokenizer import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        # The run's tokenizer.json as loaded (the default BPE's cached file or model.tokenizer_path's), copied so
        # that adding a post-processor leaves the run's own untouched.
        backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    elif isinstance(tokenizer, TikTokenTokenizer):
        try:
            backend = _from_tiktoken(tokenizer)
        except Exception as e:
            raise ValueError(f"cannot convert the tiktoken file {tokenizer.path} to tokenizer.json: {e}") from e
    else:
        raise ValueError(f"a {type(tokenizer).__name__} has no tokenizer.json form")
    bos, eos = backend.id_to_token(bos_id), backend.id_to_token(eos_id)
    if backend.post_processor is None:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, bos_id)])
    return {
        TOKENIZER_NAME: (backend.to_str(pretty=True) + "\n").encode("utf-8"),
        TOKENIZER_CONFIG_NAME: _dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            # Explicit, so transformers 5 builds the BOS-first template whatever post-processor the file has.
            "add_bos_token": True,
            "add_eos_token": False,
            # Our tokenizers encode text that spells a special token as text (torchtitan/data/tokenizer_base.py).
            # Not with a chat template: transformers renders the template to text and encodes it whole, so its
            # special tokens must stay special (a message's content spelling one then becomes it too, as in the
            # published chat models' tokenizers).
            "split_special_tokens": not chat_template,
            # Else decode() would drop spaces before punctuation, and text would not round-trip.
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            **({"chat_template": chat_template} if chat_template else {}),
        }),
        SPECIAL_TOKENS_MAP_NAME: _dump({"bos_token": bos, "eos_token": eos}),
    }


def _dump(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def tokenizer_files(tokenizer: Any, config: dict[str, Any], chat_template: str | None = None) -> dict[str, bytes]:
    """Files that make a folder's tokenizer and generation settings loadable by transformers, by name, for the run's
    `tokenizer` (a BaseTokenizer, or None) and the folder's config.json contents. Both exporters (save_hf here,
    hf_sharded.save_hf_sharded) write exactly these.

    generation_config.json whenever config.json has a BOS or EOS id. With a tokenizer: tokenizer.json (the run's
    tokenizer.json, or a tiktoken file converted, with a post-processor that puts BOS first when it has none: every
    training document starts with BOS, so prompts should too), tokenizer_config.json (BOS/EOS by name, BOS added,
    EOS not, spelled-out special tokens encoded as text as the training data was, model_max_length =
    max_position_embeddings) and special_tokens_map.json. A tokenizer that cannot be written is logged in one line
    and left out: the weights are what the export is for, never lost for a tokenizer. `chat_template` (Jinja) goes
    into tokenizer_config.json, where transformers' apply_chat_template reads it.
    """
    bos_id, eos_id = config.get("bos_token_id"), config.get("eos_token_id")
    files: dict[str, bytes] = {}
    if bos_id is not None or eos_id is not None:
        # transformers' generate() reads the ids here; without them it would not stop at EOS.
        files[GENERATION_CONFIG_NAME] = _dump({"bos_token_id": bos_id, "eos_token_id": eos_id})
    if tokenizer is None:
        return files
    try:
        files.update(_tokenizer_part(tokenizer, bos_id, eos_id, config.get("max_position_embeddings"), chat_template))
    except Exception as e:  # e.g. an unusual tiktoken file: the folder still gets the weights
        logger.warning(f"Hugging Face export: no tokenizer files ({e}); AutoTokenizer will not load the folder until "
                       "a tokenizer.json is copied into it")
    return files
