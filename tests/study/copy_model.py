"""A one-layer GPT-2 (transformers' own GPT2LMHeadModel) whose weights are set by hand:
head 0 attends from each position to the one before it and copies that token into a
subspace the output layer reads; heads 1–3 carry random weights of the same magnitude
and write where nothing reads. The task: in triples (a, b, a), predict the second a,
which only the copy head can do (scored at every third token)."""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, POSITIONS, D, HEADS = 8, 24, 64, 4
HEAD_DIM = D // HEADS
TOKEN, POSITION, COPY, SPARE = 0, VOCAB, VOCAB + POSITIONS, VOCAB + POSITIONS + VOCAB  # subspace offsets
TRIPLES = 5  # 15 tokens: below the period (16) of the position code


def build(copy_head_useful: bool = True, seed: int = 0) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=D, n_layer=1, n_head=HEADS, n_inner=4 * D,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config).eval()
    model.set_attn_implementation("eager")
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        block = model.transformer.h[0]
        for norm in (block.ln_1, block.ln_2, model.transformer.ln_f):
            norm.weight.fill_(1.0)
        for v in range(VOCAB):
            model.transformer.wte.weight[v, TOKEN + v] = 1.0
        for p in range(POSITIONS):
            model.transformer.wpe.weight[p, POSITION + p] = 1.0
        # ln_1 sees (x − μ)/σ with x two ones: s·x − ε·1; its bias cancels the −ε·1
        sigma = math.sqrt(2 / D - 4 / D**2)
        s, eps = 1 / sigma, (2 / D) / sigma
        block.ln_1.bias.fill_(eps)
        omega = np.pi * np.arange(1, HEAD_DIM // 2 + 1) / (HEAD_DIM // 2)
        def code(p: int) -> np.ndarray:
            return np.concatenate([np.cos(omega * p), np.sin(omega * p)])
        c = math.sqrt(10.0)  # scores 8c²/√d = 20 at the previous position, ≤ 0 elsewhere
        w = block.attn.c_attn.weight  # [D, 3D]: q | k | v, head h in columns h·d … (h+1)·d
        q, k, v = np.zeros((D, HEAD_DIM)), np.zeros((D, HEAD_DIM)), np.zeros((D, HEAD_DIM))
        for p in range(POSITIONS):
            q[POSITION + p] = c * code(p) / s
            k[POSITION + p] = c * code(p + 1) / s
        for t in range(VOCAB):
            v[TOKEN + t, t] = 1.0 / s
        proj = np.zeros((HEAD_DIM, D))
        target = COPY if copy_head_useful else SPARE
        for t in range(VOCAB):
            proj[t, target + t] = 4.0
        blocks = {"q": q, "k": k, "v": v}
        for h in range(HEADS):
            for i, name in enumerate("qkv"):
                matrix = blocks[name] if h == 0 else _noise(rng, blocks[name])
                w[:, i * D + h * HEAD_DIM: i * D + (h + 1) * HEAD_DIM] = torch.tensor(matrix, dtype=torch.float32)
            out = proj if h == 0 else _noise(rng, proj, columns=range(SPARE, D))
            block.attn.c_proj.weight[h * HEAD_DIM:(h + 1) * HEAD_DIM] = torch.tensor(out, dtype=torch.float32)
        for t in range(VOCAB):
            model.lm_head.weight[t, COPY + t] = 10.0
    return model


def _noise(rng: np.random.Generator, like: np.ndarray, columns: range | None = None) -> np.ndarray:
    """Random weights with the Frobenius norm of ``like`` (in ``columns`` only, if given)."""
    out = np.zeros_like(like)
    cols = list(columns) if columns is not None else list(range(like.shape[1]))
    noise = rng.standard_normal((like.shape[0], len(cols)))
    out[:, cols] = noise / np.linalg.norm(noise) * np.linalg.norm(like)
    return out


def examples(n: int, seed: int) -> list[dict]:
    """``n`` sequences of triples (a, b, a); the second a of each triple is scored."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ids = []
        for _ in range(TRIPLES):
            a, b = rng.integers(VOCAB, size=2).tolist()
            ids += [a, b, a]
        labels = [t if i % 3 == 2 else -100 for i, t in enumerate(ids)]
        rows.append({"input_ids": ids, "labels": labels})
    return rows
