"""train.py: train both stages (or evaluate a run with --eval-only), then print the final table.

    python train.py                                   # the demo: synthetic scenes, both stages, a table
    torchrun --nproc_per_node 8 train.py --cfg cfg.json [--set train.amp=fp16 ...]

A run lives in `<run.out_dir>/<run.name>/`: `config.json` (resolved, with the data fingerprint and
versions), `<stage>/checkpoints/`, `tb/`, `metrics.jsonl`. Stages run in order: the tokenizer
(VQ-VAE on single frames), then the world model on the frozen tokenizer, trained from a token cache
(every training frame encoded once) and validated by decoding its rollouts against the real
occupancy, beside the copy-last-frame baseline. Re-running the same command resumes from the newest
complete checkpoint; `--fresh` starts over (the old run folder is moved aside, never deleted).

Where each part lives: the run folder and its resume checks (wm/checkpoint/run_folder.py), the two stages and the
token cache (wm/training/stages.py, wm/training/token_cache.py), the loop (wm/training/loop.py), the final table (wm/evaluation/final_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

import torch

from wm.checkpoint.files import read_json
from wm.checkpoint.run_folder import Run, data_root, recorded
from wm.config.loading import load as load_config, to_dict
from wm.config.sections import Config
from wm.data.horizons import print_plan
from wm.data.stats import moving_classes
from wm.evaluation.evaluate import evaluate_run
from wm.evaluation.final_report import final_table, make_summary
from wm.training import activations, memory_plan
from wm.training.loop import Preempted, Preemption, fit
from wm.training.stages import TokenizerStage, WorldStage, check_stages, step_seconds
from wm.utils import distributed
from wm.utils.atomic import write_bytes
from wm.utils.errors import WMError, first_line


def cpu_has_amx() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (Intel AMX tiles: Sapphire Rapids and later)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def amp_dtype(cfg: Config, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype, or None for fp32. "auto": bf16 on CUDA, and on a CPU with AMX, where the
    demo takes a quarter less time in bf16 (BENCHMARKS.md); fp32 on other
    CPUs, whose bf16 is emulated and slower."""
    amp = cfg.train.amp
    if amp == "auto":
        return torch.bfloat16 if device.type == "cuda" or (device.type == "cpu" and cpu_has_amx()) else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[amp]


def device_line(cfg: Config, dist: distributed.Dist, device: torch.device, dtype) -> str:
    """What trains and in which precision, for the log's first lines: '1 rank on cpu (2 threads), fp32
    (train.amp=auto: no AMX on this CPU)'."""
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''}")
    prec = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    why = cfg.train.amp
    if why == "auto":
        why = "auto" if device.type == "cuda" else f"auto: {'AMX' if cpu_has_amx() else 'no AMX'} on this CPU"
    return (f"{dist.world_size} rank{'s' if dist.world_size != 1 else ''} on {device.type} ({where}), {prec} "
            f"(train.amp={why})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="train.py", description="Train an occupancy world model (wm).")
    ap.add_argument("--cfg", help="config JSON (default: the built-in demo)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set train.amp=fp16 (repeatable)")
    ap.add_argument("--fresh", action="store_true", help="start over: move the existing run folder aside")
    ap.add_argument("--allow-new-data", action="store_true",
                    help="resume even though the data set's fingerprint changed")
    ap.add_argument("--allow-changed", default="", metavar="KEY,...",
                    help="resume with these optimisation keys changed, e.g. tokenizer_stage.lr,tokenizer_stage.clip "
                         "(recorded in config.json's meta.history; data and model keys stay refused)")
    ap.add_argument("--help-config", action="store_true",
                    help="print every config key with its type, default and meaning (docs/CONFIG.md), and exit")
    ev = ap.add_argument_group("evaluation (--eval-only: OccWorld's protocol, see wm/evaluation/evaluate.py)")
    ev.add_argument("--eval-only", action="store_true",
                    help="train nothing: evaluate the run's best (else newest) checkpoints, print a table, write JSON")
    ev.add_argument("--ckpt", help="evaluate this checkpoint (a world-model one brings its tokenizer, hash-checked)")
    ev.add_argument("--stage", choices=("tokenizer", "world", "all"),
                    help="which stages to evaluate (default: train.stages, or the stage of --ckpt)")
    ev.add_argument("--split", help="the split to evaluate (default: data.val_split)")
    ev.add_argument("--mask",
                    help="visibility mask: none (default, OccWorld's protocol) or a mask the data set has (mask)")
    ev.add_argument("--mode", choices=("occworld", "exclude"),
                    help="classes absent from the ground truth: occworld (default: IoU 100%%, OccWorld's) or exclude")
    ev.add_argument("--horizons", help="forecast horizons in seconds, reported with their average (default: "
                    "data.horizons_s, else 1,2,3 where the windows reach them); without --eval-only: print a "
                    "setting of data.past, data.future, data.stride, world.max_frames that reaches them, train nothing")
    ev.add_argument("--json", help="where to write the report (default: <run>/eval/<stages>_<split>_<mode>"
                    "[_mask-<mask>][_h<horizons>].json)")
    return ap.parse_args(argv)


def _collective_failure(e: BaseException) -> bool:
    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "timed out", "timeout", "connection closed",
                                   "connection reset", "broken pipe", "watchdog"))


