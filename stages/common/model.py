"""Policy loading and the tiny default model, importable by every stage.

The tiny default is a Qwen3-architecture causal LM built from a config (nothing can be downloaded
here) with a word-level tokenizer built with `tokenizers`, or (model.tiny.tokenizer=bpe) a byte-level BPE
tokenizer trained here with Qwen's special tokens and ChatML chat template. Any Hugging Face causal-LM directory works
in its place through `model.init_path`. Loading a plain directory, dtypes and device placement live in
`stages.common.policy_io` (shared with `stages.common.lora`). Guide: docs/guides/your-model.md.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import (
    AutoConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from schemas.atomic import atomic_path, is_foreign_dir
from schemas.errors import SmdInputError
from schemas.layout import PROVENANCE
from schemas.params.model import DEVICE_CHOICES, DEVICE_PATTERN, ModelParams, TinyModelParams
from schemas.weights import verify_weights_digest, write_weights_digest
from stages.common.lora import ADAPTER_CONFIG, is_adapter_checkpoint, load_merged_policy

# Re-exported: stages import these from here; they live in the lower layer that stages.common.lora shares.
from stages.common.policy_io import DTYPES as DTYPES
from stages.common.policy_io import configure_precision as configure_precision
from stages.common.policy_io import load_plain_policy
from stages.common.policy_io import load_tokenizer as load_tokenizer
from stages.common.policy_io import place_model as place_model
from stages.common.vocab import bpe_training_corpus, tiny_vocabulary

hf_logging.disable_progress_bar()  # stage logs stay readable; stages print their own progress


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: lowercase, split on whitespace and punctuation, one token per digit."""
    vocab = {tok: i for i, tok in enumerate(tiny_vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        clean_up_tokenization_spaces=False,
    )


# ChatML, the chat format of Qwen (and of its tokenizer's `chat_template`, without the tool and reasoning branches):
# each message is "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens the assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_bpe_tokenizer(texts: list[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here with `tokenizers` (GPT-2 / Qwen style: byte-level pre-tokenizer and
    decoder, no unknown token) with Qwen's special tokens and ChatML chat template: the assistant turn ends with
    `<|im_end|>`, the EOS token (as Qwen3's instruct tokenizers), `<|endoftext|>` pads; no BOS (Qwen adds none)."""
    from tokenizers import decoders, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHATML_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE, clean_up_tokenization_spaces=False)


def build_tokenizer(shape: TinyModelParams) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer that model.tiny.tokenizer names: word-level, or byte-level BPE trained on the
    fixed corpus `stages.common.vocab.bpe_training_corpus()` (deterministic: the same tokenizer.json every time)."""
    if shape.tokenizer == "bpe":
        return build_bpe_tokenizer(bpe_training_corpus(), vocab_size=shape.bpe_vocab_size)
    return build_tiny_tokenizer()


def match_special_tokens(model, tokenizer) -> None:
    """Set the model config's and generation config's EOS, pad and BOS ids to the tokenizer's (None where the
    tokenizer has none, as Qwen has no BOS), as a Hugging Face model directory carries them: generation stops on
    the config's EOS, and a config that names another tokenizer's ids would stop on the wrong token."""
    for config in (model.config, model.generation_config):
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        config.bos_token_id = tokenizer.bos_token_id


def prompt_token_ids(tokenizer, prompt: str, chat_template: bool = True) -> list[int]:
    """The prompt's token ids as the policy sees them: rendered through the tokenizer's chat template as one user
    turn with the assistant turn opened (`add_generation_prompt`), as Hugging Face chat models are prompted, when the
    tokenizer has a template and `chat_template` is on; else the plain text without special tokens."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def build_tiny_model(shape: TinyModelParams, vocab_size: int, seed: int = 0) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def init_tiny_model(shape: TinyModelParams, out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny model and its tokenizer (model.tiny.tokenizer) and save both as one Hugging Face directory
    (atomically); the config's special-token ids are the tokenizer's. Same shape and seed -> identical files."""
    tokenizer = build_tokenizer(shape)
    model = build_tiny_model(shape, vocab_size=len(tokenizer), seed=seed)
    match_special_tokens(model, tokenizer)
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_weights_digest(tmp)
    return Path(out_dir)


# init-model's own output (dvc.yaml's `outs` of the init-model stage): the default model.init_path.
DEFAULT_INIT_DIR = Path(ModelParams.model_fields["init_path"].default)
EXTERNAL_RECORD = "source.json"
EXTERNAL_KIND = "external_model"
EXTERNAL_SCHEMA_VERSION = 1
PROVENANCE_FILE = PROVENANCE  # schemas.layout's name of convert-model's record
PROVENANCE_KIND = "converted_model"


def is_converted_model(path: str | Path) -> bool:
    """True when `path` is a model directory `smdctl convert-model` wrote (its provenance record says so): smd
    created it, but it is the user's model, which init-model uses as it is and never rebuilds."""
    path = Path(path)
    if not (path / PROVENANCE_FILE).is_file() or not (path / "config.json").is_file():
        return False
    try:
        return json.loads((path / PROVENANCE_FILE).read_text()).get("kind") == PROVENANCE_KIND
    except (OSError, ValueError, AttributeError):
        return False


