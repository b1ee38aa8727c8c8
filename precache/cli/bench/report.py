"""``format_report``: the result of ``bench_loader`` as the text ``precache bench`` prints."""

from __future__ import annotations

from typing import Any

from precache.cli.bench.measure import CACHED_CUT

__all__ = ["format_report"]


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _ratio(x: float | None, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{suffix}"


def _mb(kbs: list[int]) -> str:
    return ", ".join(f"{k / 1024:,.0f}" for k in kbs)


def _epochs(entry: dict[str, Any]) -> str:
    """Epoch count, with ``*`` when some were cut before their end."""
    return f"{len(entry['epoch_rates'])}{'*' if entry.get('cut_epochs') else ''}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = [[c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
             for cells in [headers, ["-" * w for w in widths], *rows]]
    return "\n".join("  ".join(cells).rstrip() for cells in lines)


def format_report(result: dict[str, Any]) -> str:
    """The human-readable report of a ``bench_loader`` result."""
    r = result
    limit, per_file = r["limit"], r["per_file"]
    out = [f"precache bench {r['cache']}: {r['rows']:,} rows in {r['shards']} {r['format']} "
           f"shards; columns {', '.join(r['columns'])}",
           f"batch {r['batch_size']}, shuffle, default collate, persistent workers; epoch 1, then "
           f"{r['seconds']:g} s of epochs per setting; {r['cores']} cores; torch {r['torch']}; "
           "one thread per library per process", _size_line(r), ""]
    if limit:
        out.append(f"limit (a NumPy gather from memory-mapped .npy, {r['bytes_per_sample']:,} "
                   "B/sample): "
                   f"{_rate(limit['samples_per_s'])} samples/s warm "
                   f"({limit['mb_per_s']:,.0f} MB/s; "
                   f"runs {' / '.join(_rate(x) for x in limit['runs'])}, faster kept), "
                   f"{_rate(limit['cold_samples_per_s'])} samples/s in its cold epoch 1")
        out += _limit_reads(r["limit_reads"])
    if per_file["skipped"]:
        out.append(f"per-file loader: skipped ({per_file['skipped']})")
    else:
        kind = (f"JPEG q={per_file['quality']}" if per_file["format"] == "jpeg"
                else "PNG (lossless)")
        out.append(f"per-file loader: one {kind} file per row, cv2.imread + cvtColor -> tensor "
                   f"(images only; files written in {r['export_s']:.1f} s, untimed)")
    files = {p["workers"]: p for p in per_file["results"]}
    rows = []
    for c in r["cached"]:
        p = files.get(c["workers"], {})
        rows.append([str(c["workers"]), c.get("worker_kind", "-"), _rate(c["epoch1"]),
                     _ratio(c["epoch1_fraction_of_limit"]),
                     _rate(c["epoch2"]), _epochs(c), _ratio(c["fraction_of_limit"]),
                     _rate(p.get("epoch1")), _rate(p.get("epoch2")),
                     _epochs(p) if p else "-", _ratio(c["vs_per_file"], "x")])
    out += ["", "samples/s (ep1: epoch 1 with the files out of the page cache (cold), worker "
            "start included; ep2+: epochs 2..n together (warm); *: epochs cut, cached after "
            f"{CACHED_CUT * r['seconds']:g} s, per-file after {r['seconds']:g} s)", "",
            _table(["workers", "as", "cached ep1", "of cold limit", "ep2+", "epochs", "of limit",
                    "per-file ep1", "ep2+", "epochs", "cached/per-file"], rows)]
    rec = r["recommendation"]
    out += ["", f"batch sizes at workers={rec['num_workers']} "
            f"({rec.get('worker_kind', 'processes')}; samples/s)", "",
            _table(["batch", "ep1", "ep2+", "epochs"],
                   [[str(b["batch_size"]), _rate(b["epoch1"]), _rate(b["epoch2"]),
                     _epochs(b)] for b in r["batch_sizes"]])]
    rss = r["worker_rss"]
    if rss:
        out += ["", f"worker RSS, workers={rss['workers']} (VmRSS MB per worker; RssAnon, not "
                "shared with files, in brackets):",
                f"  after epoch 1: {_mb(rss['after_epoch1_kb'])} "
                f"[{_mb(rss['anon_after_epoch1_kb'])}]; after epoch 2: "
                f"{_mb(rss['after_epoch2_kb'])}; after epoch {rss['epochs']} (last): "
                f"{_mb(rss['after_last_epoch_kb'])} [{_mb(rss['anon_after_last_epoch_kb'])}]",
                f"worker USS / PSS (MB per worker): after epoch 1 {_mb(rss['uss_after_epoch1_kb'])}"
                f" / {_mb(rss['pss_after_epoch1_kb'])}; after the last "
                f"{_mb(rss['uss_after_last_epoch_kb'])} / {_mb(rss['pss_after_last_epoch_kb'])}; "
                f"workers' total USS {_share(sum(rss['uss_after_last_epoch_kb']), r)} of the "
                "decoded size (a mapped page only one worker touched counts in its USS, though "
                "the page cache holds it once for all)"]
    best = max(r["batch_sizes"], key=lambda b: b["epoch2"])
    kind = rec.get("worker_kind", "processes")
    out += ["", f"recommended: num_workers={rec['num_workers']}"
            + (f", worker_kind={kind!r}" if rec["num_workers"] else "")
            + " (most samples/s in epochs 2+), "
            f"batch_size={rec['batch_size']} ({_rate(best['epoch2'])} samples/s, the most of "
            f"{', '.join(str(b['batch_size']) for b in r['batch_sizes'])}); differences of a few "
            "percent are noise", "",
            "notes:", "- worker processes copy every batch through shared memory; worker "
            "threads (make_loader's default for a CachedDataset without a per-sample transform) "
            "hand it over as is. Processes pay off when a transform does Python work per sample"]
    if r["ram_bytes"] and r["decoded_bytes"] > r["ram_bytes"]:
        out.append("- the cache is larger than RAM: every epoch reads from disk, so expect the "
                   "cold (ep1) rates, not the warm ones, in training")
    out += [f"- {n}" for n in r["notes"]]
    return "\n".join(out)


