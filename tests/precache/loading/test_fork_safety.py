"""A DataLoader worker process forked after OpenCV ran in a thread of the training process (a
loader thread decoding or augmenting) starts: OpenCV's half-copied thread pool used to hang the
worker's first cv2.setNumThreads (make_loader's workers call it) for ever."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

FORK_AFTER_OPENCV_IN_A_THREAD = """
import os, sys, threading, time
import cv2
import numpy as np
import precache.loading  # what a training script imports before its loaders fork workers
from precache.threads import pin_threads

image = np.random.default_rng(0).integers(0, 255, (512, 512, 3), dtype=np.uint8)
matrix = np.array([[1, 0.1, 2], [0.1, 1, 3]])
work = lambda: [cv2.warpAffine(image, matrix, (512, 512)) for _ in range(20)]
thread = threading.Thread(target=work)
thread.start()
thread.join()
pid = os.fork()  # a DataLoader worker process
if pid == 0:
    pin_threads()
    cv2.warpAffine(image, matrix, (512, 512))
    os._exit(0)
for _ in range(200):
    if os.waitpid(pid, os.WNOHANG)[0]:
        work()  # the parent's OpenCV still works
        sys.exit(0)
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit("the forked worker hung in pin_threads")
"""


def test_a_worker_forked_after_opencv_ran_in_a_thread_starts():
    done = subprocess.run([sys.executable, "-c", FORK_AFTER_OPENCV_IN_A_THREAD],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
