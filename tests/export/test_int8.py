"""INT8 deployment (wm/export/int8.py): our entropy thresholds in a Q/DQ ONNX and a TensorRT cache, the
graph structure onnxruntime's quantizer produced, bad input, and the accuracy report."""

import json
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from wm.export import int8 as I
from wm.export.calib import HistogramCollector, entropy_threshold, read_cache
from wm.utils.errors import WMError

QUANT = ("Conv", "ConvTranspose", "MatMul", "Gemm")
FLOAT_OPS = ("Softmax", "GroupNormalization", "LayerNormalization", "InstanceNormalization", "ReduceMean",
             "Gather", "GatherElements", "GatherND", "Einsum", "ArgMax", "ArgMin", "TopK")


@pytest.fixture(scope="module")
def run(trained_tiny):
    """A tiny trained run (2 + 2 steps), its three FP32 graphs (and their exported programs) and
    FP16 copies, then run_int8 on onnxruntime (8 calibration windows of 18 in the train split, all
    9 val windows)."""
    import torch
    from wm.export.onnx import OUTPUTS, dynamic_shapes, example_inputs, export_graph, fp16_model, graphs
    from wm.checkpoint.trained import load_trained

    t = trained_tiny
    torch.set_grad_enabled(False)
    trained = load_trained(t.run_dir())
    out = t.base / "export"
    out.mkdir()
    ex = example_inputs(trained, 2)
    programs = {}
    for name, module in graphs(trained).items():
        _, programs[name] = export_graph(module, ex[name], OUTPUTS[name], out / f"{name}.onnx",
                                         dynamic_shapes(trained, name, ex[name], 64))
        onnx.save(fp16_model(onnx.load(str(out / f"{name}.onnx"))), str(out / f"{name}.fp16.onnx"))
    lines = []
    res = I.run_int8(trained, out, calib_windows=8, eval_windows=0, batch=4, log=lines.append, engine="onnxruntime")
    torch.set_grad_enabled(True)
    return SimpleNamespace(t=t, trained=trained, out=out, res=res, lines=lines, programs=programs, ex=ex)


# ---------------------------------------------------------------------------------------------
# helpers that read the graphs on their own (not through wm.export.int8)


def producers(model):
    return {o: n for n in model.graph.node for o in n.output}


def inits(model):
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def data_slots(node, initializers):
    slots = (0,) if node.op_type in ("Conv", "ConvTranspose") else (0, 1)
    return [i for i in slots if i < len(node.input) and node.input[i] not in initializers]


def head_nodes(model):
    """Heads by their weights: the world model's out_conv, the tokenizer's enc_out/dec_out, and the
    codebook-distance Gemm of the nearest-code search."""
    out = set()
    for n in model.graph.node:
        if n.op_type == "Gemm" or (n.op_type == "Conv" and n.input[1] in (
                "world.out_conv.weight", "tok.enc_out.weight", "tok.dec_out.weight")):
            out.add(n.name)
    return out


def pose_linears(trained, graph):
    """The world model's Linear layers that work on its pose tokens, counted on the PyTorch module:
    the pose MLPs, each level's conditioning, and the pose layers' but for their cells' keys/values."""
    import re

    import torch
    from wm.export.onnx import graphs

    per_frame = ("pose_in", "enc_pose", "mid_pose", "dec_pose", "pose_ups", "cond")
    n = 0
    for name, m in graphs(trained)[graph].named_modules():
        parts = name.split(".")
        if isinstance(m, torch.nn.Linear) and (any(p in per_frame for p in parts) or (
                re.search(r"\.pose\.\d+\.", name) and parts[-1] != "kv")):
            n += 1
    return n


