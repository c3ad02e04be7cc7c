"""Office-Caltech-10 (DESA's OFFICE feature-shift benchmark): one client per domain, read from
`<data-dir>/office_caltech10/<domain>.npz` (arrays x, y, class_names).

The files hold every image of a domain with no train/test split, so one is drawn here: per
domain and class, `TEST_SHARE` of the images are held out for testing, from a fixed seed (not
the run seed), so every run and every seed meets the same test images, as with an official
split. `--partitions K` splits each domain's training labels over K clients as `npz-domains`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from fedvl.data.domains import SPEC, Split, federate_domains
from fedvl.data.federated import FederatedDataset
from fedvl.data.sources import (
    DataError,
    DataOptions,
    check_images,
    check_labels,
    load_npz,
    require_data_dir,
    shown_path,
)
from fedvl.data.spec import declare_benchmark
from fedvl.data.transforms import stratified_subset

DOMAINS = ("amazon", "caltech", "dslr", "webcam")
CLASS_NAMES = ("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer",
               "monitor", "mouse", "mug", "projector")
# Neither DESA's paper nor the data README states the share: FedBN's stratified split of its
# domains (`utils/data_preprocess.py`, StratifiedShuffleSplit test_size=0.2, random_state=0).
TEST_SHARE = 0.2
SPLIT_SEED = 0
# The files' native side; DESA's paper states no image size for OFFICE.
DEFAULT_SIZE = 64


def held_out(y: np.ndarray, domain: str) -> np.ndarray:
    """Sorted test indices of a domain: ceil(TEST_SHARE * N) images, stratified by class."""
    # Seeded by the domain's place in DOMAINS, so choosing `--domains` leaves each split as is.
    rng = np.random.default_rng([SPLIT_SEED, DOMAINS.index(domain)])
    return stratified_subset(y, math.ceil(TEST_SHARE * len(y)), rng)


def _domain(root: Path, domain: str) -> Split:
    """(x_train, y_train, x_test, y_test) of one domain file, checked and split."""
    path = root / f"{domain}.npz"
    arr = load_npz(path, ("x", "y", "class_names"))
    x = check_images(arr["x"], path, "x")
    y = check_labels(arr["y"], path, "y", len(CLASS_NAMES), x, "x")
    names = tuple(str(c) for c in np.asarray(arr["class_names"]).ravel())
    if names != CLASS_NAMES:
        # Another label order would silently swap classes between the domains.
        raise DataError(f"data file {shown_path(path)} names classes {list(names)}; expected "
                        f"{list(CLASS_NAMES)} in this order")
    test = held_out(y, domain)
    train = np.setdiff1d(np.arange(len(y)), test)
    return x[train], y[train], x[test], y[test]


def count_clients(opts: DataOptions) -> int:
    """The clients a run will have, without reading data: domains chosen x `--partitions`."""
    # A Flower simulation starts one node per client before any file is read.
    return sum(not opts.domains or d in opts.domains for d in DOMAINS) * opts.partitions_or(1)


@declare_benchmark("office-caltech10", replace(SPEC, count_clients=count_clients))
def office_caltech10(opts: DataOptions) -> FederatedDataset:
    """Office-Caltech-10: amazon, caltech, dslr, webcam (or the `--domains` named), one client
    each (`--partitions K`: K each), 80/20 stratified train/test per domain."""
    root = require_data_dir(opts, "office-caltech10") / "office_caltech10"
    wanted = list(DOMAINS)
    if opts.domains:
        bad = [d for d in opts.domains if d not in DOMAINS]
        if bad:
            raise DataError(f"unknown office-caltech10 domain(s) {bad}; allowed: "
                            + ", ".join(DOMAINS))
        wanted = [d for d in DOMAINS if d in opts.domains]
    domains = {d: _domain(root, d) for d in wanted}
    info: dict[str, object] = {"class_names": list(CLASS_NAMES), "test_share": TEST_SHARE,
                               "split_seed": SPLIT_SEED}
    return federate_domains("office-caltech10", domains, len(CLASS_NAMES), opts,
                            opts.image_size or DEFAULT_SIZE, 3, info)
