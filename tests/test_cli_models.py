"""``perfx models`` and ``--model NAME``: GGUF files where Hugging Face, LM Studio and llama.cpp keep them, each
described from its header (architecture, quantization, size, whether perfx runs it)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from tiny_gguf import write_tiny_llama_gguf

from perfx_core.cli import main
from perfx_core.default_model import resolve_model_path
from perfx_core.model_catalog import hf_hub_cache, llama_cpp_cache, lm_studio_dirs
from perfx_core.settings import remember_model

VOCAB = Path(__file__).parent / "data" / "vocab" / "ggml-vocab-llama-bpe.gguf"


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A home with an HF hub cache (a snapshot linking to its blob, as huggingface_hub stores files), LM Studio's
    and llama.cpp's folders, each holding GGUF files of different kinds."""
    home = tmp_path / "home"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "LLAMA_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama.cpp"))

    repo = tmp_path / "hf" / "hub" / "models--someone--tiny-GGUF"
    (repo / "blobs").mkdir(parents=True)
    write_tiny_llama_gguf(repo / "blobs" / "1a2b3c", tensor_type="Q4_0")
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "tiny-q4_0.gguf").symlink_to("../../blobs/1a2b3c")

    studio = home / ".lmstudio" / "models" / "lmstudio-community" / "mamba-GGUF"
    studio.mkdir(parents=True)
    write_tiny_llama_gguf(studio / "mamba.gguf", overrides={"general.architecture": "mamba"})
    _widened_copy(write_tiny_llama_gguf(tmp_path / "f32.gguf").path, studio / "tiny-iq4_nl.gguf")

    (tmp_path / "llama.cpp").mkdir()
    shutil.copy(VOCAB, tmp_path / "llama.cpp" / "vocab.gguf")
    (tmp_path / "llama.cpp" / "big-00001-of-00002.gguf").write_bytes(b"GGUF")
    return tmp_path


def test_the_search_folders_follow_each_tool_and_its_variables(places, monkeypatch):
    assert hf_hub_cache() == places / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(places / "elsewhere"))
    assert hf_hub_cache() == places / "elsewhere"
    assert llama_cpp_cache() == places / "llama.cpp"
    assert lm_studio_dirs()[0] == places / "home" / ".lmstudio" / "models"
    (places / "home" / ".lmstudio-home-pointer").write_text(str(places / "studio-home"))
    assert lm_studio_dirs()[0] == places / "studio-home" / "models"


def test_models_lists_what_is_at_hand_with_what_runs(places, smollm2_path, capsys):
    remember_model(places / "f32.gguf")
    assert main(["models", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    bundled = rows["SmolLM2-135M-Instruct.Q4_1"]
    assert (bundled["source"], bundled["architecture"], bundled["quantization"], bundled["runs"]) == (
        "bundled",
        "llama",
        "Q4_1",
        "yes",
    )
    assert bundled["size_bytes"] == smollm2_path.stat().st_size
    assert bundled["parameters"] == _parameters(smollm2_path)
    assert rows["f32"]["source"] == "recent" and rows["f32"]["runs"] == "yes"
    tiny = rows["tiny-q4_0"]
    assert (tiny["source"], tiny["quantization"], tiny["runs"]) == ("hf:someone/tiny-GGUF", "Q4_0", "yes")
    assert (
        tiny["size_bytes"] == (places / "hf" / "hub" / "models--someone--tiny-GGUF" / "blobs" / "1a2b3c").stat().st_size
    )
    assert rows["tiny-iq4_nl"]["runs"] == "yes (IQ4_NL widened to float16)"
    assert rows["mamba"]["source"] == "lm-studio" and rows["mamba"]["architecture"] == "mamba"
    assert rows["mamba"]["runs"] == "no: architecture 'mamba' is not one perfx runs"
    assert rows["vocab"]["runs"].startswith("no: vocabulary only") and rows["vocab"]["source"] == "llama.cpp"
    assert rows["big-00001-of-00002"]["runs"].startswith("no: a split GGUF")
    assert len(rows) == 7


def test_models_prints_a_table_and_where_it_searched(places, capsys):
    extra = places / "mine"
    extra.mkdir()
    shutil.copy(places / "f32.gguf", extra / "mine.gguf")
    assert main(["models", "--dir", str(extra)]) == 0
    out = capsys.readouterr().out
    header, *lines = out.splitlines()
    assert header.split() == ["NAME", "ARCH", "QUANT", "PARAMS", "SIZE", "RUNS", "FOUND", "IN", "PATH"]
    mine = next(line for line in lines if line.startswith("mine "))
    assert mine.split()[:4] == [
        "mine",
        "llama",
        "F32",
        f"{_parameters(extra / 'mine.gguf') / 1e3:.0f}K",
    ] and mine.endswith(str(extra / "mine.gguf"))
    assert f"hf         {places / 'hf' / 'hub'}" in out
    assert "(not there)" in out  # the older LM Studio folder


def test_model_accepts_a_listed_name(places, capsys):
    snapshot_file = places / "hf" / "hub" / "models--someone--tiny-GGUF" / "snapshots" / "0123abcd" / "tiny-q4_0.gguf"
    assert resolve_model_path("tiny-q4_0") == snapshot_file
    assert resolve_model_path("tiny-q4_0.gguf") == snapshot_file
    assert main(["run", "hello", "--model", "tiny-q4_0", "--raw", "-n", "3", "-t", "0", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_an_unknown_name_says_where_to_look():
    with pytest.raises(FileNotFoundError, match="nor a name `perfx models` lists"):
        resolve_model_path("no-such-model")


def _widened_copy(src: Path, dst: Path) -> None:
    """``src`` with its matrices stored as IQ4_NL (random valid blocks: gguf cannot quantize it), a type perfx
    widens to float16."""
    reader = gguf.GGUFReader(src)
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(os.fspath(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(name, field.contents(), kind, field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if data.ndim == 2:
            iq4 = GGMLQuantizationType.IQ4_NL
            blocks = rng.integers(0, 256, (data.shape[0], data.shape[1] // 32, 18), dtype=np.uint8)
            blocks[:, :, :2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)  # d of each block of 32
            writer.add_tensor(tensor.name, blocks.reshape(data.shape[0], -1), raw_dtype=iq4)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _parameters(path: Path) -> int:
    from perfx_core.gguf_file import read_gguf

    return sum(t.n_elements for t in read_gguf(path).tensors.values())