def product_nodes(model):
    """Matrix products of two activations (attention), by their inputs: neither is an initializer."""
    f_init = inits(model)
    return {n.name for n in model.graph.node if n.op_type == "MatMul" and len(data_slots(n, f_init)) == 2}


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("graph", ["tokenizer_encode", "world_step", "tokenizer_decode"])
def test_qdq_on_every_quantized_input_and_none_on_float_ops(run, graph):
    fp32 = onnx.load(str(run.out / f"{graph}.onnx"))
    q = onnx.load(str(run.out / f"{graph}.int8.onnx"))
    onnx.checker.check_model(q, full_check=True)
    f_init, q_init, prod = inits(fp32), inits(q), producers(q)
    orig = {n.name: n for n in fp32.graph.node}
    # same computation: the Q/DQ graph is the float graph plus Q/DQ nodes
    ops = lambda m: sorted(n.op_type for n in m.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear"))
    assert ops(q) == ops(fp32)
    heads = head_nodes(fp32)
    assert heads, "the graph should have output heads"
    quantized, float_nodes = set(), set()
    for n in q.graph.node:
        if n.op_type not in QUANT:
            continue
        reads_dq = [i for i, t in enumerate(n.input) if t in prod and prod[t].op_type == "DequantizeLinear"]
        if not reads_dq:
            float_nodes.add(n.name)
            continue
        quantized.add(n.name)
        o = orig[n.name]
        for i in data_slots(o, f_init):  # EVERY float data input of a quantized node goes through Q -> DQ
            dq = prod.get(n.input[i])
            assert dq is not None and dq.op_type == "DequantizeLinear", (n.name, i)
            qn = prod.get(dq.input[0])
            assert qn is not None and qn.op_type == "QuantizeLinear", (n.name, i)
            assert qn.input[0] == o.input[i]  # of the original tensor, by its ONNX name
            assert q_init[qn.input[2]].dtype == np.int8 and int(q_init[qn.input[2]]) == 0
            assert q_init[qn.input[1]].size == 1  # per tensor
        if n.op_type in ("Conv", "ConvTranspose") or (n.op_type == "MatMul" and o.input[1] in f_init):
            dq = prod[n.input[1]]  # weight: int8 initializer, per-channel scales
            assert dq.op_type == "DequantizeLinear" and q_init[dq.input[0]].dtype == np.int8
            w = f_init[o.input[1]]
            axis = next(a.i for a in dq.attribute if a.name == "axis")
            assert axis == {"Conv": 0, "ConvTranspose": 1, "MatMul": 1}[n.op_type]
            assert q_init[dq.input[1]].shape == (w.shape[axis],)
        if len(n.input) > 2 and n.input[2]:  # bias stays float (onnxruntime may give a shared one a copy)
            assert n.input[2] not in prod and q_init[n.input[2]].dtype == np.float32
            assert np.array_equal(q_init[n.input[2]], f_init[o.input[2]])
    products = product_nodes(fp32)
    assert products or graph != "world_step"  # its attention
    pose = set(I.pose_path(fp32))
    assert len(pose) == pose_linears(run.trained, graph)
    # exactly the heads, the attention's products and the pose-token path stay float
    assert float_nodes == heads | products | pose
    rep = run.res["int8"]["graphs"][graph]
    assert set(rep["nodes_float"]) == heads | products | pose and rep["nodes_quantized"] == len(quantized) > 0
    assert all(rep["nodes_float"][n] == "product of two activations (attention)" for n in products - heads)
    kinds = {orig[n].op_type for n in quantized}
    assert {"Conv", "MatMul"} <= kinds and ("ConvTranspose" in kinds or graph != "world_step")
    # no Q/DQ feeds anything else: every DQ output is read by quantized nodes only; no float op
    # (softmax, normalisation, gather/embeddings, einsum, argmax, heads...) reads a dequantized tensor
    for n in q.graph.node:
        if n.name in quantized or n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        for t in n.input:
            assert not (t in prod and prod[t].op_type in ("QuantizeLinear", "DequantizeLinear")), (n.name, n.op_type, t)
    present = {n.op_type for n in q.graph.node}
    assert present & set(FLOAT_OPS)  # the check above did cover such ops
    assert not any(prod.get(o.name) is not None and prod[o.name].op_type == "DequantizeLinear" for o in q.graph.output)


def test_scales_are_our_thresholds_in_graph_and_cache(run):
    import torch

    for graph in ("tokenizer_encode", "world_step", "tokenizer_decode"):
        q = onnx.load(str(run.out / f"{graph}.int8.onnx"))
        q_init = inits(q)
        graph_scales = {}
        for n in q.graph.node:
            if n.op_type == "QuantizeLinear":
                s = q_init[n.input[1]]
                assert s.dtype == np.float32 and s.size == 1
                prev = graph_scales.setdefault(n.input[0], float(s))
                assert prev == float(s)  # dedicated pairs of one tensor share its scale
        detail = json.loads((run.out / f"{graph}.calib.json").read_text())["tensors"]
        assert set(graph_scales) == set(detail) and len(detail) == run.res["int8"]["graphs"][graph]["tensors_quantized"]
        for name, d in detail.items():
            assert graph_scales[name] == float(np.float32(d["amax"] / 127.0)), name
            assert 0 < d["amax"] <= d["max"] * 1.01 + 1e-6  # an entropy cut-off, never far above the max
        header, cache = read_cache(run.out / f"{graph}.calib.cache")
        assert header == "TRT-100300-EntropyCalibration2"
        assert list(cache) == [k for k in detail]  # ONNX tensor names, graph order
        for name, s in cache.items():
            assert s == graph_scales[name]  # float32 bit pattern round trip
    # thresholds recomputed independently, in PyTorch: the decoder's first two Conv inputs are the
    # codebook lookup of the calibration codes (rows of a table: its exact max, not the entropy
    # search) and silu(norm1(dec_in(zq))) (continuous: the entropy cut-off lands well below the
    # max). Two-pass calibration = the reference's histogram of the whole calibration set as ONE batch.
    import torch.nn.functional as F

    from wm.data.windows import OccWindows

    tr, tok = run.trained, run.trained.tokenizer
    ds = OccWindows(tr.cfg.data.root, tr.cfg.data.train_split, tr.cfg.data)
    idx = np.unique(np.linspace(0, len(ds) - 1, 8).round().astype(int))
    with torch.no_grad():
        occ = torch.stack([ds[int(i)]["occ"] for i in idx])[:, tr.cfg.data.past:]  # the decoder sees future frames
        zq = tok.quantizer.lookup(tok.encode(occ.reshape(-1, *occ.shape[2:])))
        x1 = F.silu(tok.decoder[0].norm1(tok.dec_in(zq)))
    dec = onnx.load(str(run.out / "tokenizer_decode.onnx"))
    convs = [n for n in dec.graph.node if n.op_type == "Conv"]
    assert [c.input[1] for c in convs[:2]] == ["tok.dec_in.weight", "tok.decoder.0.conv1.weight"]
    detail = json.loads((run.out / "tokenizer_decode.calib.json").read_text())["tensors"]
    rules = ("max (rows of table tok.quantizer.codebook.weight)", "entropy")
    for conv, value, rule in zip(convs, (zq, x1), rules):
        col = HistogramCollector()
        col.update("t", value)
        ref = entropy_threshold(*col.histogram("t")) if rule == "entropy" else float(value.abs().max())
        got = detail[conv.input[0]]
        assert got["rule"] == rule, (conv.input[0], got)
        assert math.isclose(got["amax"], ref, rel_tol=1e-5), (conv.input[0], got, ref)
        assert math.isclose(got["max"], col.amax("t"), rel_tol=1e-5)
    assert detail[convs[1].input[0]]["amax"] < 0.97 * detail[convs[1].input[0]]["max"]  # a real cut-off


def test_data_ranged_tensors_take_their_exact_max(run):
    """Table lookups (class embedding in front of the encoder, codebook in front of the decoder), the
    ego-motion inputs of the pose MLP and the attention weights (Softmax outputs, in [0, 1]) are
    found from the graph alone, and only they are left out of the entropy search: their threshold
    is their exact max. The attention weights feed only products of two activations, float by
    default, so they are not calibrated at all here, nor is the motion input, whose reader is on the
    pose-token path, float by default (test_attention_products_and_pose_path_...)."""
    tok = run.trained.tokenizer
    want = {"tokenizer_encode": ({"rows of table tok.class_embed.weight"}, 0),
            "tokenizer_decode": ({"rows of table tok.quantizer.codebook.weight"}, 0),
            # the ego-motion features in front of the pose MLP: one tensor, the step's motion input
            "world_step": ({"values of input motion"}, 1)}
    for graph, (reasons, motion_tensors) in want.items():
        found = I.exact_range_tensors(run.out / f"{graph}.onnx")
        m = onnx.load(str(run.out / f"{graph}.onnx"))
        prod = producers(m)
        softmax = {t for t in I.quantizable_inputs(m) if t in prod and prod[t].op_type == "Softmax"}
        assert {t for t, why in found.items() if t in prod and why == f"probabilities of {prod[t].name}"} == softmax, graph
        assert softmax or graph != "world_step"  # its temporal attention
        assert set(found.values()) - {found[t] for t in softmax} == reasons, graph
        assert sum(r.startswith("values of input") for r in found.values()) == motion_tensors, graph
        detail = json.loads((run.out / f"{graph}.calib.json").read_text())["tensors"]
        # the motion input's one reader is the pose MLP, float by default like the products
        motion = {t for t, why in found.items() if why.startswith("values of input")}
        calibrated = {t: why for t, why in found.items() if t not in softmax | motion}
        assert not (softmax | motion) & set(detail), graph
        assert {t: d["rule"] for t, d in detail.items() if d["rule"] != "entropy"} == \
            {t: f"max ({why})" for t, why in calibrated.items()}, graph
        assert run.res["int8"]["graphs"][graph]["exact_range_at_max"] == calibrated
        for t in calibrated:
            assert detail[t]["amax"] == detail[t]["max"] > 0
    # the encoder-input threshold is the largest |value| of the class vectors the frames use
    enc = json.loads((run.out / "tokenizer_encode.calib.json").read_text())["tensors"]
    (t,) = [t for t, why in I.exact_range_tensors(run.out / "tokenizer_encode.onnx").items() if why.startswith("rows")]
    w = tok.class_embed.weight.detach().abs()
    free = run.trained.cfg.data.free_class
    assert float(w[free].max()) <= enc[t]["amax"] + 1e-6 and enc[t]["amax"] <= float(w.max()) + 1e-6


def test_attention_products_and_pose_path_stay_float_unless_asked(run, tmp_path):
    """By default the products of two activations (the attention's Q Kt and A V) and the pose-token
    path read no Q/DQ and their inputs are not calibrated; with products=True (export.py
    --int8-attention) the products read Q/DQ on both inputs, and the attention weights among those
    take their exact max, at most 1; with pose=True (--int8-pose) the pose path reads Q/DQ, and the
    motion input in front of it takes its exact max."""
    g = "world_step"
    m = onnx.load(str(run.out / f"{g}.onnx"))
    products, heads, prod = product_nodes(m) - head_nodes(m), head_nodes(m), producers(m)
    assert products and set(I.activation_products(m)) - heads == products
    assert run.res["int8"]["calibration"]["activation_products"] == "float"
    assert run.res["int8"]["calibration"]["pose_path"] == "float"
    pose = set(I.pose_path(m))
    assert pose and not pose & (products | heads)
    softmax = {t for t in I.quantizable_inputs(m) if t in prod and prod[t].op_type == "Softmax"}
    assert softmax and all(n in products for t in softmax for n in I.quantizable_inputs(m)[t])
    for name in I.GRAPH_NAMES:
        shutil.copy(run.out / f"{name}.onnx", tmp_path / f"{name}.onnx")
    # which inputs read Q/DQ, and the exact-range rule, whatever picks the other thresholds: "max"
    # spares the entropy search
    res = I.int8_export(run.trained, tmp_path, 4, engine="onnxruntime", products=True, pose=True,
                        method="max", log=lambda s: None)
    assert res["calibration"]["activation_products"] == "int8" and res["calibration"]["pose_path"] == "int8"
    for kind in (".int8", ".int8-ort"):
        q = onnx.load(str(tmp_path / f"{g}{kind}.onnx"))
        qprod = producers(q)
        for n in q.graph.node:
            if n.name in products:
                assert all(qprod[t].op_type == "DequantizeLinear" for t in n.input[:2]), (kind, n.name)
            if n.name in pose:
                assert qprod[n.input[0]].op_type == "DequantizeLinear", (kind, n.name)
    detail = json.loads((tmp_path / f"{g}.calib.json").read_text())["tensors"]
    for t in softmax:
        assert detail[t]["rule"] == f"max (probabilities of {prod[t].name})", t
        assert 0 < detail[t]["amax"] == detail[t]["max"] <= 1.0 + 1e-6, t
    (motion,) = [t for t, why in I.exact_range_tensors(m).items() if why.startswith("values of input")]
    assert detail[motion]["rule"] == "max (values of input motion)" and detail[motion]["amax"] == detail[motion]["max"]
    assert res["graphs"][g]["nodes_quantized"] == \
        run.res["int8"]["graphs"][g]["nodes_quantized"] + len(products) + len(pose)


def test_no_weight_is_calibrated_as_an_activation(run):
    """The exporter's Transpose(weight) in front of MatMuls is folded at export, so every weight is an
    initializer: per-channel int8 weights, and no activation scale on a weight."""
    for graph in ("tokenizer_encode", "world_step", "tokenizer_decode"):
        m = onnx.load(str(run.out / f"{graph}.onnx"))
        ini = inits(m)
        assert not [n.name for n in m.graph.node if n.op_type == "Transpose" and n.input[0] in ini], graph
        detail = json.loads((run.out / f"{graph}.calib.json").read_text())["tensors"]
        prod = producers(m)
        for t in detail:  # every calibrated tensor depends on a graph input
            stack, seen, hit = [t], set(), False
            while stack and not hit:
                x = stack.pop()
                if x in seen:
                    continue
                seen.add(x)
                hit = x in {i.name for i in m.graph.input}
                stack.extend(i for i in (prod[x].input if x in prod else ()) if i)
            assert hit, (graph, t)


def test_more_windows_than_the_split_uses_all_of_them_with_a_note(run, tmp_path):
    notes = []
    I.check_windows(run.trained, 19, 10, log=notes.append)
    assert notes == [f"note: --calib-windows 19 but split 'train' has 18 windows ({run.trained.cfg.data.root}); using all 18",
                     f"note: --eval-windows 10 but split 'val' has 9 windows ({run.trained.cfg.data.root}); using all 9"]
    assert I.check_windows(run.trained, 18, 0, log=notes.append) == (18, 9) and len(notes) == 2
    assert I.check_windows(run.trained, 500, 64, log=notes.append) == (18, 9)
    # a missing FP32 graph is named, and nothing is written
    for g in ("tokenizer_encode", "tokenizer_decode"):
        shutil.copy(run.out / f"{g}.onnx", tmp_path / f"{g}.onnx")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(WMError, match="world_step.onnx does not exist"):
        I.int8_export(run.trained, tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_int8_forecaster_runs_and_report_has_every_variant(run):
    import torch

    from wm.export.deployed import OrtGraphs, forecast
    from wm.export.int8_report import graph_files

    cfg = run.trained.cfg
    int8 = OrtGraphs(graph_files(run.out, ".int8-ort"))
    g = torch.Generator().manual_seed(0)
    P, S = cfg.data.past, cfg.data.future
    for b in (1, 3):  # dynamic batch kept: the host loop over the three INT8 graphs
        occ = torch.randint(0, cfg.data.num_classes, (b, P, *cfg.data.grid), generator=g).to(torch.uint8)
        motion = torch.randn(b, P + S, 3, generator=g)
        y = forecast(int8, cfg, occ, motion[:, :P], motion[:, P:])
        assert y.dtype == torch.uint8 and y.shape == (b, S, *cfg.data.grid) and int(y.max()) < cfg.data.num_classes

    rep = json.loads((run.out / "report.json").read_text())
    assert rep["accuracy"] == json.loads(json.dumps(run.res["accuracy"]))
    acc = rep["accuracy"]
    assert acc["split"] == "val" and acc["windows"] == 9
    S = cfg.data.future
    assert list(acc["models"]) == ["pytorch_fp32", "onnx_fp32", "onnx_fp16", "onnx_int8", "onnx_int8_ort", "copy_last"]
    for v, r in acc["models"].items():
        for k in ("iou", "miou", "drop_iou", "drop_miou"):
            assert len(r[k]) == S and all(x is not None and math.isfinite(x) for x in r[k]), (v, k, r[k])
        assert 0 <= r["iou_avg"] <= 100 and math.isfinite(r["drop_iou_avg"])
        if v.startswith("onnx"):
            assert r["ms_per_window"] > 0 and r["engine"].startswith("onnxruntime cpu")
    # TensorRT's file is scored by its ONNX semantics, onnxruntime's copy by onnxruntime's integer kernels
    assert "Q/DQ as float ops" in acc["models"]["onnx_int8"]["engine"]
    assert acc["models"]["onnx_int8_ort"]["engine"] == "onnxruntime cpu int8 kernels"
    # the CPU whose kernels computed those rows, by model name and the instruction sets that pick them
    info = Path("/proc/cpuinfo").read_text()
    assert acc["cpu"]["name"] in info and set(acc["cpu"]["flags"]) <= {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"}
    assert all(f" {f}" in info for f in acc["cpu"]["flags"]) and ("avx2" in acc["cpu"]["flags"]) == (" avx2" in info)
    assert f"computed by (cpu: {acc['cpu']['name']}, " in I.format_report(acc)
    # the ONNX FP32 graph IS the PyTorch model: no drop at all
    fp, ox = acc["models"]["pytorch_fp32"], acc["models"]["onnx_fp32"]
    assert all(abs(d) <= 1e-6 for d in ox["drop_iou"] + ox["drop_miou"] + [ox["drop_iou_avg"], ox["drop_miou_avg"]])
    assert ox["iou"] == pytest.approx(fp["iou"], abs=1e-6) and ox["agreement_vs_pytorch"] == 1.0
    # paired bootstrap: a row equal to the reference on every window has no spread at all
    assert ox["drop_iou_avg_se"] == 0.0 and ox["drop_miou_avg_se"] == 0.0 and fp["drop_iou_avg_se"] == 0.0
    assert acc["models"]["copy_last"]["drop_iou_avg_se"] > 0
    # copy-last needs no model: its geometry IoU of future step 1, recomputed from the val windows
    from wm.data.windows import OccWindows

    ds = OccWindows(cfg.data.root, cfg.data.val_split, cfg.data)
    inter = union = 0
    for i in range(len(ds)):
        occ = ds[i]["occ"].numpy() != cfg.data.free_class
        pred, gt = occ[cfg.data.past - 1], occ[cfg.data.past]
        inter, union = inter + (pred & gt).sum(), union + (pred | gt).sum()
    assert acc["models"]["copy_last"]["iou"][0] == pytest.approx(100 * inter / union, abs=1e-9)
    table = I.format_report(acc)
    assert table in "\n".join(run.lines)
    for v in acc["models"]:
        assert any(line.startswith(v) for line in table.splitlines())
    assert rep["int8"]["calibration"]["split"] == "train" and rep["int8"]["calibration"]["windows"] == 8
    assert not list(run.out.glob(".*tmp*"))


def test_drop_standard_error_is_the_spread_of_window_resamples():
    """Two classes (free = 0), two steps. The reference is right on every voxel of every window; the
    row misses k of the 10 occupied voxels of window k at step 1 and none at step 2. Its step-1 IoU
    on a resample is 1 - sum(k)/(10 W), so that step's drop has the standard error
    100 * std(k) / (10 sqrt(W)) up to the bootstrap's own noise; step 2's is 0, and the average of
    the two steps has half step 1's."""
    import torch

    from wm.export.int8_report import drop_se

    W = 400
    miss = torch.arange(W) % 5  # 0..4 missed voxels, std sqrt(2)
    ref = torch.zeros(W, 2, 2, 2, dtype=torch.int64)
    ref[:, :, 1, 1] = 10
    row = ref.clone()
    row[:, 0, 1, 1] -= miss
    row[:, 0, 1, 0] += miss
    se = drop_se({"pytorch_fp32": ref, "row": row}, free=0, resamples=4000)
    want = 100 * miss.double().std(unbiased=False).item() / (10 * W ** 0.5)
    assert se["pytorch_fp32"] == {"drop_iou_avg_se": 0.0, "drop_miou_avg_se": 0.0,
                                  "drop_iou_se": [0.0, 0.0], "drop_miou_se": [0.0, 0.0]}
    r = se["row"]
    assert r["drop_iou_se"][0] == pytest.approx(want, rel=0.05) and r["drop_iou_se"][1] == 0.0
    assert r["drop_iou_avg_se"] == pytest.approx(want / 2, rel=0.05)
    # mIoU here is the one class's IoU: the same errors
    assert r["drop_miou_se"] == pytest.approx(r["drop_iou_se"], rel=1e-9)
    assert r["drop_miou_avg_se"] == pytest.approx(r["drop_iou_avg_se"], rel=1e-9)
    one = drop_se({"pytorch_fp32": ref[:1], "row": row[:1]}, free=0)["row"]
    assert one == {"drop_iou_avg_se": None, "drop_miou_avg_se": None, "drop_iou_se": [None, None],
                   "drop_miou_se": [None, None]}


def test_graph_parity_counts_what_each_graph_agrees_on():
    """GraphParity returns the main engine's outputs and counts, per graph, the codes both engines
    give on the same inputs, and tokenizer_decode's classes by the argmax of its logits; the world
    step's float motion is no class and is not counted."""
    import torch

    from wm.export.int8_report import GraphParity

    def main(name, x):
        if name == "tokenizer_decode":
            return (torch.tensor([[[1.0, 2.0, 3.0]], [[5.0, 1.0, 0.0]]]).permute(0, 2, 1),)  # classes 2, 0
        if name == "world_step":
            return torch.arange(4), torch.zeros(3)
        return (torch.arange(10),)

    def other(name, x):
        if name == "tokenizer_decode":
            return (torch.tensor([[[1.0, 9.0, 3.0]], [[5.0, 1.0, 0.0]]]).permute(0, 2, 1),)  # classes 1, 0
        if name == "world_step":
            return torch.tensor([0, 1, 2, 0]), torch.ones(3)  # motion differs: not counted
        return (torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 0]),)

    t = GraphParity(main, other)
    for g in ("tokenizer_encode", "world_step", "world_step", "tokenizer_decode"):
        out = t(g, torch.zeros(1))
        assert all(torch.equal(a, b) for a, b in zip(out, main(g, None)))
    assert t.counts == {"tokenizer_encode": [8, 10], "world_step": [6, 8], "tokenizer_decode": [1, 2]}
    assert t.agreement() == {"tokenizer_encode": 0.8, "world_step": 0.75, "tokenizer_decode": 0.5}
    assert GraphParity(main, other).agreement() == dict.fromkeys(t.counts)


def test_mixed_runs_each_graph_on_its_engine():
    from wm.export.int8_report import Mixed

    calls = []
    m = Mixed(lambda n, *x: calls.append(("int8", n)) or ("q",), lambda n, *x: calls.append(("fp32", n)) or ("f",),
              ("world_step",))
    assert [m(g, None) for g in ("tokenizer_encode", "world_step", "tokenizer_decode")] == [("f",), ("q",), ("f",)]
    assert calls == [("fp32", "tokenizer_encode"), ("int8", "world_step"), ("fp32", "tokenizer_decode")]
    # with a device, every output lands there (onnxruntime's come back as CPU tensors), but the world
    # step's cache rows: the host loop gives them back to the engine that made them
    import torch

    m = Mixed(lambda n, *x: (torch.ones(2, dtype=torch.float64), torch.zeros(3), torch.zeros(1, 1, 4)),
              lambda n, *x: (torch.zeros(1),), ("world_step",), torch.device("meta"))
    assert [t.device.type for g in ("world_step", "tokenizer_decode") for t in m(g)] == ["meta", "meta", "cpu", "meta"]


def test_int8_float_keeps_the_matching_nodes_float_and_refuses_a_bad_pattern(run, tmp_path):
    """--int8-float: the convolutions and matrix products of the matching module paths get no Q/DQ
    (in TensorRT's file and onnxruntime's copy), the others keep theirs; a pattern that is no regular
    expression, or matches nothing, is one line before any calibration."""
    import shutil

    from wm.export.quantizable import _scope

    for g in I.GRAPH_NAMES:
        shutil.copy(run.out / f"{g}.onnx", tmp_path / f"{g}.onnx")
    models = {g: onnx.load(str(tmp_path / f"{g}.onnx")) for g in I.GRAPH_NAMES}
    with pytest.raises(I.Int8Error, match=r"--int8-float '\[' is no regular expression"):
        I.int8_export(run.trained, tmp_path, 4, engine="onnxruntime", exclude_scopes="[", log=lambda s: None)
    with pytest.raises(I.Int8Error, match=r"matches no convolution or matrix product; module paths are e\.g\. .*tok\."):
        I.int8_export(run.trained, tmp_path, 4, engine="onnxruntime", exclude_scopes="no_such_module",
                      log=lambda s: None)
    assert not list(tmp_path.glob("*.int8.onnx"))
    kept = I.kept_float(models, r"tok\.decoder")
    assert kept["world_step"] == [] and kept["tokenizer_encode"] == [] and len(kept["tokenizer_decode"]) >= 2
    # which nodes stay float does not depend on the thresholds: "max" spares the entropy search
    I.int8_export(run.trained, tmp_path, 4, engine="onnxruntime", exclude_scopes=r"tok\.decoder", method="max",
                  log=lambda s: None)
    for kind in (".int8", ".int8-ort"):
        q = onnx.load(str(tmp_path / f"tokenizer_decode{kind}.onnx"))
        prod = producers(q)
        fed = {n.name: any(prod.get(t) is not None and prod[t].op_type == "DequantizeLinear" for t in n.input)
               for n in q.graph.node if n.op_type in I.QUANT_OP_TYPES}
        in_decoder = {n.name for n in q.graph.node if n.op_type in I.QUANT_OP_TYPES and "tok.decoder" in _scope(n)}
        assert in_decoder and not any(fed[n] for n in in_decoder), kind
        assert any(fed[n] for n in set(fed) - in_decoder), kind  # the rest stays INT8
    # export.py's default: the whole tokenizer float. The GPU path's report (engine torch, here on
    # the CPU) runs the world step's file in onnxruntime and the float tokenizer as PyTorch FP32, and
    # leaves out the breakdown rows (they would repeat pytorch_fp32 and onnx_int8_ort)
    import torch

    from wm.export.collect import batches, windows
    from wm.export.deployed import OrtGraphs, TorchGraphs, forecast
    from wm.export.onnx import graphs
    from wm.export.int8_report import Mixed, accuracy_report, graph_files
    from wm.evaluation.metrics import ConfusionMatrix

    I.int8_export(run.trained, tmp_path, 4, engine="onnxruntime", exclude_scopes=r"tok\.", method="max",
                  log=lambda s: None)
    acc = accuracy_report(run.trained, tmp_path, 3, batch=2, engine="torch", device="cpu", parity_windows=0,
                          log=lambda s: None)
    assert list(acc["models"]) == ["pytorch_fp32", "onnx_int8", "onnx_int8_ort", "copy_last"]
    assert acc["models"]["onnx_int8_ort"]["engine"] == (
        "onnxruntime cpu int8 kernels on the .int8-ort.onnx files of world_step; tokenizer_encode, "
        "tokenizer_decode (no quantized node) torch cpu FP32")
    assert acc["models"]["onnx_int8"]["engine"].startswith("the onnx_int8_ort rollout")
    # the row is the world step's file itself, scored here by hand on the same 3 windows
    cfg = run.trained.cfg
    P, S = cfg.data.past, cfg.data.future
    own = Mixed(OrtGraphs(graph_files(tmp_path, ".int8-ort")), TorchGraphs(graphs(run.trained)), ["world_step"],
                torch.device("cpu"))
    ds, idx, _ = windows(run.trained, None, cfg.data.val_split, 3, "", lambda s: None)
    cm = ConfusionMatrix(cfg.data.num_classes, cfg.data.free_class, S)
    for b in batches(ds, idx, 2):
        fut = b["motion"][:, P:] if cfg.train.forecast_motion == "given" else None
        cm.update(forecast(own, cfg, b["occ"][:, :P], b["motion"][:, :P], fut), b["occ"][:, P:],
                  b["mask"][:, P:] if "mask" in b else None)
    want = cm.summary()
    for v in ("onnx_int8_ort", "onnx_int8"):
        assert acc["models"][v]["iou"] == pytest.approx(want["iou"], abs=1e-9), v
        assert acc["models"][v]["miou"] == pytest.approx(want["miou"], abs=1e-9), v
    # a TensorRT file that no longer holds the copy's values gets its own rollout: its file in
    # onnxruntime with Q/DQ as float ops
    q = onnx.load(str(tmp_path / "world_step.int8.onnx"))
    names = {i.name for i in q.graph.initializer}
    w = next(n.input[0] for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in names)
    for i in q.graph.initializer:
        if i.name == w:
            i.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(i) ^ np.int8(1), w))
    onnx.save(q, str(tmp_path / "world_step.int8.onnx"))
    # a host memory budget that holds no second rollout beside the process: one at a time, said so
    lines = []
    acc = accuracy_report(run.trained, tmp_path, 2, batch=2, engine="torch", device="cpu", parity_windows=0,
                          log=lines.append, workers=2, memory_gib=0.01)
    assert acc["models"]["onnx_int8"]["engine"] == (
        "onnxruntime cpu, Q/DQ as float ops (one session at a time: the host memory budget held no second), "
        "on the .int8.onnx files of world_step; the rest torch cpu FP32")
    s = acc["int8_sessions"]
    assert s["side_by_side"] == 1 and s["most"] == 2 and s["budget_gib"] == 0.01 and s["process_gib"] > 0.01
    assert s["one_rollout_gib"] is not None  # measured (a tiny model's rollout can round to 0.00 GiB)
    assert any(x.startswith("report: one INT8 rollout held ") and "1 side by side (not 2)" in x for x in lines)


