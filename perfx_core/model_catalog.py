"""The models at hand: the bundled one, the recently used ones and GGUF files where other tools keep them.

Where: the Hugging Face hub cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), LM Studio's
models folder (~/.lmstudio/models, the folder ~/.lmstudio-home-pointer names, or the older
~/.cache/lm-studio/models) and llama.cpp's download cache ($LLAMA_CACHE, else the user cache directory's
llama.cpp). ``find_models`` only walks folders (cheap: ``--model NAME`` uses it); ``describe`` reads one file's
GGUF header and tensor table, never its weights.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from .errors import ModelFormatError, ModelNotFoundError, PerfxError

MAX_DEPTH = 6  # below a search root: hub/models--org--name/snapshots/REV/sub/file.gguf is 4
MAX_FILES = 2000  # per root; a models folder with more is not walked further
SPLIT_FILE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")  # llama.cpp's split files: perfx reads single files only

# GGUF tensor types perfx runs in their stored form (int4, int5 or int8 kernels, or floats; a runtime without int5
# kernels gets Q5_1 and Q5_K in float16, weights.for_runtime). Other types gguf can dequantize are widened to
# float16 on load (gguf_loader): they run, at 2 bytes per weight.
NATIVE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q4_K")


@dataclass(frozen=True)
class Found:
    name: str  # what --model accepts: the file name without .gguf, or the directory's name
    path: Path
    source: str  # "bundled", "recent", "hf:org/repo", "lm-studio", "llama.cpp", or a folder given with --dir


@dataclass(frozen=True)
class ModelInfo:
    found: Found
    architecture: str
    quantization: str
    parameters: int | None
    size_bytes: int
    runs: str  # "yes", "yes (...)" or "no: why"

    @property
    def runnable(self) -> bool:
        return self.runs.startswith("yes")


def hf_hub_cache() -> Path:
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def lm_studio_dirs() -> list[Path]:
    dirs = [Path.home() / ".lmstudio" / "models"]
    try:  # LM Studio moved to another folder writes its home there
        pointed = (Path.home() / ".lmstudio-home-pointer").read_text(encoding="utf-8").strip()
        if pointed:
            dirs.insert(0, Path(pointed).expanduser() / "models")
    except (OSError, UnicodeDecodeError):
        pass
    dirs.append(Path.home() / ".cache" / "lm-studio" / "models")
    return dirs


def llama_cpp_cache() -> Path:
    cache = os.environ.get("LLAMA_CACHE")
    return Path(cache).expanduser() if cache else Path(platformdirs.user_cache_dir("llama.cpp", appauthor=False))


def search_roots(extra: Sequence[str | os.PathLike[str]] = ()) -> list[tuple[str, Path]]:
    """(source, folder) pairs, in the order names are looked up."""
    roots = [(str(Path(d)), Path(d).expanduser()) for d in extra]
    roots.append(("hf", hf_hub_cache()))
    roots += [("lm-studio", d) for d in lm_studio_dirs()]
    roots.append(("llama.cpp", llama_cpp_cache()))
    return roots


def find_models(extra: Sequence[str | os.PathLike[str]] = ()) -> list[Found]:
    """Every model found, each file once (the first source that has it wins)."""
    from .bundled_model import bundled_model_path
    from .settings import recent_models

    found: list[Found] = []
    seen: set[Path] = set()

    def add(name: str, path: Path, source: str) -> None:
        try:
            key = path.resolve()
        except OSError:
            return
        if key not in seen and path.exists():
            seen.add(key)
            found.append(Found(name, path, source))

    try:
        bundled = bundled_model_path()
        add(_name(bundled), bundled, "bundled")
    except ModelNotFoundError:
        pass
    for recent in recent_models():
        add(_name(Path(recent)), Path(recent), "recent")
    for source, root in search_roots(extra):
        for path in _gguf_files(root):
            add(_name(path), path, _hf_source(root, path) if source == "hf" else source)
    return found


def lookup(name: str, extra: Sequence[str | os.PathLike[str]] = ()) -> Path | None:
    """The path of the first model listed as ``name`` (``.gguf`` optional), in ``find_models``' order; None when
    none is. (Another file of the same name is loaded by its path.)"""
    wanted = name.removesuffix(".gguf")
    return next((f.path for f in find_models(extra) if f.name == wanted), None)


def describe(found: Found) -> ModelInfo:
    """Architecture, quantization, parameters, size and whether perfx runs it, from the header alone."""
    path = found.path
    if path.is_dir():
        return _describe_directory(found)
    size = path.stat().st_size
    if SPLIT_FILE.search(path.name):
        return ModelInfo(found, "?", "?", None, size, "no: a split GGUF; merge it with llama-gguf-split --merge")
    from .gguf_file import read_gguf

    try:
        gf = read_gguf(path)
    except PerfxError as exc:
        return ModelInfo(found, "?", "?", None, size, f"no: {_first_line(exc)}")
    arch = str(gf.metadata.get("general.architecture", "?"))
    matrices = [t for t in gf.tensors.values() if len(t.shape) >= 2]
    params = sum(t.n_elements for t in gf.tensors.values()) or None
    return ModelInfo(found, arch, _quantization(gf, matrices), params, size, _runs(gf, arch, matrices))


def _runs(gf, arch: str, matrices: list) -> str:
    from .architectures import FAMILIES
    from .gguf_loader import read_llama_config

    if not gf.tensors:
        return "no: vocabulary only (a tokenizer file without weights)"
    if arch not in {f.gguf_arch for f in FAMILIES}:
        return f"no: architecture {arch!r} is not one perfx runs"
    try:
        read_llama_config(gf)
    except PerfxError as exc:
        return f"no: {_first_line(exc)}"
    types = Counter(t.ggml_type.name for t in matrices)
    unknown = sorted(t for t in types if t not in NATIVE_TYPES and not _dequantizable(t))
    if unknown:
        return f"no: tensor types {', '.join(unknown)} cannot be read yet"
    widened = sorted(t for t in types if t not in NATIVE_TYPES)
    return f"yes ({', '.join(widened)} widened to float16)" if widened else "yes"


def _dequantizable(type_name: str) -> bool:
    """Whether the gguf package can dequantize this type (the loader widens such tensors to float16)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    t = GGMLQuantizationType[type_name]
    _, block_bytes = GGML_QUANT_SIZES[t]
    try:
        quants.dequantize(np.zeros((1, block_bytes), np.uint8), t)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def _quantization(gf, matrices: list) -> str:
    from gguf import LlamaFileType

    file_type = gf.metadata.get("general.file_type")
    try:
        name = LlamaFileType(int(file_type)).name
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        pass
    counts = Counter(t.ggml_type.name for t in matrices)
    return counts.most_common(1)[0][0] if counts else "-"


