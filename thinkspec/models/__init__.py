"""Model code for Hugging Face checkpoints: Qwen3, Qwen2, Llama, and Qwen3-MoE / Qwen2-MoE."""

from thinkspec.models.loader import ARCHITECTURES, ModelInfo, load_model

__all__ = ["ARCHITECTURES", "ModelInfo", "load_model"]
