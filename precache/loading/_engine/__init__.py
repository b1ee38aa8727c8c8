"""Stage 2's engine room, private to ``precache.loading``: what every read path of a
``CachedDataset`` shares and users never import (``tests/test_layering.py`` checks that nothing
outside ``precache/loading`` does).

- ``read_state``: what every read path of a dataset shares (the index arrays, the open
  shards, the lock and its pid guard, the page policy, the requested columns);
- ``read_batch``: which read path serves a batch, and its ``target`` column;
- ``row_selection``: the rows a dataset holds (``where=``, ``select``, ``split``), its targets;
- ``gather_fixed``: a warm batch with fixed-shape columns, one ``FixedRows`` gather a column
  (its variable-length columns, if any, from the ``RowTable``, one slice a row);
- ``gather_rows``: variable-length columns row by row (``RowTable``, or each shard's row reader);
- ``gather_shards``: the general path, a batch read shard by shard, and read-ahead;
- ``resident``: the columns of older caches held whole in memory;
- ``encoded_images``: JPEG/WebP rows decoded into one batch array (or handed out as bytes);
- ``open_shards``: the shard readers a process keeps open, within its open-file budget;
- ``row_table``, ``fixed_rows``: per-process tables from dataset row to an open shard's mapped
  bytes (``RowTable`` for variable-length columns, ``FixedRows`` for fixed-shape ones), so a
  batch is one gather a column however many shards it touches;
- ``batch_arrays``: the arrays a batch is gathered into, which start on a cache line;
- ``page_policy``: a dataset's page-cache policy (faults, read-ahead, warming, release);
- ``warm``: reading whole shards into the page cache in a thread;
- ``lazy_order``: an epoch's shuffled order computed as it is consumed;
- ``generation_pin``: the generation a dataset reads, the same on every rank.
"""
