"""Train a small transformer encoder to classify cached documents by ``label``, the speed
checklist applied. It reads only the token ids of a ``text`` cache (no tokenizer at train time).

    torchrun --nproc_per_node=2 pipelines/text/train.py --cache data/textcache --epochs 3
    python pipelines/text/train.py --cache data/textcache --resume runs/text/last.pt
    srun python pipelines/text/train.py --cache data/textcache   # Slurm: one task per GPU

The task is ``precache.pipelines.text.task.TextClassification`` (length-bucketed batches padded to
their own longest document, every 10th document held out, validation accuracy); the loop is
``precache.training.loop.fit``: ``--strategy ddp|zero|fsdp``, ``--precision bf16|fp16|fp32|auto``,
accumulation, clipping, the OneCycle schedule by progress, the step timeline, and checkpoints
that resume mid-epoch on another number of ranks. Each epoch appends a record (samples/s, real
tokens/s, the padded share, the data wait) to ``<out>/metrics.jsonl``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from precache.training.loop import fit
from precache.training.settings import Settings, check_cache, training_parser
from precache.pipelines.text.task import TextClassification, TextModel

VOCAB = 30522  # BERT WordPiece (the text pipeline's default tokenizer); pad id 0


class TextClassifier(nn.Module):
    """Token + learned position embeddings, a 2-layer encoder, mean over real tokens, a linear head."""

    def __init__(self, classes: int, max_length: int, vocab_size: int = VOCAB, d_model: int = 128,
                 heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.positions = nn.Embedding(max_length, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.1,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions.weight[: ids.shape[1]]
        x = self.encoder(x, src_key_padding_mask=mask == 0)
        m = mask.unsqueeze(-1).to(x.dtype)
        return self.head((x * m).sum(1) / m.sum(1).clamp_min(1))


def main(argv: list[str] | None = None) -> None:
    p = training_parser(__doc__, out="runs/text", lr=1e-3, items="documents",
                        cache_help="a cache of the text pipeline")
    p.add_argument("--vocab-size", type=int, default=VOCAB,
                   help="the tokenizer's vocabulary size (default: BERT WordPiece's, the text "
                        "pipeline's default tokenizer; for your own, what `precache tokenizer "
                        "train` printed)")
    args = p.parse_args(argv)
    check_cache(p, args.cache, "text", ["ids", "length", "label"])

    def build(classes: list[str], lengths: np.ndarray) -> TextModel:
        max_length = -(-int(lengths.max()) // 8) * 8  # TokenCollate pads to multiples of 8
        return TextModel(TextClassifier(len(classes), max_length, args.vocab_size),
                         lambda net, ids, mask: net(ids, mask), args.vocab_size,
                         f"beyond --vocab-size {args.vocab_size}: pass the vocabulary size of "
                         "the tokenizer that built the cache", extra={"max_length": max_length})

    fit(TextClassification(build), Settings.from_args(args))


if __name__ == "__main__":
    main()
