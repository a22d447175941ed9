"""The HF <-> Megatron layouts the family converters share: the dense decoder (`dense.py`), the mixture-of-experts
MLPs (`moe.py`), the HF config fields a converter reads, refuses or ignores (`fields.py`) and YaRN's RoPE
parameters (`yarn.py`). A family's own converter lives in its module in `megatron_rl/families/`."""
