"""``precache tokenizer train``: train a WordPiece or BPE tokenizer on a corpus."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tokenizer", help="train a tokenizer for the text pipeline",
        description="Tokenizer tools for the text pipeline.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    train = actions.add_parser(
        "train", help="train a WordPiece or BPE tokenizer on a corpus",
        description="Train a tokenizer on the documents of a corpus (.txt files; .jsonl, .csv or "
        ".parquet records) "
        "and save it as one tokenizer.json, e.g. beside the cache it will build.",
        epilog="example:\n  precache tokenizer train -i corpus/ -o cache.tokenizer.json "
        "--vocab-size 8000\n  precache run text -i corpus/ -o cache/ "
        "--set tokenizer=cache.tokenizer.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--input", "-i", required=True, help="folder, or a .txt/.jsonl/.csv/.parquet file")
    train.add_argument("--output", "-o", required=True, help="tokenizer.json to write")
    train.add_argument("--model", choices=["wordpiece", "bpe"], default="wordpiece")
    train.add_argument("--vocab-size", type=int, default=8000)
    train.add_argument("--min-frequency", type=int, default=2)
    train.add_argument("--cased", action="store_true", help="keep case (default: lowercase)")
    train.add_argument("--text-field", default="text", help="the field (JSON Lines) or column (CSV, Parquet) holding the text")
    train.set_defaults(handler=train_command)


def train_command(args: argparse.Namespace) -> int:
    from precache.cli.tokenizer_train import train_tokenizer

    try:
        path = train_tokenizer(args.input, args.output, model=args.model,
                               vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                               lowercase=not args.cased, text_field=args.text_field)
    except ImportError:
        print("precache: error: training needs Hugging Face tokenizers: "
              "pip install 'precache[text]'", file=sys.stderr)
        return 2
    from tokenizers import Tokenizer

    print(f"wrote {path} ({Tokenizer.from_file(str(path)).get_vocab_size()} tokens)")
    return 0
