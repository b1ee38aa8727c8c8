"""precache doctor's rules on recorded timelines: a loader-bound run recorded here, and the
metrics.jsonl of real MiniLM fine-tunes by pipelines/text/finetune.py: on this machine's CPU
(timelines/minilm_cpu_fp32.jsonl, --batch-size 8 --workers 0) and on an H100
(timelines/minilm_h100_fp32.jsonl and _fp16, --batch-size 32 --workers 4, 16 CPUs; phases timed
with CUDA events; _fp32_threads with loader threads, random weights), the video classifier and
the faces trainer decoding and augmenting on an H100; and the real command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from precache.training.doctor import TimelineError, diagnose, load_timeline
from precache.training.timeline import run_record
from tests.helpers import precache_cli
from tests.precache.training.timeline_runs import train

RECORDED = Path(__file__).with_name("timelines")


def write_run(path: Path, config: dict, summary: dict, steps: list[dict]) -> Path:
    lines = [run_record(**config), *steps, {"kind": "epoch", "epoch": 0, "timeline": summary}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


@pytest.fixture(scope="module")
def loader_bound(tmp_path_factory) -> Path:
    summary, steps = train(delay=0.01, width=8, every=1)
    config = {"device": "cpu", "world_size": 1, "workers": 0, "cpus": 4, "batch_size": 4,
              "precision": "fp32", "compile": False, "columns": ["image", "landmarks5", "mesh"],
              "columns_used": ["image", "landmarks5"], "transform_in_loader": False}
    return write_run(tmp_path_factory.mktemp("doctor") / "metrics.jsonl", config, summary, steps)


def rules(findings) -> list[str]:
    return [f.rule for f in findings]


def test_a_loader_bound_run_is_told_to_add_workers_and_read_fewer_columns(loader_bound):
    config, epochs, steps = load_timeline(loader_bound)
    assert len(epochs) == 1 and len(steps) == 24
    found = diagnose(config, epochs[-1])
    assert rules(found) == ["more-workers", "fewer-columns"]
    assert "with 0 loader workers per rank on 4 CPUs, 1 rank" in found[0].evidence
    assert "--workers to 3" in found[0].advice
    assert found[1].evidence.endswith("columns read but not used: mesh")
    # With the workers it asks for and only the columns it uses, the loader is at its limit.
    tuned = dict(config, workers=3, columns=["image", "landmarks5"])
    assert rules(diagnose(tuned, epochs[-1])) == ["loader-at-its-limit"]


def test_the_recorded_minilm_cpu_run_is_told_to_compile_and_step_less_often_not_to_use_bf16():
    config, epochs, steps = load_timeline(RECORDED / "minilm_cpu_fp32.jsonl")
    assert config["precision"] == "fp32" and config["device"] == "cpu" and steps
    found = diagnose(config, epochs[-1])
    assert rules(found) == ["compile", "fewer-optimizer-steps"]
    # bf16 is emulated on a CPU without AVX512-BF16/AMX (measured 23x slower): not advised there,
    # advised where the CPU has it.
    assert "mixed-precision" in rules(diagnose(dict(config, cpu_bf16=True), epochs[-1]))



def test_bf16_emulated_on_the_cpu_is_told_to_use_fp32_and_not_to_compile(tmp_path):
    """The recorded MiniLM CPU run as if it had run in bf16 on a CPU without native bf16 (the run
    record's cpu_bf16: false): fp32 first, and no --compile (what doctor said before)."""
    config, epochs, steps = load_timeline(RECORDED / "minilm_cpu_fp32.jsonl")
    emulated = dict(config, precision="bf16", cpu_bf16=False)
    assert rules(diagnose(emulated, epochs[-1])) == ["fp32-on-this-cpu", "fewer-optimizer-steps"]
    assert rules(diagnose(dict(emulated, cpu_bf16=True), epochs[-1])) == [
        "compile", "fewer-optimizer-steps"]  # native bf16: as before
    run = write_run(tmp_path / "metrics.jsonl", emulated, epochs[-1]["timeline"], steps)
    done = precache_cli("doctor", str(run))
    assert done.returncode == 0, done.stderr
    assert ("1. --precision fp32, or auto (the trainers' default), which picks fp32 on this CPU"
            in done.stdout) and "--compile" not in done.stdout
    assert "because: precision bf16 on a CPU without native bf16 (the run record says " \
           "cpu_bf16: false" in done.stdout


@pytest.mark.parametrize("run, fired", [("minilm_h100_fp32", ["more-workers"]),
                                        ("minilm_h100_fp16", ["more-workers", "compile"])])
def test_the_recorded_h100_runs_are_told_to_add_loader_workers(run, fired):
    config, epochs, steps = load_timeline(RECORDED / f"{run}.jsonl")
    assert config["device"] == "cuda" and config["pin_memory"] and len(epochs) == 2
    assert all(s["forward_s"] > 0 for s in steps)  # CUDA events, read after the step
    found = diagnose(config, epochs[-1])
    assert rules(found) == fired
    assert "with 4 loader workers per rank on 16 CPUs, 1 rank" in found[0].evidence
    assert "--workers to 15" in found[0].advice


@pytest.mark.parametrize("run", ["classifier_h100_gpu_decode", "faces_h100_gpu_decode"])
def test_runs_that_decode_and_augment_on_the_gpu_are_told_the_cost_is_per_batch(run):
    """Recorded on an H100 (16 CPUs): pipelines/faces/train_classifier.py (4 videos x 8 frames a
    batch) and pipelines/faces/train.py (256 crops a batch), JPEG crops decoded by nvJPEG and
    augmented on the GPU in the task's inputs, which the h2d phase times."""
    config, epochs, _ = load_timeline(RECORDED / f"{run}.jsonl")
    assert config["device"] == "cuda" and config["images_decoded_on"] == "device"
    found = diagnose(config, epochs[-1])
    assert "device-inputs" in rules(found) and "smaller-transfers" not in rules(found)
    advice = next(f for f in found if f.rule == "device-inputs")
    assert "--batch-size" in advice.advice and "h2d" in advice.evidence
    assert "--decode-on loader" in advice.advice


def test_a_cuda_run_whose_gpu_waits_for_the_host_is_told_to_launch_less():
    """The MiniLM fine-tune on an H100 with 4 loader threads (batch 32, fp32): the loader keeps
    up (data wait under 1%), but half of the step is neither data wait nor GPU time."""
    config, epochs, _ = load_timeline(RECORDED / "minilm_h100_fp32_threads.jsonl")
    assert config["worker_kind"] == "threads" and epochs[-1]["timeline"]["data_wait"] < 0.05
    found = diagnose(config, epochs[-1])
    assert rules(found) == ["host-bound"]
    assert "--compile" in found[0].advice and "--batch-size" in found[0].advice


def test_gpu_rules_fire_on_cuda_runs_only():
    epoch = {"epoch": 0, "timeline": {"data_wait": 0.0, "h2d": 0.3, "forward": 0.3,
                                      "backward": 0.3, "optimizer": 0.05, "other": 0.05}}
    config = {"device": "cuda", "pin_memory": False, "precision": "fp32", "compile": True,
              "input": "images", "channels_last": False}
    assert rules(diagnose(config, epoch)) == ["pin-memory", "mixed-precision", "channels-last"]
    assert rules(diagnose(dict(config, pin_memory=True, precision="bf16", channels_last=True),
                          epoch)) == ["smaller-transfers"]
    assert rules(diagnose(dict(config, device="cpu"), epoch)) == []


def test_a_file_without_a_timeline_is_an_error_naming_it(tmp_path):
    old = tmp_path / "metrics.jsonl"
    old.write_text(json.dumps({"epoch": 0, "train_loss": 1.0, "data_wait": 0.1}) + "\n")
    with pytest.raises(TimelineError, match="has no epoch record with a 'timeline'"):
        load_timeline(tmp_path)
    old.write_text("{not json\n")
    with pytest.raises(TimelineError, match=r"metrics.jsonl, line 1: not JSON"):
        load_timeline(old)


def test_the_command_prints_the_phases_and_suggestions(loader_bound, tmp_path):
    done = precache_cli("doctor", str(loader_bound))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["epoch", "s/batch", "data_wait", "h2d", "forward", "backward",
                                "optimizer", "other"]
    assert lines[1].split()[0] == "0"
    assert any(line.startswith("1. raise --workers to 3") for line in lines)

    as_json = json.loads(precache_cli("doctor", str(loader_bound.parent), "--json").stdout)
    assert [f["rule"] for f in as_json["findings"]] == ["more-workers", "fewer-columns"]
    assert as_json["sampled_steps"] == 24

    missing = precache_cli("doctor", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == (f"precache: error: {tmp_path / 'nope'}: "
                                      "no such file; give a run's metrics.jsonl or its folder")
    wrong_epoch = precache_cli("doctor", str(loader_bound), "--epoch", "7")
    assert wrong_epoch.returncode == 2 and "no timeline for epoch 7" in wrong_epoch.stderr


def test_an_epoch_with_no_timed_batch_says_not_timed_instead_of_0_percent(tmp_path):
    """With --timeline-every larger than the epoch, no batch is timed in detail: the table shows
    "-" for the phases it did not time and says why, and no rule concludes from their zeros."""
    summary, steps = train(delay=0.0, width=8, every=10_000, batches=4)
    assert summary["sampled"] == 0 and steps == []  # a real epoch that timed no batch
    config = {"device": "cuda", "world_size": 1, "workers": 0, "cpus": 4, "batch_size": 4,
              "precision": "fp32", "compile": False, "pin_memory": False, "input": "images",
              "channels_last": False}
    run = write_run(tmp_path / "metrics.jsonl", config, summary, steps)
    _, epochs, _ = load_timeline(run)
    found = diagnose(config, epochs[-1])
    assert rules(found)[0] == "not-timed"
    assert not {"pin-memory", "smaller-transfers", "mixed-precision", "compile", "channels-last",
                "fewer-optimizer-steps"} & set(rules(found))
    assert found[0].evidence.startswith("not timed: 0 sampled batches of 4")
    assert "--timeline-every" in found[0].advice

    done = precache_cli("doctor", str(run))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    row = lines[1].split()  # epoch, s/batch, data_wait, h2d, forward, backward, optimizer, other
    assert row[2].endswith("%") and row[3:] == ["-"] * 5  # data wait measured, the rest unknown
    assert lines[2] == ("-: not timed: 0 sampled batches in epoch 0 (about one batch in "
                        "--timeline-every is timed)")
    assert "1. time some batches: lower --timeline-every" in done.stdout
    assert "no rule fired" not in done.stdout and "largest share" not in done.stdout

    as_json = json.loads(precache_cli("doctor", str(run), "--json").stdout)
    assert as_json["timeline"]["forward"] is None and as_json["timeline"]["data_wait"] >= 0
    assert as_json["findings"][0]["rule"] == "not-timed"


def test_a_loader_bound_run_is_shown_the_thread_and_gpu_decode_paths(loader_bound):
    config, epochs, _ = load_timeline(loader_bound)
    tuned = dict(config, workers=3, columns=["image", "landmarks5"])
    assert rules(diagnose(dict(tuned, worker_kind="processes"), epochs[-1])) == ["thread-workers"]
    assert rules(diagnose(dict(tuned, worker_kind="threads"), epochs[-1])) == [
        "loader-at-its-limit"]
    gpu = dict(tuned, worker_kind="threads", device="cuda", images_decoded_on="cpu")
    assert "decode-on-gpu" in rules(diagnose(gpu, epochs[-1]))
    assert "decode-on-gpu" not in rules(diagnose(dict(gpu, images_decoded_on="device"),
                                                 epochs[-1]))


def test_the_plot_draws_each_epoch_with_its_data_wait(loader_bound, tmp_path):
    import matplotlib.image

    done = precache_cli("doctor", str(loader_bound), "--plot", str(tmp_path / "steps.png"))
    assert done.returncode == 0, done.stderr
    pixels = (matplotlib.image.imread(tmp_path / "steps.png")[..., :3] * 255).round()
    red = (abs(pixels - [0xD6, 0x27, 0x28]).sum(axis=-1) < 6).sum()  # data_wait's colour
    _, epochs, _ = load_timeline(loader_bound)
    assert epochs[-1]["timeline"]["data_wait"] > 0.2 and red > 500
    bad = precache_cli("doctor", str(loader_bound), "--plot", str(tmp_path / "no" / "x.png"))
    assert bad.returncode == 2 and "x.png" in bad.stderr
