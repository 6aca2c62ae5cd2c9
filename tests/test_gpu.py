"""The CUDA paths the CPU suite cannot reach: the Megatron trainer on a GPU (NCCL process group,
fp32 and bf16 with Megatron's mixed-precision optimizer; the local spec's SDPA core attention
against the unfused one, and on its flash kernel; a mixture of experts' step at EP 1, and at
EP 2 over NCCL where two GPUs are lent, with one linear per expert and, where TransformerEngine
is installed, grouped-GEMM experts) and the colocated weight-sync payload shared through
CUDA IPC.

Every test here is skipped on machines without a CUDA GPU (CI has none); on a GPU box run
``pytest tests/test_gpu.py``. The references are the same as the CPU suite's: transformers +
torch.optim.AdamW on the CPU (conftest's ``actor_step``, as in ``test_megatron_train``), and the tensors the
sender shared, read back in a second process.
"""
from __future__ import annotations

import pytest
import torch

from ragen_mega.backends.megatron.launch import run_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (NCCL, bf16 and CUDA IPC paths)")


def _read_shared(payload: bytes, queue) -> None:
    """Child process: unpickle the payload as SGLang's server does, report float64 checksums."""
    import pickle

    obj = pickle.loads(payload)
    if isinstance(obj, dict):  # flattened bucket: slice each tensor back out of the flat bytes
        flat = obj["flattened_tensor"]
        named = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
                 for m in obj["metadata"]]
    else:
        named = obj
    queue.put({n: (t.device.type, float(t.double().sum()), float(t.double().abs().sum()))
               for n, t in named})


def _gpu_worker(rank, world_size, hf_dir, batch, actor_settings):
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig
    from ragen_mega.backends.sglang.payloads import engine_payload, pickle_for_receiver

    out = {"backend": dist.get_backend()}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        unfused = MegatronTrainer(ActorConfig(**actor_settings, bf16=bf16, local_attention="unfused"),
                                  hf_dir, total_steps=10)
        unfused_logprobs = unfused.compute_logprobs(batch).cpu()
        del unfused
        trainer = MegatronTrainer(ActorConfig(**actor_settings, bf16=bf16), hf_dir,
                                  total_steps=10)  # SDPA attention
        logprobs = trainer.compute_logprobs(batch)
        logprobs = logprobs.cpu()
        if bf16:  # the same forward with SDPA held to its flash kernel: an error if it cannot
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    out["flash_logprobs"] = trainer.compute_logprobs(batch).cpu()
            except RuntimeError as e:
                out["flash_logprobs"] = repr(e)
        metrics = trainer.train({**batch, "old_logprobs": logprobs + batch["noise"]})
        out[name] = {"logprobs": logprobs, "unfused_logprobs": unfused_logprobs,
                     "metrics": metrics,
                     "weights": {n: t.float().cpu() for n, t in trainer.export_hf_state()}}

    # colocated sync payload: the trainer's CUDA tensors travel as IPC handles, not bytes
    bucket = [(n, t.clone()) for n, t in trainer.export_hf_state()]
    ctx = mp.get_context("spawn")
    for flattened in (False, True):
        payload = pickle_for_receiver(engine_payload(bucket, flattened=flattened))
        queue = ctx.Queue()
        child = ctx.Process(target=_read_shared, args=(payload, queue))
        child.start()
        out[f"ipc_flattened={flattened}"] = {"payload_bytes": len(payload),
                                             "seen": queue.get(timeout=120)}
        child.join(timeout=60)
    out["ipc_expected"] = {n: ("cuda", float(t.double().sum()), float(t.double().abs().sum()))
                           for n, t in bucket}
    out["bucket_bytes"] = sum(t.nbytes for _, t in bucket)
    return out


@pytest.fixture(scope="module")
def result(actor_model_dir, actor_batch, actor_step):
    return run_workers(_gpu_worker, 1, actor_model_dir, actor_batch, actor_step.settings,
                       timeout=600)[0]


@pytest.fixture(scope="module")
def reference(actor_model_dir, actor_batch, actor_step):
    return actor_step.reference(actor_model_dir, actor_batch, "token-mean")


def _valid(reference):
    return torch.cat([torch.zeros(4, 1), reference["mask"]], dim=1) > 0


def test_trainer_runs_on_nccl(result):
    assert result["backend"] == "nccl"


