"""Reference prompts and transformers greedy outputs that the engine must reproduce."""

from __future__ import annotations

import random
import time

import torch


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Eight prompts of different lengths crossing block boundaries (4 and 16); several share
    a long prefix, one is a prefix of another."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    shared = tokens(37)
    return [
        tokens(1), tokens(5), tokens(16), shared + tokens(3),
        shared + tokens(12), shared[:33], tokens(70), shared + tokens(28),
    ]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding, cut after EOS the way the engine stops."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def hf_beams(model: torch.nn.Module, prompt: list[int], width: int, max_new_tokens: int,
             length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """transformers' beam search: every finished candidate, best first, as (generated tokens up
    to and with EOS, score)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        num_beams=width, num_return_sequences=width, length_penalty=length_penalty, early_stopping=False,
        output_scores=True, return_dict_in_generate=True, pad_token_id=0,
    )
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    beams = []
    for tokens, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist(), strict=True):
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        beams.append((tokens[:end], score))
    return beams


def settle_writes(llm, timeout_s: float = 30.0) -> dict:
    """Tend the idle engine `llm`'s tiers, as its loop does between requests
    (`LLMEngine.tend_tiers`), until its transfers and the lower-tier writes and reads it has in
    flight are finished and booked (they run on other threads, so a run may end before they do);
    its stats."""
    deadline = time.monotonic() + timeout_s
    while llm.tend_tiers() and time.monotonic() < deadline:
        time.sleep(0.005)
    return llm.stats()
