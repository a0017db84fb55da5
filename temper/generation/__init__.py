"""Text generation with the training model definition: KV cache, batched prompts of different
lengths, greedy or temperature/top-k/top-p sampling, stop tokens; one process or FSDP2."""

from temper.generation.decoding import Generation, generate
from temper.generation.fsdp import gathered_weights
from temper.generation.sampling import sample_next
from temper.models.layers.kv_cache import KVCache

__all__ = ["Generation", "KVCache", "gathered_weights", "generate", "sample_next"]