def test_fp32_step_on_gpu_matches_transformers_and_adamw(result, reference):
    valid = _valid(reference)
    expected = torch.cat([torch.zeros(4, 1), reference["ref_lp"]], dim=1)
    torch.testing.assert_close(result["fp32"]["logprobs"][valid], expected[valid], atol=1e-4, rtol=0)
    m = result["fp32"]["metrics"]
    assert m["update_successful"] == 1.0
    assert m["loss"] == pytest.approx(reference["loss"], rel=1e-4, abs=1e-5)
    assert m["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    for hf_name, tensor in result["fp32"]["weights"].items():
        torch.testing.assert_close(tensor, reference["weights"][hf_name], atol=1e-4, rtol=0,
                                   msg=lambda msg: f"{hf_name}: {msg}")


def test_bf16_step_on_gpu_tracks_fp32_reference(result, reference):
    """bf16 keeps ~3 significant digits: log-probs within bf16 rounding of the fp32 reference,
    the same loss and gradient norm to a few percent, and the fp32 master weights move the
    reference's way (Megatron's mixed-precision optimizer)."""
    valid = _valid(reference)
    expected = torch.cat([torch.zeros(4, 1), reference["ref_lp"]], dim=1)
    diff = (result["bf16"]["logprobs"][valid] - expected[valid]).abs()
    print(f"bf16 vs fp32 log-probs: max {diff.max():.4f}, mean {diff.mean():.5f}")
    assert diff.mean() < 0.02 and diff.max() < 0.15
    m = result["bf16"]["metrics"]
    assert m["update_successful"] == 1.0
    assert m["grad_norm"] == pytest.approx(reference["grad_norm"], rel=0.05)
    assert m["loss"] == pytest.approx(reference["loss"], rel=0.05, abs=1e-3)


def test_sdpa_attention_matches_unfused_on_gpu_and_runs_flash(result, reference):
    """The local spec's SDPA core attention against Megatron's unfused one on CUDA: fp32 to
    float rounding, bf16 within bf16 rounding; in bf16 SDPA can run on its flash kernel."""
    valid = _valid(reference)
    for name, atol in (("fp32", 1e-4), ("bf16", None)):
        diff = (result[name]["logprobs"] - result[name]["unfused_logprobs"])[valid].abs()
        print(f"{name} SDPA vs unfused attention log-probs: max {diff.max():.2e}, "
              f"mean {diff.mean():.2e}")
        if atol is not None:
            assert diff.max() <= atol
        else:
            assert diff.mean() < 0.01 and diff.max() < 0.1
    flash = result["flash_logprobs"]
    assert torch.is_tensor(flash), f"SDPA could not use its flash kernel: {flash}"
    diff = (flash - result["bf16"]["logprobs"])[valid].abs()
    print(f"bf16 flash-only vs default SDPA kernel log-probs: max {diff.max():.2e}")
    assert diff.max() < 0.05


def test_colocated_payload_shares_cuda_tensors(result):
    expected = result["ipc_expected"]
    for key in ("ipc_flattened=False", "ipc_flattened=True"):
        seen = result[key]["seen"]
        assert set(seen) == set(expected), key
        for name, (device, total, abs_total) in seen.items():
            assert device == "cuda", (key, name)
            assert total == pytest.approx(expected[name][1], rel=1e-12, abs=1e-9), (key, name)
            assert abs_total == pytest.approx(expected[name][2], rel=1e-12), (key, name)
        # handles, not the bytes: the payload is far smaller than the bucket it describes
        assert result[key]["payload_bytes"] < result["bucket_bytes"] / 100, key


def _moe_gpu_worker(rank, world_size, hf_dir, batch, actor_settings, ep, grouped_gemm):
    """A qwen2_moe actor step on CUDA/NCCL (alltoall dispatcher; SequentialMLP experts, or
    TransformerEngine's TEGroupedMLP with ``grouped_gemm``) in fp32 and bf16, at expert
    parallel size ``ep``."""
    from ragen_mega.backends.megatron.train import MegatronTrainer
    from ragen_mega.config import ActorConfig

    out = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        trainer = MegatronTrainer(ActorConfig(**actor_settings, bf16=bf16, ep=ep,
                                              moe_grouped_gemm=grouped_gemm), hf_dir,
                                  total_steps=10)
        logprobs = trainer.compute_logprobs(batch).cpu()
        metrics = trainer.train({**batch, "old_logprobs": logprobs + batch["noise"]})
        out[name] = {"logprobs": logprobs, "metrics": metrics,
                     "weights": {n: t.float().cpu() for n, t in trainer.export_hf_state()}}
        del trainer
    return out if rank == 0 else None


@pytest.mark.parametrize("ep, grouped_gemm", [(1, False), (2, False), (1, True), (2, True)])
def test_moe_step_on_gpu_matches_transformers_and_adamw(tiny_model, actor_batch, actor_step, ep,
                                                         grouped_gemm):
    """Mixtures of experts on CUDA: the actor step of a tiny qwen2_moe (shared expert, q/k/v
    biases) at EP 1 on one GPU and EP 2 over NCCL on two, one linear per expert or grouped-GEMM
    experts (TransformerEngine's TEGroupedMLP, whose per-expert weights the mapping renames),
    fp32 against transformers + AdamW, bf16 within bf16 rounding of it."""
    from ragen_mega.backends.megatron.transformer_config import te_available

    if torch.cuda.device_count() < ep:
        pytest.skip(f"needs {ep} CUDA GPUs for expert parallel size {ep}, this machine has "
                    f"{torch.cuda.device_count()}")
    if grouped_gemm and not te_available():
        pytest.skip("grouped-GEMM experts need TransformerEngine (a CUDA-only library), which "
                    "this GPU machine has not installed")
    from test_moe import per_expert
    from ragen_mega.models.hf_config import model_spec

    hf_dir = tiny_model("qwen2_moe")
    got = run_workers(_moe_gpu_worker, ep, hf_dir, actor_batch, actor_step.settings, ep,
                      grouped_gemm, ep=ep, timeout=600)[0]
    ref = actor_step.reference(hf_dir, actor_batch, "token-mean")
    weights = per_expert(ref["weights"], model_spec(hf_dir))
    valid = _valid(ref)
    expected = torch.cat([torch.zeros(4, 1), ref["ref_lp"]], dim=1)
    torch.testing.assert_close(got["fp32"]["logprobs"][valid], expected[valid], atol=1e-4, rtol=0)
    assert got["fp32"]["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    for name, tensor in got["fp32"]["weights"].items():
        torch.testing.assert_close(tensor, weights[name], atol=1e-4, rtol=0,
                                   msg=lambda msg: f"{name}: {msg}")
    diff = (got["bf16"]["logprobs"][valid] - expected[valid]).abs()
    print(f"MoE EP {ep} bf16 vs fp32 log-probs: max {diff.max():.4f}, mean {diff.mean():.5f}")
    assert diff.mean() < 0.02 and diff.max() < 0.15
    assert got["bf16"]["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=0.05)
