"""`vramguard up --model PATH` (and `check --model PATH`): serve a local folder in the Hugging Face
layout. The folder is classified here, before anything starts (shared/folders.py: one line naming
what was found and what is supported, exit 2), then written as the one `path = "..."` entry of a
models file in the run folder, which the gateway and the workers read as any models file.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import tomli_w

from vramguard.shared.folders import DTYPES, FolderError, classify, looks_like_path, served_name
from vramguard.shared.models import BUILTIN, MODEL_NAME, folder_spec

MODELS_FILE = "folder-models.toml"  # in the run folder
KINDS = {"generate": "text generation (/v1/chat/completions, /v1/completions)",
         "embed": "embeddings (/v1/embeddings, native and v2 routes)",
         "classify_text": "text classification (labels and scores)",
         "classify_image": "image classification (labels and scores)"}


class FolderRefused(ValueError):
    """The folder or the folder options cannot be served; the message is the one line to print (exit 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The folder options of `vramguard up` and `vramguard check` (beside --model PATH)."""
    parser.add_argument("--served-name", metavar="NAME",
                        help="with --model PATH: the name clients use (default the folder's name, lower case)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="with --model PATH: the weights' dtype (default the folder's config.json, else float32)")


def is_folder_request(args: argparse.Namespace) -> bool:
    """Whether --model names a path (shared/folders.py looks_like_path) rather than a catalogue name.
    Raises FolderRefused for --served-name or --dtype without a path."""
    if looks_like_path(args.model):
        return True
    given = [option for option, value in (("--served-name", args.served_name), ("--dtype", args.dtype)) if value]
    if given:
        raise FolderRefused(f"{' and '.join(given)} need --model PATH (a model folder); --model {args.model!r} "
                            "is a catalogue name")
    return False


def describe_folder(args: argparse.Namespace, models_file_set: bool) -> tuple[str, dict[str, object], str]:
    """(served name, its models-file entry, one line saying what the folder is) for --model PATH.
    Raises FolderRefused: the folder cannot be served (FolderError's line), the name is not a model
    name or is a built-in model's, or --placement / VRAMGUARD_MODELS_FILE are given too."""
    if getattr(args, "placement", None) is not None or getattr(args, "backend", None) or models_file_set:
        raise FolderRefused("--model PATH serves one folder; it excludes --placement, --backend and "
                            "VRAMGUARD_MODELS_FILE (a models file takes a `path = \"...\"` entry instead)")
    try:
        model = classify(args.model)  # what the path is comes first: a missing folder is named before its name
    except FolderError as exc:
        raise FolderRefused(str(exc)) from None
    name = args.served_name or served_name(model.path)
    if not re.fullmatch(MODEL_NAME, name):
        raise FolderRefused(f"--served-name {name!r}: a model name is lower case letters, digits, '-' and '_', "
                            "starting with a letter")
    if name in BUILTIN:
        raise FolderRefused(f"served name {name!r} is a built-in model's; give the folder another with --served-name")
    try:
        spec = folder_spec(name, model.path, args.dtype)
    except FolderError as exc:
        raise FolderRefused(str(exc)) from None
    entry: dict[str, object] = {"path": str(model.path)}
    if args.dtype:
        entry["dtype"] = args.dtype
    line = (f"{model.path}: {model.architecture or 'sentence-transformers'} -> {KINDS[model.kind]}, "
            f"served as {name}, {spec.options['dtype']}")
    return name, entry, line


def write_models_file(run_dir: Path, name: str, entry: dict[str, object]) -> Path:
    """Write `entry` as the one table `name` of a models file in `run_dir`; returns its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / MODELS_FILE
    path.write_text(tomli_w.dumps({name: entry}))
    return path
