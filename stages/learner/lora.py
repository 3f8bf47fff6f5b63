"""LoRA in the learner (`learner.lora`, issue 43): the adapter form of the policy, its checkpoints and the base view.

The field's memory lever for RL post-training on one GPU: TRL's GRPOTrainer takes a PEFT `peft_config`, verl a
`lora_rank`, OpenRLHF `--lora_rank`. Here, through PEFT (Hu et al. 2021; `peft.LoraConfig`, `get_peft_model`):

- `load_lora_policy`: the policy the learn call starts from, in the adapter form W x + (alpha / r) B A x. From a
  full model directory a fresh adapter (PEFT's init: A Kaiming-uniform from the learner's seed, B = 0, so the
  first update starts from exactly the policy that sampled); from a LoRA checkpoint (stages/common/lora.py) its
  adapter, trainable, on its checked base. Only B and A require gradients: the DeepSpeed engine's AdamW holds
  their state alone (`stages.learner.deepspeed_runtime.make_engine`), and the trainer state saved beside the
  adapter holds nothing of the base (`save_trainer_state`, frozen parameters excluded).
- The engine trains `LoraPolicy.model`, the transformers model with PEFT's LoRA layers in place of its linear
  layers (`PeftModel.get_base_model()`): the learner's forward code (`decoder_of`, `lm_head_of`, the shadow
  attention) runs on it unchanged.
- `BaseView`: the base with the adapter disabled (PEFT's `disable_adapter()`), the way TRL computes the reference
  log-probs of its KL under PEFT (GRPOTrainer: `with self.accelerator.unwrap_model(self.model).disable_adapter()`)
  -- the reference of `ref_kl_coef` and the teacher of `kl_teacher: reference`, with no second model in memory.
- `LoraPolicy.save`: the adapter in PEFT's format (`save_pretrained`) plus the record of its base
  (`stages.common.lora.write_base_record`): `PeftModel.from_pretrained(base, DIR)` loads it.
- Dropout (`learner.lora.dropout`): PEFT's dropout on the adapters' input, here only in forwards with gradient
  (`GradOnlyDropout`), so no_grad scoring (the parity pass, old log-probs, teachers) sees the policy itself. With
  dropout the training forward is not the policy that sampled: `check_lora_params` refuses it for the objectives
  whose parity gate asserts that (smd, shadow).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from schemas.errors import SmdInputError
from schemas.params.learner import LearnerParams, LoraParams
from stages.common.lora import (
    ADAPTER_CONFIG,
    base_weights_digest,
    is_adapter_checkpoint,
    load_adapter_policy,
    require_peft,
    write_base_record,
)
from stages.common.model import load_policy


def lora_config(params: LoraParams):
    """PEFT's `LoraConfig` of `learner.lora` (task CAUSAL_LM, no bias terms: PEFT's and TRL's defaults)."""
    peft = require_peft("learner.lora")
    targets = params.target_modules if isinstance(params.target_modules, str) else list(params.target_modules)
    return peft.LoraConfig(r=params.rank, lora_alpha=params.alpha, target_modules=targets,
                           lora_dropout=params.dropout, bias="none", task_type="CAUSAL_LM")


def check_lora_params(cfg: LearnerParams, masked: bool) -> None:
    """One line for what LoRA cannot run here: dropout under an objective whose parity gate asserts that the
    learner's forward is the sampling policy (`masked`: smd, shadow), and the EMA teacher (it would average a
    second full copy of the model)."""
    lora = cfg.lora
    if lora is None:
        return
    if masked and lora.dropout > 0:
        raise SmdInputError(f"parity gate: learner.lora.dropout={lora.dropout:g}: with dropout the learner's forward "
                            f"is not the policy that sampled; {cfg.objective} trains strictly on-policy: set "
                            "learner.lora.dropout: 0")
    if cfg.kl_teacher == "ema" and cfg.objective == "smd" and cfg.kl_lambda > 0:
        raise SmdInputError("learner.kl_teacher=ema: not supported with learner.lora (the average would hold a second "
                            "full copy of the model); use current or reference (the base with the adapter disabled)")


def refuse_adapter_without_lora(policy_path: str | Path) -> None:
    """Full fine-tuning (`learner.lora: null`) from a LoRA checkpoint: one line (its trainer state is the
    adapter's; write the merged weights first to start a full fine-tuning from them)."""
    if is_adapter_checkpoint(policy_path):
        raise SmdInputError(f"{Path(policy_path) / ADAPTER_CONFIG}: a LoRA checkpoint but learner.lora is null; set "
                            "learner.lora as it was trained, or write the merged weights (`smdctl merge-lora`) and "
                            "fine-tune them in full")