def init_model(model: ModelParams, seed: int = 0, out: str | Path | None = None) -> dict[str, Path]:
    """`smdctl init-model`: build the tiny default at `out` (default: model.init_path), or, when
    model.init_path is a model directory smd did not create (a user's Hugging Face model), leave it untouched
    and record which model the pipeline starts from in init-model's own output directory (so `dvc exp run
    -S model.init_path=DIR` runs the whole pipeline from DIR). Never replaces a directory smd did not create:
    an explicit `out`, or a model.init_path that is not a model directory, is refused with one line."""
    target = Path(out if out is not None else model.init_path)
    if out is not None and is_converted_model(target):
        raise SmdInputError(f"--out {target}: a model directory `smdctl convert-model` wrote; refusing to replace "
                            "it with the tiny model. Choose another output path")
    if out is None and (is_foreign_dir(target) or is_converted_model(target)):
        if not (target / "config.json").is_file():
            raise SmdInputError(
                f"model.init_path {target}: an existing directory smd did not create and not a Hugging Face "
                "model directory (no config.json); refusing to touch it"
            )
        if target.resolve() == DEFAULT_INIT_DIR.resolve():
            raise SmdInputError(
                f"model.init_path {target}: your model directory (not smd's tiny model) sits at init-model's own "
                "output path; refusing to replace it. Move it elsewhere and set model.init_path to it"
            )
        what = "converted by `smdctl convert-model`" if is_converted_model(target) else "smd did not create"
        print(f"model.init_path {target}: a model directory {what}; using it as is (nothing built, nothing "
              "written there)")
        return {"record": record_external_model(target, DEFAULT_INIT_DIR)}
    return {"model": init_tiny_model(model.tiny, target, seed=seed)}


