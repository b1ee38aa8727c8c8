"""make_loader's thread workers (``ThreadedBatches``): the same batches as the training loop
reading them itself, a resumable position, CachedDataset safe under concurrent reads, and the
choice between threads and processes."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Subset

import precache
from precache.loading import CachedDataset, decode_images, make_loader
from precache.loading.loaders import threaded
from tests.helpers import build_cache, write_photos


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """JPEG crops (decoded by the dataset), keys (str) and sizes (scalars), 4 rows a shard."""
    root = tmp_path_factory.mktemp("threaded")
    write_photos(root / "photos", 40)
    build_cache(root / "photos", root / "cache", pipeline="images",
                params={"size": 16, "image_codec": "jpeg"}, workers=1, shard_rows=4)
    return root / "cache"


COLUMNS = ["key", "image", "orig_width"]


def epoch(loader, number: int,
          tensors: tuple[str, ...] | list[str] = ("image", "orig_width")) -> list[dict]:
    loader.set_epoch(number)
    return [{"key": list(b["key"]), **{name: b[name].clone() for name in tensors}}
            for b in loader]


def test_threads_hand_out_the_batches_the_loop_would_read_itself_and_resume_exactly(cache):
    dataset = CachedDataset(cache, columns=COLUMNS)
    itself = epoch(make_loader(dataset, 4, num_workers=0, seed=2), 1)
    threaded = make_loader(dataset, 4, num_workers=3, seed=2)
    assert threaded.worker_kind == "threads" and "3 worker threads" in threaded.describe()
    got = epoch(threaded, 1)
    assert [b["key"] for b in got] == [b["key"] for b in itself]
    for a, b in zip(got, itself):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["orig_width"],
                                                                   b["orig_width"])
    assert a["image"].shape[1:] == (16, 16, 3) and a["image"].dtype == torch.uint8

    threaded.set_epoch(2)
    batches = iter(threaded)  # threads read ahead of what the loop has taken
    taken = [list(next(batches)["key"]) for _ in range(3)]
    state = threaded.state_dict()
    assert state["offset"] == 12
    resumed = make_loader(dataset, 4, num_workers=2, seed=2)
    resumed.load_state_dict(state)
    rest = epoch(resumed, 2)
    seen = [k for keys in taken for k in keys] + [k for b in rest for k in b["key"]]
    assert sorted(seen) == sorted(precache.Cache(cache).read_all(["key"])["key"])
    threaded.close()
    resumed.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_subset_is_read_with_the_loaders_hints_mapped_onto_the_cache(cache, monkeypatch,
                                                                       workers):
    """torch's Subset hands a plain list to the dataset, which dropped the batch's read-ahead,
    storage order and pinned arrays; the trainers train on a Subset of the cache's rows."""
    dataset = CachedDataset(cache, columns=COLUMNS)
    rows = list(range(1, len(dataset), 2))
    wanted = sorted(dataset.read_batch(rows)["key"])
    calls = []
    read = CachedDataset.read_batch

    def spy(self, indices, ahead=None, storage_order=False, **kwargs):
        calls.append((list(indices), ahead, storage_order))
        return read(self, indices, ahead, storage_order, **kwargs)

    monkeypatch.setattr(CachedDataset, "read_batch", spy)
    loader = make_loader(Subset(dataset, rows), 4, num_workers=workers, seed=2)
    got = epoch(loader, 1)
    assert sorted(k for b in got for k in b["key"]) == wanted
    assert len(calls) == len(rows) // 4 and all(order for _, _, order in calls)
    assert all(set(indices) <= set(rows) for indices, _, _ in calls)
    aheads = [ahead for _, ahead, _ in calls if ahead is not None]
    assert aheads and all(set(ahead) <= set(rows) for ahead in aheads)
    loader.close()


