"""`warmstart` stage: supervised next-token training on the task's train split (loss on response tokens).

The response is the reference text followed by EOS, tokenized with the policy's tokenizer and appended
to the prompt's stored token ids. After training, a greedy `model.generate` pass over the eval split
measures exact match and the task reward (schemas.rewards). Writes the Hugging Face policy directory,
metrics.json (headline: exact match, reward, steps, final loss, minutes) and details.json (everything,
with the checks and sample responses; with reward functions, each function's `rewards/<name>/mean` as the
rollout and evaluate stages write them), each atomically.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from schemas.atomic import atomic_path
from schemas.errors import SmdInputError
from schemas.metrics import write_metrics
from schemas.params.model import ModelParams
from schemas.params.reward import RewardParams
from schemas.params.warmstart import WarmstartParams
from schemas.rewards import metric_name
from schemas.tables import read_table
from schemas.weights import write_weights_digest
from stages.common.model import (
    check_positions,
    load_policy,
    load_tokenizer,
    model_device,
    reference_nll,
    resolve_device,
    response_ids_after,
)
from stages.common.scoring import Scoring, concat, term_means

HEADLINE = ("exact_match", "reward", "reference_nll", "steps", "final_loss", "minutes")


def _batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
           device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and per-position targets (-100 outside the response), built on the
    host and copied to `device` (the model's) once per batch."""
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device="cpu")
    labels = torch.full((len(seqs), width), -100, dtype=torch.long, device="cpu")
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r, device="cpu")
        mask[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(r, device="cpu")
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def response_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over response tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100
    )


class CurriculumSampler:
    """Seeded batches with a sequence-length curriculum (short sequences first).

    Sequences are sorted by length. Until step `hold * steps` a batch is drawn only from the shortest
    `start` fraction of them; the admitted fraction then grows linearly to the whole split at step
    `end * steps`. A batch is drawn uniformly without replacement among admitted sequences.
    `start` = 1 disables the curriculum.
    """

    def __init__(
        self,
        lengths: list[int],
        steps: int,
        batch_size: int,
        generator: torch.Generator,
        start: float = 1.0,
        hold: float = 0.0,
        end: float = 0.0,
    ):
        self.order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        self.steps, self.batch_size, self.gen = steps, batch_size, generator
        self.start, self.hold, self.end = start, hold, max(end, hold)

    def admitted(self, step: int) -> int:
        """How many of the shortest sequences step `step` may draw from."""
        n = len(self.order)
        progress = step / max(1, self.steps)
        if self.start >= 1.0 or progress >= self.end:
            return n
        ramp = 0.0 if progress <= self.hold else (progress - self.hold) / (self.end - self.hold)
        fraction = self.start + (1.0 - self.start) * ramp
        return min(n, max(math.ceil(fraction * n - 1e-9), self.batch_size))

    def batch(self, step: int) -> list[int]:
        pool = self.admitted(step)
        picks = torch.randperm(pool, generator=self.gen, device="cpu")[: self.batch_size].tolist()
        return [self.order[i] for i in picks]


def _lr_at(step: int, cfg: WarmstartParams) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def greedy_eval(
    model, tokenizer, rows: list[dict[str, Any]], batch_size: int, max_new_tokens: int,
    scoring: Scoring | None = None,
) -> dict[str, Any]:
    """Greedy decoding (left-padded batches, model.generate) and scores over `rows`: the task's built-in scorer,
    or `scoring`'s reward functions (stages.common.scoring)."""
    model.eval()
    pad_id = tokenizer.pad_token_id
    scoring = scoring or Scoring(RewardParams())
    pending, samples = [], []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long, device="cpu")
        mask = torch.zeros((len(chunk), width), dtype=torch.long, device="cpu")
        for i, r in enumerate(chunk):
            p = r["prompt_token_ids"]
            ids[i, width - len(p) :] = torch.tensor(p, device="cpu")
            mask[i, width - len(p) :] = 1
        device = model_device(model)
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        seqs = out[:, width:].tolist()  # one host copy per batch
        texts = [tokenizer.decode(seq, skip_special_tokens=True) for seq in seqs]
        pending.append(scoring.submit(chunk, texts, seqs))
        samples.extend({"prompt_id": r["prompt_id"], "response": text, "reference": r["reference"]}
                       for r, text in zip(chunk, texts, strict=True))
    scored = concat([scoring.result(h) for h in pending])
    for sample, ok in zip(samples, scored.exact_match):
        sample["exact_match"] = ok
    n = len(rows)
    # with reward functions: each function's mean (and a verl function's numeric extras), as rollout and evaluate
    # write them (`rewards/<name>/mean`, stages.common.scoring.term_means)
    terms = term_means(scored.terms, scored.extras) if scored.terms is not None else {}
    return {"exact_match": sum(scored.exact_match) / n, "reward": sum(scored.rewards) / n, "eval_rows": n,
            "reward_terms": terms, "samples": samples[:5]}


