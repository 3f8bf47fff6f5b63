"""The learner's inputs: the trajectory table, the compacted mask store, and right-padded micro-batches.

`load_learner_data` reads and cross-checks the two artifacts (one clear line naming the file and field on
any mismatch) and computes the GRPO advantages over the whole iteration batch; `build_micro_batch` turns a
list of rows into the tensors one forward pass needs (prompt + response ids right-padded to the longest
row, per-layer evict_at with `pad_evict_at`, and, for the flex backend, one BlockMask per layer), or with
`learner.pack` the rows one after another in one row (`stages.learner.packing`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from schemas.compacted_masks import MaskStore, open_mask_store, read_mask_rows, verify_array
from schemas.errors import SmdInputError
from schemas.params.learner import LearnerParams
from schemas.tables import check_binding, read_table, table_config
from stages.learner.mismatch import check_finite
from stages.learner.objectives import group_advantages
from stages.learner.packing import pack_ids, packed_evict_at
from stages.learner.shadow_attention import pad_evict_at


@dataclass
class LearnerData:
    """One iteration's batch, in trajectory-table order."""

    trajectories_path: Path
    masks_path: Path | None
    trajectory_ids: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[np.ndarray]
    rewards: np.ndarray
    advantages: np.ndarray
    mask_rows: np.ndarray
    groups: np.ndarray  # [N] int64 GRPO group of each row (one per prompt_id)
    store: MaskStore | None = field(default=None, repr=False)
    rollout_config: dict = field(default_factory=dict)  # the config the trajectory table records (its producer's)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def length(self, row: int) -> int:
        return len(self.prompt_ids[row]) + len(self.response_ids[row])

    @property
    def num_response_tokens(self) -> int:
        return int(sum(len(r) for r in self.response_ids))


def _check_store(store: MaskStore, data: LearnerData, num_layers: int, num_kv_heads: int) -> None:
    where = store.path
    n = len(data)
    if store.num_rows != n:
        raise SmdInputError(
            f"{where}: num_rows: {store.num_rows} mask rows for {n} trajectories in {data.trajectories_path} "
            "(masks from another rollout?)"
        )
    if (store.num_layers, store.num_kv_heads) != (num_layers, num_kv_heads):
        raise SmdInputError(
            f"{where}: num_layers/num_kv_heads: masks have {store.num_layers} layers x {store.num_kv_heads} KV heads, "
            f"the policy {num_layers} x {num_kv_heads}"
        )
    lengths = store.lengths()
    for r in range(n):
        m = int(data.mask_rows[r])
        T = data.length(r)
        if int(lengths[m]) != T:
            raise SmdInputError(
                f"{where}: offsets: mask row {m} has {int(lengths[m])} tokens, trajectory {data.trajectory_ids[r]} "
                f"has {T} (prompt + response); masks from another rollout?"
            )
        if int(store.prompt_len[m]) != len(data.prompt_ids[r]):
            raise SmdInputError(
                f"{where}: prompt_len: mask row {m} has {int(store.prompt_len[m])}, trajectory "
                f"{data.trajectory_ids[r]} has a {len(data.prompt_ids[r])}-token prompt"
            )
        if int(store.table_row[m]) != r:
            raise SmdInputError(
                f"{where}: table_row: mask row {m} points to table row {int(store.table_row[m])}, but trajectory "
                f"{data.trajectory_ids[r]} (row {r}) has mask_row {m}"
            )


def scored_rows(table) -> np.ndarray | None:
    """[N] bool from the trajectories' `reward_terms` (reward functions, issue 33): False where every function
    returned None (TRL's unscorable rows, left out of the advantages: `group_advantages(scored=)`); None when the
    table has no such column (built-in scorers score every row)."""
    if "reward_terms" not in table.column_names:
        return None
    terms = [json.loads(t) if t else {} for t in table.column("reward_terms").to_pylist()]
    return np.array([not t or any(v is not None for v in t.values()) for t in terms], dtype=bool)


def load_learner_data(
    cfg: LearnerParams,
    trajectories_path: str | Path,
    masks_path: str | Path | None,
    num_layers: int,
    num_kv_heads: int,
    need_masks: bool,
) -> LearnerData:
    """Read the trajectory table (and, when `need_masks`, the compacted mask store), cross-check them and
    compute group advantages over the whole batch (groups = prompt_id)."""
    traj_path = Path(trajectories_path)
    table = read_table(traj_path, "trajectories")
    cols = {name: table.column(name).to_pylist() for name in (
        "trajectory_id", "prompt_id", "prompt_token_ids", "response_token_ids", "rollout_logprobs", "reward",
        "mask_row")}
    rewards = np.asarray(cols["reward"], dtype=np.float64)
    check_finite(f"{traj_path}: reward", torch.from_numpy(rewards))
    logprobs = []
    for r, (ids, lps) in enumerate(zip(cols["response_token_ids"], cols["rollout_logprobs"])):
        lp = np.asarray(lps, dtype=np.float32)
        if len(ids) != len(lp):
            raise SmdInputError(f"{traj_path}: rollout_logprobs: row {r} has {len(lp)} values for {len(ids)} tokens")
        check_finite(f"{traj_path}: rollout_logprobs row {r}", torch.from_numpy(lp))
        if len(cols["prompt_token_ids"][r]) == 0:
            raise SmdInputError(f"{traj_path}: prompt_token_ids: row {r} is empty")
        logprobs.append(lp)
    if sum(len(x) for x in cols["response_token_ids"]) == 0:
        raise SmdInputError(f"{traj_path}: response_token_ids: the batch has no response tokens (nothing to learn)")
    _, group = np.unique(np.asarray(cols["prompt_id"], dtype=object), return_inverse=True)
    scored = scored_rows(table)
    adv = group_advantages(torch.from_numpy(rewards), torch.from_numpy(group.astype(np.int64)),
                           eps=cfg.advantage_eps, scale=cfg.advantage_scale,
                           scored=None if scored is None else torch.from_numpy(scored))
    data = LearnerData(
        trajectories_path=traj_path,
        rollout_config=table_config(table),
        masks_path=Path(masks_path) if masks_path is not None else None,
        trajectory_ids=cols["trajectory_id"],
        prompt_ids=cols["prompt_token_ids"],
        response_ids=cols["response_token_ids"],
        rollout_logprobs=logprobs,
        rewards=rewards,
        advantages=adv.numpy(),
        mask_rows=np.asarray(cols["mask_row"], dtype=np.int64),
        groups=group.astype(np.int64),
    )
    if need_masks:
        if masks_path is None:
            raise SmdInputError("the shadow-masked objectives need the compacted mask store (masks.zarr)")
        data.store = open_mask_store(masks_path)
        check_binding(data.store.attrs.get("trajectories"), table, masks_path, traj_path)
        _check_store(data.store, data, num_layers, num_kv_heads)
        verify_array(data.store, "kept_final")  # bit-packed, ~1/32 of evict_at: the whole store is checked
    return data


