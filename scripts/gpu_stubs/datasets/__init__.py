"""A working stand-in for Hugging Face `datasets` in the GPU check's kit: not a stub, the titan jobs read
their text through it. The real package needs pyarrow and pandas (~250 MiB), more than the kit can carry.

Pulled in by torchtitan/hf_datasets/text_datasets.py:14-15 (`from datasets import Dataset, load_dataset`,
`from datasets.distributed import split_dataset_by_node`), which launchers/titan.py:315 imports and whose
HuggingFaceTextDataLoader the generated job config uses (dataset "c4_test": `load_dataset(path,
split="train")` on the local folder of JSON lines launchers/titan_assets.py writes).

What it does is what datasets 4.7 does on that path, for a map-style dataset of a local JSON-lines folder:
load_dataset reads the rows in file order; Dataset.skip(n) = select(range(n, len)); Dataset.shuffle(seed)
= select(np.random.default_rng(seed).permutation(len)) (arrow_dataset.py); split_dataset_by_node(ds, rank,
world) = ds.shard(world, rank, contiguous=True), the same contiguous blocks. So the batches (token ids)
and losses are the real package's (tests/test_gpu_kit.py compares a job's losses with .venv's). Anything
else (streaming, a hub name, another format) raises StubUsed naming it. USES counts what was used.
"""
from __future__ import annotations

import glob
import json
import os
from collections import Counter

from _gpu_stub import StubUsed

USES: Counter = Counter()


def _refuse(what: str):
    raise StubUsed(f"datasets.{what}: the GPU check's kit carries a stand-in of datasets (scripts/gpu_stubs/"
                   "datasets) that loads a local folder of JSON lines only", name="datasets")


class Dataset:
    """A map-style dataset of rows (dicts)."""

    def __init__(self, rows: list[dict]):
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self):
        USES["Dataset.__iter__"] += 1
        return iter(self._rows)

    def __getitem__(self, i):
        return self._rows[i]

    def select(self, indices) -> "Dataset":
        return Dataset([self._rows[int(i)] for i in indices])

    def skip(self, n: int) -> "Dataset":
        USES["Dataset.skip"] += 1
        return self.select(range(n, len(self)))

    def shuffle(self, seed=None, generator=None, **kwargs) -> "Dataset":
        USES["Dataset.shuffle"] += 1
        import numpy as np

        if generator is None:
            if seed is None:
                _refuse("Dataset.shuffle without a seed")
            generator = np.random.default_rng(seed)
        return self.select(generator.permutation(len(self)))

    def shard(self, num_shards: int, index: int, contiguous: bool = True, **kwargs) -> "Dataset":
        USES["Dataset.shard"] += 1
        if not contiguous:
            return self.select(range(index, len(self), num_shards))
        div, mod = divmod(len(self), num_shards)
        start = div * index + min(index, mod)
        return self.select(range(start, start + div + (1 if index < mod else 0)))


class IterableDataset:  # isinstance checks only: load_dataset never makes one here
    def __init__(self, *args, **kwargs):
        _refuse("IterableDataset")


def load_dataset(path: str, name=None, split=None, streaming: bool = False, **kwargs) -> Dataset:
    USES["load_dataset"] += 1
    if streaming or not os.path.isdir(path) or split not in (None, "train"):
        _refuse(f"load_dataset({path!r}, name={name!r}, split={split!r}, streaming={streaming})")
    files = sorted(glob.glob(os.path.join(path, "*.jsonl")) + glob.glob(os.path.join(path, "*.json")))
    if not files:
        _refuse(f"load_dataset({path!r}): no .jsonl / .json file there")
    rows = []
    for f in files:
        with open(f) as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return Dataset(rows)


def __getattr__(attr: str):
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    _refuse(attr)