def test_torch_engine_report_runs_the_int8_files_and_holds_fp32_parity(run):
    """The GPU path's report (engine torch; here on the CPU): its INT8 rows are the files' own (every
    graph of this fixture is quantized, so onnxruntime runs them all and the rows are the onnxruntime
    engine's, number for number); parity runs the FP32 files in onnxruntime on the first windows, as
    rollouts and graph by graph on PyTorch's own inputs, scores both, and the table prints the
    per-step drops."""
    from wm.export.int8_report import accuracy_report, format_report

    cfg = run.trained.cfg
    lines = []
    # two onnxruntime sessions side by side roll out the windows: the same numbers, in the same order
    acc = accuracy_report(run.trained, run.out, 4, batch=2, engine="torch", device="cpu", parity_windows=3,
                          log=lines.append, workers=2)
    assert acc["models"]["onnx_int8_ort"]["engine"] == (
        f"onnxruntime cpu int8 kernels (2 sessions side by side, {max(1, os.cpu_count() // 2)} thread"
        f"{'s' * (os.cpu_count() > 3)} each) on the .int8-ort.onnx files of tokenizer_encode, world_step, tokenizer_decode")
    # the copy holds the TensorRT file's values: one rollout gives both rows
    assert acc["models"]["onnx_int8"]["engine"] == ("the onnx_int8_ort rollout (its .int8-ort.onnx files hold "
                                                     "these files' values)")
    assert acc["int8_sessions"]["side_by_side"] == 2 and acc["int8_sessions"]["budget_gib"] == 8.0
    ort = accuracy_report(run.trained, run.out, 4, batch=2, engine="onnxruntime", rows=["onnx_int8_ort"],
                          log=lambda s: None)
    for v in ("onnx_int8", "onnx_int8_ort"):
        for k in ("iou", "miou", "agreement_vs_pytorch", "drop_iou_se", "drop_miou_se"):
            assert acc["models"][v][k] == pytest.approx(ort["models"]["onnx_int8_ort"][k], abs=1e-12), (v, k)
    p = acc["parity"]
    assert p["windows"] == 3 and p["seconds"] > 0
    # the parity also scores the FP32 files' rollouts and PyTorch's on those windows: the first 3 of
    # the report's 4, in its batches ([0, 1], then [2] cut from [2, 3]); scored here by hand
    from wm.export.collect import batches, windows
    from wm.export.deployed import TorchGraphs, forecast
    from wm.export.onnx import graphs
    from wm.export.int8_report import ort_row
    from wm.evaluation.metrics import ConfusionMatrix

    ds, idx, _ = windows(run.trained, None, cfg.data.val_split, 4, "", lambda s: None)
    P, S = cfg.data.past, cfg.data.future
    engines = {"onnx_fp32": ort_row(run.out, "onnx_fp32"), "pytorch_fp32": TorchGraphs(graphs(run.trained))}
    cms = {v: ConfusionMatrix(cfg.data.num_classes, cfg.data.free_class, S) for v in engines}
    for b in batches(ds, idx[:3], 2):
        fut = b["motion"][:, P:] if cfg.train.forecast_motion == "given" else None
        for v, eng in engines.items():
            cms[v].update(forecast(eng, cfg, b["occ"][:, :P], b["motion"][:, :P], fut), b["occ"][:, P:],
                          b["mask"][:, P:] if "mask" in b else None)
    want = {v: cm.summary() for v, cm in cms.items()}
    assert set(p["accuracy"]) == set(p["graphs"]) == {"onnx_fp32_vs_pytorch_fp32"}
    a = p["accuracy"]["onnx_fp32_vs_pytorch_fp32"]
    assert (a["file_iou_avg"], a["file_miou_avg"]) == pytest.approx((want["onnx_fp32"]["iou_avg"],
                                                                      want["onnx_fp32"]["miou_avg"]), abs=1e-9)
    assert (a["torch_iou_avg"], a["torch_miou_avg"]) == pytest.approx((want["pytorch_fp32"]["iou_avg"],
                                                                        want["pytorch_fp32"]["miou_avg"]), abs=1e-9)
    # onnxruntime's CPU minutes are a phase after the report's windows, with their own progress, so
    # the report's rate and ETA are its rows' alone
    said = [i for i, ln in enumerate(lines) if ln.startswith("parity: onnxruntime runs")]
    done = [i for i, ln in enumerate(lines) if ln.strip().startswith("report: 4/4 windows")]
    assert len(said) == 1 and done and done[0] < said[0], lines
    assert lines[said[0] + 1:][-1].strip().startswith("parity: 3/3 windows x files"), lines
    g = p["graphs"]["onnx_fp32_vs_pytorch_fp32"]
    assert list(g) == ["tokenizer_encode", "world_step", "tokenizer_decode"]
    assert all(x >= 0.99 for x in g.values()), g  # FP32 against FP32: a near-tie may flip
    assert min(g.values()) >= p["onnx_fp32_vs_pytorch_fp32"]  # one flipped token moves every later frame
    for v in ("onnx_fp16", "onnx_int8", "onnx_int8_ort"):
        r = acc["models"][v]
        assert len(r["drop_iou_se"]) == S and all(x is not None and x >= 0 for x in r["drop_miou_se"])
    # the breakdown rows: one part INT8 (the files), the rest FP32
    for v, part in (("int8_tokenizer", "tokenizer_encode, tokenizer_decode"), ("int8_world", "world_step")):
        r = acc["models"][v]
        assert r["engine"] == f"{part} as onnx_int8_ort, the rest as pytorch_fp32"
        assert len(r["drop_miou"]) == S and all(math.isfinite(x) for x in r["drop_miou"])
    table = format_report(acc)
    assert "drop per future step vs pytorch_fp32" in table
    said = [ln for ln in table.splitlines() if ln.startswith("parity on 3 windows (voxels equal): ")]
    assert len(said) == 1 and "seconds" not in said[0] and said[0].count(" 0.") + said[0].count(" 1.") == 1, said
    assert "each graph on the same inputs, onnx_fp32_vs_pytorch_fp32: tokenizer_encode" in table
    per_step = [ln for ln in table.splitlines() if ln.startswith("  onnx_int8 ")]
    assert len(per_step) == 1 and f"t+{S} " in per_step[0] and "±" in per_step[0]
    assert "IoU / mIoU on these windows, the file in onnxruntime | its torch row, onnx_fp32_vs_pytorch_fp32" in table
    # a report of some rows: the FP32 parity still holds the files to PyTorch
    few = accuracy_report(run.trained, run.out, 2, batch=2, engine="torch", device="cpu", parity_windows=1,
                          log=lambda s: None, rows=["onnx_int8_ort"])
    assert list(few["models"]) == ["pytorch_fp32", "onnx_int8_ort", "copy_last"]
    assert set(few["parity"]["graphs"]) == {"onnx_fp32_vs_pytorch_fp32"}


