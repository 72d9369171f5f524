"""The small talker the model tests share (test_model, test_cuda_path): its config and page
size."""

from omni_dp.engine.config import ModelConfig

CFG = ModelConfig(
    name="test", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=96, max_position=128, codebook_size=32,
)
PAGE = 4
