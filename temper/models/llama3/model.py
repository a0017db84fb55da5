"""Llama 3 decoder composed from the shared layers; HF-compatible numerics and weight layout."""

from torch import nn

from temper.models.layers.decoder import Decoder
from temper.models.layers.mlp import FeedForward
from temper.models.llama3.args import LlamaArgs


class Transformer(Decoder):
    """Llama 3 causal LM: the shared decoder, whose MLP may carry biases (``mlp_bias``)."""

    args: LlamaArgs

    def feed_forward(self, layer_id: int) -> nn.Module:
        return FeedForward(self.args.dim, self.args.ffn_hidden_dim, bias=self.args.mlp_bias)
