"""Train an occupancy world model.

    python train.py                                   # demo: synthetic scenes, tokenizer then world model
    python train.py --cfg configs/demo.json --set world_stage.epochs=20
    torchrun --nproc_per_node 8 train.py --cfg cfg.json
"""

from wm.errors import run_cli
from wm.train import main

if __name__ == "__main__":
    run_cli(main)
