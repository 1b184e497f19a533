"""Tiny checkpoints that ``transformers serve`` loads from disk, saved with
``save_pretrained``: transformers' own Llama (GQA) and gpt-oss (learned sinks, a sliding
layer) classes with query and key projections sharpened (random initialisation attends
almost uniformly, and its heads alike: sharpened twelvefold, a Llama's heads are about
0.65 apart in head diversity), a byte-level BPE tokenizer trained here with a chat template, and a
greedy generation config. ``collapsed=True`` gives a Llama whose heads all attend alike
(a broken revision for the canary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from tests.integrations.models import SENTENCES, SMALL

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
BOS, EOS, PAD = 0, 1, 2

#: prompts of varied lengths for the served models (real sentences, alone and joined)
PROMPTS = tuple(SENTENCES) + tuple(" ".join(SENTENCES[i: i + n]) for n in (2, 3) for i in range(len(SENTENCES) - n))


def tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text tokenizes) of about 300 tokens; <s>, </s>, <pad> first."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(SENTENCES) * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _sharpen(model: Any, sinks: bool = False) -> None:
    with torch.no_grad():
        for module in model.modules():
            for projection in ("q_proj", "k_proj"):
                weight = getattr(getattr(module, projection, None), "weight", None)
                if weight is not None:
                    weight.mul_(12.0)
            if sinks and isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.copy_(torch.linspace(-2.0, 3.0, module.sinks.numel()))


def _collapse(model: Any) -> None:
    """Every query head the first one's, every KV head the first one's: heads alike."""
    with torch.no_grad():
        for module in model.modules():
            for projection in ("q_proj", "k_proj"):
                weight = getattr(getattr(module, projection, None), "weight", None)
                if weight is not None:
                    heads = weight.view(-1, module.head_dim, weight.shape[-1])
                    heads[1:] = heads[0]


def save(model: Any, path: Path) -> Path:
    """The model, the tokenizer and a greedy generation config in ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, do_sample=False,
                     max_new_tokens=16).save_pretrained(path)
    return path


def save_llama(path: Path, *, collapsed: bool = False, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(**{**SMALL, "num_attention_heads": 8, "vocab_size": len(tokenizer()),
                            "max_position_embeddings": 512}, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(config).eval()
    _sharpen(model)
    if collapsed:
        _collapse(model)
    return save(model, path)


def save_gpt_oss(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = GptOssConfig(**{**SMALL, "intermediate_size": 64, "vocab_size": len(tokenizer()),
                             "max_position_embeddings": 512}, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                          bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model = GptOssForCausalLM(config).eval()
    _sharpen(model, sinks=True)
    return save(model, path)


def main() -> None:
    """``python -m tests.integrations.serve_checkpoints DIR [--gpt-oss | --collapsed]``: save
    one of these checkpoints in DIR, to try ``attention-monitor serve`` without a model
    of one's own (the README's walk-through)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("directory", type=Path)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--gpt-oss", action="store_true", help="the gpt-oss-style model (learned sinks, a window)")
    kind.add_argument("--collapsed", action="store_true", help="the Llama with its heads made alike (a canary)")
    args = parser.parse_args()
    path = save_gpt_oss(args.directory) if args.gpt_oss else save_llama(args.directory, collapsed=args.collapsed)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
