"""Checkpoints: Hugging Face safetensors in and out (`hf`), Megatron distributed training
checkpoints with atomic saves, retention and exact resume (`training`), and their checksum
manifests, which name a damaged file (`integrity`)."""