def run_warmstart(
    cfg: WarmstartParams,
    model_cfg: ModelParams,
    data_dir: str | Path,
    out_dir: str | Path,
    seed: int = 0,
    reward: RewardParams | None = None,
    prompt_key: str = "prompt",
) -> dict[str, Path]:
    """Train the policy at `model_cfg.init_path` on `data_dir/train.arrow`; evaluate on `data_dir/eval.arrow`.

    Writes `out_dir/policy` (Hugging Face model + tokenizer), `out_dir/metrics.json` and `out_dir/details.json`.
    The checks and the evaluation score with the task's built-in scorer, or `reward.function` when set.
    """
    reward = reward or RewardParams()
    with Scoring(reward, prompt_key) as scoring:
        return _warmstart(cfg, model_cfg, Path(data_dir), out_dir, seed, scoring)


def _warmstart(cfg: WarmstartParams, model_cfg: ModelParams, data_dir: Path, out_dir: str | Path, seed: int,
               scoring: Scoring) -> dict[str, Path]:
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    train = read_table(data_dir / "train.arrow", "prompts").to_pylist()
    evaluation = read_table(data_dir / "eval.arrow", "prompts").to_pylist()
    no_reference = next((r["prompt_id"] for r in train if not r["reference"]), None)
    if cfg.steps and no_reference is not None:  # a TRL data set: its rewards read their own columns
        raise SmdInputError(f"{data_dir / 'train.arrow'}: reference: empty for prompt {no_reference}, and the warm "
                            "start trains on the references; set warmstart.steps=0 (evaluate only) or "
                            "prepare.reference_key")
    tokenizer = load_tokenizer(model_cfg.init_path)
    model = load_policy(model_cfg.init_path, dtype=model_cfg.dtype, device=resolve_device(model_cfg.device))
    examples = Examples.build(train, tokenizer, cfg, model, data_dir / "train.arrow")
    started = time.monotonic()
    log = train_loop(model, tokenizer, examples, cfg, seed, scoring)
    eval_started = time.monotonic()
    ref_tokens = max(len(response_ids_after(tokenizer, r["prompt_token_ids"], r["reference"])) for r in evaluation)
    result = greedy_eval(model, tokenizer, evaluation, cfg.eval_batch_size, cfg.eval_max_new_tokens or ref_tokens + 4,
                         scoring)
    result["reference_nll"] = reference_nll(model, tokenizer, [r["prompt_token_ids"] for r in evaluation],
                                            [r["reference"] for r in evaluation], cfg.eval_batch_size)
    metrics = warmstart_metrics(train[0]["task"], result, log, len(examples.check), cfg.log_every, started,
                                eval_started, scoring.metric_name(train[0]["task"]))
    config = {"warmstart": cfg.model_dump(), "model": {"init_path": model_cfg.init_path, "dtype": model_cfg.dtype,
                                                        "device": str(model_device(model))},
              "seed": seed, "data": str(data_dir), **scoring.record()}
    return write_warmstart(Path(out_dir), model, tokenizer, metrics, config)


