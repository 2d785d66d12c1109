"""Write the forget and retain files of the WMDP RMU recipes (recipes/wmdp/*.yaml) from the corpora the WMDP
authors' RMU run reads (centerforaisafety/wmdp, rmu/unlearn.py and rmu/utils.py get_data):

* forget: the first ROWS documents of the bio forget corpus and the first ROWS of the cyber forget corpus,
  interleaved (bio, cyber, bio, ...) as the authors' loop takes one batch of each topic in turn. Their zephyr run
  takes 150 batches of 4 (75 per topic), so ROWS = 300 are exactly the documents it sees.
* retain: the first ROWS non-empty rows of WikiText-2 (wikitext-2-raw-v1, test split), the authors' retain set
  for both topics (each topic's batches take its first 75 batches of 4, so every row serves twice).

`cais/wmdp-corpora`'s bio forget corpus is gated: request it through the form linked from the WMDP authors'
README and dataset card (https://huggingface.co/datasets/cais/wmdp-corpora), then pass the file you receive
(`bio-forget-corpus.jsonl`, one {"text": ...} per line) with --bio. The cyber forget corpus and WikiText are public
and come through `datasets` (or pass local JSON-lines files with --cyber and --wikitext).

    python recipes/data/make_wmdp_corpora.py --bio PATH/bio-forget-corpus.jsonl
    # writes recipes/wmdp/data/wmdp/forget.jsonl and retain.jsonl, where the recipes look for them

Rows are {"text": ...}; doplus trains on every token of a text row, cut at the recipe's max_length.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

ROWS = 300
MIN_CHARS = 0  # the authors' --min_len default: a document longer than this is kept


def _kept(texts: Iterable[str]) -> Iterator[str]:
    return (text for text in texts if len(text) > MIN_CHARS)


def local_texts(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise SystemExit(f"{path}:{number}: a row must be an object with a 'text' string")
                yield row["text"]


def hub_texts(name: str, config: str, split: str) -> Iterator[str]:
    from datasets import load_dataset

    yield from (row["text"] for row in load_dataset(name, config, split=split, streaming=True))


def first(texts: Iterable[str], rows: int, what: str) -> list[str]:
    taken = list(islice(_kept(texts), rows))
    if len(taken) < rows:
        raise SystemExit(f"{what}: {len(taken)} documents, the recipes take {rows}")
    return taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bio", type=Path, required=True, help="the gated bio-forget-corpus.jsonl")
    parser.add_argument("--cyber", type=Path, help="cyber-forget-corpus.jsonl (default: cais/wmdp-corpora)")
    parser.add_argument("--wikitext", type=Path, help="WikiText-2 rows as JSON lines (default: Salesforce/wikitext)")
    parser.add_argument("--rows", type=int, default=ROWS, help="documents per forget topic and retain rows")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "wmdp" / "data" / "wmdp")
    args = parser.parse_args()
    bio = first(local_texts(args.bio), args.rows, str(args.bio))
    cyber = first(local_texts(args.cyber) if args.cyber else
                  hub_texts("cais/wmdp-corpora", "cyber-forget-corpus", "train"), args.rows, "cyber forget corpus")
    retain = first(local_texts(args.wikitext) if args.wikitext else
                   hub_texts("Salesforce/wikitext", "wikitext-2-raw-v1", "test"), args.rows, "WikiText-2 test")
    args.out.mkdir(parents=True, exist_ok=True)
    forget = [text for pair in zip(bio, cyber) for text in pair]
    for name, texts in (("forget.jsonl", forget), ("retain.jsonl", retain)):
        (args.out / name).write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    print(f"wrote {len(forget)} forget and {len(retain)} retain rows under {args.out}")


if __name__ == "__main__":
    main()
