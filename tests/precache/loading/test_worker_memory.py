"""Workers do not copy the dataset: what a DataLoader worker's private memory grows by over an
epoch stays flat as the cache grows 20x, while a dataset that keeps one Python dict per row (the
common hand-written kind) makes every worker copy those pages as it touches them.

The worker measures itself, in its collate function, right after each batch: the numbers belong to
known points of the epoch, whatever the main process was doing. Samples come in index order, so
the copies of per-row objects build up over the epoch (shuffled, the first batches would already
touch nearly every page); both caches are read in the same number of batches, so what a batch
costs is the same for both, and the growth is counted from the end of the first batches (which
open the shards and set up the transfer to the main process: once per worker).

What the number must not pick up, since it depends on timing and not on the dataset:
``Private_Dirty`` counts the pages this process alone maps, so when the *main* process writes a
page it shares with the worker, the worker's old copy becomes "private" although the worker copied
nothing (one full collection of the main process's cyclic GC, which writes to every container it
holds, adds 35 MB to the worker's number); the main process therefore runs the epoch with its GC
off (the worker's GC runs as usual). Transparent huge pages (a machine with THP "always", or
khugepaged collapsing a region at some moment) would turn one touched byte into 2 MB, and glibc
handing freed memory back to the kernel mid-epoch would make the reading at batch ``WARM`` low:
the measuring process turns THP off for itself and its worker and fixes malloc's trim and mmap
thresholds.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import Dataset

from precache.loading import CachedDataset, make_loader
from precache.loading.datasets.batches import collate_samples
from tests.helpers import build_cache

PIPELINE = str(Path(__file__).with_name("synthetic_pipeline.py"))


def private_mb(pid: int) -> float:
    """Memory this process wrote and shares with nobody (copy-on-write copies, its heap), from
    smaps_rollup: ``Private_Dirty``. Not ``Private_Clean``: that counts the pages of the
    memory-mapped shards this process alone has touched, which the page cache holds once for
    every process, and which grow with how much of the cache one worker has read."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text()
                  .splitlines()[1:])
    return int(fields["Private_Dirty"].split()[0]) / 1024


def build(root: Path, rows: int) -> Path:
    inputs = root / f"in{rows}"
    inputs.mkdir()
    for i in range(rows):
        (inputs / f"{i:06d}.bin").write_bytes(bytes([i % 256]))
    build_cache(inputs, root / f"cache{rows}", pipeline=PIPELINE, workers=2)  # 2: half the time
    return root / f"cache{rows}"


class RowDicts(Dataset):
    """The hand-written kind: a Python dict per row, built in the main process."""

    def __init__(self, rows: int) -> None:
        self.rows = [{"key": f"{i:06d}.bin", "label": i % 7, "path": f"/data/{i:06d}.bin"}
                     for i in range(rows)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"label": self.rows[i]["label"]}


BATCHES, WARM = 50, 4  # batches per epoch; growth counts from the end of batch WARM
ROWS = 20_000


def collate_measured(samples):
    """The batch, and this worker's private MB right after making it."""
    gc.enable()  # the worker's GC runs as in any worker (the main process turned its own off)
    return collate_samples(samples), private_mb(os.getpid())


def worker_growth(dataset) -> float:
    """Private MB the single worker gained from the end of batch ``WARM`` to the epoch's end."""
    loader = make_loader(dataset, -(-len(dataset) // BATCHES), shuffle=False, num_workers=1,
                         multiprocessing_context="fork", collate_fn=collate_measured)
    loader.set_epoch(0)
    gc.collect()
    gc.disable()  # no collection in this process may write the pages it shares with the worker
    try:
        measured = [mb for _, mb in loader]
    finally:
        gc.enable()
    assert len(measured) == BATCHES
    return measured[-1] - measured[WARM - 1]


class ShardsOpenedFirst(CachedDataset):
    """A ``CachedDataset`` whose worker opens (maps) every shard with its first batch. A worker
    keeps a few kB of bookkeeping per open shard (bounded by ``max_open_shards``), which an
    in-order epoch would otherwise add batch by batch; what is measured here is per row."""

    def __getitems__(self, indices):
        if getattr(self, "_all_opened_by", None) != os.getpid():  # once in each process (the
            self._all_opened_by = os.getpid()  # parent's open reader must not stop the worker)
            for shard in range(len(self._cache.manifest.shards)):
                self._state.readers.get(shard).mapped()
        return super().__getitems__(indices)


def measure(small: str, large: str) -> dict[str, float]:
    """Run in a fresh process: a big parent (pytest's) would add its own copy-on-write noise."""
    def least(make) -> float:  # noise (a heap step of MBs) only adds: take the least of two
        return min(worker_growth(make()) for _ in range(2))

    return {"small": least(lambda: ShardsOpenedFirst(small, columns=["image"])),
            "large": least(lambda: ShardsOpenedFirst(large, columns=["image"])),
            "dicts": least(lambda: RowDicts(ROWS))}


@pytest.mark.slow
def test_worker_memory_stays_flat_as_the_cache_grows(tmp_path):
    small, large = build(tmp_path, ROWS // 20), build(tmp_path, ROWS)
    repo = Path(__file__).resolve().parents[3]
    # malloc keeps what it frees (no trim, a fixed mmap threshold): its high-water mark is read
    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_=str(1 << 30), MALLOC_MMAP_THRESHOLD_=str(1 << 20),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "tests.precache.loading.test_worker_memory",
                           str(small), str(large)], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    grown = json.loads(done.stdout.splitlines()[-1])
    print(f"worker private MB grown over one epoch: CachedDataset {ROWS // 20} rows "
          f"{grown['small']:.2f}, {ROWS} rows {grown['large']:.2f}; a dict per row, {ROWS} rows "
          f"{grown['dicts']:.2f}")
    # The measure sees copy-on-write copies: touching a dict dirties its page, so the worker
    # copies at least the dict objects it touched after batch WARM.
    touched_dicts_mb = ROWS * (BATCHES - WARM) / BATCHES * sys.getsizeof({}) / 2**20
    assert grown["dicts"] > touched_dicts_mb / 2
    # A CachedDataset has no per-row objects to copy: 20x the rows adds far below what even one
    # small object per row would (one 2-tuple per row adds about half the dicts' growth), and
    # its growth stays a small part of the dicts'. (Reading mapped shards, a worker's heap
    # still grows a few hundred kB with 20x larger batches; the old decoded path, which
    # allocated everything before the measured batches, met /10 and /4.)
    assert grown["large"] - grown["small"] < grown["dicts"] / 4
    assert grown["large"] < grown["dicts"] / 2


def without_huge_pages() -> None:
    """Turn transparent huge pages off for this process and the workers it forks (prctl
    PR_SET_THP_DISABLE), whatever the machine's setting: memory is then counted in 4 kB pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(41, 1, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())


if __name__ == "__main__":
    without_huge_pages()
    print(json.dumps(measure(sys.argv[1], sys.argv[2])))
