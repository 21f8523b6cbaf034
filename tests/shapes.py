"""The model shapes tests share, each defined once (the same shape compiles to the same program, which XLA's cache
then shares across test processes): `tiny_config()` (jaxtune.config) is the one to run; SMALL is a planner-sized
model still cheap to compile; the real ones are planned, never allocated."""

from jaxtune.config import ModelConfig

SMALL = ModelConfig(vocab_size=2048, hidden_size=128, intermediate_size=352, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=32)
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, rope_theta=500000.0)
LLAMA2_7B = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                        num_kv_heads=32, head_dim=128)
