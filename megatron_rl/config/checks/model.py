"""The model against where it runs: the device's transformer implementation, the rollout engine's support
for its layers, context parallelism with its attention."""

from __future__ import annotations

from megatron_rl.checks import ConfigError


def check_model(cfg) -> None:
    """What the model can run on: the device's transformer implementation, the rollout engine's support
    for its layers, context parallelism with its attention."""
    model, par = cfg.model, cfg.parallel
    if model.transformer_impl == "transformer_engine" and cfg.cluster.device == "cpu":
        raise ConfigError("model.transformer_impl=transformer_engine needs a GPU, but cluster.device=cpu: use "
                          "model.transformer_impl=auto (the local spec on CPU)")
    if model.transformer_impl == "local" and cfg.cluster.device == "cuda":
        problem = model.local_spec_gpu_problem(par.sequence_parallel)
        if problem:
            raise ConfigError(f"model.transformer_impl=local cannot run {problem} on a GPU (cluster.device=cuda): "
                              "Megatron-core's local paths for it assume Transformer Engine; use "
                              "model.transformer_impl=auto with TE installed")
    if par.cp > 1 and model.attention_sinks:
        raise ConfigError(
            f"parallel.cp={par.cp} is not supported with model.family={model.family}: its attention (sinks, "
            "sliding windows) runs in the CPU path's own core attention, which does not split sequences, and TE's "
            "context-parallel attention with sinks is unverified; set parallel.cp=1"
        )
    if model.mlp_bias and cfg.rollout.backend == "sglang":
        # sglang/srt/models/llama.py: LlamaMLP builds gate_up_proj and down_proj with bias=False, and its weight
        # loader skips bias tensors it has no parameter for: the engine would sample from another model
        raise ConfigError("model.mlp_bias=true is not supported with rollout.backend=sglang: SGLang's Llama has no "
                          "MLP biases and would drop them; use rollout.backend=hf")
