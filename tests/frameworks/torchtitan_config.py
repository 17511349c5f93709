"""A torchtitan config registry for the tests: llama3's ``debugmodel`` made tiny for CPU.

``--module tests.frameworks.torchtitan_config --config tiny_llama3`` (torchtitan's
own way to name a config function). Everything but the model's size and its inner
attention is ``llama3_debugmodel``: its optimizer, lr schedule, dataloader
(``c4_test``'s loader over a small JSON corpus the test writes), metrics, checkpoint
settings. The attention is torchtitan's ``ScaledDotProductAttention`` (as its own
graph_trainer tests do): FlexAttention has no backward on CPU.
"""

from __future__ import annotations

from typing import Any

# torchtitan has no type information.
from torchtitan.models.common import (  # type: ignore[import-untyped]
    ComplexRoPE,
    Embedding,
    Linear,
    RMSNorm,
)
from torchtitan.models.common.attention import (  # type: ignore[import-untyped]
    ScaledDotProductAttention,
)
from torchtitan.models.llama3 import (  # type: ignore[import-untyped]
    _EMBEDDING_INIT,
    _NORM_INIT,
    Llama3Model,
    _build_llama3_layers,
    _output_linear_init,
)
from torchtitan.models.llama3.config_registry import (  # type: ignore[import-untyped]
    llama3_debugmodel,
)

DIM, HEADS, LAYERS, VOCAB, MAX_SEQ = 64, 4, 2, 256, 256


def tiny_llama3() -> Any:
    """``llama3_debugmodel`` with a 2-layer, 64-wide model (~100k parameters)."""
    config = llama3_debugmodel()
    layers = _build_llama3_layers(
        n_layers=LAYERS,
        dim=DIM,
        n_heads=HEADS,
        hidden_dim=4 * DIM,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=MAX_SEQ, theta=10000),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.model_spec.model = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)
        ),
        layers=layers,
    )
    config.loss.loss_fn.global_vocab_size = VOCAB
    return config
