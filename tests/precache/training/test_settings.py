"""The common flags of every trainer (training_parser) become Settings, the one input of the
loop; the epoch record schema (records.epoch_record) refuses a task field that would overwrite
the loop's and values out of range."""

from __future__ import annotations

import pytest

from precache.training.metrics_log import EPOCH_FIELDS, epoch_record
from precache.training.settings import Settings, training_parser


def test_the_common_flags_become_settings_and_a_recipe_adds_its_own():
    p = training_parser("doc", out="runs/x", lr=3e-3, epochs=8, batch_size=4)
    p.add_argument("--mode", default="frames")
    args = p.parse_args(["--cache", "c", "--precision", "auto", "--strategy", "fsdp",
                         "--compile", "--accumulate", "2", "--mode", "clips"])
    settings = Settings.from_args(args)
    assert settings == Settings(cache="c", out="runs/x", epochs=8, batch_size=4, lr=3e-3,
                                accumulate=2, precision="auto", strategy="fsdp", compile=True)
    assert settings.workers is None and settings.max_steps == 0  # automatic; no limit
    assert args.mode == "clips"


def test_another_framework_gets_the_same_names_without_the_loop_only_flags():
    p = training_parser("doc", out="o", lr=1e-3, loop=False,
                        strategies=("ddp", "fsdp", "deepspeed_stage_2"))
    args = p.parse_args(["--cache", "c", "--strategy", "deepspeed_stage_2", "--precision", "fp16"])
    assert (args.strategy, args.precision, args.max_steps) == ("deepspeed_stage_2", "fp16", 0)
    for flag in ("--compile", "--timeline-every", "--save-every"):
        assert flag not in p.format_help()
    with pytest.raises(SystemExit):
        p.parse_args(["--cache", "c", "--strategy", "zero"])


def test_an_epoch_record_keeps_the_loops_fields_first_and_refuses_what_breaks_them():
    fields = dict(epoch=0, step=3, train_loss=0.5, samples_per_s=10.0, data_wait=0.25,
                  world_size=2, lr=1e-3, strategy="ddp", precision="bf16", samples_seen=24,
                  samples_planned=48)
    record = epoch_record(**fields, val_accuracy=0.9)
    assert list(record) == [*EPOCH_FIELDS, "val_accuracy"] and record["kind"] == "epoch"
    with pytest.raises(ValueError, match="may not be called 'kind'"):
        epoch_record(**fields, kind="step")
    with pytest.raises(ValueError, match="data_wait is a share of step time"):
        epoch_record(**{**fields, "data_wait": 1.5})
    with pytest.raises(TypeError):  # a field of the schema missing
        epoch_record(**{k: v for k, v in fields.items() if k != "lr"})


def test_settings_refuse_what_the_loop_cannot_run():
    with pytest.raises(ValueError, match="precision must be one of bf16, fp16, fp32, auto"):
        Settings(cache="c", out="o", precision="16-mixed")
    with pytest.raises(ValueError, match="strategy must be one of ddp, zero, fsdp"):
        Settings(cache="c", out="o", strategy="deepspeed")
    with pytest.raises(ValueError, match="accumulate must be at least 1, not 0"):
        Settings(cache="c", out="o", accumulate=0)
    with pytest.raises(ValueError, match="worker_kind must be one of auto, threads, processes"):
        Settings(cache="c", out="o", worker_kind="fibers")
    args = training_parser(None, out="o", lr=1.0).parse_args(["--cache", "c", "--worker-kind",
                                                               "processes"])
    assert Settings.from_args(args).worker_kind == "processes"


def test_precision_defaults_to_auto_and_the_help_says_what_auto_picks():
    """On a CPU without native bf16, auto is fp32 (bf16 is emulated there: 4-23x slower)."""
    import torch

    from precache.training.step import auto_precision, cpu_has_native_bf16

    p = training_parser("doc", out="o", lr=1e-3)
    assert p.parse_args(["--cache", "c"]).precision == "auto" == Settings("c", "o").precision
    help_text = " ".join(p.format_help().split())
    assert ("auto: bf16 where the device computes it natively (a GPU with bf16, a CPU with "
            "AVX512-BF16 or AMX), fp16 on a GPU without bf16, fp32 on other CPUs") in help_text
    if not torch.cuda.is_available():
        assert f"here: {auto_precision(torch.device('cpu'))} (default: auto)" in help_text
    avx2 = "flags : fpu sse2 avx avx2 fma\n"
    assert not cpu_has_native_bf16(avx2) and cpu_has_native_bf16(avx2 + " avx512_bf16")
    assert auto_precision(torch.device("cpu"), cpu_bf16=False) == "fp32"
    assert auto_precision(torch.device("cpu"), cpu_bf16=True) == "bf16"
