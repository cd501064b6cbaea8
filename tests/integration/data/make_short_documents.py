"""Writes short_documents.jsonl: short documents (single sentences of the pydoc topics that ship with Python),
so that every 64-token row of the document-masking parity layouts packs several documents. Run from the repository
root: python tests/integration/data/make_short_documents.py"""

import json
import re
from pathlib import Path
from pydoc_data.topics import topics


def main() -> None:
    sentences = []
    for name in sorted(topics)[:40]:
        text = " ".join(topics[name].split())
        sentences += [s for s in re.split(r"(?<=[.!?])\s+", text) if 20 <= len(s) <= 200]
    docs = sentences[::2][:400]
    out = Path(__file__).with_name("short_documents.jsonl")
    out.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    print(f"wrote {out}: {len(docs)} documents, {sum(map(len, docs))} characters")


if __name__ == "__main__":
    main()
