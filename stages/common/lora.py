"""LoRA policy checkpoints (`learner.lora`, issue 43): reading them as the merged policy every stage samples from.

A LoRA checkpoint is a directory PEFT reads (`PeftModel.from_pretrained(base, DIR)`, or
`AutoPeftModelForCausalLM.from_pretrained(DIR)` through `adapter_config.json`'s `base_model_name_or_path`):
`adapter_config.json` and `adapter_model.safetensors` (PEFT's `save_pretrained`), the tokenizer, smd's
`weights_digest.json` of the adapter (schemas/weights.py), and `lora_base.json`, the record of its base: the base
directory's path as the learner was given it and the digest of its weight files (`schemas.weights.file_sha256` by
file name, the same record as the base's own `weights_digest.json` when it has one). Loading checks both: a
flipped byte in the adapter, and a base whose weights changed since the adapter was trained on it, are each one
line naming the file (an adapter applied to another base is another policy).

Rollout and evaluation sample from the merged weights W + (alpha / r) B A (`load_merged_policy`, PEFT's
`merge_and_unload`): the plain model, with no adapter layers in its forward; the learner trains the adapter form
(stages/learner/lora.py) and its parity gate holds within the float32 bound between the two (tests/test_lora.py).
`write_merged_policy` (`smdctl merge-lora`) writes the merged weights as a plain Hugging Face directory.
Its plain loaders come from `stages.common.policy_io`; `stages.common.model.load_policy` routes LoRA checkpoints
here. Guide: docs/guides/lora.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from schemas.atomic import atomic_path, check_replaceable
from schemas.errors import SmdInputError
from schemas.weights import (
    DIGEST_FILE,
    file_sha256,
    verify_weights_digest,
    weight_files,
    write_weights_digest,
)
from stages.common.policy_io import DTYPES, load_plain_policy, load_tokenizer, place_model

ADAPTER_CONFIG = "adapter_config.json"  # peft.utils.CONFIG_NAME
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft.utils.SAFETENSORS_WEIGHTS_NAME
BASE_RECORD = "lora_base.json"
BASE_RECORD_KIND = "lora_base"
BASE_RECORD_VERSION = "1"


def is_adapter_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a LoRA checkpoint (PEFT's adapter_config.json) rather than a full model directory."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def require_peft(what: str):
    """The `peft` package, or one line saying how to install it (the `lora` extra)."""
    try:
        import peft
    except ImportError as exc:
        raise SmdInputError(f"{what}: needs PEFT: pip install 'smd[lora]' (peft==0.21.2)") from exc
    return peft


def base_weights_digest(base: str | Path) -> dict[str, str]:
    """The digest of a base's weight files ({file name: sha256}). A base smd wrote is checked against its own
    weights_digest.json first (one line if it is damaged) and its record is returned without hashing twice."""
    base = Path(base)
    if not (base / "config.json").is_file():
        raise SmdInputError(f"{base}: the LoRA base is not a model directory (config.json missing)")
    if (base / DIGEST_FILE).exists():
        verify_weights_digest(base)
        return dict(json.loads((base / DIGEST_FILE).read_text())["files"])
    return {p.name: file_sha256(p) for p in weight_files(base)}


def write_base_record(directory: str | Path, base: str | Path, digest: dict[str, str] | None = None) -> Path:
    """Write `lora_base.json` into the adapter directory being written: the base's path (as given, relative to
    the working directory when relative, as every artifact path of the pipeline) and the digest of its weights
    (`digest`: computed already, or computed here)."""
    body = {"kind": BASE_RECORD_KIND, "schema_version": BASE_RECORD_VERSION, "path": str(base),
            "weights_digest": digest if digest is not None else base_weights_digest(base)}
    path = Path(directory) / BASE_RECORD
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return path


def read_base_record(adapter_dir: str | Path) -> dict:
    """The base record of a LoRA checkpoint; one line naming the file when it is missing or malformed."""
    path = Path(adapter_dir) / BASE_RECORD
    try:
        body = json.loads(path.read_text())
        if body.get("kind") != BASE_RECORD_KIND or not isinstance(body.get("path"), str) \
                or not isinstance(body.get("weights_digest"), dict):
            raise ValueError("not a LoRA base record")
    except (OSError, ValueError, AttributeError, UnicodeDecodeError) as exc:
        raise SmdInputError(f"{path}: unreadable LoRA base record ({exc.__class__.__name__}); smd's LoRA "
                            "checkpoints record their base there") from exc
    return body


def checked_base(adapter_dir: str | Path) -> tuple[Path, dict[str, str]]:
    """The base directory of a LoRA checkpoint and its digest, after checking that its weights are the ones the
    adapter was trained on: a base that changed since is refused in one line."""
    record = read_base_record(adapter_dir)
    base = Path(record["path"])
    digest = base_weights_digest(base)
    if digest != record["weights_digest"]:
        raise SmdInputError(f"{Path(adapter_dir) / BASE_RECORD}: the base {base} changed since this adapter was "
                            "trained on it (its weights digest differs); the adapter belongs to the recorded base")
    return base, digest


def load_adapter_policy(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
                        device="cpu", is_trainable: bool = False):
    """The LoRA checkpoint `path` in the adapter form: the checked base (`checked_base`) with the adapter of
    `path` (`PeftModel.from_pretrained`; `is_trainable`: B and A require gradients, the base none). Returns
    (PeftModel, base path, base digest)."""
    peft = require_peft(str(path))
    path = Path(path)
    verify_weights_digest(path)  # the adapter's own weights
    base, digest = checked_base(path)
    model = load_plain_policy(base, dtype, attn_implementation, device="cpu")  # a base is a plain directory
    try:
        wrapped = peft.PeftModel.from_pretrained(model, str(path), is_trainable=is_trainable,
                                                 autocast_adapter_dtype=False)  # the model's dtype
    except Exception as exc:  # noqa: BLE001 - any loader failure is a bad artifact
        raise SmdInputError(f"{path}: cannot load the LoRA adapter ({exc.__class__.__name__}: "
                            f"{str(exc)[:120]})") from exc
    wrapped.eval()
    return place_model(wrapped, device), base, digest


def load_merged_policy(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
                       device="cpu"):
    """The LoRA checkpoint `path` as a plain model with merged weights W + (alpha / r) B A (PEFT's
    `merge_and_unload`): what rollout and evaluation sample from (`stages.common.model.load_policy` routes LoRA
    checkpoints here)."""
    wrapped, _, _ = load_adapter_policy(path, dtype, attn_implementation, device="cpu")
    merged = wrapped.merge_and_unload()
    merged.eval()
    return place_model(merged, device)


def write_merged_policy(adapter_dir: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """`smdctl merge-lora`: write the merged weights of a LoRA checkpoint as a plain Hugging Face model directory
    (safetensors, tokenizer, weights digest) at `out`, atomically; never into a directory smd did not create."""
    adapter_dir, out = Path(adapter_dir), Path(out)
    if dtype not in DTYPES:
        raise SmdInputError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    if not is_adapter_checkpoint(adapter_dir):
        raise SmdInputError(f"{adapter_dir}: not a LoRA checkpoint ({ADAPTER_CONFIG} missing)")
    check_replaceable(out)
    model = load_merged_policy(adapter_dir, dtype)
    tokenizer = load_tokenizer(adapter_dir)
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_weights_digest(tmp)
    return out
