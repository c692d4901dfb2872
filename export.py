"""Export a trained world-model run to ONNX (FP32, optionally FP16 and INT8), checked against PyTorch;
TensorRT engines where TensorRT is installed (wm/export/main.py says what is written where).

    python export.py                              # newest world-model run under runs/, its best checkpoint
    python export.py --run runs/demo --fp16
    python export.py --run runs/demo --int8       # + Q/DQ INT8 graphs, calibration caches, report.json
    python export.py --run runs/demo --ckpt runs/demo/world/checkpoints/step_000000450.pt
"""

from wm.export.main import main
from wm.utils.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