def test_without_workers_the_loop_reads_each_batch_when_it_asks_as_a_dataloader_would(cache):
    from torch.utils.data import DataLoader

    from precache.loading.loaders.cache_loader import collate_samples

    dataset = CachedDataset(cache, columns=COLUMNS)
    loader = make_loader(dataset, 4, num_workers=0, seed=3)
    assert loader.worker_kind == "none"
    readers = []
    read = dataset.__getitems__
    dataset.__getitems__ = lambda indices: readers.append(threading.current_thread()) or read(
        indices)
    loader.set_epoch(1)
    batches = iter(loader)
    first = next(batches)
    assert readers == [threading.main_thread()]  # one batch, read by the loop, nothing ahead
    got = [first, *batches]
    assert len(readers) == len(got) and set(readers) == {threading.main_thread()}

    del dataset.__getitems__
    loader.set_epoch(1)  # the same batches through torch's own single-process DataLoader
    torch_batches = list(DataLoader(dataset, batch_sampler=loader.batch_sampler,
                                    collate_fn=collate_samples))
    assert [list(b["key"]) for b in got] == [list(b["key"]) for b in torch_batches]
    for a, b in zip(got, torch_batches):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["orig_width"],
                                                                   b["orig_width"])


def test_a_script_that_exits_without_closing_its_loader_exits_quietly(cache):
    """A loop that breaks out of an epoch and ends the script leaves the threads reading; the
    exit must not print a traceback (ThreadPoolExecutor's shutdown fails once modules are gone)."""
    script = ("import sys; from precache.loading import CachedDataset, make_loader; "
              "loader = make_loader(CachedDataset(sys.argv[1]), 4, num_workers=2, "
              "worker_kind='threads'); next(iter(loader))")
    done = subprocess.run([sys.executable, "-c", script, str(cache)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_concurrent_batches_get_their_own_rows_while_shards_are_closed_and_reopened(cache):
    everything = precache.Cache(cache).read_all(COLUMNS)
    reference = CachedDataset(cache, columns=COLUMNS)
    images = reference.read_batch(list(range(len(reference))))["image"]  # decoded once
    dataset = CachedDataset(cache, columns=COLUMNS, max_open_shards=2)  # 10 shards: churn
    failures: list[BaseException] = []

    def read(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                rows = rng.choice(len(dataset), size=int(rng.integers(1, 12)), replace=False)
                batch = dataset.read_batch(rows.tolist())
                assert list(batch["key"]) == [everything["key"][i] for i in rows]
                np.testing.assert_array_equal(batch["orig_width"], everything["orig_width"][rows])
                np.testing.assert_array_equal(batch["image"], images[rows])
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    threads = [threading.Thread(target=read, args=(seed,)) for seed in range(6)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often, as when the GIL is let go in C
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures[0]


class Tagged:
    """A batch transform: adds the batch's sum of widths (checks it ran, once per batch)."""

    def __call__(self, batch: dict) -> dict:
        if batch["key"][0] == self.fail_on:
            raise RuntimeError(f"augmentation failed on the batch of {self.fail_on}")
        return {**batch, "tag": batch["orig_width"].sum()}

    fail_on = None


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_a_batch_transform_runs_on_every_batch_and_its_error_reaches_the_loop(cache, kind):
    dataset = CachedDataset(cache, columns=COLUMNS)
    transform = Tagged()
    loader = make_loader(dataset, 8, num_workers=2, seed=4, worker_kind=kind,
                         batch_transform=transform)
    assert loader.worker_kind == kind
    for batch in epoch_with_tags(loader, 0):
        assert int(batch["tag"]) == int(batch["orig_width"].sum())
    loader.close()
    if kind == "processes":  # torch's own hand-over of a worker's error (its shutdown then
        return               # waits 5 s a worker): not this module's to test
    order = epoch_with_tags(loader, 1)
    transform.fail_on = order[2]["key"][0]
    failing = make_loader(dataset, 8, num_workers=2, seed=4, worker_kind=kind,
                          batch_transform=transform)
    with pytest.raises(RuntimeError, match="augmentation failed"):
        epoch_with_tags(failing, 1)
    failing.close()
    transform.fail_on = None
    assert len(epoch_with_tags(failing, 2)) == 5  # the next epoch starts threads again


def epoch_with_tags(loader, number: int) -> list[dict]:
    loader.set_epoch(number)
    return [dict(batch) for batch in loader]


def test_auto_uses_processes_where_python_runs_per_sample(cache):
    plain = CachedDataset(cache, columns=COLUMNS)
    transformed = CachedDataset(cache, columns=COLUMNS, transform=lambda sample: sample)
    subset = torch.utils.data.Subset(plain, range(0, 40, 2))
    assert make_loader(subset, 4, num_workers=2).worker_kind == "threads"
    per_sample = make_loader(transformed, 4, num_workers=2)
    assert per_sample.worker_kind == "processes" and "transform" in per_sample.describe()
    collated = make_loader(plain, 4, num_workers=2, collate_fn=lambda samples: samples)
    assert collated.worker_kind == "processes" and "collate_fn" in collated.describe()
    assert make_loader(plain, 4, num_workers=2, worker_kind="processes").worker_kind == "processes"
    assert make_loader(plain, 4, num_workers=0).worker_kind == "none"
    forced = make_loader(transformed, 4, num_workers=2, worker_kind="threads")
    assert forced.worker_kind == "threads"
    assert len([k for b in epoch(forced, 0) for k in b["key"]]) == 40
    forced.close()
    with pytest.raises(ValueError, match="worker_kind"):
        make_loader(plain, 4, num_workers=2, worker_kind="fibres")


def test_encoded_crops_travel_as_bytes_and_decode_where_the_batch_is_used(cache):
    reference = CachedDataset(cache, columns=COLUMNS)
    images = reference.read_batch(list(range(len(reference))))["image"]
    encoded = CachedDataset(cache, columns=COLUMNS, decode_images=False)
    loader = make_loader(encoded, 8, num_workers=2, seed=6)
    loader.set_epoch(0)
    keys = reference.read_batch(list(range(len(reference))))["key"]
    for batch in loader:
        rows = [keys.index(k) for k in batch["key"]]
        assert all(isinstance(r, np.ndarray) and r.dtype == np.uint8 for r in batch["image"])
        assert not any(r.flags.owndata for r in batch["image"])  # views of the shards
        decoded = decode_images(batch["image"], "cpu")
        np.testing.assert_array_equal(decoded.numpy(), images[rows])
    loader.close()
    broken = [batch["image"][0], np.frombuffer(b"\xff\xd8 not a jpeg", np.uint8)]
    with pytest.raises(ValueError, match="row 1"):
        decode_images(broken, "cpu", where="batch 3")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nvJPEG)")
def test_crops_decoded_on_the_gpu_match_the_cpu(cache):
    dataset = CachedDataset(cache, columns=["image"], decode_images=False)
    rows = dataset.read_batch(list(range(len(dataset))))["image"]
    on_gpu = decode_images(rows, "cuda")
    assert on_gpu.device.type == "cuda" and on_gpu.shape[1:] == (16, 16, 3)
    difference = (on_gpu.cpu().int() - decode_images(rows, "cpu").int()).abs()
    assert difference.float().mean() < 1.0  # nvJPEG's IDCT may differ by a grey level


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nvJPEG)")
def test_cuda_decoding_does_not_wait_for_the_work_queued_on_the_current_stream(cache):
    """TorchCodec synchronises the stream it decodes on; on the training's stream that would
    hold the loop until the GPU had run every queued step. decode_images uses its own stream,
    which the current stream then waits for."""
    dataset = CachedDataset(cache, columns=["image"], decode_images=False)
    rows = dataset.read_batch(list(range(8)))["image"]
    decode_images(rows, "cuda")  # warm: the decoder's handles
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued on the current stream
    images = decode_images(rows, "cuda")
    assert not torch.cuda.current_stream().query()  # returned while the GPU still sleeps
    np.testing.assert_array_equal(images.cpu().numpy().shape, (8, 16, 16, 3))


def test_the_gpu_decoders_batch_keeps_row_order_with_webp_rows_among_jpeg_ones(cache):
    """decode_images' GPU path assembles nvJPEG's CHW images and the WebP rows it leaves to the
    CPU in row order; here a CPU decoder of the same API (libjpeg-turbo) stands in for nvJPEG."""
    import cv2

    from precache.cache.image_codec import decode_image
    from precache.loading.loaders.image_decode import _on_gpu

    dataset = CachedDataset(cache, columns=["image"], decode_images=False)
    rows = list(dataset.read_batch(list(range(6)))["image"])
    expected = decode_images(rows, "cpu").numpy()
    ok, webp = cv2.imencode(".webp", np.ascontiguousarray(expected[2][..., ::-1]),
                            [cv2.IMWRITE_WEBP_QUALITY, 101])  # lossless
    rows[2] = webp.reshape(-1)
    seen: list[int] = []

    def chw(tensors):
        seen.append(len(tensors))
        return [torch.from_numpy(decode_image(t.numpy())).permute(2, 0, 1) for t in tensors]

    out = _on_gpu(rows, torch.device("cpu"), "batch 0", chw)
    assert seen == [5]  # the JPEG rows in one call, the WebP row decoded apart
    np.testing.assert_array_equal(out.numpy(), expected)

    jpegs = list(dataset.read_batch(list(range(6)))["image"])  # the usual batch: all JPEG
    out = _on_gpu(jpegs, torch.device("cpu"), "batch 1", chw)
    assert seen[-1] == 6 and out.is_contiguous()  # NHWC, as the CPU path gives it
    np.testing.assert_array_equal(out.numpy(), expected)
    ok, larger = cv2.imencode(".jpg", np.zeros((24, 16, 3), np.uint8))
    with pytest.raises(ValueError, match="batch 2: the crops differ in size"):
        _on_gpu(jpegs[:3] + [larger.reshape(-1)], torch.device("cpu"), "batch 2", chw)


@pytest.fixture(scope="module")
def dtypes_cache(tmp_path_factory):
    """A fixed-shape column of every dtype a cache stores, two scalars, keys and JPEG crops."""
    root = tmp_path_factory.mktemp("dtypes")
    (root / "in").mkdir()
    for i in range(24):
        (root / "in" / f"{i:02d}.bin").write_bytes(bytes([i * 11]))
    build_cache(root / "in", root / "cache", pipeline=str(Path(__file__).with_name(
        "dtypes_pipeline.py")), workers=1, shard_rows=4)
    return root / "cache"


def fixed_columns(dataset: CachedDataset) -> list[str]:
    schema = dataset._cache.manifest.schema
    return [n for n in dataset.columns if schema[n].kind in ("ndarray", "scalar")]


class Allocations:
    """``pinned_empty`` keeping each array it makes, by its address; unpinned unless
    ``pin_memory`` (without CUDA, pinning fails)."""

    empty = staticmethod(threaded.pinned_empty)  # the real one (a test may replace it)

    def __init__(self, pin_memory: bool = False) -> None:
        self.arrays: dict[int, np.ndarray] = {}
        self.pin_memory = pin_memory
        self._lock = threading.Lock()

    def __call__(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        array = self.empty(shape, dtype, pin_memory=self.pin_memory)
        with self._lock:
            self.arrays[array.__array_interface__["data"][0]] = array
        return array


def test_pinned_empty_makes_tensor_backed_arrays_and_numpy_ones_for_dtypes_torch_lacks():
    floats = threaded.pinned_empty((2, 3), np.float32, pin_memory=False)
    assert floats.shape == (2, 3) and floats.dtype == np.float32
    assert isinstance(floats.base, torch.Tensor) and floats.base.data_ptr() == (
        floats.__array_interface__["data"][0])
    for dtype in ("datetime64[s]", ">f4", "U3"):  # no torch dtype: np.empty
        array = threaded.pinned_empty((2,), dtype, pin_memory=False)
        assert array.dtype == np.dtype(dtype) and not isinstance(array.base, torch.Tensor)


def test_read_batch_makes_every_fixed_shape_column_and_the_decoded_images_with_empty(
        dtypes_cache):
    dataset = CachedDataset(dtypes_cache)
    fixed = fixed_columns(dataset)
    assert len(fixed) == 17 and "image" in dataset.encoded_columns
    rows = [9, 2, 17, 3, 22]
    expected = dataset.read_batch(rows)
    for storage_order in (False, True):
        made = Allocations()
        batch = dataset.read_batch(rows, storage_order=storage_order, empty=made)
        assert len(made.arrays) == len(fixed) + 1  # every fixed column, the images, no more
        for name in [*fixed, "image"]:
            assert batch[name].__array_interface__["data"][0] in made.arrays, name
        order = [expected["key"].index(k) for k in batch["key"]]  # storage order: by shard
        assert (order != list(range(5))) == storage_order
        for name in [*fixed, "image"]:
            np.testing.assert_array_equal(batch[name], expected[name][order])
    # warm, variable-length columns only: the images of the complete row table's path
    images = CachedDataset(dtypes_cache, columns=["key", "image"])
    images.read_batch(list(range(len(images))))
    images.read_batch(rows)
    assert images._state.complete is not None and not images._state.policy.faulting
    made = Allocations()
    batch = images.read_batch(rows, empty=made)
    assert list(made.arrays) == [batch["image"].__array_interface__["data"][0]]
    np.testing.assert_array_equal(batch["image"], expected["image"])
    # columns held whole in memory (an older cache's path): gathered into empty's arrays too
    resident = CachedDataset(dtypes_cache, columns=["key", *fixed], resident=True)
    made = Allocations()
    batch = resident.read_batch([*rows[:4], -1], empty=made)
    assert len(made.arrays) == len(fixed)
    for name in fixed:
        assert batch[name].__array_interface__["data"][0] in made.arrays
        np.testing.assert_array_equal(batch[name], resident.read_batch([*rows[:4], 23])[name])


def loader_columns(cache) -> list[str]:
    """The columns a loader collates into tensors (torch has no datetime64 tensor)."""
    return [n for n in precache.Cache(cache).manifest.schema if n != "a_datetime64s"]


def test_threads_that_pin_gather_and_decode_into_the_pinned_arrays_and_copy_nothing_after(
        dtypes_cache, monkeypatch):
    """With no CUDA here, ``pinned_empty`` is stood in for by unpinned tensor-backed arrays and
    a tensor counts as pinned when its memory is one of them; ``pin_memory()`` records what it
    copies; ``make_loader`` is told CUDA is there (else it does not pin)."""
    dataset = CachedDataset(dtypes_cache, columns=loader_columns(dtypes_cache))
    fixed = fixed_columns(dataset)
    expected = epoch(make_loader(dataset, 4, num_workers=0, seed=5, pin_memory=False), 1,
                     [*fixed, "image"])
    made, copied = Allocations(), []
    monkeypatch.setattr(threaded, "pinned_empty", made)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.data_ptr() in made.arrays)
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self: copied.append(tuple(self.shape)) or self.clone())

    loader = make_loader(dataset, 4, num_workers=2, seed=5, pin_memory=True,
                         worker_kind="threads")
    loader.set_epoch(1)
    batches = list(loader)
    loader.close()
    pinnable = [n for n in fixed if dataset._cache.manifest.schema[n].dtype in
                {d.name for d in threaded._TORCH_DTYPES}]  # on torch < 2.3 not uint16-64
    assert len(batches) == 6 and len(made.arrays) == 6 * (len(fixed) + 1)
    assert len(copied) == 6 * (len(fixed) - len(pinnable))  # only what torch cannot pin
    for batch, reference in zip(batches, expected):
        assert list(batch["key"]) == reference["key"]
        for name in [*pinnable, "image"]:
            array = made.arrays.get(batch[name].data_ptr())
            assert array is not None, name  # the loop has the memory the dataset read into
            assert batch[name] is array.base  # the allocator's own tensor (no from_numpy)
        for name in [*fixed, "image"]:
            assert torch.equal(batch[name], reference[name]), name

    made.arrays.clear()
    copied.clear()  # the loop's own thread and worker processes pin after reading, as before
    itself = make_loader(dataset, 4, num_workers=0, seed=5, pin_memory=True)
    itself.set_epoch(1)
    assert len(list(itself)) == 6 and not made.arrays and len(copied) == 6 * (len(fixed) + 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machines without CUDA")
@pytest.mark.parametrize("kind", ["threads", "processes", "none"])
def test_pin_memory_without_cuda_warns_and_reads_unpinned_batches_with_every_worker_kind(
        cache, kind):
    """``tensor.pin_memory()`` raises without CUDA: every worker kind warns once, as
    ``DataLoader`` does for processes, and hands out the same batches unpinned."""
    expected = epoch(make_loader(CachedDataset(cache), 8, num_workers=0, seed=3), 0)
    with pytest.warns(UserWarning, match="CUDA is not available"):
        loader = make_loader(CachedDataset(cache), 8, num_workers=0 if kind == "none" else 1,
                             seed=3, pin_memory=True, worker_kind="auto" if kind == "none"
                             else kind)
    got = epoch(loader, 0)
    loader.close()
    assert [b["key"] for b in got] == [b["key"] for b in expected]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
def test_cuda_threads_that_pin_hand_out_batches_read_straight_into_pinned_memory(
        dtypes_cache, monkeypatch):
    from precache.loading import DevicePrefetcher

    dataset = CachedDataset(dtypes_cache, columns=loader_columns(dtypes_cache))
    fixed = fixed_columns(dataset)
    expected = epoch(make_loader(dataset, 4, num_workers=0, seed=7, pin_memory=False), 1,
                     [*fixed, "image"])
    pinnable = [n for n in fixed if dataset._cache.manifest.schema[n].dtype in
                {d.name for d in threaded._TORCH_DTYPES}]
    made, copied = Allocations(pin_memory=True), []
    pin = torch.Tensor.pin_memory
    monkeypatch.setattr(threaded, "pinned_empty", made)
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self, *args: copied.append(tuple(self.shape)) or pin(self, *args))
    loader = make_loader(dataset, 4, num_workers=2, seed=7, pin_memory=True,
                         worker_kind="threads")
    loader.set_epoch(1)
    batches = list(loader)
    loader.close()
    assert len(batches) == 6 and len(copied) == 6 * (len(fixed) - len(pinnable))
    for batch, reference in zip(batches, expected):
        for name in [*pinnable, "image"]:
            assert batch[name].is_pinned(), name
            assert batch[name] is made.arrays[batch[name].data_ptr()].base, name  # not copied
        for name in [*fixed, "image"]:
            assert batch[name].is_pinned() and torch.equal(batch[name], reference[name]), name

    # the real allocator, buffers freed as the loop drops batches: every copy to the GPU
    # (non-blocking, on a side stream) still gets its own batch's values
    monkeypatch.setattr(threaded, "pinned_empty", Allocations.empty)
    loader = make_loader(dataset, 4, num_workers=2, seed=7, pin_memory=True,
                         worker_kind="threads")
    for _ in range(3):
        loader.set_epoch(1)
        on_gpu = [{name: batch[name].clone() for name in ["image", *pinnable]}
                  for batch in DevicePrefetcher(loader, "cuda")]
        torch.cuda.synchronize()
        for batch, reference in zip(on_gpu, expected):
            for name, values in batch.items():
                assert values.is_cuda and torch.equal(values.cpu(), reference[name]), name
    loader.close()