def _timed_out(e: BaseException) -> bool:
    # gloo says "Timed out waiting ..." in one collective, "Application timeout caused pair closure" in another
    return any(w in str(e).lower() for w in ("timed out", "timeout"))


def hparams_of(cfg: Config) -> dict:
    """The flat config `section.key` for TensorBoard's HParams, each value of its key's type in the
    default config, so every run has one schema: bools stay bools, numbers numbers, the rest
    (strings, lists, None) text."""
    def flat(c):
        return {f"{sec}.{k}": v for sec, kv in to_dict(c).items() for k, v in kv.items()}

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    out, default = {}, flat(Config())
    for k, v in flat(cfg).items():
        ref = default.get(k, v)
        out[k] = v if isinstance(ref, bool) and isinstance(v, bool) else \
            float(v) if number(ref) and number(v) else str(v)
    return out


def hparam_metrics(cfg: Config) -> list[str]:
    """The HParams metrics, the same list for every run (whichever stages it trains): each stage's
    validation IoU and mIoU, the forecast's per future step (as the world stage logs them) and the
    run's device hours."""
    steps = [f"world/val/{m}_t{t + 1}" for t in range(cfg.data.future) for m in ("iou", "miou")]
    return ["tokenizer/val/iou", "tokenizer/val/miou", "world/val/iou", "world/val/miou", *steps, "run/gpu_hours"]


def stage_times(run: Run, names) -> dict:
    """Each finished stage's training time from its done.json (wall_s, gpu_hours: summed over its
    processes, the gaps between them left out) and their sum under "run"."""
    out = {}
    for n in names:
        done = read_json(run.stage_dir(n) / "done.json")
        if isinstance(done, dict) and "wall_s" in done:
            out[n] = {"wall_s": done["wall_s"], "gpu_hours": done["gpu_hours"]}
    out["run"] = {"wall_s": round(sum(t["wall_s"] for t in out.values()), 3),
                  "gpu_hours": sum(t["gpu_hours"] for t in out.values())}
    return out


def report(run: Run, cfg: Config, results: dict, times: dict, t0: float) -> None:
    """The final table on the console and summary.json (rank 0)."""
    moving = moving_classes(run.manifest.info, cfg.data.moving_classes)
    step_s = step_seconds(cfg, run.manifest.info)
    before = {n: b["metrics"] for n in results if isinstance(b := read_json(run.stage_dir(n) / "before.json"), dict)
              and isinstance(b.get("metrics"), dict)}
    table = final_table(cfg, results, moving, step_s, before, times)
    minutes = (time.time() - t0) / 60
    print(f"\nrun {run.dir} finished in {minutes:.1f} min\n{table}")
    summary = make_summary(cfg, results, moving, step_s)
    if before or cfg.init.from_:
        summary["before"] = make_summary(cfg, before, moving, step_s)
        summary["init"] = recorded(run.dir)
    summary["minutes"] = round(minutes, 2)
    for n, t in times.items():
        (summary.setdefault(n, {}) if n != "run" else summary).update(t)
    write_bytes(run.dir / "summary.json", json.dumps(summary, indent=1))


def end_record(run: Run, ended: Optional[str], e: Optional[BaseException]) -> None:
    """The run's last line in metrics.jsonl (rank 0): {"kind": "run/end", "status": finished, preempted,
    failed (an exception) or stopped (Ctrl-C, an exit), "error": its one line}; tools/runs.py reads it."""
    status = ended or ("failed" if e is None or isinstance(e, Exception) else "stopped")
    rec = {"status": status, "time": round(time.time(), 3)}
    if e is not None:
        rec["error"] = (first_line(e) if isinstance(e, WMError) else f"{type(e).__name__}: {first_line(e)}")[:300]
    run.log.record(0, "run/end", rec)


