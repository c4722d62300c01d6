"""A tiny checkpoint with a real tokenizer: a byte-level BPE trained here, a random Llama sized
to its vocabulary, and a chat template, saved as a transformers model directory."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
EOS = 1  # "</s>"
END = 6  # "<|end|>": special, not an EOS
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = ("the a cache block tier offload swap recompute prefix token model server stream client request "
         "memory disk host device fast slow hot cold café naïve 東京 über").split()
MAX_POSITIONS = 256


def train_tokenizer(vocab_size: int = 400, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text encodes; some tokens are parts of a UTF-8 character)."""
    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) + rng.choice(".!?,\n") for _ in range(2000)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", additional_special_tokens=SPECIAL_TOKENS[3:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    """Random weights far from ties (greedy decoding is stable), EOS = "</s>"."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=0, eos_token_id=EOS,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def save_checkpoint(path: Path, seed: int = 0) -> Path:
    """Tokenizer, model and chat template in `path`."""
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(path)
    tiny_llama(len(tokenizer), seed).save_pretrained(path)
    return path
