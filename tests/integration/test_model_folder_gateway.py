"""What the gateway makes of a model folder's catalogue entry (a models-file `path` entry), before any
worker: a causal LM folder without a chat template refuses chat completions, naming the route it takes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.helpers import gateway_with
from vramguard.shared.settings import Settings


async def test_a_causal_lm_folder_without_a_chat_template_answers_chat_with_400_naming_completions(
        settings_factory: Callable[..., Settings], tmp_path: Path) -> None:
    folder = tmp_path / "lm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    for name in ("model.safetensors", "tokenizer.json"):  # classified, never loaded: no worker runs
        (folder / name).write_bytes(b"")
    (tmp_path / "models.toml").write_text('[lm]\npath = "lm"\n')
    settings = settings_factory(models_file=str(tmp_path / "models.toml"), served_models="lm")
    async with gateway_with(settings) as gateway:
        chat = await gateway.post("/v1/chat/completions",
                                  json={"model": "lm", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400, chat.text
        assert "'lm' has no chat template; use POST /v1/completions" in chat.json()["error"]["message"]
        text = await gateway.post("/v1/completions", json={"model": "lm", "prompt": "hi", "max_tokens": 2})
        assert text.status_code == 503, text.text  # taken (no worker to answer it), not refused