def record_external_model(init_path: Path, record_dir: Path) -> Path:
    """Write `record_dir/source.json` naming the external model (path, top-level file names and sizes): the
    init-model stage's output when the pipeline starts from a user's model, which it only reads."""
    files = {p.name: p.stat().st_size for p in sorted(init_path.iterdir()) if p.is_file()}
    record = {"schema_version": EXTERNAL_SCHEMA_VERSION, "kind": EXTERNAL_KIND, "init_path": str(init_path),
              "files": files}
    with atomic_path(record_dir) as tmp:
        tmp.mkdir(parents=True)
        (tmp / EXTERNAL_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record_dir / EXTERNAL_RECORD


def local_rank() -> int:
    """This process's rank on its node (LOCAL_RANK from the deepspeed launcher or torchrun; 0 when not launched)."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def resolve_device(spec: str = "auto", rank: int | None = None) -> torch.device:
    """The one device rule of every stage (`model.device`, docs/design.md "Devices").

    `auto`: cuda:<local rank> when CUDA is available, else the CPU; `cuda`: cuda:<local rank> (each process of
    the launcher takes its own GPU); `cuda:N`: that GPU; `cpu`: the CPU. `rank` defaults to LOCAL_RANK. A value
    that is not a device, or a GPU this machine does not have, is one line naming model.device."""
    if not isinstance(spec, str) or not DEVICE_PATTERN.fullmatch(spec):
        raise SmdInputError(f"model.device: {spec!r} is not a device; expected {DEVICE_CHOICES}")
    rank = local_rank() if rank is None else rank
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SmdInputError(f"model.device: {spec}: CUDA is not available here (torch {torch.__version__}); "
                            "use auto or cpu")
    index = int(spec.split(":")[1]) if ":" in spec else rank
    count = torch.cuda.device_count()
    if index >= count:
        raise SmdInputError(f"model.device: {spec}: cuda:{index} does not exist ({count} CUDA device(s) visible)")
    return torch.device("cuda", index)


def model_device(model) -> torch.device:
    """The device a model's weights live on: where every tensor of a forward over it must be created."""
    return next(model.parameters()).device


def load_policy(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
                device: torch.device | str = "cpu"):
    """Load a causal LM from a Hugging Face directory onto `device` (stages pass
    `resolve_device(params.model.device)`); one clear line if it is missing or unloadable. A LoRA checkpoint
    (`learner.lora`: PEFT's adapter plus the record of its base) loads as its merged weights
    (`stages.common.lora.load_merged_policy`), any other directory as a plain one
    (`stages.common.policy_io.load_plain_policy`)."""
    if is_adapter_checkpoint(path):
        return load_merged_policy(path, dtype, attn_implementation, device)
    return load_plain_policy(path, dtype, attn_implementation, device)


@contextlib.contextmanager
def attention_implementation(model, name: str) -> Iterator:
    """Run the model's forward passes with the attention function registered as `name` (restored on exit)."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield model
    finally:
        model.config._attn_implementation = previous


def load_policy_config(path: str | Path):
    """The policy's model config alone (no weights): what a stage needs when vLLM holds the weights. vLLM reads a
    plain model directory: a LoRA checkpoint is one line (write its merged weights with `smdctl merge-lora`)."""
    path = Path(path)
    if is_adapter_checkpoint(path):
        raise SmdInputError(f"{path / ADAPTER_CONFIG}: a LoRA checkpoint; vLLM samples from a plain model "
                            "directory: use engine hf, or write the merged weights with `smdctl merge-lora`")
    if not (path / "config.json").exists():
        raise SmdInputError(f"{path}: no policy checkpoint (config.json missing)")
    verify_weights_digest(path)  # the caller's engine (vLLM) reads these weights next: check them first
    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - any loader failure is a bad artifact
        raise SmdInputError(f"{path / 'config.json'}: cannot load the model config "
                            f"({exc.__class__.__name__}: {str(exc)[:120]})") from exc


def check_positions(config, tokens: int, what: str) -> None:
    """One line (SmdInputError) when a sequence of `tokens` tokens does not fit the positions of the model
    whose `config` is given.

    `what` describes the sequence and leads the message: "<what> exceeds the model's N positions".
    """
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        raise SmdInputError(f"{what} exceeds the model's {limit} positions")


# A user turn whose content cannot change how the template renders the assistant turn after it (ChatML and the
# templates derived from it render each message on its own).
_PROBE_TURN = [{"role": "user", "content": "x"}]


def _chat_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


# Per tokenizer object and template: the probe turn rendered closed and with the assistant turn opened (every
# prompt row asks, so the template renders once).
_PROBE_RENDERS: dict[tuple[int, str, int, int | None], tuple[list[int], list[int]]] = {}


def _probe_renders(tokenizer) -> tuple[list[int], list[int]]:
    key = (id(tokenizer), tokenizer.chat_template, len(tokenizer), tokenizer.eos_token_id)
    if key not in _PROBE_RENDERS:
        _PROBE_RENDERS[key] = (_chat_ids(tokenizer, _PROBE_TURN, False), _chat_ids(tokenizer, _PROBE_TURN, True))
    return _PROBE_RENDERS[key]


def generation_prompt_ids(tokenizer) -> list[int]:
    """The tokens the chat template appends to open the assistant turn (`add_generation_prompt`), e.g. ChatML's
    `<|im_start|>assistant\n`; [] when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    closed, opened = _probe_renders(tokenizer)
    if opened[: len(closed)] != closed:
        raise SmdInputError("tokenizer: chat_template: the generation prompt does not extend the rendered user turn")
    return opened[len(closed):]


# User messages whose renders end differently on any tokenizer (a word-level vocabulary maps unknown words to one
# token, so several, of which some are in every vocabulary).
_TAIL_PROBES = ("x", "1", "answer :", "?", "y")


def chat_template_tail(tokenizer) -> list[int]:
    """The tokens a chat template renders after the user's message when it opens the assistant turn: the user turn's
    closing tokens and the generation prompt (ChatML: `<|im_end|>\n<|im_start|>assistant\n`); [] when the tokenizer
    has no chat template. The longest suffix the renders of several different user messages share, so nothing of
    the message itself is in it. SnapKV's `window_anchor: user_end` ends its observation window before these."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    renders = [_chat_ids(tokenizer, [{"role": "user", "content": text}], True) for text in _TAIL_PROBES]
    n = 0
    while all(len(r) > n for r in renders) and len({r[-1 - n] for r in renders}) == 1:
        n += 1
    return renders[0][len(renders[0]) - n:]


def observation_window_tail(eviction, tokenizer, prompts: list[list[int]] | None = None, source: str | Path = "",
                            field: str = "rollout.eviction.window_anchor") -> int:
    """Tokens after SnapKV's observation window at the end of every prompt: the chat template's closing tokens
    (`chat_template_tail`) under `window_anchor: user_end`, else 0. With `prompts`, checks that each ends with
    them (one line naming `source` and `field` when one does not: the data was rendered without this template)."""
    if eviction.window_anchor != "user_end":
        return 0
    tail = chat_template_tail(tokenizer)
    for ids in prompts or []:
        if len(ids) < len(tail) or list(ids[len(ids) - len(tail):]) != tail:
            raise SmdInputError(
                f"{source}: prompt_token_ids: a prompt does not end with the chat template's closing tokens "
                f"{tokenizer.decode(tail)!r} ({field} user_end needs prompts rendered through the policy's template; "
                "set it to prompt_end)")
    return len(tail)


def rendered_as_chat(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether `prompt_ids` were rendered through the tokenizer's chat template with the assistant turn opened
    (`prompt_token_ids` with the template on): they end with the template's generation prompt."""
    suffix = generation_prompt_ids(tokenizer)
    return bool(suffix) and list(prompt_ids[-len(suffix):]) == suffix


def response_ids(tokenizer, reference: str, chat: bool = False) -> list[int]:
    """Token ids of the target response, ending with EOS, tokenised as the policy produces it after its prompt.

    `chat` (the prompt was rendered through the chat template, `rendered_as_chat`): exactly the tokens the
    template's assistant turn holds for `reference` up to its end-of-turn token (the tokenizer's EOS, e.g.
    ChatML's `<|im_end|>`): the conversation [user, assistant: reference] rendered and tokenised as one text,
    minus the prompt with the generation prompt. A BPE tokenizer then sees the answer with no leading space,
    as the model writes it after `<|im_start|>assistant\n`. Otherwise (a plain prompt ending with its answer
    cue, e.g. `answer :`): the reference after a space, then EOS.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SmdInputError("tokenizer: eos_token: missing (the response must end with EOS)")
    if not chat:
        return tokenizer(" " + reference, add_special_tokens=False)["input_ids"] + [eos]
    prompt = _probe_renders(tokenizer)[1]
    full = _chat_ids(tokenizer, [*_PROBE_TURN, {"role": "assistant", "content": reference}], False)
    if full[: len(prompt)] != prompt or eos not in full[len(prompt):]:
        raise SmdInputError(
            "tokenizer: chat_template: the assistant turn does not follow the generation prompt or does not end "
            f"with the EOS token {tokenizer.eos_token!r}; render prompts without it (prepare.chat_template=false)"
        )
    turn = full[len(prompt):]
    return turn[: turn.index(eos) + 1]


def response_ids_after(tokenizer, prompt_ids: list[int], reference: str) -> list[int]:
    """`response_ids` of `reference` in the form that follows `prompt_ids`: the template's assistant turn after a
    prompt rendered as chat (`rendered_as_chat`), else the reference after a space."""
    return response_ids(tokenizer, reference, rendered_as_chat(tokenizer, prompt_ids))


@torch.no_grad()
def reference_nll(model, tokenizer, prompts: list[list[int]], references: list[str], batch_size: int = 16) -> float:
    """Mean over prompts of the reference response's negative log-likelihood (nats, summed over its tokens and
    EOS) under the policy with the full context, temperature 1 -- the held-out likelihood of the right answer,
    a low-noise companion of greedy exact match."""
    total = 0.0
    for start in range(0, len(prompts), batch_size):
        for nll in reference_nll_batch(model, tokenizer, prompts[start: start + batch_size],
                                       references[start: start + batch_size]):
            total += nll
    return total / max(len(prompts), 1)


def reference_nll_batch(model, tokenizer, prompts: list[list[int]], references: list[str]) -> list[float]:
    """Per prompt of one batch: the reference response's negative log-likelihood (see `reference_nll`; the
    data-parallel evaluate sums these in batch order, so its mean equals the one-process figure exactly)."""
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seqs = [(list(p), response_ids_after(tokenizer, p, r)) for p, r in zip(prompts, references, strict=True)]
    T = max(len(p) + len(r) for p, r in seqs)
    # Built on the host, copied to the model's device once per batch.
    ids = torch.full((len(seqs), T), pad, dtype=torch.long, device="cpu")
    mask = torch.zeros(len(seqs), T, dtype=torch.long, device="cpu")
    targets = torch.zeros(len(seqs), T, dtype=torch.long, device="cpu")
    for b, (p, r) in enumerate(seqs):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r, device="cpu")
        mask[b, : len(p) + len(r)] = 1
        targets[b, len(p) - 1: len(p) + len(r) - 1] = torch.tensor(r, device="cpu")
    # Logits only at the positions that predict a reference token (their union over the batch, at most its
    # reference tokens): the whole [B, T, V] and its log-softmax would be gigabytes at long context (16 rows x 2k
    # tokens x SmolLM2's 49k vocabulary = 6.4 GB in float32, twice).
    keep = sorted({t for p, r in seqs for t in range(len(p) - 1, len(p) + len(r) - 1)})
    column = {t: i for i, t in enumerate(keep)}  # a row's positions are consecutive, so are their columns
    keep_idx = torch.tensor(keep, dtype=torch.long, device="cpu")
    device = model_device(model)
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                       logits_to_keep=keep_idx.to(device)).logits  # [B, len(keep), V]
    kept_targets = targets.index_select(1, keep_idx).to(device)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, kept_targets.unsqueeze(-1)).squeeze(-1)
    picked = logp.cpu()  # one host copy per batch
    return [-float(picked[b, column[len(p) - 1]: column[len(p) - 1] + len(r)].sum()) for b, (p, r) in enumerate(seqs)]
