"""The small models the engine tests share: a talker (test_model, test_cuda_path) with its page
size, and a whole pipeline, talker and vocoder (test_weights, test_weight_share)."""

from omni_dp.engine.config import ModelConfig, VocoderConfig

CFG = ModelConfig(
    name="test", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=96, max_position=128, codebook_size=32,
)
PAGE = 4

# Talker and vocoder, a few thousand parameters: seeded, saved and shared in milliseconds.
PIPELINE = ModelConfig(
    name="unit", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=48, codebook_size=16, num_speakers=4,
    vocoder=VocoderConfig(embed_dim=16, channels=(8, 4), upsample_factors=(4, 5), kernel_size=3),
)