class GradOnlyDropout(torch.nn.Dropout):
    """PEFT's `lora_dropout`, active only in a forward with gradient: no_grad scoring (parity pass, recomputed old
    log-probs, teachers) sees the deterministic policy, the training forward the dropped adapter input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, training=torch.is_grad_enabled())


def _grad_only_dropout_(model) -> None:
    for module in model.modules():
        drops = getattr(module, "lora_dropout", None)
        if isinstance(drops, torch.nn.ModuleDict):
            for name, drop in list(drops.items()):
                if isinstance(drop, torch.nn.Dropout) and drop.p > 0:
                    drops[name] = GradOnlyDropout(drop.p)


def _check_same_config(path: Path, saved, params: LoraParams) -> None:
    """One line when the adapter of `path` was trained with other LoRA settings than `learner.lora`."""
    want = {"rank": (saved.r, params.rank), "alpha": (saved.lora_alpha, params.alpha),
            "dropout": (saved.lora_dropout, params.dropout)}
    if not isinstance(params.target_modules, str):
        want["target_modules"] = (sorted(saved.target_modules or []), sorted(params.target_modules))
    for key, (got, asked) in want.items():
        if got != asked and not (isinstance(got, float | int) and float(got) == float(asked)):
            raise SmdInputError(f"{path / ADAPTER_CONFIG}: {key} {got!r} but learner.lora.{key} is {asked!r}; continue "
                                "the adapter with its own settings")


class _AdapterDisabledCall:
    """A module called with the adapter disabled (PEFT's `disable_adapter()` around each call); every other
    attribute is the module's."""

    def __init__(self, peft_model, module):
        self._peft, self._module = peft_model, module

    def __call__(self, *args, **kwargs):
        with self._peft.disable_adapter():
            return self._module(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


class BaseView:
    """The base policy inside the adapter model: what the learner's scoring reads of a model
    (`decoder_of(model)` = `getattr(model, model.base_model_prefix)`, `model.config`, `lm_head_of(model)`,
    `parameters()`, `.to()`), with every forward of the decoder run under PEFT's `disable_adapter()`: W x alone,
    the weights the adapter started from. Shares every tensor with the trained policy (no copy); not a module, so
    `requires_grad_` or `.eval()` on it cannot reach the adapter's parameters."""

    def __init__(self, peft_model):
        self._peft = peft_model
        self._model = peft_model.get_base_model()
        self.base_model_prefix = self._model.base_model_prefix
        self.config = self._model.config
        setattr(self, self.base_model_prefix,
                _AdapterDisabledCall(peft_model, getattr(self._model, self.base_model_prefix)))

    def __call__(self, *args, **kwargs):
        with self._peft.disable_adapter():
            return self._model(*args, **kwargs)

    def get_output_embeddings(self):
        return self._model.get_output_embeddings()

    def parameters(self):
        return self._model.parameters()

    def modules(self):
        return self._model.modules()

    def __getattr__(self, name: str):  # any other read (no forward: the decoder and __call__ are the view's own)
        if name.startswith("_"):  # not set up yet (copy, pickle): no recursion through self._model
            raise AttributeError(name)
        return getattr(self._model, name)

    def to(self, *args, **kwargs) -> BaseView:
        self._model.to(*args, **kwargs)
        return self

    def requires_grad_(self, requires_grad: bool = True) -> BaseView:  # the callers run it under no_grad
        return self


@dataclass
class LoraPolicy:
    """The learner's policy under `learner.lora`: the PEFT model, the base it adapts (path and weights digest)
    and whether it continues a saved adapter (whose trainer state then resumes)."""

    peft_model: Any
    base: Path
    base_digest: dict[str, str]
    continued: bool

    @property
    def model(self):
        """The transformers model with the LoRA layers in place: what the DeepSpeed engine trains."""
        return self.peft_model.get_base_model()

    def base_view(self) -> BaseView:
        return BaseView(self.peft_model)

    def save(self, directory: str | Path) -> None:
        """The adapter in PEFT's format plus the record of its base (inside the atomic write of the policy)."""
        self.peft_model.save_pretrained(str(directory))
        write_base_record(directory, self.base, self.base_digest)

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.peft_model.parameters() if p.requires_grad)


def load_lora_policy(policy_path: str | Path, cfg: LearnerParams, dtype: str, seed: int) -> LoraPolicy:
    """The policy of `policy_path` in the adapter form (module docstring), on the CPU (setup places it)."""
    peft = require_peft("learner.lora")
    params = cfg.lora
    assert params is not None
    policy_path = Path(policy_path)
    if is_adapter_checkpoint(policy_path):
        wrapped, base, digest = load_adapter_policy(policy_path, dtype, is_trainable=True)
        _check_same_config(policy_path, wrapped.peft_config["default"], params)
        continued = True
    else:
        base, digest = policy_path, base_weights_digest(policy_path)
        model = load_policy(policy_path, dtype)
        with torch.random.fork_rng(devices=[]):  # A's init from the learner's seed; the caller's RNG untouched
            torch.manual_seed(seed)
            wrapped = peft.get_peft_model(model, lora_config(params), autocast_adapter_dtype=False)
        continued = False
    head = wrapped.get_base_model().get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise SmdInputError(f"learner.lora.target_modules: {params.target_modules!r} adapts the lm head; the learner "
                            "scores through its plain weight: adapt the decoder's layers only")
    _grad_only_dropout_(wrapped)
    wrapped.eval()  # no dropout but the adapters' own (GradOnlyDropout); gradients still flow
    return LoraPolicy(peft_model=wrapped, base=base, base_digest=digest, continued=continued)