@dataclass
class Examples:
    """Train sequences (prompt ids, response ids) and the held-out check rows: the longest train prompts (like
    the eval split's full-length ones), never trained on, with the new-token limit their checks decode."""

    prompts: list[list[int]]
    responses: list[list[int]]
    check: list[dict[str, Any]]
    check_new_tokens: int

    @classmethod
    def build(cls, train: list[dict[str, Any]], tokenizer, cfg: WarmstartParams, model, source: Path) -> Examples:
        prompts = [r["prompt_token_ids"] for r in train]
        responses = [response_ids_after(tokenizer, p, r["reference"]) for r, p in zip(train, prompts, strict=True)]
        longest = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        check_positions(model.config, longest, f"{source}: prompt_token_ids: a sequence of {longest} tokens")
        n_check = min(cfg.check_rows, len(train) // 4) if cfg.target_exact_match > 0 else 0
        by_length = sorted(range(len(train)), key=lambda i: (-len(prompts[i]), i))
        check_idx, train_idx = sorted(by_length[:n_check]), sorted(by_length[n_check:])
        return cls(
            prompts=[prompts[i] for i in train_idx],
            responses=[responses[i] for i in train_idx],
            check=[train[i] for i in check_idx],
            check_new_tokens=max((len(responses[i]) for i in check_idx), default=0) + 4,
        )


@dataclass
class TrainLog:
    losses: list[float] = field(default_factory=list)
    checks: list[dict[str, float]] = field(default_factory=list)
    steps: int = 0
    stop_reason: str | None = None
    minutes: float = 0.0


def train_loop(model, tokenizer, examples: Examples, cfg: WarmstartParams, seed: int,
               scoring: Scoring | None = None) -> TrainLog:
    """AdamW on the response loss with a length curriculum; stop at `steps`, `max_minutes`, or when the check
    rows reach `target_exact_match` (checked every `check_every` steps)."""
    torch.manual_seed(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)  # batch picks on the host, whatever the model's device
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, cfg.adam_beta2), weight_decay=cfg.weight_decay
    )
    model.train()
    sampler = CurriculumSampler(
        [len(p) + len(r) for p, r in zip(examples.prompts, examples.responses, strict=True)],
        cfg.steps,
        cfg.batch_size,
        gen,
        start=cfg.curriculum_start,
        hold=cfg.curriculum_hold,
        end=cfg.curriculum_end,
    )
    started = time.monotonic()
    log = TrainLog()
    for step in range(cfg.steps):
        if cfg.max_minutes and time.monotonic() - started > cfg.max_minutes * 60:
            log.stop_reason = "max_minutes"
            break
        idx = sampler.batch(step)
        batch = _batch([examples.prompts[i] for i in idx], [examples.responses[i] for i in idx], tokenizer.pad_token_id,
                       model_device(model))
        log.losses.append(train_step(model, optimizer, batch, _lr_at(step, cfg), cfg.max_grad_norm))
        log.steps = step + 1
        if log.steps % cfg.log_every == 0 or log.steps == cfg.steps:
            recent = log.losses[-cfg.log_every :]
            elapsed = (time.monotonic() - started) / 60
            print(
                f"warmstart step {log.steps}/{cfg.steps} loss {sum(recent) / len(recent):.4f} {elapsed:.2f} min",
                file=sys.stderr,
                flush=True,
            )
        if examples.check and log.steps % cfg.check_every == 0:
            em = greedy_eval(model, tokenizer, examples.check, cfg.eval_batch_size, examples.check_new_tokens,
                             scoring)["exact_match"]
            model.train()
            log.checks.append({"step": log.steps, "exact_match": em})
            print(f"warmstart step {log.steps} check exact_match {em:.3f}", file=sys.stderr, flush=True)
            if em >= cfg.target_exact_match:
                log.stop_reason = "target_exact_match"
                break
    log.minutes = (time.monotonic() - started) / 60
    return log


def train_step(model, optimizer, batch: dict[str, torch.Tensor], lr: float, max_grad_norm: float) -> float:
    """One AdamW step on the batch's response loss (gradient norm clipped); returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = response_loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


def warmstart_metrics(task: str, result: dict[str, Any], log: TrainLog, check_rows: int, log_every: int,
                      started: float, eval_started: float, metric: str | None = None) -> dict[str, Any]:
    """Held-out exact match and reward of the trained policy, and how training went."""
    tail = log.losses[-min(len(log.losses), log_every) :]
    return {
        "task": task,
        "metric": metric or metric_name(task),
        "exact_match": result["exact_match"],
        "reward": result["reward"],
        **result.get("reward_terms", {}),
        "reference_nll": result["reference_nll"],
        "eval_rows": result["eval_rows"],
        "steps": log.steps,
        "stop_reason": log.stop_reason,
        "check_rows": check_rows,
        "checks": log.checks,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "train_minutes": log.minutes,
        "eval_minutes": (time.monotonic() - eval_started) / 60,
        "minutes": (time.monotonic() - started) / 60,
        "samples": result["samples"],
    }


def write_warmstart(out_dir: Path, model, tokenizer, metrics: dict[str, Any],
                    config: dict[str, Any]) -> dict[str, Path]:
    """Write the policy directory and the metrics (details.json with the config it ran with), each atomically."""
    model.eval()
    policy = out_dir / "policy"
    with atomic_path(policy) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_weights_digest(tmp)
    return {"policy": policy, **write_metrics(out_dir / "metrics.json", metrics, HEADLINE, config)}