@pytest.mark.cuda
def test_torch_engine_report_on_a_gpu_is_the_files_own(run):
    """On a GPU the INT8 rows' graphs come back from onnxruntime on the CPU and meet the GPU's
    tensors in one rollout: the rows are the onnxruntime engine's, number for number."""
    from wm.export.int8_report import accuracy_report

    acc = accuracy_report(run.trained, run.out, 3, batch=2, engine="torch", device="cuda", parity_windows=1,
                          log=lambda s: None)
    ort = accuracy_report(run.trained, run.out, 3, batch=2, engine="onnxruntime", rows=["onnx_int8_ort"],
                          log=lambda s: None)
    assert acc["models"]["pytorch_fp32"]["engine"] == "torch cuda"
    for k in ("iou", "miou"):
        assert acc["models"]["onnx_int8_ort"][k] == pytest.approx(ort["models"]["onnx_int8_ort"][k], abs=1e-12), k
    assert acc["parity"]["windows"] == 1 and acc["parity"]["onnx_fp32_vs_pytorch_fp32"] >= 0.9


def _small_model(path: Path):
    """x -> Conv(w1) -> a; a -> Conv(w2) -> b (quantized); a -> InstanceNormalization -> c (float);
    b, c -> MatMul -> Softmax -> MatMul(y) -> ArgMax -> out; a -> Conv(w2) -> ArgMax -> out2 (a head,
    float, sharing conv2's weight). `a` has ONE quantized consumer and float ones, and w2 a float
    consumer: the cases where onnxruntime wires a DequantizeLinear into every consumer."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((4, 4, 1, 1)).astype(np.float32)
    ones, zeros = np.ones(4, np.float32), np.zeros(4, np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["a", "w2"], ["b"], name="conv2"),
        helper.make_node("InstanceNormalization", ["a", "g", "beta"], ["c"], name="norm"),
        helper.make_node("Transpose", ["c"], ["ct"], name="tr", perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["b", "ct"], ["s"], name="mm1"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "b"], ["o"], name="mm2"),
        helper.make_node("ArgMax", ["o"], ["out"], name="argmax", axis=1, keepdims=0),
        helper.make_node("Conv", ["a", "w2"], ["d"], name="head"),  # shares w2 with conv2
        helper.make_node("ArgMax", ["d"], ["out2"], name="argmax2", axis=1, keepdims=0),
    ]
    g = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, 6, 6])],
                          [helper.make_tensor_value_info("out", TensorProto.INT64, ["n", 6, 6]),
                           helper.make_tensor_value_info("out2", TensorProto.INT64, ["n", 6, 6])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
                           numpy_helper.from_array(ones, "g"), numpy_helper.from_array(zeros, "beta")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    onnx.save(m, str(path))


def test_quantize_qdq_keeps_float_consumers_float(tmp_path):
    src, dst = tmp_path / "small.onnx", tmp_path / "small.int8.onnx"
    _small_model(src)
    feeds = [{"x": np.random.default_rng(i).standard_normal((2, 2, 6, 6)).astype(np.float32)} for i in range(3)]
    import torch

    from wm.export.collect import TappedOrt

    col = HistogramCollector()  # onnxruntime's values of every quantizable input, batch by batch
    eng = TappedOrt({"small": src}, {"small": list(I.quantizable_inputs(src))}, lambda g, n, v: col.update(n, v))
    for f in feeds:
        eng("small", torch.from_numpy(f["x"]))
    assert set(col.names()) == {"x", "a", "b", "ct", "p"}  # data inputs of Conv/MatMul; no weights
    th = {k: entropy_threshold(*col.histogram(k)) for k in col.names()}
    info = I.quantize_qdq(src, dst, th)  # by default mm1, a product of two activations, stays float
    assert info["float_nodes"]["mm1"] == "product of two activations (attention)"
    assert set(info["quantized_nodes"]) == {"conv1", "conv2"}
    info = I.quantize_qdq(src, dst, th, exclude_products=False)
    # mm2 produces the values the ArgMax decides on: an output head, float; mm1 reads b, ct (quantized)
    assert set(info["float_nodes"]) == {"mm2", "head"} and set(info["quantized_nodes"]) == {"conv1", "conv2", "mm1"}
    q = onnx.load(str(dst))
    prod, qi = producers(q), inits(q)
    node = {n.name: n for n in q.graph.node}
    assert info["rewired"] >= 3
    assert node["norm"].input[0] == "a"  # float, though onnxruntime first wired the DQ of `a` into it
    assert node["head"].input == ["a", "w2"] and qi["w2"].dtype == np.float32  # the float weight is back
    assert prod[node["conv2"].input[1]].op_type == "DequantizeLinear"  # while conv2 reads it in int8
    assert node["softmax"].input[0] == "s" and node["mm2"].input[:2] == ["p", "b"]
    assert prod[node["conv2"].input[0]].op_type == "DequantizeLinear"
    for n in q.graph.node:
        if n.op_type == "QuantizeLinear":
            assert qi[n.input[1]] == np.float32(th[n.input[0]] / 127) and qi[n.input[2]] == 0
    assert {n.input[0] for n in q.graph.node if n.op_type == "QuantizeLinear"} == {"x", "a", "b", "ct"}
    # a tensor without a threshold leaves its consumer in float, and the result still runs
    th.pop("ct")
    info = I.quantize_qdq(src, dst, th, exclude_products=False)
    assert "mm1" in info["float_nodes"] and "no calibrated range" in info["float_nodes"]["mm1"]
    import onnxruntime as ort

    s = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    assert s.run(None, feeds[0])[0].shape == (2, 6, 6)


def test_torch_calibration_matches_onnxruntime(run):
    """Histograms collected on the exported programs (the GPU path, here on the CPU) and with
    onnxruntime over the ONNX files: the same tensors, the same ranges and counts up to float
    rounding at bin edges, hence the same entropy thresholds."""
    from wm.export.collect import TappedOrt, collect, windows
    from wm.export.deployed import ProgramGraphs
    from wm.export.int8_report import graph_files

    cfg = run.trained.cfg
    wanted = {g: list(I.quantizable_inputs(p)) for g, p in graph_files(run.out).items()}
    ds, idx, _ = windows(run.trained, None, "train", 4, "--calib-windows")
    pg = ProgramGraphs(run.programs, "cpu")

    def torch_engine(taps):
        pg.taps = taps
        return pg

    a = collect(torch_engine, wanted, cfg, ds, idx, 2, log=lambda s: None)
    b = collect(lambda taps: TappedOrt(graph_files(run.out), wanted, taps), wanted, cfg, ds, idx, 2, log=lambda s: None)
    close = []
    for g in wanted:
        ha, hb = a[g].histograms(), b[g].histograms()
        assert set(ha) == set(hb) == {t for t in wanted[g] if t not in a[g].zero_tensors()} and ha, g
        for i, t in enumerate(sorted(ha)):
            assert a[g].amax(t) == pytest.approx(b[g].amax(t), rel=1e-4), (g, t)
            ca, cb = ha[t][0], hb[t][0]  # two passes: 2048 bins over [0, max] of the whole set
            assert len(ca) == len(cb) == 2048 and ha[t][1][-1] == pytest.approx(a[g].amax(t))
            assert ca.sum() == cb.sum() and np.abs(ca - cb).sum() <= 0.01 * ca.sum() + 4, (g, t)
            if i % 4:  # the thresholds of every 4th tensor: each search takes ~0.3 s on 2 cores, and
                continue  # the histograms they follow from were compared bin by bin above
            # the entropy search over a few windows' histograms may move by a bin or two where a
            # float rounding moved a count across an edge: same threshold within 5 %, most (80 %) within 1 %
            ra, rb = entropy_threshold(*ha[t]), entropy_threshold(*hb[t])
            assert ra == pytest.approx(rb, rel=0.05), (g, t)
            close.append(abs(ra - rb) <= 0.01 * rb)
    assert np.mean(close) >= 0.8, np.mean(close)


def test_calibration_in_frame_groups_sees_the_same_values(run, monkeypatch):
    """Calibration runs the tokenizer graphs on a few frames at a time (memory at the occworld
    size). The frames are independent, so the counts and ranges are those of one call per batch
    (up to float rounding at bin edges); with one frame per call (the smallest group) they must not
    move, and the calls are many more."""
    import wm.export.collect as C
    from wm.export.deployed import ProgramGraphs
    from wm.export.int8_report import graph_files

    cfg = run.trained.cfg
    wanted = {g: list(I.quantizable_inputs(p)) for g, p in graph_files(run.out).items()}
    ds, idx, _ = C.windows(run.trained, None, "train", 4, "--calib-windows")
    pg = ProgramGraphs(run.programs, "cpu")
    calls = []

    def engine(taps):
        pg.taps = taps

        def call(name, *x):
            calls.append((name, len(x[0])))
            return pg(name, *x)
        return call

    whole = C.collect(engine, wanted, cfg, ds, idx, 2, log=lambda s: None)
    n_whole = len(calls)
    frame = int(np.prod(ds[0]["occ"].shape[1:]))
    monkeypatch.setattr(C, "_FRAME_VOXELS", frame)  # one frame per call
    calls.clear()
    single = C.collect(engine, wanted, cfg, ds, idx, 2, log=lambda s: None)
    assert len(calls) > 3 * n_whole and {n for g, n in calls if g != "world_step"} == {1}
    for g in wanted:
        ha, hb = whole[g].histograms(), single[g].histograms()
        assert set(ha) == set(hb) and ha
        for t in ha:
            assert whole[g].amax(t) == pytest.approx(single[g].amax(t), rel=1e-5), (g, t)
            ca, cb = ha[t][0], hb[t][0]
            # a matmul's summation order depends on its batch size, so float rounding may move a few
            # values across a bin edge (seen: 10 of 4096 softmax values); ranges and totals are exact
            assert ca.sum() == cb.sum() and np.abs(ca - cb).sum() <= 0.01 * ca.sum() + 4, (g, t)


def test_threshold_workers_equal_the_serial_search_and_a_failure_is_said(monkeypatch):
    """The entropy search in worker processes gives exactly the serial numbers; workers that cannot
    run fall back to this process with one note, and the same numbers."""
    import sys

    import numpy as np

    rng = np.random.default_rng(0)
    hists = {}
    for k in range(16):
        x = np.abs(rng.standard_normal(20000) * (1 + k)) ** (1 + k % 3)
        hists[f"t{k}"] = np.histogram(x, bins=2048, range=(0, float(x.max())))
    serial = {t: entropy_threshold(*h) for t, h in hists.items()}
    lines = []
    assert I._thresholds(hists, "entropy", workers=2, log=lines.append) == serial and lines == []
    monkeypatch.setattr(sys, "executable", "/bin/false")
    assert I._thresholds(hists, "entropy", workers=2, log=lines.append) == serial
    assert len(lines) == 1 and lines[0].startswith("note: threshold workers failed")


# ---------------------------------------------------------------------------------------------
# onnxruntime's INT8 copy: exact on every x86 CPU class (AVX2-only CPUs emulated by qemu)


def test_onnxruntime_copy_holds_tensorrts_values_as_uint8(run, tmp_path):
    """Same nodes, same scales; every int8 weight is the TensorRT file's plus 128 and every zero
    point 128 (uint8): the same dequantized values (qdq.same_values, which lets the report run one
    rollout for both files' rows). And
    onnxruntime runs the copy's matrix products in its integer kernel."""
    import onnxruntime as ort

    from wm.export.qdq import same_values
    from wm.export.int8_report import graph_files

    for g, p in graph_files(run.out, ".int8").items():
        trt, cpu = onnx.load(str(p)), onnx.load(str(p.with_name(f"{g}.int8-ort.onnx")))
        assert [(n.name, n.op_type, list(n.input)) for n in trt.graph.node] == \
            [(n.name, n.op_type, list(n.input)) for n in cpu.graph.node]
        a, b = I.qdq_scales(trt), I.qdq_scales(cpu)
        assert a["activations"].keys() == b["activations"].keys() and a["activations"]
        for t, x in a["activations"].items():
            y = b["activations"][t]
            assert (x["dtype"], x["zero_point"], y["dtype"], y["zero_point"]) == ("int8", 0, "uint8", 128)
            assert x["scale"] == y["scale"] and x["consumers"] == y["consumers"]
        ti, ci = inits(trt), inits(cpu)
        assert a["weights"].keys() == b["weights"].keys() and a["weights"]
        for w, x in a["weights"].items():
            y = b["weights"][w]
            assert ti[w].dtype == np.int8 and ci[w].dtype == np.uint8
            assert np.array_equal(ti[w].astype(np.int16) + 128, ci[w].astype(np.int16)), w
            assert set(x["zero_points"]) == {0} and set(y["zero_points"]) == {128}
            assert x["scales"] == y["scales"] and x["axis"] == y["axis"]
        assert np.abs(np.concatenate([ti[w].reshape(-1) for w in a["weights"]]).astype(np.int16)).max() == 127
        assert same_values(trt, cpu) and same_values(cpu, trt)
        w = next(iter(a["weights"]))  # one weight one step off is another file
        for i in cpu.graph.initializer:
            if i.name == w:
                i.CopyFrom(numpy_helper.from_array((ci[w].astype(np.int16) ^ 1).astype(np.uint8), w))
        assert not same_values(trt, cpu)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "world_step.opt.onnx")
    ort.InferenceSession(str(run.out / "world_step.int8-ort.onnx"), so, providers=["CPUExecutionProvider"])
    ops = {n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node}
    assert ops & {"MatMulIntegerToFloat", "QLinearMatMul", "MatMulInteger"}, ops


