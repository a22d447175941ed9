"""Each CPU-compatibility patch is still needed, still works, and still points at the upstream
line it works around. After a megatron-core upgrade these tests say which patch changed.

The probes run in one spawned process (a one-rank gloo group) because they touch
Megatron's global state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

if torch.cuda.is_available():  # the layer is inactive with CUDA; nothing here applies
    pytest.skip("CPU compatibility layer tests need a CPU-only torch", allow_module_level=True)


def _probe_current_device():
    from megatron.core.utils import GlobalMemoryBuffer

    t = GlobalMemoryBuffer().get_tensor((4,), torch.float32, "probe")
    assert t.device.type == "cpu"


def _probe_rng_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mrandom.model_parallel_cuda_manual_seed(7)
    tracker = mrandom.get_cuda_rng_tracker()
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside), "fork must restore the default generator"
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b), "the tracked stream must advance between forks"


def _probe_torch_norm_sequence_parallel():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                               tensor_model_parallel_size=2, sequence_parallel=True)
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())


def _probe_device_literals():
    from megatron.core.optimizer import clip_grads

    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 0.0, 4.0])
    norm = clip_grads.get_grad_norm_fp32([p.grad])
    assert abs(float(norm) - 5.0) < 1e-6


def _tiny_model_with_distributed_optimizer():
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, activation_func=F.silu,
                               use_cpu_initialization=True)

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.weight = torch.nn.Parameter(torch.ones(4, 4))

    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), Tiny())
    return model, get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), [model])


def _probe_cuda_at_construction():
    _tiny_model_with_distributed_optimizer()


def _probe_torch_adam_step_state():
    model, opt = _tiny_model_with_distributed_optimizer()
    model.module.weight.sum().backward()
    model.finish_grad_sync()
    opt.step()
    dopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    param = model.module.weight
    saved = {k: v.clone() for k, v in dopt._get_main_param_and_optimizer_states(param).items() if k != "step"}
    with torch.no_grad():  # as in the optimizer's load_state_dict
        dopt._set_main_param_and_optimizer_states(param, saved)


def _probe_clip_grad_type_assert():
    from megatron.core.optimizer import optimizer

    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([6.0, 8.0])
    optimizer.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=10.0)
    # upstream formula: grads *= max_norm / (total_norm + 1e-6)
    assert torch.allclose(p.grad, torch.tensor([6.0, 8.0]) * (1.0 / (10.0 + 1e-6)))


def _probe_moe_router_gemm_without_te():
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    inp = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(3, 4, requires_grad=True)
    logits = router_gating_linear(inp, weight, None, torch.float32)
    assert torch.allclose(logits, inp @ weight.t())
    logits.sum().backward()
    assert torch.allclose(weight.grad, torch.ones(5, 3).t() @ inp)


def _probe_mla_without_te():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_rl.models.local_attention import MaskedAttention

    config = MLATransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8,
                                  qk_head_dim=4, qk_pos_emb_head_dim=2, v_head_dim=6, rope_type="rope",
                                  normalization="RMSNorm", use_cpu_initialization=True, apply_rope_fusion=False,
                                  attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    attention = spec.submodules.self_attention
    attention.submodules.core_attention = MaskedAttention  # the local DotProductAttention takes no v_channels
    out, _ = build_module(attention, config=config, layer_number=1)(torch.randn(5, 1, 16), None)
    assert out.shape == (5, 1, 16)


def _probe_pos_emb_cp_rank_pinned():
    from megatron.core.models.common.embeddings import rope_utils

    class Group:  # rank 0 of two context-parallel ranks keeps chunks 0 and 3 of 4 (load-balanced order)
        def size(self):
            return 2

        def rank(self):
            return 0

    table = torch.arange(8.0).view(8, 1, 1, 1)
    mine = rope_utils.get_pos_emb_on_this_cp_rank(table, 0, Group())
    assert mine.flatten().tolist() == [0.0, 1.0, 6.0, 7.0]


def _probe_float16_optimizer_cpu_params():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, bf16=True,
                               params_dtype=torch.bfloat16, use_cpu_initialization=True)

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.weight = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))

    model = DistributedDataParallel(config, DistributedDataParallelConfig(), Tiny())
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.5, bf16=True, params_dtype=torch.bfloat16, optimizer="sgd",
                                                 weight_decay=0.0, sgd_momentum=0.0, clip_grad=0.0),
                                 [model])
    (2 * model.module.weight.float()).sum().backward()  # gradient 2 everywhere
    model.finish_grad_sync()
    opt.step()
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    main = inner.fp32_from_float16_groups[0][0]
    assert main.dtype == torch.float32 and torch.equal(main, torch.zeros(4, 4))  # 1 - 0.5 * 2 in the fp32 master
    weight = model.module.weight
    assert weight.dtype == torch.bfloat16 and torch.equal(weight.float(), torch.zeros(4, 4))


PROBES = {
    "current_device": _probe_current_device,
    "rng_tracker": _probe_rng_tracker,
    "torch_norm_sequence_parallel": _probe_torch_norm_sequence_parallel,
    "device_literals": _probe_device_literals,
    "cuda_at_setup_and_checkpoint": _probe_cuda_at_construction,
    "clip_grad_type_assert": _probe_clip_grad_type_assert,
    "torch_adam_step_state": _probe_torch_adam_step_state,
    "moe_router_gemm_without_te": _probe_moe_router_gemm_without_te,
    "mla_without_te": _probe_mla_without_te,
    "pos_emb_cp_rank_pinned": _probe_pos_emb_cp_rank_pinned,
    "float16_optimizer_cpu_params": _probe_float16_optimizer_cpu_params,
}


def _worker(rank: int, world: int, out_path: str) -> None:
    from megatron_rl.parallel import cpu_compat
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=60)
    state.initialize(1, 1)  # activates the layer
    results = {}
    for name, probe in PROBES.items():
        with cpu_compat.without(name):
            try:
                probe()
                without = None
            except Exception as exc:  # noqa: BLE001 - any failure shows the patch is needed
                without = f"{type(exc).__name__}: {exc}"
        try:
            probe()
            with_patch = None
        except Exception as exc:  # noqa: BLE001
            with_patch = f"{type(exc).__name__}: {exc}"
        results[name] = (without, with_patch)
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def probe_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compat") / "results.pt"
    run_spawned(_worker, 1, str(out))
    return torch.load(out)


def test_every_patch_has_a_probe():
    from megatron_rl.parallel import cpu_compat

    assert sorted(cpu_compat.patches()) == sorted(PROBES)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_patch_is_still_needed(probe_results, name):
    without, _ = probe_results[name]
    assert without is not None, (
        f"megatron-core now works without the {name!r} patch: remove it from cpu_compat.py")


@pytest.mark.parametrize("name", sorted(PROBES))
def test_patch_still_works(probe_results, name):
    _, with_patch = probe_results[name]
    assert with_patch is None, f"the {name!r} patch no longer works: {with_patch}"


def test_cited_upstream_lines_still_match():
    import megatron.core

    from megatron_rl.parallel import cpu_compat

    root = Path(megatron.core.__file__).parent
    for patch in cpu_compat.patches().values():
        for site in patch.sites:
            lines = (root / site.path).read_text().splitlines()
            assert site.snippet in lines[site.line - 1], (
                f"{patch.name}: {site.path}:{site.line} no longer reads {site.snippet!r}; "
                f"update the citation (megatron-core changed)")
