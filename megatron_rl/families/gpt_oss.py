"""gpt-oss (gpt-oss-20b, -120b): experts in every layer with a bias on every linear layer, a clamped SwiGLU,
attention sinks, sliding-window attention on some layers, YaRN."""

from typing import Any

from megatron_rl.checks import check_min, invalid
from megatron_rl.families.common import renormalising_router
from megatron_rl.families.spec import FamilySpec


def _check_moe(m: Any) -> None:
    if m.qkv_bias is False:
        raise invalid("model.qkv_bias", False, "gpt-oss has a bias on every linear layer (HF attention_bias "
                      "false is not supported); set model.qkv_bias=true or null")
    renormalising_router(m, "gpt-oss")


def _check(m: Any) -> None:
    """gpt-oss's own fields: the sliding window and the layers that use it, the SwiGLU clamp."""
    if m.swiglu_limit is None:
        raise invalid("model.swiglu_limit", None, "model.family=gpt_oss clamps its experts' SwiGLU: set it "
                      "(HF swiglu_limit; gpt-oss: 7)")
    check_min("model.swiglu_limit", m.swiglu_limit, 0, strict=True)
    layers = list(m.sliding_window_layers)
    m.sliding_window_layers = sorted(layers)  # one spelling per layout (checkpoints compare it)
    if m.sliding_window is None:
        if layers:
            raise invalid("model.sliding_window_layers", layers, "needs model.sliding_window (the window "
                          "width); set it, or model.sliding_window_layers=[]")
        return
    check_min("model.sliding_window", m.sliding_window, 1)
    m.check_layer_list("sliding_window_layers", layers)


SPECS = (FamilySpec("gpt_oss", "gpt-oss", "gpt_oss:GptOssConverter", moe=True, experts_in_every_layer=True,
                    renormalised_topk=True, rope_scalings=("yarn",), qkv_bias=True, linear_bias=True,
                    attention_sinks=True, own_fields={"sliding_window": None, "sliding_window_layers": [],
                                                      "swiglu_limit": None},
                    check=_check, check_moe=_check_moe),)
