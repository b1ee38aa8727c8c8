#!/usr/bin/env bash
# Issue 25's GPU checks in one go on a CUDA machine with PyTorch (e.g. one H100; ~7 minutes):
# the CUDA tests, bench_gpu.py (nvJPEG or CPU decode + FaceAugment at 224 px), the faces trainer
# decoding on the GPU and in its loader, and the data wait of the
# MiniLM fine-tune and the video classifier with loader threads and with worker processes.
#
#   bash tests/benchmarks/gpu_checks.sh prepare     # here: caches and wheels into .gpu/
#   bash tests/benchmarks/gpu_checks.sh run OUT     # there, from the repository's root
#   bash tests/benchmarks/gpu_checks.sh stage1 OUT  # there: issue 40's checks (~3 minutes)
#
# `stage1` (needs only `prepare`'s wheels and the repository): the torch MTCNN's CUDA test,
# bench_mtcnn.py --cuda (photos/s batched on the GPU against OpenCV on one core, same run), and
# the faces pipeline with device=cuda on the sample photos, whose summary gives the device
# stage's busy share (goal >= 80%) and photos/s (goal >= 300 at 640x480), then video-faces with
# device=cuda on 32 generated videos (its detector's calls in the device stage; ~1 minute).
#
# `prepare` needs the dev install (.venv): it builds a text cache of data/make_corpus.py's
# corpus and a video-faces cache (JPEG crops) of data/make_videos.py's videos, copies MiniLM's
# config and tokenizer (not its weights: the machine may take little data along; `run` gives
# the model random weights, which changes no step time) and downloads the wheels of simplejpeg
# and TorchCodec (precache.loading.decode_images prefers it to torchvision on a GPU).
# `run` installs that wheel, runs everything with precache from this folder on PYTHONPATH, and
# writes logs and metrics under OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
G=.gpu

prepare() {
    set -e
    mkdir -p "$G"
    .venv/bin/python data/make_corpus.py --output "$G/corpus"
    .venv/bin/precache run text --input "$G/corpus" --output "$G/textcache" -q
    .venv/bin/python data/make_videos.py --output "$G/videos" --per-label 48 --seconds 2
    .venv/bin/precache run video-faces -i "$G/videos" -o "$G/videocache" --set size=128 \
        --set frames=32 --set image_codec=jpeg --set "labels=$G/videos_metadata.json" -q
    rm -rf "$G/corpus" "$G/videos"
    model=$(.venv/bin/python -c "from pipelines.text.finetune import default_model; print(default_model())")
    mkdir -p "$G/minilm"
    cp "$model"/{config.json,tokenizer.json,tokenizer_config.json,vocab.txt,special_tokens_map.json} "$G/minilm/"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$G/wheels" simplejpeg==1.9.0
    # TorchCodec (CUDA 13 wheels on PyPI, torch >= 2.11): batched nvJPEG with the hardware
    # decoder of an A100/H100, which torchvision's decode_jpeg does not use
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d "$G/wheels" torchcodec==0.17.0
    du -sh "$G"
}

train() {  # name, script, args...: one training run, then precache doctor on it
    local name=$1 script=$2
    shift 2
    echo "== $name"
    timeout 150 python "$script" --out "$W/$name" "$@" >"$OUT/$name.log" 2>&1 || echo "FAILED $name: $(tail -3 "$OUT/$name.log")"
    python -c "import sys; from precache.cli import main; sys.exit(main(sys.argv[1:]))" doctor "$W/$name" >"$OUT/$name.doctor.txt" 2>&1
    cat "$OUT/$name.doctor.txt" | head -12
    cp "$W/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
}

run() {
    OUT=$1
    W=$(mktemp -d)
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$G"/wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    # the entry points that name the built-in pipelines ("images", ...) for the tests
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
    nvidia-smi -L; nproc
    python -c "import torch, torchvision; print(torch.__version__, torchvision.__version__, torch.cuda.get_device_name())"
    python -c "import torchcodec.decoders; print('torchcodec', torchcodec.__version__)" 2>&1 | tail -1
    echo "== CUDA tests"
    timeout 120 python -m pytest -q -o addopts="" -p no:cacheprovider -k "cuda or gpu" \
        tests/precache/augment/test_face_augment_cuda.py tests/precache/loading/test_threaded.py \
        tests/precache/augment/test_volume.py 2>&1 | tail -5
    echo "== bench_gpu"
    timeout 260 python tests/benchmarks/bench_gpu.py --rows 15360 --size 224 --epochs 3 \
        --profile --keep "$W/faces" >"$OUT/bench_gpu.log" 2>&1; grep -E "^part|^reader|/s " "$OUT/bench_gpu.log" | grep -v "^epoch"
    for decode in device loader; do  # nvJPEG, or libjpeg-turbo in 15 loader threads
        train "faces-decode-$decode" pipelines/faces/train.py --cache "$W/faces/cache-jpeg" \
            --epochs 2 --batch-size 256 --precision bf16 --workers 15 --decode-on "$decode" \
            --timeline-every 5
    done
    python - <<'EOF'
from transformers import AutoConfig, AutoModel
folder = ".gpu/minilm"
AutoModel.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
EOF
    for kind in threads processes; do
        train "finetune-$kind" pipelines/text/finetune.py --cache "$G/textcache" \
            --model "$G/minilm" --epochs 2 --precision fp32 --workers 4 --worker-kind "$kind" \
            --timeline-every 5
        train "classifier-$kind" pipelines/faces/train_classifier.py --cache "$G/videocache" \
            --epochs 6 --precision fp16 --workers 4 --worker-kind "$kind" --timeline-every 5
    done
    rm -rf "$W"
}

stage1() {
    OUT=$1
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
    nvidia-smi -L; nproc
    echo "== torch MTCNN on CUDA"
    timeout 120 python -m pytest -q -o addopts="" -p no:cacheprovider \
        tests/precache/faces/test_mtcnn_torch.py 2>&1 | tail -3
    echo "== bench_mtcnn --cuda"
    timeout 200 python tests/benchmarks/bench_mtcnn.py --photos 128 --frames 64 --repeat 2 \
        --cuda >"$OUT/bench_mtcnn.log" 2>&1; tail -20 "$OUT/bench_mtcnn.log"
    echo "== faces with device=cuda (the device stage), $(nproc) workers"
    python data/make_samples.py --count 600 --output /tmp/samples >/dev/null
    timeout 200 python -m precache run faces -i /tmp/samples -o /tmp/facescache \
        --set device=cuda --set detect_size=640 -j "$(nproc)" 2>&1 | tail -6 | tee "$OUT/faces_cuda.log"
    echo "== video-faces with device=cuda (its detector in the device stage), $(nproc) workers"
    python data/make_videos.py --output /tmp/videos --per-label 16 >/dev/null
    timeout 200 python -m precache run video-faces -i /tmp/videos -o /tmp/videocache \
        --set device=cuda --set frames=32 -j "$(nproc)" 2>&1 | tail -6 | tee "$OUT/video_cuda.log"
}

"$@"
