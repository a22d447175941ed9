"""Mixtral: experts in every layer, the router's top-k softmax always renormalised, no attention bias."""

from typing import Any

from megatron_rl.checks import invalid
from megatron_rl.families.common import renormalising_router
from megatron_rl.families.spec import FamilySpec


def _check_moe(m: Any) -> None:
    if m.qkv_bias:
        raise invalid("model.qkv_bias", True, "Mixtral attention has no qkv bias; set model.qkv_bias=false or null")
    renormalising_router(m, "Mixtral")


SPECS = (FamilySpec("mixtral", "Mixtral", "mixtral:MixtralConverter", moe=True, experts_in_every_layer=True,
                    renormalised_topk=True, check_moe=_check_moe),)
