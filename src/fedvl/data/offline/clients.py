"""The five client styles of digits-offline, their seeds and independent random streams."""

from __future__ import annotations

import operator

import numpy as np

CLIENT_NAMES: tuple[str, ...] = (
    "handwritten",
    "handwritten-color",
    "printed-clutter",
    "printed-clean",
    "handwritten-thick",
)
HANDWRITTEN_CLIENTS: tuple[str, ...] = ("handwritten", "handwritten-color", "handwritten-thick")

# Independent RNG streams per client, so asking for a subset of clients (or a different
# test size) never changes the images of the other clients / the train set.
_CLIENT_OFFSET = {name: 101 * (i + 1) for i, name in enumerate(CLIENT_NAMES)}
STREAM_SPLIT, STREAM_PICK_TRAIN, STREAM_PICK_TEST = 0, 1, 2
STREAM_RENDER_TRAIN, STREAM_RENDER_TEST = 3, 4


def check_seed(seed: int) -> int:
    """The seed as an int, refusing negative or non-integer values."""
    seed = operator.index(seed)
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    return seed


def client_rng(seed: int, client: str, stream: int) -> np.random.Generator:
    """The random stream number `stream` of one client."""
    return np.random.default_rng([seed, _CLIENT_OFFSET[client], stream])


def check_sizes(train_per_client: int, test_per_client: int) -> tuple[int, int]:
    """The per-client image counts as ints, refusing an empty training set or a negative count."""
    train_per_client = operator.index(train_per_client)
    test_per_client = operator.index(test_per_client)
    if train_per_client < 1 or test_per_client < 0:
        raise ValueError(
            "train_per_client must be >= 1 and test_per_client >= 0, got "
            f"{train_per_client} and {test_per_client}"
        )
    return train_per_client, test_per_client
