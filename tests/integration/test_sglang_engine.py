"""The `sglang` rollout backend against a real SGLang 0.5.23 engine on CPU.

SGLang lives in its own venv (tests/integration/sglang/setup.sh). Per mode (offline: the engine
in-process; attach: an HTTP server) one engine runs the scenarios of
tests/integration/sglang/engine_scenarios.py once; the tests here judge what it reported:
shapes and order, stop tokens, log-probs against `transformers` (fp32, independent of the code
under test), weight updates with versions, the colocated release/resume order, pause, abort,
and reproducibility of sampling across engines with the same random_seed. The first tests need
no SGLang: configuration and the error without it.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from megatron_rl.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig, server_command
from tests.integration.sglang import harness
from tests.integration.sglang.engine_scenarios import (
    ABORT_MAX_NEW_TOKENS, GREEDY, LORA_ALPHA, LORA_RANK, PROMPTS, RELEASE_CYCLES, SAMPLING, STOP_IDS, STOP_STRINGS,
    lora_adapters)

pytestmark = pytest.mark.timeout(1200)
_needs_venv = pytest.mark.skipif(
    harness.venv_python() is None,
    reason=f"no SGLang venv at {harness.venv()}: run `bash tests/integration/sglang/setup.sh` "
           "(~2-5 min once; MEGATRON_RL_SGLANG_VENV overrides the path)")


def real_engine(test):
    """Marks a test that judges a real SGLang engine (integration tier, needs the venv)."""
    return pytest.mark.integration(_needs_venv(test))


MODES = ("offline", "attach")

# Both sides compute in float32 (SGLang dtype="float32"; transformers in fp32) but with
# different kernels: SGLang's torch_native attention and log(softmax(x)) against HF's sdpa and
# log_softmax, summed in different orders. Measured worst case over all ~700 sampled tokens:
# 2.9e-6 (log-probs down to -8, logits up to ~20, fp32 eps 1.2e-7). 5e-5 leaves 15x headroom
# and stays >1000x below what any real mistake produces: the wrong temperature, an off-by-one
# position or a weight tensor left out of an update each move log-probs by 0.1 or more (the
# temperature case is checked below).
LOGPROB_ATOL = 5e-5


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_without_sglang_the_error_says_how_to_install_it():
    with pytest.raises(ImportError, match="needs sglang: see docs/rollout.md"):
        SGLangEngine(SGLangEngineConfig(model_path="unused", device="cpu"))


def test_config_maps_to_sglang_engine_arguments():
    gpu = SGLangEngineConfig(model_path="/ckpt", tp_size=2, base_gpu_id=4, mem_fraction_static=0.4)
    assert gpu.engine_kwargs() == {**gpu.engine_kwargs(), "tp_size": 2, "base_gpu_id": 4, "enable_memory_saver": True,
                                   "mem_fraction_static": 0.4, "skip_tokenizer_init": True, "weight_version": "0"}
    cpu = SGLangEngineConfig(model_path="/ckpt", device="cpu", server_args={"max_total_tokens": 64,
                                                                          "attention_backend": "intel_amx"})
    kwargs = cpu.engine_kwargs()
    assert kwargs["enable_memory_saver"] is False and kwargs["sampling_backend"] == "pytorch"
    assert kwargs["attention_backend"] == "intel_amx" and kwargs["max_total_tokens"] == 64  # server_args win
    argv = server_command(cpu, "/ckpt", port=1234, python="py")
    assert argv[:7] == ["py", "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", "1234"]
    assert "--disable-cuda-graph" in argv and "--enable-memory-saver" not in argv
    assert argv[argv.index("--max-total-tokens") + 1] == "64"
    lora = SGLangEngineConfig(model_path="/ckpt", device="cpu", server_args={
        "enable_lora": True, "lora_target_modules": ["q_proj", "down_proj"], "json_model_override_args": {"a": 1}})
    argv = server_command(lora, "/ckpt", python="py")
    assert argv[argv.index("--lora-target-modules") + 1:][:3] == ["q_proj", "down_proj", "--json-model-override-args"]
    assert argv[argv.index("--json-model-override-args") + 1] == '{"a": 1}' and "--enable-lora" in argv
    assert argv[argv.index("--lora-backend") + 1] == "torch_native"
    for bad in ({}, {"model_path": "a", "base_url": "http://b"}, {"model_path": "a", "device": "tpu"},
                {"model_path": "a", "tp_size": 0}):
        with pytest.raises(ValueError):
            SGLangEngineConfig(**bad)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sglang_ckpt")
    return {"A": harness.write_checkpoint(root / "A", seed=1), "B": harness.write_checkpoint(root / "B", seed=2)}


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict:
    return {name: harness.load_checkpoint(path) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def scenarios(checkpoints, tmp_path_factory):
    """mode -> the scenario JSON; each engine starts once, on first use."""
    runs: dict = {}
    out_dir = tmp_path_factory.mktemp("sglang_runs")

    def get(mode: str) -> dict:
        if mode not in runs:
            start = time.perf_counter()
            runs[mode] = harness.run_scenarios(mode, checkpoints["A"], checkpoints["B"], out_dir)
            runs[mode]["timings"]["wall_incl_imports"] = round(time.perf_counter() - start, 1)
            print(f"\n[sglang {mode}] timings (s): {runs[mode]['timings']}")
        return runs[mode]

    return get


def max_logprob_error(model, generations, temperature: float) -> float:
    worst = 0.0
    for g in generations:
        ref, _ = harness.token_logprobs(model, PROMPTS[g["prompt_index"]], g["output_ids"], temperature)
        worst = max(worst, (ref - torch.tensor(g["logprobs"])).abs().max().item())
    return worst


@real_engine
def test_the_offline_engines_processes_are_shielded_from_the_stop_signals(scenarios):
    """srun forwards SIGUSR1 (megatron_rl.preemption's stop request) to every process of the step, and Slurm
    ends a job with SIGTERM to all of them: SGLang's scheduler processes must survive both while the rank
    checkpoints, and the rank keeps its own handlers through the engine's start and its generate calls
    (SGLang sets a SIGTERM handler of its own when its event loop runs on the main thread)."""
    run = scenarios("offline")
    assert run["children_shielded"] and all(run["children_shielded"]) and run["tracker_started_with_the_engine"]
    assert run["parent_handled"] == ["SIGUSR1", "SIGTERM"]
    # signalled, SGLang's processes still generate (greedy: the same tokens as before the signals)
    assert [g["output_ids"] for g in run["greedy_after_stop_signals"]] == [g["output_ids"] for g in run["greedy_a"]]


@real_engine
def test_shutdown_stops_sglangs_processes_and_no_other(scenarios):
    """`sglang.Engine.shutdown` SIGKILLs every child of the calling process; the engine narrows that to
    SGLang's own processes: a child started before the engine (as a sandbox server would be) and
    multiprocessing's resource tracker survive it (killed, the tracker was relaunched at exit with a
    "process died unexpectedly" warning and a KeyError traceback at the end of every run)."""
    shutdown = scenarios("offline")["shutdown"]
    assert shutdown["sglang_pids"] and shutdown["sglang_left"] == []
    assert shutdown["bystander_alive"] and shutdown["tracker_alive"]


@real_engine
@pytest.mark.parametrize("mode", MODES)
def test_generate_shapes_order_and_version(scenarios, mode):
    gens = scenarios(mode)["gen_a"]
    assert [g["prompt_index"] for g in gens] == [i for i in range(len(PROMPTS)) for _ in range(SAMPLING.n)]
    for g in gens:
        assert 1 <= len(g["output_ids"]) <= SAMPLING.max_new_tokens
        assert len(g["logprobs"]) == len(g["output_ids"])
        assert all(0 <= t < 128 for t in g["output_ids"])
        assert all(lp <= 0 for lp in g["logprobs"])
        assert g["weight_version"] == 0
        # eos is token 0: it ends a sample (and is its last token); without it a sample runs
        # to max_new_tokens
        assert 0 not in g["output_ids"][:-1]
        assert g["finish_reason"] == ("stop" if g["output_ids"][-1] == 0 else "length")
    # n samples of one prompt are different samples, not copies
    first = [tuple(g["output_ids"]) for g in gens[:SAMPLING.n]]
    assert len(set(first)) > 1


@real_engine
@pytest.mark.parametrize("mode", MODES)
def test_stop_tokens_end_samples_and_are_included(scenarios, mode):
    gens = scenarios(mode)["stop"]
    stops = set(STOP_IDS) | {0}
    assert any(g["finish_reason"] == "stop" for g in gens)
    for g in gens:
        ids = g["output_ids"]
        assert not stops & set(ids[:-1]), "a stop token inside the sample"
        if g["finish_reason"] == "stop":
            assert ids[-1] in stops
        else:
            assert g["finish_reason"] == "length" and len(ids) == SAMPLING.max_new_tokens


@real_engine
def test_stop_strings_end_samples_at_the_token_completing_them(scenarios):
    """Offline (the engine loads the checkpoint's character tokenizer): a sample ends with the token that
    completes a stop string, which stays in it, and holds none before; a sample that ended otherwise
    (length, or the end-of-text token) holds none at all. Attach mode's server runs token ids only:
    stop strings are refused there, before any request."""
    from megatron_rl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("builtin:char")
    gens = scenarios("offline")["stop_strings"]
    by_string = 0
    for g in gens:
        ids = g["output_ids"]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ends = [text.find(s) + len(s) for s in STOP_STRINGS if s in text]
        assert len(ids) == len(g["logprobs"])
        if g["finish_reason"] == "stop" and ids[-1] != tokenizer.eos_token_id:
            by_string += 1
            assert min(ends) == len(text), (text, g)
        else:
            assert not ends, (text, g)
    assert by_string > 0, "no sample met a stop string: nothing was checked"
    assert scenarios("attach")["stop_strings_error"] == "ValueError"


@real_engine
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key,model", [("gen_a", "A"), ("stop", "A"), ("gen_b", "B"), ("gen_a2", "A")])
def test_logprobs_match_transformers(scenarios, reference, mode, key, model):
    """log_softmax(logits / temperature) of each sampled token, as `transformers` computes it
    for the same checkpoint (after an update: the checkpoint the update sent)."""
    error = max_logprob_error(reference[model], scenarios(mode)[key], SAMPLING.temperature)
    assert error < LOGPROB_ATOL


@real_engine
def test_logprobs_are_temperature_scaled(scenarios, reference):
    """The parity check can fail: the same samples against temperature 1 are far off."""
    gens = scenarios("offline")["gen_a"]
    assert max_logprob_error(reference["A"], gens, 1.0) > 1000 * LOGPROB_ATOL


@real_engine
@pytest.mark.parametrize("mode", MODES)
def test_weight_update_changes_outputs_to_the_new_model(scenarios, reference, mode):
    """Greedy decoding follows model A before the update and model B after it (every token is
    the reference model's argmax), and the reported versions follow the updates."""
    run = scenarios(mode)
    assert run["version_after_update"] == 1
    assert {g["weight_version"] for g in run["gen_b"] + run["greedy_b"]} == {1}
    assert {g["weight_version"] for g in run["gen_a2"]} == {2}
    assert [g["output_ids"] for g in run["greedy_a"]] != [g["output_ids"] for g in run["greedy_b"]]
    for key, model in (("greedy_a", "A"), ("greedy_b", "B")):
        for g in run[key]:
            ref, full = harness.token_logprobs(reference[model], PROMPTS[g["prompt_index"]], g["output_ids"],
                                               GREEDY.temperature)
            assert (full.max(dim=-1).values - ref).max().item() < LOGPROB_ATOL, f"{key}: not the argmax"
            assert (ref - torch.tensor(g["logprobs"])).abs().max().item() < LOGPROB_ATOL


@real_engine
@pytest.mark.parametrize("mode", MODES)
def test_release_resume_in_colocated_order(scenarios, mode):
    run = scenarios(mode)
    assert run["paused_generate_error"] == "EngineStateError"
    assert run["released_generate_error"] == "EngineStateError"
    assert run["released_update_error"] == "EngineStateError"
    assert run["bad_tag_error"] == "ValueError"
    released = run["health_released"]
    assert released["released"] == ["kv_cache", "weights"] and released["paused"] and released["healthy"]
    end = run["health_end"]
    assert end == {**end, "healthy": True, "paused": False, "released": [], "weight_version": 2, "in_flight": 0}
    assert run["health_start"]["weight_version"] == 0 and run["health_start"]["healthy"]
    assert run["release_cycles"] == RELEASE_CYCLES  # generate, then release at once: the scheduler survives


@real_engine
@pytest.mark.parametrize("mode", MODES)
def test_abort_returns_partial_samples(scenarios, mode):
    abort = scenarios(mode)["abort"]
    assert abort["finished"] and abort["in_flight_before_abort"] == 1
    assert "abort" in abort["finish_reasons"] and abort["aligned"]
    assert all(n < ABORT_MAX_NEW_TOKENS for n, r in zip(abort["lengths"], abort["finish_reasons"]) if r == "abort")
    after = scenarios(mode)["after_abort"]
    assert len(after) == 1 and after[0]["finish_reason"] == "length"


@real_engine
def test_same_random_seed_same_samples_across_engines(scenarios):
    """SGLang on CPU cannot honour per-request seeds (deterministic inference needs a CUDA
    attention backend), so reproducibility comes from the engine's random_seed: two engines
    started with the same seed and sent the same requests sample the same tokens."""
    offline, attach = scenarios("offline")["gen_a"], scenarios("attach")["gen_a"]
    assert [g["output_ids"] for g in offline] == [g["output_ids"] for g in attach]
    for a, b in zip(offline, attach):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=LOGPROB_ATOL)


@real_engine
def test_lora_adapters_from_tensors_compute_peft_s_lora(scenarios, checkpoints):
    """`update_adapters` (rollout.weight_sync=adapters) on model A, over HTTP to a server started with LoRA
    serving (the offline path runs in test_sglang_rl_loop.py): SGLang gives the log-probs `peft` computes with
    the same adapters on the same checkpoint, for the first adapters and for their replacement, which the base
    model alone does not. The server holds one adapter at a time, and none once the engine shut down."""
    from peft import LoraConfig, get_peft_model

    run = scenarios("attach")
    first, second = run["gen_lora_loaded"], run["gen_lora2_loaded"]
    assert len(first) == len(second) == 1 and first != second and run["loaded_after_shutdown"] == []
    for key, seed, version in (("gen_lora", 0, 3), ("gen_lora2", 1, 4)):
        adapters = lora_adapters(str(checkpoints["A"]), seed)
        model = get_peft_model(harness.load_checkpoint(checkpoints["A"]), LoraConfig(
            r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=sorted(adapters), lora_dropout=0.0)).eval()
        with torch.no_grad():
            for name, (a, b) in adapters.items():
                layer = model.base_model.model.get_submodule(name)
                layer.lora_A["default"].weight.copy_(a)
                layer.lora_B["default"].weight.copy_(b)
        assert {g["weight_version"] for g in run[key]} == {version}
        assert max_logprob_error(model, run[key], SAMPLING.temperature) < LOGPROB_ATOL
        with model.disable_adapter():
            assert max_logprob_error(model, run[key], SAMPLING.temperature) > 1000 * LOGPROB_ATOL
