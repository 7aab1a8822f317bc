"""Synthetic token sequences of different lengths, padded: the data of a token-level loss.

Each sequence comes from one of ``topics`` first-order Markov chains over a vocabulary of V
tokens (each chain's start and transition rows drawn from a Dirichlet of ``concentration``: small
values make peaked rows, so the chain is predictable once its topic is known). Its length is drawn
uniformly from ``min_length`` to V. A sequence is stored as a 1 x V x V image, row t the one-hot
code of token t and all-zero rows after the sequence ends (padding), so every model and the
probe see an image as on the other data choices. A sequence's label is its topic (which chain
wrote it: a classification objective can learn it); the next-token targets are read from the
image itself (``next_token_targets``). Predicting a token is hard at the start of a sequence (the
topic is unknown) and easier later, so short sequences hold more hard tokens per token.

The chains and both sets are fixed (not the run's seed): every run sees the same task.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gradrepro.data.base import DataBase, ImageData

IGNORE = -100  # torch.nn.functional.cross_entropy's default ignore_index


@dataclass
class TokenSequencesConfig(DataBase):
    name: str = "token_sequences"
    n_train: int = 4000
    n_test: int = 1000
    batch_size: int = 16
    channels: int = 1
    image_size: int = 16  # V: the vocabulary and the longest sequence (one-hot rows of a V x V image)
    # The outputs a model needs: the vocabulary (next-token targets), so it must equal image_size;
    # the topic labels use the first ``topics`` of them.
    num_classes: int = 16
    topics: int = 4
    min_length: int = 2
    concentration: float = 0.1


def markov_sequences(n: int, vocab: int, topics: int, min_length: int, concentration: float,
                     process_seed: int, sample_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences as (one-hot images N x 1 x V x V, topics N)."""
    process = np.random.default_rng(process_seed)
    start = process.dirichlet(np.full(vocab, concentration), size=topics)  # topics x V
    moves = process.dirichlet(np.full(vocab, concentration), size=(topics, vocab))  # topics x V x V
    rng = np.random.default_rng(sample_seed)
    topic = rng.integers(topics, size=n)
    lengths = rng.integers(min_length, vocab + 1, size=n)

    def draw(rows: np.ndarray) -> np.ndarray:  # one token per row of probabilities
        return (rng.random((len(rows), 1)) > rows.cumsum(1)).sum(1).clip(max=vocab - 1)

    tokens = np.zeros((n, vocab), dtype=np.int64)
    tokens[:, 0] = draw(start[topic])
    for t in range(1, vocab):
        tokens[:, t] = draw(moves[topic, tokens[:, t - 1]])
    real = np.arange(vocab)[None, :] < lengths[:, None]
    x = np.eye(vocab, dtype=np.float32)[tokens] * real[..., None]
    return torch.from_numpy(x)[:, None], torch.from_numpy(topic)


def next_token_targets(x: torch.Tensor) -> torch.Tensor:
    """The next-token target of each row of one-hot token images (N x 1 x L x V): the token of
    row t+1 at row t, ``IGNORE`` where row t+1 is padding (all zero) and at the last row. Raises
    ValueError for images whose rows are not one-hot or zero."""
    rows = x[:, 0] if x.dim() == 4 and x.shape[1] == 1 else None
    if rows is None or not bool(((rows == 0) | (rows == 1)).all()) or bool((rows.sum(-1) > 1).any()):
        raise ValueError("objective=next_token reads images whose rows are one-hot tokens or zero padding "
                         f"(data=token_sequences); got images of shape {tuple(x.shape[1:])} that are not")
    tokens, real = rows.argmax(-1), rows.sum(-1) > 0  # NxL
    targets = torch.full_like(tokens, IGNORE)
    targets[:, :-1] = torch.where(real[:, 1:], tokens[:, 1:], IGNORE)
    return targets


class TokenSequences(ImageData):
    def __init__(self, cfg: TokenSequencesConfig, seed: int) -> None:
        if cfg.num_classes != cfg.image_size:
            raise ValueError(f"data=token_sequences predicts tokens: data.num_classes ({cfg.num_classes}) must "
                             f"equal the vocabulary, data.image_size ({cfg.image_size})")
        if not 2 <= cfg.min_length <= cfg.image_size:
            raise ValueError(f"data.min_length={cfg.min_length} must be 2 to data.image_size ({cfg.image_size}): "
                             "a sequence needs a token to predict")
        args = (cfg.image_size, cfg.topics, cfg.min_length, cfg.concentration, 0)
        x_train, y_train = markov_sequences(cfg.n_train, *args, sample_seed=1)
        x_test, y_test = markov_sequences(cfg.n_test, *args, sample_seed=2)
        super().__init__(x_train, y_train, x_test, y_test, cfg.batch_size, cfg.views)