def test_onnxruntime_copy_refuses_an_asymmetric_or_shared_int8_tensor(tmp_path):
    """cpu_copy only converts the symmetric int8 grid (what export.py writes), read only through
    Q/DQ; anything else is refused in one line naming the file and the tensor."""
    _qdq_matmul(tmp_path / "mm.onnx", np.ones((4, 3), np.int8))
    m = onnx.load(str(tmp_path / "mm.onnx"))
    for i in m.graph.initializer:
        if i.name == "z":
            i.CopyFrom(numpy_helper.from_array(np.array(3, np.int8), "z"))
    onnx.save(m, str(tmp_path / "asym.onnx"))
    with pytest.raises(I.Int8Error) as e:
        I.cpu_copy(tmp_path / "asym.onnx", tmp_path / "asym-ort.onnx")
    assert "asym.onnx: zero point 'z' is int8 [3], want int8 0" in str(e.value)
    assert not (tmp_path / "asym-ort.onnx").exists()
    m = onnx.load(str(tmp_path / "mm.onnx"))  # an op that reads the int8 weight itself
    m.graph.node.append(helper.make_node("Cast", ["wq"], ["wf"], name="reads_wq", to=TensorProto.FLOAT))
    m.graph.output.append(helper.make_tensor_value_info("wf", TensorProto.FLOAT, [4, 3]))
    onnx.save(m, str(tmp_path / "shared.onnx"))
    with pytest.raises(I.Int8Error, match=r"shared.onnx: Cast 'reads_wq' reads the quantized tensor 'wq' directly"):
        I.cpu_copy(tmp_path / "shared.onnx", tmp_path / "shared-ort.onnx")
    assert I.cpu_copy(tmp_path / "mm.onnx", tmp_path / "mm-ort.onnx") == 1


