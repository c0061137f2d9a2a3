"""Tiny model folders in the Hugging Face layout, built and saved with save_pretrained in a test
(random weights, a tokenizer over a local 11-word vocabulary, no download): what `vramguard up
--model PATH` classifies and the workers load."""

from __future__ import annotations

from pathlib import Path

ID2LABEL = {0: "negative", 1: "neutral", 2: "positive"}
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "movie", "the", "was", "a"]


def _bert_config(**extra: object) -> object:
    import transformers

    return transformers.BertConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32, max_position_embeddings=64, **extra)


def _tokenizer(folder: Path) -> None:
    import transformers

    folder.mkdir(parents=True)
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)


def build_tiny_classifier(folder: Path) -> Path:
    """A 1-layer BertForSequenceClassification of 3 labels (ID2LABEL) and its WordPiece tokenizer."""
    import torch
    import transformers

    _tokenizer(folder)
    torch.manual_seed(0)
    config = _bert_config(num_labels=3, id2label=ID2LABEL, label2id={v: k for k, v in ID2LABEL.items()})
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def build_tiny_encoder(folder: Path) -> Path:
    """A 1-layer BertModel (hidden size 16) and its tokenizer, no modules.json: a plain encoder."""
    import torch
    import transformers

    _tokenizer(folder)
    torch.manual_seed(0)
    transformers.BertModel(_bert_config()).save_pretrained(folder)
    return folder


def build_tiny_image_classifier(folder: Path) -> Path:
    """A 1-layer ViTForImageClassification on 32x32 images in 8x8 patches, 3 labels (ID2LABEL), and
    the ViT image processor that resizes any image to 32x32."""
    import torch
    import transformers

    folder.mkdir(parents=True)
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, num_labels=3, id2label=ID2LABEL,
                                    label2id={v: k for k, v in ID2LABEL.items()})
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder
