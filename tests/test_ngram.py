import random

import pytest
import torch

from thinkspec.spec_decode.ngram import ngram_propose


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    n_tok = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n_tok <= n:
            continue
        suffix = tokens[n_tok - n :]
        for j in range(n_tok - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[j : j + n] == suffix:
                return tokens[j + n : j + n + k]
    return []


def pack(rows: list[list[int]], pad_to: int | None = None):
    width = max(pad_to or 0, max(len(r) for r in rows))
    t = torch.full((len(rows), width), 7777, dtype=torch.long)  # padding must never match
    for i, r in enumerate(rows):
        t[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return t, torch.tensor([len(r) for r in rows])


def test_simple_lookup():
    tokens = [5, 1, 2, 3, 9, 9, 1, 2]
    drafts, num = ngram_propose(*pack([tokens]), k=3, min_n=1, max_n=2)
    assert num.tolist() == [3]
    assert drafts.tolist() == [[3, 9, 9]]


def test_truncated_at_end_and_no_match():
    rows = [[1, 2, 3, 1, 2], [4, 5, 6], [8]]
    drafts, num = ngram_propose(*pack(rows, pad_to=10), k=4, min_n=1, max_n=3)
    assert num.tolist() == [3, 0, 0]
    assert drafts[0].tolist() == [3, 1, 2, -1]
    assert (drafts[1:] == -1).all()


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5])
    k = rng.randint(1, 6)
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 4)
    rows = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 6))]
    drafts, num = ngram_propose(*pack(rows, pad_to=rng.randint(0, 40)), k=k, min_n=min_n, max_n=max_n)
    for b, row in enumerate(rows):
        expect = brute_force(row, k, min_n, max_n)
        assert num[b].item() == len(expect)
        assert drafts[b, : len(expect)].tolist() == expect
        assert (drafts[b, len(expect) :] == -1).all()


def test_invalid_bounds():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        ngram_propose(*pack([[1, 2]]), k=2, min_n=3, max_n=2)
