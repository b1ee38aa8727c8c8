"""What the tests share, one copy of each (test files import from here, never from another test
file or from a conftest.py, which keep only fixtures):

* ``files``: the repository's paths, real photos to cache, a script loaded as a module, the
  counting pipeline's call log;
* ``caches``: ``build_cache``, a quiet ``precache.run``, and the settings most tests build with;
* ``processes``: the ``precache`` command in a subprocess, waiting for an event, free ports,
  gloo ranks and torchrun launches;
* ``sampling``: which keys each rank trained on, the one exact-once-per-epoch assertion, and
  what a padded plan holds;
* ``generations``: a cache whose re-run changes most inputs, a reader holding generation 1, what
  reading a removed generation says;
* ``remote``: S3 (SeaweedFS) and GCS (emulator) servers and their files;
* ``training``: a launcher-free environment, a trainer's epoch records, the keys it trains on.
"""

from tests.helpers.caches import (build_cache, build_counting, make_face_cache, make_volume_cache,
                                  quiet)
from tests.helpers.files import COUNTING_PIPELINE, REPO, load_script, read_calls, write_photos
from tests.helpers.processes import (assert_one_line_error, free_port, free_ports, launch_ranks,
                                     memory_cap, precache_cli, run_torchrun, wait_until)
from tests.helpers.sampling import assert_each_sample_once_per_epoch, keys_per_epoch, seen_keys

__all__ = ["COUNTING_PIPELINE", "REPO", "assert_each_sample_once_per_epoch",
           "assert_one_line_error", "build_cache", "build_counting", "free_port", "free_ports", "keys_per_epoch", "launch_ranks",
           "load_script", "make_face_cache", "make_volume_cache", "memory_cap", "precache_cli", "quiet", "read_calls",
           "run_torchrun", "seen_keys", "wait_until", "write_photos"]
