"""Where bytes live: local paths, ``file://``, ``s3://`` and ``gs://`` URLs (``locations``), the
files of one folder there (``store``), durable local writes (``durable``), checksums
(``hashing``), precache's own local folders (``folders``), remote shards kept on local disk
(``disk_cache``) and the one-writer lease of a remote cache (``lease``).

The bottom layer: it imports nothing else of precache (``precache.errors`` aside).
"""

from precache.storage.folders import precache_home, private_dir, work_dir_for
from precache.storage.locations import (ENDPOINT_VARIABLES, GCS_EMULATOR_VARIABLE, ChecksumError,
                                        StorageError, UnsafeFolderError, explained, is_remote,
                                        is_url, local_path, open_input_file, read_remote_bytes,
                                        resolve)
from precache.storage.store import Store

__all__ = ["StorageError", "ChecksumError", "UnsafeFolderError", "Store", "is_remote", "is_url",
           "local_path", "resolve", "explained", "precache_home", "private_dir", "work_dir_for",
           "read_remote_bytes", "open_input_file", "ENDPOINT_VARIABLES", "GCS_EMULATOR_VARIABLE"]