def _limit_reads(reads: dict[str, str]) -> list[str]:
    """How the limit reads each column (``bench_loader``'s ``limit_reads``), a line per way."""
    how: dict[str, list[str]] = {"take": [], "slice": [], "decode": []}
    for column, read in reads.items():
        if read == "take":
            how["take"].append(column)
        elif read in ("bytes", "str") or read.startswith("ragged"):
            how["slice"].append(f"{column} ({read})")
        else:  # an image codec
            how["decode"].append(f"{column} ({read})")
    lines = {"take": "np.take into preallocated batches",
             "slice": "one slice values[offsets[i]:offsets[i+1]] per row of a flat values .npy "
                      "and an int64 offsets .npy (str decoded as UTF-8, bytes as bytes)",
             "decode": "decoded per row (precache's decode_image) into one preallocated uint8 "
                       "array"}
    return [f"  {lines[k]}: {', '.join(columns)}" for k, columns in how.items() if columns]


def _size_line(r: dict[str, Any]) -> str:
    """The cache's size against this machine's RAM."""
    ram = r["ram_bytes"]
    against = ("RAM unknown" if not ram else
               f"{r['decoded_bytes'] / ram:.2f}x RAM ({ram / 2**30:.1f} GiB)")
    fits = "" if not ram else ("; fits in RAM" if r["decoded_bytes"] <= ram else
                               "; larger than RAM")
    return (f"cache {r['cache_bytes'] / 1e9:.2f} GB on disk, {r['decoded_bytes'] / 1e9:.2f} GB of "
            f"the columns asked for (variable-length ones as stored) = {against}{fits}")


def _share(kb: int, r: dict[str, Any]) -> str:
    decoded = r["decoded_bytes"]
    return "-" if not decoded else f"{kb * 1024 / decoded:.1%}"
