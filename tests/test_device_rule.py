"""The one device rule (`model.device`, docs/design.md "Devices") and the learner's tensors on the model's device.

- `resolve_device`: auto = cuda:<local rank> when CUDA is available, else the CPU; cuda / cuda:N / cpu as named;
  a bad value, or a GPU this machine lacks, is one line naming `model.device` (in params validation too).
- The learner's forward (micro-batch build, shadow attention on every CPU backend, the shared-prefix teacher,
  the chunked scores, the objective and its backward) runs with torch's default device set to `meta` while the
  model is on the CPU: a tensor created without naming its device would land on `meta` and fail where it meets
  a real one. The scores under `meta` equal the scores without it.
"""

from __future__ import annotations

import pytest
import torch

from schemas.errors import SmdInputError
from schemas.params import load_params
from schemas.params.compaction import CompactionParams
from schemas.params.learner import LearnerParams
from stages.common.distributed import init_distributed, worker_context
from stages.common.model import configure_precision, load_policy, place_model, resolve_device
from stages.compaction import run_compaction
from stages.learner.data import build_micro_batch, load_learner_data
from stages.learner.logprobs import chunked_token_scores, lm_head_of
from stages.learner.objectives import ObjectiveBatch, objective_loss
from stages.learner.shadow_attention import response_hidden, response_hidden_with_teacher
from tests.helpers import SHAPES, make_inputs, make_model_dir


# ------------------------------------------------------------------ the rule
def test_auto_is_the_local_rank_gpu_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("auto", 0) == torch.device("cuda", 0)
    assert resolve_device("auto", 3) == torch.device("cuda", 3)  # each launcher process takes its own GPU
    assert resolve_device("cuda", 2) == torch.device("cuda", 2)
    assert resolve_device("cuda:1", 3) == torch.device("cuda", 1)  # an explicit index wins over the rank
    assert resolve_device("cpu", 3) == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device("auto") == torch.device("cuda", 2)  # the rank defaults to LOCAL_RANK


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", 0) == torch.device("cpu")
    assert resolve_device("auto", 5) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_one_line(monkeypatch, spec):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SmdInputError, match=r"^model\.device: cuda(:0)?: CUDA is not available") as err:
        resolve_device(spec, 0)
    assert "\n" not in str(err.value)


def test_a_gpu_that_does_not_exist_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SmdInputError, match=r"^model\.device: cuda:2: cuda:2 does not exist \(2 CUDA device"):
        resolve_device("cuda:2", 0)
    with pytest.raises(SmdInputError, match=r"^model\.device: auto: cuda:5 does not exist"):
        resolve_device("auto", 5)  # more launcher processes than GPUs


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CPU", "mps", "cuda:0,1", ""])
def test_bad_values_name_model_device(tmp_path, bad):
    with pytest.raises(SmdInputError, match=r"^model\.device: ") as err:
        resolve_device(bad)
    assert "\n" not in str(err.value)
    path = tmp_path / "params.yaml"
    path.write_text(f"model:\n  device: {bad!r}\n")
    with pytest.raises(SmdInputError, match=rf"^{path}: model\.device: ") as err:
        load_params(path)
    assert "\n" not in str(err.value) and "auto | cpu | cuda | cuda:N" in str(err.value)


def test_params_default_and_overrides():
    assert load_params(None).model.device == "auto"
    for value in ("cpu", "cuda", "cuda:3", "auto"):
        assert load_params(None, [f"model.device={value}"]).model.device == value


def test_worker_context_follows_the_rule(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert worker_context("cpu").device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_context("auto").device == torch.device("cpu")
    with pytest.raises(SmdInputError, match=r"^model\.device: cuda: CUDA is not available"):
        worker_context("cuda")
    with pytest.raises(SmdInputError, match=r"^model\.device: cuda: CUDA is not available"):
        init_distributed(device="cuda")  # the learner's group: refused before any process group exists


def test_attention_backend_auto_is_flex_on_cuda_and_sdpa_on_cpu():
    cfg = LearnerParams()
    assert cfg.attention_backend == "auto"
    assert (cfg.backend_for("cuda"), cfg.backend_for("cpu")) == ("flex", "sdpa")
    for name in ("sdpa", "flex", "tiled"):  # an explicit backend is used on every device
        assert {LearnerParams(attention_backend=name).backend_for(d) for d in ("cpu", "cuda")} == {name}


def test_a_bare_cuda_device_is_placed_on_the_current_gpu(monkeypatch):
    """place_model("cuda") sets the current GPU by its index: torch.cuda.set_device raises on an index-less
    device ("Expected a torch.device with a specified index", found by the GPU check on an H200). Recorded
    here with the CUDA calls replaced, so the check runs without a GPU."""
    set_to, moved_to = [], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_to.append(d))
    monkeypatch.setattr("stages.common.policy_io.configure_precision", lambda device, dtype: None)

    class Model:
        def to(self, device):
            moved_to.append(device)

        def parameters(self):
            return iter([torch.zeros(1)])

    place_model(Model(), "cuda")
    place_model(Model(), "cuda:1")
    assert set_to == [torch.device("cuda", 3), torch.device("cuda", 1)]
    assert moved_to == set_to