QEMU = shutil.which("qemu-x86_64")
needs_qemu = pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 (Debian's qemu-user) is not installed: "
                                "it runs onnxruntime as on an AVX2-only CPU (.ci/run installs it)")
AVX2_ONLY = "Haswell"  # AVX2 and FMA, no AVX-512, no VNNI, no AMX

_RUN_ORT = """
import sys, numpy as np, onnxruntime as ort
so = ort.SessionOptions()
if sys.argv[3] == "float":
    so.add_session_config_entry("session.disable_quant_qdq", "1")
s = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
feed = dict(np.load(sys.argv[2]))
np.savez(sys.argv[2] + ".out.npz", *s.run(None, feed))
"""


def _ort_on_cpu(cpu, model: Path, feed: dict, mode: str = "int8", tmp=None) -> list:
    """onnxruntime's outputs for `feed`, on this CPU (cpu=None) or under qemu's model of `cpu`."""
    import subprocess
    import sys

    inp = Path(tmp) / f"feed-{model.stem}-{mode}-{cpu}.npz"
    np.savez(inp, **feed)
    cmd = ([QEMU, "-cpu", cpu] if cpu else []) + [sys.executable, "-c", _RUN_ORT, str(model), str(inp), mode]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    with np.load(str(inp) + ".out.npz") as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def _qdq_matmul(path: Path, w: np.ndarray) -> None:
    """x (int8 values, scale 1) @ W (int8, scale 1 per column), no output Q: what onnxruntime fuses
    into its MatMulIntegerToFloat kernel."""
    k, n = w.shape
    one = numpy_helper.from_array(np.array(1.0, np.float32), "s")
    zp = numpy_helper.from_array(np.array(0, np.int8), "z")
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    g = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                          [one, zp, numpy_helper.from_array(w.astype(np.int8), "wq"),
                           numpy_helper.from_array(np.ones(n, np.float32), "ws"),
                           numpy_helper.from_array(np.zeros(n, np.int8), "wz")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path))


