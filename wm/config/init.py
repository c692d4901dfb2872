"""The config section `init`: a run's stages start from another run's weights (fine-tuning), apart
from resuming this run's own checkpoints. What the keys do is wm/checkpoint/init_from.py's; here they check
themselves."""

from __future__ import annotations

from dataclasses import dataclass

from wm.config.rules import FREE, MATCH, rule
from wm.utils.errors import ConfigError

INIT_STAGES = ("tokenizer", "world")
NEW_CLASS_RULES = ("mean", "fresh")


@dataclass
class InitConfig:
    """Weights only: optimizer, schedule, sampler and RNG start fresh. Applied to a stage only while
    it has no checkpoint of its own, so rerunning the same command resumes the fine-tune."""

    RESUME, EVALUATE = MATCH, FREE
    # a run folder (each stage from its best checkpoint) or one checkpoint file
    from_: str = rule("", path=True)  # run folder or checkpoint to start from (empty: from scratch)
    stages: tuple[str, ...] = ()  # stages initialised from it (empty: every stage the source has)
    # {this data's class: the source's class}; classes of the same name map without it, free to free
    class_map: dict[str, str] | str = rule({}, path=True)  # class name -> source class name, or a JSON file of it
    # mean: the mean of the source's non-free class embeddings; fresh: the new model's random init
    new_classes: str = "mean"  # how a class with no source class starts: mean | fresh

    def validate(self) -> None:
        bad = [s for s in self.stages if s not in INIT_STAGES]
        if bad or len(set(self.stages)) != len(self.stages):
            raise ConfigError("stages", f"{list(self.stages)} must be distinct names from {list(INIT_STAGES)}")
        if self.stages and not self.from_:
            raise ConfigError("stages", f"{list(self.stages)} needs init.from (the run or checkpoint to start from)")
        if self.class_map and not self.from_:
            raise ConfigError("class_map", "maps classes onto a source, but init.from is empty")
        if isinstance(self.class_map, dict):
            for k, v in self.class_map.items():
                if not k or not v:
                    raise ConfigError("class_map", f"{k!r}: {v!r}: class names must not be empty")
        if self.new_classes not in NEW_CLASS_RULES:
            raise ConfigError("new_classes", f"{self.new_classes!r} must be one of {list(NEW_CLASS_RULES)}")


def matches(name: str, prefix: str) -> bool:
    """Whether parameter `name` lies under module prefix `prefix` ('encoder' holds 'encoder.0.conv1.weight')."""
    return name == prefix or name.startswith(prefix + ".")


def check_prefixes(freeze: tuple[str, ...], lr_mult: dict) -> None:
    """A stage's freeze and lr_mult keys: module prefixes, multipliers > 0."""
    if any(not p or p.startswith(".") or p.endswith(".") for p in freeze):
        raise ConfigError("freeze", f"{list(freeze)}: each entry is a module prefix such as 'encoder'")
    for k, v in lr_mult.items():
        if not k or k.startswith(".") or k.endswith("."):
            raise ConfigError("lr_mult", f"{k!r}: each key is a module prefix such as 'encoder'")
        if not v > 0:
            raise ConfigError("lr_mult", f"{k!r}: {v} must be > 0 (to keep a module fixed, list it in freeze)")