@dataclass
class MicroBatch:
    rows: list[int]
    input_ids: torch.Tensor  # [B, T] right-padded prompt + response
    prompt_lens: list[int]
    resp_lens: list[int]
    rollout_logp: torch.Tensor  # [B, R] (0 at padding)
    valid: torch.Tensor  # [B, R] bool
    advantages: torch.Tensor  # [B]
    evict_at: torch.Tensor | None = None  # [L, B, H, T]
    block_masks: list | None = None  # flex backend: one BlockMask per layer
    kl_mask: torch.Tensor | None = None  # [B, R] bool: the tokens smd's teacher KL applies to (set by micro_step)
    packed: bool = False  # learner.pack: input_ids [1, N] and evict_at [L, 1, H, N] hold the rows one after another

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def forward_extra(self) -> dict:
        return {"smd_block_masks": self.block_masks} if self.block_masks is not None else {}


def read_evict_at(data: LearnerData, rows: list[int]) -> list[torch.Tensor]:
    """Per row, int64 evict_at [T_i, L, H] from the store, checked against the encoding (k < evict_at[k] <= T_i)."""
    assert data.store is not None
    blocks = read_mask_rows(data.store, [int(data.mask_rows[r]) for r in rows])
    out = []
    for r, ev in zip(rows, blocks):
        T = data.length(r)
        pos = np.arange(T).reshape(T, 1, 1)
        if ev.shape[0] != T or not ((ev > pos) & (ev <= T)).all():
            raise SmdInputError(
                f"{data.store.path}: evict_at: mask row {int(data.mask_rows[r])} (trajectory {data.trajectory_ids[r]}) "
                f"is not a valid shadow mask for its {T} tokens (need k < evict_at[k] <= T)"
            )
        out.append(torch.from_numpy(ev))
    return out


def build_micro_batch(data: LearnerData, rows: list[int], masked: bool, backend: str = "sdpa",
                      block_size: int = 128, num_q_heads: int | None = None, pad_id: int = 0,
                      device: torch.device | str = "cpu", pack: bool = False) -> MicroBatch:
    """Right-padded tensors of `rows` (rollout order inside); evict_at (and block masks) when `masked`. `pack`
    (learner.pack): ids [1, N] and evict_at [L, 1, H, N] of the rows one after another, no padding
    (`stages.learner.packing`); the per-token tensors [B, R] stay as padded."""
    seqs = [list(data.prompt_ids[r]) + list(data.response_ids[r]) for r in rows]
    T = max(map(len, seqs))
    # Built on the host (explicit device: never torch's default device), copied to `device` once per micro-batch.
    if pack:
        ids = pack_ids(seqs)
    else:
        ids = torch.full((len(rows), T), pad_id, dtype=torch.long, device="cpu")
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(s, dtype=torch.long, device="cpu")
    resp_lens = [len(data.response_ids[r]) for r in rows]
    R = max(max(resp_lens), 1)
    rollout = torch.zeros(len(rows), R, dtype=torch.float32, device="cpu")
    valid = torch.zeros(len(rows), R, dtype=torch.bool, device="cpu")
    for b, r in enumerate(rows):
        n = resp_lens[b]
        rollout[b, :n] = torch.from_numpy(data.rollout_logprobs[r])
        valid[b, :n] = True
    mb = MicroBatch(
        rows=list(rows),
        input_ids=ids.to(device),
        prompt_lens=[len(data.prompt_ids[r]) for r in rows],
        resp_lens=[max(n, 0) for n in resp_lens],
        rollout_logp=rollout.to(device),
        valid=valid.to(device),
        advantages=torch.tensor([data.advantages[r] for r in rows], dtype=torch.float32, device=device),
        packed=pack,
    )
    if masked:
        if pack:
            mb.evict_at = packed_evict_at(read_evict_at(data, rows)).to(device)
        else:
            mb.evict_at = pad_evict_at(read_evict_at(data, rows), T).to(device)
        if backend == "flex":
            from stages.learner.flex_backend import build_block_masks

            assert num_q_heads is not None
            mb.block_masks = build_block_masks(mb.evict_at, num_q_heads, block_size)
    return mb
