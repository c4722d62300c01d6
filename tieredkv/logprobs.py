"""Log-probabilities of sampled tokens and of the most likely ones.

Operations:
- `token_logprobs(logits, tokens, num_top, decode)`: for each row, the sampled token's logprob
  and rank, and the `num_top[i]` most likely tokens'.
- `sampled_logprobs(logits, tokens, num_top, decode)`: the same for the rows that keep them.
- `top_logprobs(logits, k)`: each row's `k` best log-probs and their tokens (beam search).

Logprobs are those of the model's distribution (`log_softmax` of the logits), before the
temperature, top-k, top-p and banned tokens shape the distribution a token is drawn from
(vLLM's default, "raw" logprobs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability, its rank among all tokens (1: the most likely), and its
    text alone (with a tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# token id -> its Logprob: the sampled token and the top-k of one position
TokenLogprobs = dict[int, Logprob]


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int],
    decode: Callable[[int], str] | None = None,
) -> list[TokenLogprobs]:
    """Row i of `logits` (`[n, vocab]`) produced `tokens[i]`: its logprob and rank, and those of
    the `num_top[i]` most likely tokens (the sampled one may be among them, once)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(tokens), dtype=torch.int64, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top = logprobs.topk(min(max(num_top), logprobs.shape[1]), dim=1)
    chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for i, token in enumerate(tokens):
        k = num_top[i]
        entry = {t: Logprob(v, r, _text(decode, t))
                 for r, (v, t) in enumerate(zip(top_values[i][:k], top_ids[i][:k], strict=True), start=1)}
        entry.setdefault(token, Logprob(chosen[i], ranks[i], _text(decode, token)))
        out.append(entry)
    return out


def _text(decode: Callable[[int], str] | None, token: int) -> str | None:
    return decode(token) if decode is not None else None


def sampled_logprobs(
    logits: torch.Tensor, tokens: Sequence[object], num_top: Sequence[int | None],
    decode: Callable[[int], str] | None = None,
) -> list[TokenLogprobs | None] | None:
    """`token_logprobs` of the rows whose `num_top[i]` is not None and whose sample is a token
    (an int); None in the others' places, and None alone if no row keeps them."""
    wanted = [i for i, k in enumerate(num_top) if k is not None and isinstance(tokens[i], int)]
    if not wanted:
        return None
    found = token_logprobs(logits[wanted], [tokens[i] for i in wanted], [num_top[i] for i in wanted], decode)
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    for i, entry in zip(wanted, found, strict=True):
        out[i] = entry
    return out


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` (at most the vocabulary) best log-probs of each row of `logits` and their token
    ids, best first, on the CPU: `([n, k] float32, [n, k] int64)`."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[1]), dim=1)
    return top.values.cpu(), top.indices.cpu()