def test_tf32_is_left_alone_on_cpu_and_for_bf16(monkeypatch):
    """configure_precision touches the process-wide flags only for a float32 model on CUDA (where it turns TF32
    off); the flag setters are recorded here, so the check runs without a GPU."""
    calls = []

    class Flags:
        def __setattr__(self, name, value):
            calls.append((name, value))

    monkeypatch.setattr(torch.backends.cuda, "matmul", Flags())
    monkeypatch.setattr(torch.backends, "cudnn", Flags())
    configure_precision("cpu", torch.float32)
    configure_precision("cuda:0", torch.bfloat16)
    assert calls == []
    configure_precision("cuda:0", torch.float32)
    assert calls == [("allow_tf32", False), ("allow_tf32", False)]


# ------------------------------------------------------------------ no tensor without a device
LENGTHS, PROMPTS = [44, 37, 52, 30], [32, 26, 40, 22]


@pytest.fixture(scope="module")
def learner_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    model_dir = make_model_dir(root, "gqa")
    shape = SHAPES["gqa"]
    ins = make_inputs(root / "rollout", "snapkv", LENGTHS, PROMPTS, num_layers=shape.num_hidden_layers,
                      num_kv_heads=shape.num_key_value_heads)
    masks = run_compaction(CompactionParams(chunk_rows=2), ins["trajectories"], ins["raw"], root / "masks.zarr")["masks"]
    data = load_learner_data(LearnerParams(), ins["trajectories"], masks, shape.num_hidden_layers,
                             shape.num_key_value_heads, need_masks=True)
    data.advantages[:] = [1.0, -1.0, 0.5, -0.5]
    return load_policy(model_dir, device="cpu"), data


def _learner_step(model, data, backend: str) -> dict[str, torch.Tensor]:
    """What `micro_step` runs for smd: micro-batch, masked policy + dense teacher on the shared prefix, chunked
    scores, the objective and its backward; also the masked-only forward (`forward_logp`'s path)."""
    rows = list(range(len(data)))
    mb = build_micro_batch(data, rows, True, "sdpa", 128, model.config.num_attention_heads, device="cpu")
    hidden, teacher, targets, valid = response_hidden_with_teacher(model, mb.input_ids, mb.evict_at, mb.prompt_lens,
                                                                   mb.resp_lens, backend)
    scores = chunked_token_scores(hidden, lm_head_of(model), targets, valid, teacher_hidden=teacher, chunk_tokens=8)
    loss, _ = objective_loss(LearnerParams(), ObjectiveBatch(advantages=mb.advantages, mask=mb.valid,
                                                             rollout_logp=mb.rollout_logp, masked_logp=scores["logp"],
                                                             kl_per_token=scores["kl"]))
    model.zero_grad(set_to_none=True)
    loss.backward()
    grad = model.get_input_embeddings().weight.grad.detach().clone()
    with torch.no_grad():
        h, t, v = response_hidden(model, mb.input_ids, mb.evict_at, mb.prompt_lens, mb.resp_lens, backend)
        masked_only = chunked_token_scores(h, lm_head_of(model), t, v)["logp"]
    return {"logp": scores["logp"].detach(), "kl": scores["kl"].detach(), "loss": loss.detach(), "grad": grad,
            "masked_only": masked_only}


@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
def test_learner_forward_creates_no_tensor_without_a_device(learner_inputs, backend):
    model, data = learner_inputs
    expected = _learner_step(model, data, backend)
    torch.set_default_device("meta")
    try:
        got = _learner_step(model, data, backend)
    finally:
        torch.set_default_device(None)
    assert torch.empty(1).device.type == "cpu"  # the default is restored for the other tests
    for name, want in expected.items():
        assert got[name].device.type == "cpu", name
        # the same kernels on the same inputs: equal up to float32 reassociation of a few-term sum
        assert torch.allclose(got[name], want, rtol=0, atol=8 * torch.finfo(torch.float32).eps * max(
            1.0, float(want.abs().max()))), name


def test_reference_nll_creates_no_tensor_without_a_device(learner_inputs, tmp_path):
    """The reference NLL (warm start and evaluate): its batch is built on the host and copied once."""
    from stages.common.model import load_tokenizer, reference_nll_batch
    from tests.helpers import make_model_dir

    model, _ = learner_inputs
    tokenizer = load_tokenizer(make_model_dir(tmp_path, "gqa"))
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    expected = reference_nll_batch(model, tokenizer, prompts, ["bird 58", "fox 11 ; bear 20"])
    torch.set_default_device("meta")
    try:
        got = reference_nll_batch(model, tokenizer, prompts, ["bird 58", "fox 11 ; bear 20"])
    finally:
        torch.set_default_device(None)
    assert got == pytest.approx(expected, rel=0, abs=8 * torch.finfo(torch.float32).eps * max(map(abs, expected)))
    assert all(v > 0 for v in got)
