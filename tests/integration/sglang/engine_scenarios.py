"""Drive one real SGLang engine through the RolloutEngine protocol and write what happened as JSON.

Runs inside the SGLang test venv (tests/integration/sglang/setup.sh), started by
tests/integration/test_sglang_engine.py, which makes the two checkpoints and judges the JSON
against `transformers` in the project venv. One engine per run, because starting one costs
20-60 s on CPU:

    python engine_scenarios.py --mode offline|attach --model-a DIR --model-b DIR --out FILE

offline: `SGLangEngine` starts `sglang.Engine` in this process. attach: this script starts
`python -m sglang.launch_server` with the same arguments (`server_command`) and the engine
attaches to it over HTTP. The scenarios and their order are the same in both modes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from multiprocessing import resource_tracker
from pathlib import Path

from safetensors.torch import load_file

from megatron_rl.parallel.dist import free_port
from megatron_rl.rollout.base import ALL_TAGS, TAG_KV_CACHE, TAG_WEIGHTS, SamplingParams
from megatron_rl.rollout.sglang_engine import SGLangEngine, SGLangEngineConfig, server_command
from tests.integration.jobs import shielded_signals

# Shared with the test module, which recomputes log-probs for these prompts and parameters.
PROMPTS = [[1, 87, 73, 72, 72, 3], [5, 6, 7, 8, 9, 10, 11], [40, 41]]
SAMPLING = SamplingParams(temperature=0.8, top_p=1.0, top_k=-1, max_new_tokens=16, n=4)
GREEDY = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=16)
STOP_IDS = tuple(range(4, 99, 2))  # every other printable character: sequences stop early
# Stop strings (the offline engine loads the checkpoint's character tokenizer for them): characters that no
# special token's text holds, so that whether SGLang decodes special tokens cannot change a match.
STOP_STRINGS = ("K", "4", "Q", "W", "zq")
RELEASE_CYCLES = 5
ABORT_MAX_NEW_TOKENS = 500  # with the prompt, just under the model's 512 positions


LORA_RANK, LORA_ALPHA = 4, 8.0
LORA_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def cpu_config(lora: bool = False, **kwargs) -> SGLangEngineConfig:
    """`lora`: LoRA serving on, as rollout.weight_sync=adapters starts it (the attach-mode server; the offline
    engine runs without, as full weight syncs use SGLang)."""
    lora_args = {"enable_lora": True, "max_lora_rank": LORA_RANK, "max_loras_per_batch": 2,
                 "lora_target_modules": [m.split(".")[1] for m in LORA_MODULES]} if lora else {}
    return SGLangEngineConfig(device="cpu", dtype="float32", random_seed=0,
                              server_args={"max_total_tokens": 8192, **lora_args}, **kwargs)


def lora_adapters(model_dir: str, seed: int) -> dict:
    """Seeded LoRA adapters {HF module: (A [r, in], B [out, r])} for every layer of the checkpoint's
    architecture (the test module rebuilds them to judge the engine against peft)."""
    import torch

    config = json.loads((Path(model_dir) / "config.json").read_text())
    h, f = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, f),
              "up_proj": (h, f), "down_proj": (f, h)}  # (in, out)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(config["num_hidden_layers"]):
        for module in LORA_MODULES:
            fan_in, fan_out = shapes[module.split(".")[1]]
            out[f"model.layers.{layer}.{module}"] = (torch.randn(LORA_RANK, fan_in, generator=gen) / fan_in ** 0.5,
                                                     torch.randn(fan_out, LORA_RANK, generator=gen) * 0.2)
    return out


def as_dicts(generations) -> list[dict]:
    return [dataclasses.asdict(g) for g in generations]


def error_name(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the test checks which one
        return type(exc).__name__
    return "none"


def buckets(model_dir: str) -> list[list[tuple[str, object]]]:
    """The checkpoint's tensors in two buckets, as weight sync would send them."""
    tensors = sorted(load_file(str(Path(model_dir) / "model.safetensors")).items())
    half = len(tensors) // 2
    return [tensors[:half], tensors[half:]]


def update(engine: SGLangEngine, model_dir: str, version: int) -> None:
    first, last = buckets(model_dir)
    engine.update_weights(first, version, flush=False)
    engine.update_weights(last, version, flush=True)