@needs_qemu
def test_int8_matmul_kernel_is_exact_as_uint8_on_an_avx2_cpu(tmp_path):
    """One quantized MatMul over the full int8 range against exact integer arithmetic: on an
    AVX2-only CPU onnxruntime's int8 x int8 kernel is wrong (its int16 pair sums saturate); the
    same values as uint8 with zero point 128 (cpu_copy) are exact there and natively."""
    rng = np.random.default_rng(0)
    x = rng.integers(-128, 128, (64, 512)).astype(np.float32)
    x[0] = 127  # the largest u8 value onnxruntime's kernel sees (x + 128 = 255)
    w = rng.integers(-128, 128, (512, 256))
    w[:, 0] = 127  # the extreme pair sum: 2 * 255 * 127
    _qdq_matmul(tmp_path / "mm.onnx", w)
    assert I.cpu_copy(tmp_path / "mm.onnx", tmp_path / "mm-ort.onnx") == 1
    exact = (x.astype(np.int64) @ w).astype(np.float32)
    y = _ort_on_cpu(AVX2_ONLY, tmp_path / "mm.onnx", {"x": x}, tmp=tmp_path)[0]
    assert not np.array_equal(y, exact)  # the saturating kernel: this test sees what an AVX2-only CPU computes
    for cpu in (None, AVX2_ONLY):
        y = _ort_on_cpu(cpu, tmp_path / "mm-ort.onnx", {"x": x}, tmp=tmp_path)[0]
        assert np.array_equal(y, exact), cpu


@needs_qemu
def test_onnxruntime_int8_copy_computes_its_onnx_semantics_on_an_avx2_cpu(run, tmp_path):
    """The exported INT8 copies for onnxruntime, in its integer kernels on an AVX2-only CPU, give
    what the files define (their Q/DQ as float ops, here on this CPU): the accuracy the report
    states holds on every x86 CPU class."""
    from wm.export.int8_report import graph_files

    for g, p in graph_files(run.out, ".int8-ort").items():
        feed = {k: v.numpy() for k, v in run.ex[g].items()}
        got = _ort_on_cpu(AVX2_ONLY, p, feed, tmp=tmp_path)
        ref = _ort_on_cpu(None, p, feed, mode="float", tmp=tmp_path)
        for x, y in zip(got, ref):
            if np.issubdtype(x.dtype, np.floating):
                assert np.abs(x - y).max() <= 1e-4 * max(1.0, np.abs(y).max()), g
            else:
                assert (x == y).mean() >= 0.99, g


def _tool(name, *args):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, str(root / "tools" / name), *map(str, args)], cwd=root,
                          capture_output=True, text=True, timeout=900)


def _int8_cpus(*args):
    return _tool("int8_cpus.py", *args)


def _here(name, *args):
    """A tool's refusals in this process (helpers.cli_in_process: its main, its one-line error):
    the checks take milliseconds, a process start seconds; each tool's real process runs above."""
    from helpers import cli_in_process

    return cli_in_process(Path(__file__).resolve().parents[2] / "tools" / name, *args)


@needs_qemu
def test_int8_cpus_tool_compares_the_files_on_two_cpu_classes(run, trained_tiny, tmp_path):
    """tools/int8_cpus.py: real rollouts' graph calls, run natively, under qemu's AVX2-only model
    and as ONNX semantics; onnxruntime's copy agrees on both CPU classes."""
    out = tmp_path / "cpus.json"
    p = _int8_cpus("--run", trained_tiny.run_dir(), "--export", run.out, "--windows", 3, "--batch", 2, "--json", out)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["windows"] == 3 and d["cpu"]["emulated"] == f"qemu -cpu {AVX2_ONLY}"
    # 3 windows in batches of 2: 2 rollouts, each one encode, data.future world steps, one decode
    calls = {"tokenizer_encode": 2, "world_step": 2 * 2, "tokenizer_decode": 2}
    assert d["calls"] == sum(calls.values())
    for kind in (".int8-ort", ".int8"):
        for pair in ("native_vs_emulated", "native_vs_1ulp", "native_vs_onnx", "emulated_vs_onnx"):
            got = d["rows"][kind][pair]
            assert {g: r["calls"] for g, r in got.items()} == calls, (kind, pair)
            assert got["world_step"]["max_abs_diff"] is not None  # the ego motion, a float output
    # the yardstick moved the inputs: the world step's float outputs (motion, cache rows) moved with them
    assert d["rows"][".int8-ort"]["native_vs_1ulp"]["world_step"]["max_abs_diff"] > 0
    for pair in ("native_vs_emulated", "emulated_vs_onnx"):
        for g, r in d["rows"][".int8-ort"][pair].items():
            assert r["agree"] >= 0.99, (pair, g, r)
    assert "native_vs_emulated" in p.stdout and "world_step" in p.stdout


