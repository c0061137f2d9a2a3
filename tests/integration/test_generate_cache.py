"""The de-quantized copy of a GGUF model is keyed by the file's content: a second checkout or
virtualenv holding the same package file at another path loads the first one's conversion
instead of converting again (a minute of CPU) and overwriting it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vramguard.shared.settings import Settings
from vramguard.worker.generate import causal_lm
from vramguard.worker.generate.causal_lm import CausalLMBackend

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _backend() -> CausalLMBackend:
    settings = Settings(model="smollm2", served_models=["smollm2"])
    return CausalLMBackend(settings.model_config_for("smollm2"), "cpu", settings)


@pytest.mark.timeout(600)
def test_same_gguf_at_another_path_reuses_the_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _backend()
    converted = first._converted_folder()  # converts once per machine, then it is found
    assert (converted / "config.json").is_file()

    gguf = str(first.options["gguf_file"])
    copy = tmp_path / "other-checkout"
    copy.mkdir()
    shutil.copyfile(first._source() / gguf, copy / gguf)
    second = _backend()
    second.options = {**second.options, "path": str(copy)}
    second.options.pop("package")

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again although the same file was converted before")

    monkeypatch.setattr(causal_lm.AutoModelForCausalLM, "from_pretrained", no_conversion)
    assert second._converted_folder() == converted


class Converting(Exception):
    pass


def test_a_changed_gguf_is_converted_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _backend()
    converted = first._converted_folder()
    gguf = str(first.options["gguf_file"])
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / converted.name).symlink_to(converted)  # the conversion of the package's file is there
    changed = tmp_path / "changed"
    changed.mkdir()
    data = bytearray((first._source() / gguf).read_bytes())
    data[-1] ^= 0xFF  # one byte differs: another file for the cache
    (changed / gguf).write_bytes(bytes(data))

    def converting(*args: object, **kwargs: object) -> None:
        raise Converting

    monkeypatch.setattr(causal_lm.AutoModelForCausalLM, "from_pretrained", converting)
    backend = _backend()
    backend.options = {"path": str(changed), "gguf_file": gguf, "cache_dir": str(cache)}
    with pytest.raises(Converting):
        backend._converted_folder()