def abort_scenario(engine: SGLangEngine) -> dict:
    """A long generation in another thread, aborted once it is under way."""
    result: dict = {}
    params = SamplingParams(temperature=1.0, max_new_tokens=ABORT_MAX_NEW_TOKENS, n=8)
    thread = threading.Thread(target=lambda: result.update(out=engine.generate(PROMPTS[:2], params)))
    thread.start()
    deadline = time.monotonic() + 30
    while engine.health()["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Long enough for the requests to reach the scheduler even on a loaded box, short enough
    # that they are still decoding: 16 samples decode at ~200 tokens/s each on 2 cores.
    time.sleep(0.8)
    in_flight = engine.health()["in_flight"]
    engine.abort()
    thread.join(timeout=120)
    gens = result.get("out", [])
    return {"in_flight_before_abort": in_flight, "finished": not thread.is_alive(),
            "finish_reasons": [g.finish_reason for g in gens],
            "lengths": [len(g.output_ids) for g in gens],
            "aligned": all(len(g.output_ids) == len(g.logprobs) for g in gens)}


def run(engine: SGLangEngine, args: argparse.Namespace) -> dict:
    out: dict = {"timings": {}}

    def timed(name, fn):
        start = time.perf_counter()
        value = fn()
        out["timings"][name] = round(time.perf_counter() - start, 3)
        return value

    # The first generate call is the same in both modes: with the same random_seed it must
    # give the same samples (the test compares offline with attach).
    out["gen_a"] = as_dicts(timed("generate_a", lambda: engine.generate(PROMPTS, SAMPLING)))
    out["greedy_a"] = as_dicts(engine.generate(PROMPTS, GREEDY))
    out["stop"] = as_dicts(engine.generate(PROMPTS, dataclasses.replace(SAMPLING, stop_token_ids=STOP_IDS)))
    with_strings = dataclasses.replace(SAMPLING, stop=STOP_STRINGS)
    if engine.config.skip_tokenizer_init:  # attach: the server runs token ids only
        out["stop_strings_error"] = error_name(lambda: engine.generate(PROMPTS, with_strings))
    else:
        out["stop_strings"] = as_dicts(engine.generate(PROMPTS, with_strings))
    out["health_start"] = engine.health()

    timed("update_b", lambda: update(engine, args.model_b, version=1))
    out["version_after_update"] = engine.weight_version
    out["gen_b"] = as_dicts(engine.generate(PROMPTS, SAMPLING))
    out["greedy_b"] = as_dicts(engine.generate(PROMPTS, GREEDY))

    # The colocated phase order: pause, release everything, resume weights, sync, resume KV.
    engine.pause()
    out["paused_generate_error"] = error_name(lambda: engine.generate(PROMPTS, GREEDY))
    timed("release", lambda: engine.release_memory(ALL_TAGS))
    out["health_released"] = engine.health()
    out["released_generate_error"] = error_name(lambda: engine.generate(PROMPTS, GREEDY))
    out["released_update_error"] = error_name(lambda: update(engine, args.model_a, version=2))
    engine.resume_memory([TAG_WEIGHTS])
    update(engine, args.model_a, version=2)
    engine.resume_memory([TAG_KV_CACHE])
    engine.resume()
    out["bad_tag_error"] = error_name(lambda: engine.release_memory(["activations"]))
    out["gen_a2"] = as_dicts(engine.generate(PROMPTS, SAMPLING))

    # The colocation controller's hand-back: a release right after a generate call returns, not paused.
    short = dataclasses.replace(GREEDY, max_new_tokens=4)
    out["release_cycles"] = 0
    for _ in range(RELEASE_CYCLES):
        engine.generate(PROMPTS, short)
        engine.release_memory(ALL_TAGS)
        engine.resume_memory(ALL_TAGS)
        out["release_cycles"] += 1

    out["abort"] = abort_scenario(engine)
    out["after_abort"] = as_dicts(engine.generate(PROMPTS[:1], GREEDY))
    out["health_end"] = engine.health()

    if args.mode == "attach":  # LoRA adapters on model A (rollout.weight_sync=adapters), then a replacement:
        # the engine loads each under a new name and unloads the one before
        for key, seed, version in (("gen_lora", 0, 3), ("gen_lora2", 1, 4)):
            engine.update_adapters(lora_adapters(args.model_a, seed), LORA_ALPHA / LORA_RANK, version)
            out[key] = as_dicts(engine.generate(PROMPTS, SAMPLING))
            out[key + "_loaded"] = loaded_adapters(engine.config.base_url)
    return out


def loaded_adapters(url: str) -> list[str]:
    """The LoRA adapters a server holds (its /v1/models lists them beside the base model)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        models = json.loads(resp.read())["data"]
    return sorted(m["id"] for m in models if m.get("parent"))


def start_server(model_dir: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = server_command(cpu_config(lora=True, model_path=model_dir), model_dir, port=port, python=sys.executable)
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the SGLang server exited with {proc.returncode}; log: {log_path}")
        try:
            with urllib.request.urlopen(url + "/model_info", timeout=5):
                return proc, url
        except OSError:
            time.sleep(1.0)
    stop_server(proc)  # else it outlives the test (a busy machine saw two such servers burn its CPUs)
    raise TimeoutError(f"the SGLang server did not come up in 600 s; log: {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _resource_tracker_alive() -> bool:
    """multiprocessing's resource tracker of this process runs."""
    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return pid is not None and pid in _children(os.getpid())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("offline", "attach"), required=True)
    parser.add_argument("--model-a", required=True)
    parser.add_argument("--model-b", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    start = time.perf_counter()
    server = None
    stop_requested = []
    for sig in (signal.SIGUSR1, signal.SIGTERM):  # as megatron_rl.preemption does
        signal.signal(sig, lambda signum, frame: stop_requested.append(signum))
    bystander = None
    if args.mode == "offline":
        # a child process of this one that is not SGLang's (as a sandbox server or generator would be): the
        # engine's shutdown must leave it running
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])
        # with the checkpoint's tokenizer, for stop strings (token ids still go in and out)
        config = cpu_config(model_path=args.model_a, skip_tokenizer_init=False)
        config.server_args["tokenizer_path"] = args.model_a  # as the rollout factory passes it
        engine = SGLangEngine(config)
    else:
        server, url = start_server(args.model_a, Path(args.out).with_suffix(".server.log"))
        engine = SGLangEngine(SGLangEngineConfig(base_url=url))
    engine_start = time.perf_counter() - start
    try:
        result = run(engine, args)
        # SGLang's processes and multiprocessing's resource tracker, which the engine's start started (a
        # tracker started there unblocked SIGTERM for the processes started after it)
        result["children_shielded"] = [{signal.SIGUSR1, signal.SIGTERM} <= shielded_signals(pid)
                                       for pid in _children(os.getpid()) if pid != (bystander and bystander.pid)]
        result["tracker_started_with_the_engine"] = _resource_tracker_alive()
        for sig in (signal.SIGUSR1, signal.SIGTERM):  # this process keeps its own handlers
            os.kill(os.getpid(), sig)
            time.sleep(0.1)
        result["parent_handled"] = [signal.Signals(sig).name for sig in stop_requested]
        if args.mode == "offline":  # SGLang's processes get both (as Slurm sends them) and go on generating
            for pid in engine._transport._sglang_pids:
                for sig in (signal.SIGUSR1, signal.SIGTERM):
                    os.kill(pid, sig)
            time.sleep(1.0)
            result["greedy_after_stop_signals"] = as_dicts(engine.generate(PROMPTS, GREEDY))
    finally:
        sglang_pids = list(getattr(engine._transport, "_sglang_pids", []))
        engine.shutdown()
        if bystander is not None:
            result["shutdown"] = {"sglang_pids": sglang_pids, "bystander_alive": bystander.poll() is None,
                                  "sglang_left": [pid for pid in sglang_pids if pid in _children(os.getpid())],
                                  "tracker_alive": _resource_tracker_alive()}
            bystander.kill()
            bystander.wait()
        if server is not None:
            try:
                after_shutdown = loaded_adapters(url)  # the engine took its adapter back
            finally:
                stop_server(server)
    if server is not None:
        result["loaded_after_shutdown"] = after_shutdown
    result["timings"]["engine_start"] = round(engine_start, 3)
    result["timings"]["total"] = round(time.perf_counter() - start, 3)
    result["mode"] = args.mode
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