def _describe_directory(found: Found) -> ModelInfo:
    from .formats import directory_kind

    path = found.path
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    try:
        kind = directory_kind(path)
    except ModelFormatError as exc:
        return ModelInfo(found, "?", "?", None, size, f"no: {_first_line(exc)}")
    meta_file = path / ("perfx.json" if kind == "perfx" else "config.json")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = {}
    if kind == "perfx":
        arch = str(meta.get("config", {}).get("arch", "?"))
        quant = f"int4 ({meta.get('quantization', {}).get('method', 'perfx')})"
    else:
        arch = str(meta.get("model_type", "?"))
        quant = "AWQ int4" if kind == "awq" else str(meta.get("torch_dtype") or meta.get("dtype") or "float")
    return ModelInfo(found, arch, quant, None, size, "yes")


def _gguf_files(root: Path) -> Iterator[Path]:
    if not root.is_dir():
        return
    count = 0
    base_depth = len(root.parts)
    for folder, dirs, files in os.walk(root):
        if len(Path(folder).parts) - base_depth >= MAX_DEPTH:
            dirs[:] = []
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "blobs"]  # hub blobs: reached via snapshots
        for file in sorted(files):
            if file.endswith(".gguf"):
                count += 1
                if count > MAX_FILES:
                    return
                yield Path(folder) / file


def _hf_source(root: Path, path: Path) -> str:
    repo = path.relative_to(root).parts[0]  # models--org--name
    return "hf:" + repo.removeprefix("models--").replace("--", "/", 1) if repo.startswith("models--") else "hf"


def _name(path: Path) -> str:
    return path.name.removesuffix(".gguf")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