def main(argv=None, stop: Optional[Preemption] = None) -> int:
    """train.py. `stop`: the preemption flag SIGTERM/SIGINT set (a fresh one unless given)."""
    args = parse_args(argv)
    if args.help_config:
        from wm.config.reference import reference

        print(reference())
        return 0
    stray = [f for f in ("ckpt", "stage", "split", "mask", "mode", "json") if getattr(args, f) is not None]
    if stray and not args.eval_only:
        raise WMError(f"--{stray[0]} belongs to evaluation; add --eval-only (training ignores it)")
    quiet = os.environ.get("RANK", "0") != "0"  # torchrun's other ranks: rank 0 says it
    cfg = load_config(args.cfg, args.set, say=(lambda *a, **k: None) if quiet else print)
    if args.horizons is not None and not args.eval_only:  # plan: a window setting that reaches them
        return print_plan(cfg, args.horizons, data_root(cfg))
    stop = Preemption() if stop is None else stop
    if not args.eval_only:  # evaluation keeps the default Ctrl-C: nothing to save
        stop.install()
    dist = distributed.init(cfg.train.device, cfg.ddp.timeout_s)
    broken, run, ended = False, None, None
    try:
        device = dist.device
        dtype = amp_dtype(cfg, device)
        if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise WMError("train.amp is bf16 but this GPU has no bf16; use --set train.amp=fp16")
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if args.eval_only:
            return evaluate_run(cfg, dist, device, dtype, args)
        # before the data is generated: a config this machine cannot hold stops here, in one line
        plan = memory_plan.start(cfg, dist, device, dtype, args.fresh, say=(lambda *a, **k: None) if quiet else print)
        run = Run(cfg, dist, fresh=args.fresh, allow_new_data=args.allow_new_data,
                  allow_changed=tuple(k.strip() for k in args.allow_changed.split(",") if k.strip()))
        run.memory_plan = plan  # the first step's memory line compares with it
        if dist.is_main:
            activations.keep_measured(run.dir)  # a resume reads them instead of tracing again
        if run.resuming:
            run.say(f"resuming run {run.dir}")
        run.say(f"training: {device_line(cfg, dist, device, dtype)}")
        check_stages(run)
        t0 = time.time()
        results, times, status = {}, {}, "failure"
        run.log.hparams_start(hparams_of(cfg), hparam_metrics(cfg), run.dir.name)  # rank 0; a failure warns
        try:
            for name in cfg.train.stages:
                t_stage = time.perf_counter()  # the stage's time includes building it (the token cache)
                stage = TokenizerStage(run) if name == "tokenizer" else WorldStage(run, device, dtype)
                results[name] = fit(run, stage, device, dtype, stop, t_stage)
                del stage  # the next stage must not hold this one's model, optimizer and captured graphs
                memory_plan.release(device)
            times = stage_times(run, results)
            run.log.scalars(0, {"run/gpu_hours": times["run"]["gpu_hours"]}, kind="run")
            status = "success"
        except Preempted:
            status, ended = None, "preempted"  # no session end: the resume's is the one TensorBoard keeps
            return 0
        except (torch.distributed.DistError, RuntimeError) as e:
            if not dist.active or not _collective_failure(e):
                raise
            broken = True  # destroying a group whose peer is gone can block: leave it to exit
            what = f"timed out after ddp.timeout_s={cfg.ddp.timeout_s:g} s" if _timed_out(e) else "failed"
            raise WMError(f"rank {dist.rank}: a collective {what} ({str(e).strip().splitlines()[0][:200]}); "
                          "another rank died or hung (see its log). Checkpoints are intact: rerun the "
                          "same command to resume") from None
        finally:
            if status:
                run.log.hparams_end(status)
        if dist.is_main:
            report(run, cfg, results, times, t0)
        ended = "finished"  # after summary.json: a finished record means the figures are on disk
        return 0
    finally:
        if run is not None:
            end_record(run, ended, sys.exc_info()[1])
            run.log.close()
            run.close()  # the lock goes last: nothing of this run is written after it
        if not broken:
            distributed.close(dist)