@needs_qemu
def test_int8_cpus_tool_saves_the_first_calls_of_each_graph_and_replays_them_elsewhere(run, trained_tiny, tmp_path):
    """--calls-per-graph, --graphs and --files with --save: the rollout is whole, the first N calls of
    each graph asked for are saved with only the files asked for; --replay runs them the three ways
    from a moved copy of that folder, with no run folder."""
    saved = tmp_path / "calls"
    p = _int8_cpus("--run", trained_tiny.run_dir(), "--export", run.out, "--windows", 2, "--batch", 1,
                   "--calls-per-graph", 1, "--graphs", "world_step,tokenizer_decode", "--files", "int8-ort",
                   "--save", saved)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"saved 2 calls of 2 windows and their INT8 files in {saved}" in p.stdout
    assert sorted(f.name for f in saved.iterdir()) == ["calls.json", "feed-00000.npz", "feed-00001.npz",
                                                      "tokenizer_decode.int8-ort.onnx", "world_step.int8-ort.onnx"]
    moved = tmp_path / "elsewhere"
    saved.rename(moved)
    out = tmp_path / "cpus.json"
    p = _int8_cpus("--replay", moved, "--json", out)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["windows"] == 2 and d["calls"] == 2 and d["graphs"] == ["world_step", "tokenizer_decode"]
    assert d["calls_per_graph"] == 1  # as recorded
    assert d["recorded_on"]["cpu"] == d["cpu"]["native"] and list(d["rows"]) == [".int8-ort"]
    for pair in ("native_vs_emulated", "native_vs_1ulp", "native_vs_onnx", "emulated_vs_onnx"):
        got = d["rows"][".int8-ort"][pair]
        assert {g: r["calls"] for g, r in got.items()} == dict.fromkeys(("world_step", "tokenizer_decode"), 1)
    for g, r in d["rows"][".int8-ort"]["native_vs_emulated"].items():
        assert r["agree"] >= 0.99, (g, r)
    assert "recorded on" in p.stdout
    # refused in one line each: a folder --save did not write, a missing file, the run's files not saved
    for args, says in [(("--replay", tmp_path), f"--replay {tmp_path}: not a folder that int8_cpus.py --save wrote"),
                       (("--replay", moved, "--files", "int8"), f"--replay {moved} holds .int8-ort files of "
                                                                   "tokenizer_decode, world_step calls; ask for those"),
                       (("--run", trained_tiny.run_dir(), "--replay", moved), "give --run <run> (with --save DIR"),
                       (("--run", trained_tiny.run_dir(), "--export", run.out, "--save", moved),
                        f"--save {moved}: exists and is not an empty folder")]:
        p = _here("int8_cpus.py", *args)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and says in p.stderr, (args, p.stderr)
    (moved / "feed-00001.npz").unlink()
    p = _here("int8_cpus.py", "--replay", moved)
    assert p.returncode == 2 and "feed-00001.npz is missing; copy the whole folder" in p.stderr
    p = _here("int8_cpus.py", "--run", trained_tiny.run_dir(), "--export", run.out, "--calls-per-graph", -1)
    assert p.returncode == 2 and "--calls-per-graph must be >= 0" in p.stderr and p.stderr.count("\n") == 1
    p = _here("int8_cpus.py", "--run", trained_tiny.run_dir(), "--export", run.out, "--graphs", "world")
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "--graphs 'world': name some of tokenizer_encode, world_step, tokenizer_decode" in p.stderr


def test_int8_cpus_tool_refuses_an_export_without_int8_files(trained_tiny, tmp_path):
    p = _here("int8_cpus.py", "--run", trained_tiny.run_dir(), "--export", tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"{tmp_path / 'tokenizer_encode.int8-ort.onnx'} does not exist; run export.py --run" in p.stderr


def test_int8_cpus_tool_without_qemu_says_so_in_one_line(run, trained_tiny, tmp_path, monkeypatch):
    """No qemu-x86_64 on the PATH: refused before any rollout (--run) or replay, in one line."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PATH=str(tmp_path))  # a folder with no qemu-x86_64 in it
    with monkeypatch.context() as m:
        m.setenv("PATH", str(tmp_path))
        for args in (["--run", trained_tiny.run_dir(), "--export", run.out], ["--replay", tmp_path]):
            p = _here("int8_cpus.py", *args)
            assert p.returncode == 2 and p.stderr.count("\n") == 1, (args, p.stderr)
            assert "qemu-x86_64 is not installed" in p.stderr, (args, p.stderr)
    # recording needs no qemu: that is what --save is for
    p = subprocess.run([sys.executable, str(root / "tools" / "int8_cpus.py"), "--run", str(trained_tiny.run_dir()),
                        "--export", str(run.out), "--windows", "1", "--batch", "1", "--calls-per-graph", "1",
                        "--graphs", "world_step", "--save", str(tmp_path / "calls")], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and (tmp_path / "calls" / "calls.json").is_file(), p.stderr[-2000:]


def test_int8_report_tool_scores_the_files_themselves(run, trained_tiny, tmp_path):
    """tools/int8_report.py: the report with every asked row run by onnxruntime on the files (the
    numbers accuracy_report's onnxruntime engine gives), written apart from report.json and set
    beside it; an unknown row or an export without INT8 files is refused in one line."""
    from wm.export.int8_report import accuracy_report

    out = tmp_path / "own.json"
    before = (run.out / "report.json").read_bytes()
    p = _tool("int8_report.py", "--run", trained_tiny.run_dir(), "--export", run.out, "--eval-windows", 4,
              "--rows", "onnx_int8_ort", "--json", out)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())["accuracy"]
    assert list(got["models"]) == ["pytorch_fp32", "onnx_int8_ort", "copy_last"]
    assert got["models"]["onnx_int8_ort"]["engine"] == "onnxruntime cpu int8 kernels"
    want = accuracy_report(run.trained, run.out, 4, batch=2, engine="onnxruntime", rows=["onnx_int8_ort"],
                           log=lambda s: None)
    for v in got["models"]:
        assert got["models"][v]["miou"] == pytest.approx(want["models"][v]["miou"], abs=1e-9), v
    assert (run.out / "report.json").read_bytes() == before
    side = p.stdout[p.stdout.index("beside the export's report.json"):].splitlines()
    assert side[0].startswith("beside the export's report.json (engine onnxruntime, 9 windows)"), side
    assert side[1].split()[0] == "onnx_int8_ort" and side[2].startswith("  copy_last"), side

    p = _here("int8_report.py", "--run", trained_tiny.run_dir(), "--export", run.out, "--device", "tpu")
    assert p.returncode == 2 and p.stderr == "error: --device tpu: use auto, cpu, or cuda on a machine with a GPU\n"
    p = _here("int8_report.py", "--run", trained_tiny.run_dir(), "--export", run.out, "--rows", "onnx_int4")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "no row onnx_int4 with engine onnxruntime here; rows are onnx_fp32, onnx_fp16, onnx_int8, onnx_int8_ort" \
        in p.stderr
    empty = tmp_path / "empty"
    shutil.copy(run.out / "tokenizer_encode.onnx", empty.mkdir() or empty)
    for g in ("world_step", "tokenizer_decode"):
        shutil.copy(run.out / f"{g}.onnx", empty)
    p = _here("int8_report.py", "--run", trained_tiny.run_dir(), "--export", empty)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"{empty / 'tokenizer_encode.int8.onnx'} does not exist; run the INT8 step (export.py --int8) first" \
        in p.stderr


def test_time_estimate_and_budget():
    # 10 s a window: 2 passes x 30 windows = 10 min of calibration, 4 rows x 20 windows = 13 min of report
    line = I.time_estimate(30, 20, 4, 10.0)
    assert "calibration about 10 min (30 windows, 2 passes), report about 13 min (20 windows x 4 rows)" in line
    assert I.time_estimate(30, 20, 4, 10.0, budget_s=3600) == line  # fits
    assert I.time_estimate(30, 20, 4, 10.0, parity=2) == line + (
        ", then the parity of 2 windows in onnxruntime on the CPU (its own ETA)")
    assert I.time_estimate(30, 20, 4, 10.0, int8_on_cpu=True) == line + (
        " plus the INT8 files' quantized graphs in onnxruntime on the CPU (the report's own ETA)")
    with pytest.raises(WMError, match=r"about 23 min, over --time-budget 4 min: rerun with --calib-windows 4 "
                                      r"--eval-windows 3"):  # 230 / 1400 of each
        I.time_estimate(30, 20, 4, 10.0, budget_s=230)


def test_export_says_its_time_before_the_long_phases_and_keeps_to_a_budget(run, tmp_path):
    out = tmp_path / "x"
    shutil.copytree(run.out, out, ignore=shutil.ignore_patterns("*.int8*", "*.calib.*", "report.json"))
    lines = []
    with pytest.raises(WMError, match="over --time-budget .*: rerun with --calib-windows 1 --eval-windows 1"):
        I.run_int8(run.trained, out, calib_windows=8, eval_windows=0, batch=4, log=lines.append,
                   engine="onnxruntime", budget_s=1e-6)
    est = [ln for ln in lines if ln.startswith("estimate from the first window")]
    assert len(est) == 0 and not list(out.glob("*.int8*"))  # stopped before any INT8 file
    lines.clear()
    I.run_int8(run.trained, out, calib_windows=4, eval_windows=2, batch=2, log=lines.append, engine="onnxruntime")
    est = [ln for ln in lines if ln.startswith("estimate from the first window")]
    assert len(est) == 1 and "(4 windows, 2 passes)" in est[0] and "(2 windows x 5 rows)" in est[0], est
    assert lines.index(est[0]) < next(i for i, ln in enumerate(lines) if "pass 2/2" in ln)
