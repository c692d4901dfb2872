# wm on NVIDIA's PyTorch container (NGC). The image's own CUDA build of torch, cuDNN, NCCL and
# TensorRT stay exactly as shipped; only wm's other dependencies are added.
#
#   docker build -t wm .
#   docker run --gpus all --ipc=host --rm -v "$PWD/runs:/wm/runs" -v /data:/data wm \
#       torchrun --nproc-per-node 8 train.py --cfg configs/occworld_nuscenes.json --set data.root=/data/occ3d
#
# 25.12-py3: CUDA 13 and a TensorRT 10.x (10.14, inferred from the TensorRT-LLM stack pinning
# tensorrt~=10.14.1 on this base; not confirmed from NVIDIA's release notes, and the image was not
# built here; the build reports whether TensorRT is present). TensorRT 10.x matters: export.py
# writes its own INT8 calibration cache, which 10.x still reads (11 removed implicit calibration). CUDA 13 needs an NVIDIA driver
# >= 580; on an older driver build on a CUDA 12.9 release instead:
#   docker build --build-arg BASE=nvcr.io/nvidia/pytorch:25.08-py3 -t wm .
ARG BASE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE}

WORKDIR /wm

# Dependencies first, in their own layer (it survives code edits). torch is the base image's: its
# line is dropped from requirements.txt, and since 25.03 the image's pip constraints
# (/etc/pip/constraint.txt) pin every package it ships, so nothing the image has is replaced.
# The last line fails the build if torch changed anyway.
COPY requirements.txt .
RUN python -c "import torch; print(torch.__version__)" > /tmp/torch.before \
 && grep -viE '^[[:space:]]*torch([<>=!~ ;[]|$)' requirements.txt > /tmp/requirements-no-torch.txt \
 && pip install --no-cache-dir -r /tmp/requirements-no-torch.txt \
 && python -c "import torch; print(torch.__version__)" | diff -u /tmp/torch.before - \
 && python -c "import h5py, hdf5plugin, onnx, onnxruntime, tensorboard" \
 && python -c "import importlib.util as u; print('tensorrt:', 'present' if u.find_spec('tensorrt') else 'absent (export.py then prints the trtexec line to run)')"

COPY . .

# The synthetic data sets and other caches: mount a volume here to keep them between containers.
ENV WM_CACHE=/wm/cache \
    PYTHONUNBUFFERED=1

# `docker run --gpus all wm` alone runs the demo (synthetic scenes, both stages, the forecast table).
CMD ["python", "train.py"]
