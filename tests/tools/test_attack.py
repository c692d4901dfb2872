"""tools/attack.py, the attack suite (docs/RELIABILITY.md): its cheapest case run as a user runs it
(one table, the JSON, exit 0), and its self-test cases show that a FAIL, and a hang, make the exit
status non-zero with the process killed. The damaged shards themselves are tests/data/test_shards.py's;
the whole suite: `python tools/attack.py` (about 3-5 min)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = "| case | what was done | expected | observed | result |"


def attack(*args, timeout=300):
    return subprocess.run([sys.executable, "tools/attack.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_a_cheap_case_passes_in_one_table_and_the_json(tmp_path):
    js = tmp_path / "attack.json"
    p = attack("--cases", "manifest", "--json", str(js))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == COLUMNS and lines.count(COLUMNS) == 1, p.stdout  # one table
    rows = [ln for ln in lines[2:] if ln.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows] == ["| manifest"] and rows[0].endswith("| PASS |"), p.stdout
    rep = json.loads(js.read_text())
    assert rep["passed"] is True and rep["wall_s"] > 0 and rep["machine"] and rep["date"]
    (c,) = rep["cases"]
    assert set(c) >= {"case", "done", "expected", "observed", "status", "seconds"}, c
    assert c["case"] == "manifest" and c["status"] == "PASS", c
    # both damaged manifests, each with 0 and 2 loader workers, named in the observed line
    assert "a list:" in c["observed"] and "'path' is 5" in c["observed"], c["observed"]
    assert "Traceback (most recent call last)" not in p.stdout + p.stderr


def test_a_failing_case_and_a_hang_make_the_exit_status_non_zero(tmp_path):
    js = tmp_path / "attack.json"
    p = attack("--cases", "_fail,_hang", "--json", str(js), timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    rep = json.loads(js.read_text())
    assert rep["passed"] is False and [c["status"] for c in rep["cases"]] == ["FAIL", "FAIL"], rep
    assert "0 error: lines" in rep["cases"][0]["observed"], rep
    assert rep["cases"][1]["observed"].startswith("hung: still running after 2 s"), rep
    assert rep["cases"][1]["seconds"] < 30  # killed at its timeout, not waited for
    assert all(r.endswith("| FAIL |") for r in p.stdout.splitlines()[2:4]), p.stdout
    leftover = subprocess.run(["pgrep", "-f", "time.sleep\\(120\\)"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "the hung process outlived the suite"


def test_an_unknown_case_is_one_line_naming_the_cases():
    p = attack("--cases", "nosuch", timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "unknown case nosuch" in p.stderr and "kill9" in p.stderr and "_fail" not in p.stderr, p.stderr
