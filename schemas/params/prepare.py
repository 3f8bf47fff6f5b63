"""`prepare:` section: which task, how much of it, and how hard.

Synthetic tasks (`kv_retrieval`, `var_tracking`, `arithmetic`, `pointer_chasing`: the tiny word-level model's) and
instruct tasks (`fact_recall`: natural wording and an answer format for a pretrained chat model, e.g.
SmolLM2-135M-Instruct) are generated from the seed; dataset
tasks (`gsm8k`, `hotpotqa`, `tldr`, `govreport`) are read from local files in their public formats
(`train_file`, optional `eval_file`); `dataset` reads a user's data set in TRL's or verl's layout (JSON Lines, JSON,
Parquet or a `datasets` directory), with `prompt_key` and `reference_key` naming its columns, and is scored by
`reward.function`.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

SyntheticTask = Literal["kv_retrieval", "var_tracking", "arithmetic", "pointer_chasing"]
# Generated like the synthetic tasks, phrased for pretrained instruct models (stages.prepare.instruct).
InstructTask = Literal["fact_recall"]
DatasetTask = Literal["gsm8k", "hotpotqa", "tldr", "govreport"]
# A user's data set in TRL's or verl's layout, scored by `reward.function` (stages.prepare.datasets).
UserDataTask = Literal["dataset"]
TaskName = Literal[SyntheticTask, InstructTask, DatasetTask, UserDataTask]
SYNTHETIC_TASKS: tuple[str, ...] = get_args(SyntheticTask)
INSTRUCT_TASKS: tuple[str, ...] = get_args(InstructTask)
GENERATED_TASKS: tuple[str, ...] = SYNTHETIC_TASKS + INSTRUCT_TASKS
DATASET_TASKS: tuple[str, ...] = get_args(DatasetTask)
USER_DATA_TASKS: tuple[str, ...] = get_args(UserDataTask)
TASKS: tuple[str, ...] = GENERATED_TASKS + DATASET_TASKS + USER_DATA_TASKS
# fact_recall's keys (stages.prepare.instruct.ANIMALS).
FACT_RECALL_ANIMALS = 20
# pointer_chasing's node words (stages.prepare.synthetic.POINTER_NODE_WORDS: animals and the places filler never uses).
POINTER_NODES = 40


class PrepareParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: TaskName = Field(
        "kv_retrieval",
        description=f"Task name: a synthetic generator for the tiny model {SYNTHETIC_TASKS}, one phrased for "
        f"pretrained instruct models {INSTRUCT_TASKS}, a public data set format with its built-in scorer "
        f"{DATASET_TASKS}, or `dataset`: any data set in TRL's or verl's layout, scored by `reward.function`.",
    )
    num_train: int = Field(
        16384,
        ge=1,
        description="Train prompts (synthetic: generated; datasets: at most this many, after filtering).",
    )
    num_eval: int = Field(
        128,
        ge=1,
        description="Held-out prompts (synthetic: generated with a disjoint seed stream; datasets: at most this many).",
    )
    context_tokens: int = Field(
        100,
        ge=16,
        le=1_000_000,
        description="Synthetic tasks: approximate prompt length in (tiny-tokenizer) tokens; filler sentences "
        "and distractors are added until the prompt reaches it. Hundreds to thousands of tokens.",
    )
    train_context_min_fraction: float = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="Synthetic tasks: each train prompt's length is drawn uniformly between this fraction of "
        "`context_tokens` and `context_tokens` (short prompts make supervised warm start learn retrieval "
        "faster); eval prompts always use `context_tokens`. 1.0 = every prompt at full length.",
    )
    # kv_retrieval
    num_pairs: int = Field(
        6,
        ge=1,
        le=100,
        description="kv_retrieval, fact_recall: key-value pairs spread over the context (distinct keys; "
        "fact_recall: animals with their numbers, at most 20).",
    )
    num_queries: int = Field(
        3,
        ge=1,
        le=100,
        description="kv_retrieval, fact_recall: keys asked for; the answer lists their values in query order.",
    )
    value_digits: int = Field(2, ge=1, le=6, description="kv_retrieval, fact_recall: digits of each value.")
    question_position: Literal["end", "start"] = Field(
        "end",
        description="fact_recall: where the question goes. end = after the notes (the prompt's last tokens, "
        "SnapKV's observation window, hold the question); start = before the notes (instruction, question, "
        "notes), so the prefill's eviction does not see which fact will be asked: the query-agnostic setting "
        "of SCBench and kvpress's benchmarks, where eviction costs more.",
    )
    # var_tracking
    num_hops: int = Field(
        3, ge=1, le=20, description="var_tracking: assignments between the queried variable and its number."
    )
    num_chains: int = Field(
        3, ge=1, le=8, description="var_tracking: chains in the context (one queried, the rest distractors)."
    )
    # arithmetic
    num_steps: int = Field(
        2,
        ge=1,
        le=8,
        description="arithmetic: operations after the initial amount (one chain-of-thought step each).",
    )
    max_operand: int = Field(9, ge=1, le=999, description="arithmetic: largest initial amount and operand.")
    # pointer_chasing
    pointer_hops: int = Field(
        17,
        ge=1,
        le=39,
        description="pointer_chasing: hops of the asked path; the answer restates each hop's fact (`fox owl`, "
        "3 tokens with its separator), so 17 hops answer in 50 tokens.",
    )
    pointer_distractors: int = Field(
        3,
        ge=0,
        le=38,
        description="pointer_chasing: extra facts from nodes off the path (to any other node) that the path "
        "never uses.",
    )
    # dataset loaders
    train_file: str | None = Field(
        None,
        description="Dataset tasks: local train file. dataset: a .jsonl, .json (a list of rows), .parquet file, or "
        "a directory written by `datasets`' save_to_disk (one split's directory). gsm8k: jsonl {question, answer with '#### N'}; hotpotqa: "
        "json list (or jsonl) of {_id, question, answer, context: [[title, [sentences]], ...]}; tldr: jsonl "
        "{post, summary, optional id, subreddit, title} or CarperAI's {prompt, label}; govreport: jsonl "
        "{optional id, report or document, summary}.",
    )
    eval_file: str | None = Field(
        None,
        description="Dataset tasks: local held-out file in the same format; when unset, `num_eval` examples "
        "are split off the train file (seeded shuffle).",
    )
    chat_template: bool = Field(
        True,
        description="When the policy's tokenizer has a chat template (Hugging Face chat models), render each prompt "
        "through it as one user turn with the assistant turn opened (add_generation_prompt), as the model was "
        "trained to be prompted; false = the plain prompt text. The tiny default tokenizer has no template. "
        "Dataset prompts are truncated to max_prompt_tokens before the template adds its few tokens.",
    )
    max_prompt_tokens: int = Field(
        1024,
        ge=16,
        description="Dataset tasks: prompts longer than this (policy tokenizer) have their document/context "
        "truncated (the question and answer cue are kept). dataset: a prompt longer than this (after the chat "
        "template) is dropped and counted, as verl's `filter_overlong_prompts` does (a generic prompt has no "
        "document to cut).",
    )
    prompt_key: str = Field(
        "prompt",
        description="dataset: the column holding the prompt (TRL's `prompt`, also verl's): a string, rendered like the "
        "other tasks' prompts, or a list of chat messages [{role, content}, ...] rendered with the policy's chat "
        "template (the tokenizer must have one). Dots reach into nested columns.",
    )
    reference_key: str | None = Field(
        "reward_model.ground_truth",
        description="dataset: the column holding the reference the reward function receives as `ground_truth` "
        "(verl's `reward_model.ground_truth`; dots reach into nested columns). When no row has the default key "
        "(a TRL data set, whose reward functions read their own columns) the reference is empty, unless every row "
        "has `data_source` (verl's layout, whose reward manager needs the reference: one line); a key set here, "
        "or the default present in some rows only, is required in every row. null = no reference (empty).",
    )
    max_reference_chars: int = Field(
        0,
        ge=0,
        description="Dataset tasks: drop examples whose reference is longer than this (0 = keep all).",
    )

    @model_validator(mode="after")
    def _check(self) -> PrepareParams:
        if self.task in DATASET_TASKS + USER_DATA_TASKS and not self.train_file:
            raise ValueError(f"train_file: task {self.task} reads a local file; set prepare.train_file")
        if self.task in ("kv_retrieval", "fact_recall") and self.num_queries > self.num_pairs:
            raise ValueError(f"num_queries: {self.num_queries} is larger than num_pairs={self.num_pairs}")
        if self.task == "fact_recall" and self.num_pairs > FACT_RECALL_ANIMALS:
            raise ValueError(f"num_pairs: fact_recall has {FACT_RECALL_ANIMALS} animals; {self.num_pairs} asked")
        if self.task in ("kv_retrieval", "fact_recall") and self.num_pairs > 9 * 10 ** (self.value_digits - 1) + (
            self.value_digits == 1
        ):
            raise ValueError(
                f"num_pairs: {self.num_pairs} distinct values do not fit in {self.value_digits} digit(s)"
            )
        if self.task == "pointer_chasing" and self.pointer_hops + 1 + self.pointer_distractors > POINTER_NODES:
            raise ValueError(
                f"pointer_distractors: {self.pointer_hops} hops and {self.pointer_distractors} distractors need "
                f"{self.pointer_hops + 1 + self.pointer_distractors} distinct node words; there are {POINTER_NODES}"
            )
        if self.task == "var_tracking" and self.num_chains * self.num_hops > 25:
            raise ValueError(
                f"num_chains: {self.num_chains} chains of {self.num_hops} hops need more than 25 variable names"
            )
        return self
