"""The docs agree with the code: docs/FILES.md is what tools/files_doc.py writes from the
docstrings, every module path, folder and dotted module name the guides mention exists, and
docs/ARCHITECTURE.md's map names every folder of wm/ in the order tests/test_structure.py's LAYERS
holds. Each check is also run on a stale name, so that it is seen to fail."""

import ast
import functools
import glob
import importlib.util
import re
from pathlib import Path

import pytest

from test_structure import LAYERS

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("files_doc", ROOT / "tools" / "files_doc.py")
files_doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(files_doc)

DOCS = sorted(["README.md", "BENCHMARKS.md", "wm/models/kernels/README.md",
               *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
PATH = re.compile(r"(?<![\w./~-])(?:wm|tools|tests)/(?:[\w.*-]+/)*[\w.*-]*")
DOTTED = re.compile(r"(?<![\w./-])wm(?:\.\w+)+")
BARE = re.compile(r"(?<![\w/.-])[\w-]+\.py\b")  # a file named without its folder
EXTERNAL = {"eval_metric_stp3.py"}  # OccWorld's files, named where its protocol is


def module_file(parts: list[str]):
    base = ROOT.joinpath(*parts)
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


@functools.lru_cache(maxsize=None)
def defined(path: Path) -> set[str]:
    """The names a module's source binds anywhere: def, class, assignments, imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def dotted_problem(name: str):
    """None if `name` is a module of wm, or a module followed by names its source defines."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        f = module_file(parts[:i])
        if f is not None:
            have = defined(f)
            for attr in parts[i:]:
                if attr not in have:
                    return f"{name} ({'.'.join(parts[:i])} defines no {attr})"
            return None
    return f"{name} (no such module)"


def path_problem(path: str):
    path = path.rstrip(".")
    if any(c in path for c in "*?["):
        return None if glob.glob(str(ROOT / path)) else f"{path} (matches nothing)"
    return None if (ROOT / path).exists() else f"{path} (no such file or folder)"


def stale_names(text: str, basenames: set[str]) -> list[str]:
    """Every path, dotted module name and bare file name in `text` that names nothing."""
    out = [path_problem(p) for p in PATH.findall(text)]
    out += [dotted_problem(d.rstrip(".")) for d in DOTTED.findall(text)]
    out += [f"{b} (no file of that name)" for b in BARE.findall(text) if b not in basenames | EXTERNAL]
    return sorted({p for p in out if p})


@pytest.fixture(scope="module")
def basenames():
    return {Path(f).name for f in files_doc.tracked(ROOT)}


def test_files_md_is_what_the_tool_writes():
    want = files_doc.render()
    have = (ROOT / files_doc.OUT).read_text()
    assert have == want, f"{files_doc.OUT} is stale: {files_doc.first_difference(want, have)} (python tools/files_doc.py)"


def test_the_page_follows_a_docstring_and_names_a_stale_line(tmp_path):
    files = ["wm/__init__.py", "wm/utils/__init__.py", "wm/utils/a.py", "tools/t.py", *files_doc.CLIS,
             "Dockerfile", *files_doc.DESCRIBED]
    for f in files:
        p = tmp_path / f.rstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        if f.endswith("/"):
            p.mkdir(exist_ok=True)
        else:
            p.write_text('"""A module. More."""\n' if f.endswith(".py") else "# A file. More.\n")
    (tmp_path / "wm/utils/a.py").write_text('"""Atomic writes, the one way. The rest."""\n')
    page = files_doc.render(tmp_path, files)
    assert "wm/utils/a.py  Atomic writes, the one way\n" in page and "## wm/utils/\n\nA module.\n" in page
    (tmp_path / "wm/utils/a.py").write_text('"""Atomic writes, another way."""\n')
    line = page.splitlines().index("wm/utils/a.py  Atomic writes, the one way") + 1
    assert files_doc.first_difference(files_doc.render(tmp_path, files), page) == \
        f"line {line} reads 'wm/utils/a.py  Atomic writes, the one way', should read 'wm/utils/a.py  Atomic writes, another way'"
    (tmp_path / "wm/utils/a.py").write_text("x = 1\n")
    with pytest.raises(files_doc.WMError, match="wm/utils/a.py has no docstring"):
        files_doc.render(tmp_path, files)
    with pytest.raises(files_doc.WMError, match="configs/new.json has no line"):
        files_doc.render(tmp_path, files[:2] + ["configs/new.json"])


def test_a_long_sentence_is_cut_at_a_word_to_fit():
    s = files_doc.first_sentence("The shard format: a folder with shards of two kinds (HDF5, memmap).\n\nMore.")
    assert s == "The shard format: a folder with shards of two kinds (HDF5, memmap)"
    assert files_doc.first_sentence("Errors a user can cause. Each one is a line, e.g. a key.") == "Errors a user can cause"
    cut = files_doc.fit(s, 40)
    assert len(cut) <= 40 and cut.endswith("…") and s.startswith(cut[:-1]) and s[len(cut) - 1] in " ,:"
    assert files_doc.fit("Occ3D as distributed (`a/annotations.json` + `gts/`), read", 40) == "Occ3D as distributed…"


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_name_a_doc_mentions_exists(doc, basenames):
    bad = stale_names((ROOT / doc).read_text(), basenames)
    assert not bad, f"{doc} names what is not there: {'; '.join(bad)}"


def test_a_stale_name_is_seen(basenames):
    good = ("`wm/training/loop.py` `wm/models/kernels/` `tools/bench_*.py` wm.training.loop.train_step "
            "wm.data.windows.spread, wm.Forecaster. wm.models.tokenizer._ClassEmbed.backward train.py")
    assert stale_names(good, basenames) == []
    bad = stale_names("`wm/loop.py` `wm/kernels/` `tools/nope_*.py` wm.train.train_step wm.data.windows.nope "
                      "wm.training.main.train_step `shard_writer.py`", basenames)
    assert bad == ["shard_writer.py (no file of that name)", "tools/nope_*.py (matches nothing)",
                   "wm.data.windows.nope (wm.data.windows defines no nope)",
                   "wm.train.train_step (wm defines no train)",
                   "wm.training.main.train_step (wm.training.main defines no train_step)",
                   "wm/kernels/ (no such file or folder)", "wm/loop.py (no such file or folder)"]


def the_map() -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    return text[text.index("## 1."): text.index("## 2.")]


def map_problems(text: str) -> list[str]:
    """The folders of wm/ the map leaves out, and whether its top-level folders keep LAYERS' order."""
    folders = sorted({str(p.parent.relative_to(ROOT)) + "/" for p in (ROOT / "wm").rglob("*.py")} - {"wm/"})
    out = [f"{f} is not in the map" for f in folders if f not in text]
    order = [n.replace(".", "/") + "/" for n in LAYERS if (ROOT / n.replace(".", "/")).is_dir() and n != "wm"]
    seen = sorted((text.index(f), f) for f in order if f in text)
    if [f for _, f in seen] != [f for f in order if f in text]:
        out.append(f"the map's folders run {[f for _, f in seen]}, LAYERS runs {order}")
    return out


def test_the_architecture_map_names_every_folder_in_layers_order():
    bad = map_problems(the_map())
    assert not bad, "docs/ARCHITECTURE.md, section 1: " + "; ".join(bad)


def test_a_folder_left_out_of_the_map_or_out_of_order_is_seen():
    text = the_map()
    assert map_problems(text.replace("wm/data/convert/", "wm/data/")) == ["wm/data/convert/ is not in the map"]
    swapped = text.replace("wm/utils/", "@").replace("wm/config/", "wm/utils/").replace("@", "wm/config/")
    assert len(map_problems(swapped)) == 1 and "LAYERS runs" in map_problems(swapped)[0]
