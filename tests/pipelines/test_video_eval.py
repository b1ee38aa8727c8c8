"""Per-video scoring of the face-video classifier (precache.pipelines.faces.video_eval): ROC AUC and
log-loss over videos, frame scores to one video score, and a held-out split that keeps a fake
with its original, the same on every rank."""

from __future__ import annotations

import numpy as np
import pytest

from precache.pipelines.faces.video_eval import aggregate, log_loss, roc_auc, split_videos


def test_video_scores_and_metrics() -> None:
    assert roc_auc([1, 1, 0, 0], [0.9, 0.8, 0.3, 0.1]) == 1.0
    assert roc_auc([1, 0, 1, 0], [0.9, 0.8, 0.3, 0.1]) == 0.75
    assert roc_auc([1, 0], [0.5, 0.5]) == 0.5
    assert np.isnan(roc_auc([1, 1], [0.2, 0.4]))
    assert log_loss([1, 0], [0.5, 0.5]) == pytest.approx(np.log(2))
    assert aggregate(np.array([]), "mean") == 0.5  # a video without faces
    # one very confident frame among unsure ones counts more in the confident variant
    scores = np.array([0.99, 0.55, 0.5, 0.45])
    assert aggregate(scores, "confident") > aggregate(scores, "mean")


def test_the_split_keeps_pairs_together_and_is_the_same_every_time() -> None:
    videos = [f"real/r{i}.mp4" for i in range(10)] + [f"fake/f{i}.mp4" for i in range(10)]
    labels = ["REAL"] * 10 + ["FAKE"] * 10
    groups = videos[:10] + videos[:10]  # each fake's group is its original
    held = split_videos(videos, labels, groups, 0.25)
    assert {v.split("/")[0] for v in held} == {"real", "fake"}
    for i in range(10):  # a fake and its original on the same side, always
        assert (f"real/r{i}.mp4" in held) == (f"fake/f{i}.mp4" in held)
    assert 4 <= len(held) <= 6
    assert held == split_videos(videos, labels, groups, 0.25)  # the same on every rank
