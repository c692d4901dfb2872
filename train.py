"""Train an occupancy world model.

    python train.py                                   # demo: synthetic scenes, tokenizer then world model
    python train.py --cfg configs/demo.json --set world_stage.epochs=20
    torchrun --nproc_per_node 8 train.py --cfg cfg.json
"""

from wm.training.host_gc import freeze_imports
from wm.training.main import main
from wm.utils.errors import run_cli

if __name__ == "__main__":
    freeze_imports()
    run_cli(main)
