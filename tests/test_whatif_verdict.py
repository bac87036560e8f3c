"""The what-if report opens with a verdict (issue 27): which arm fixes what (severity fell below 0.5, or
its flag is gone), which finding every arm keeps; an arm without a flag shows '-', not 0.00.

The arms' findings are written by hand here (what three arms' analyses could return), so that the
verdict can be checked against a known answer without training anything; the training path is
tests/test_whatif.py's."""

from __future__ import annotations

import dataclasses
import json
import re

import pandas as pd

from gradforensics.analysis.contract.model import Findings, Flag
from gradforensics.runs.arms import Arm
from gradforensics.runs.render import finding_matrix, verdict_lines, write
from gradforensics.runs.result import WhatIf
from gradforensics.runs.train import ArmRun

TENSORS = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(3)]


def _flag(kind, tensor, severity, sources=()):
    return Flag(kind=kind, tensor=tensor, head=None, sources=tuple(sources), severity=severity, records=(0, 11),
                evidence={}, summary=f"{kind} on {tensor}")


def _whatif(tmp_path) -> WhatIf:
    flags = {
        # the baseline: a zh/en conflict on three tensors, an oscillation, noise
        "base": [*(_flag("conflict", t, 0.9, ("en", "zh")) for t in TENSORS), _flag("oscillation", TENSORS[0], 0.8),
                 _flag("noise", "whole model", 0.7)],
        # a lower LR: the oscillation falls to 0.2; the conflict and the noise stay
        "lowlr": [*(_flag("conflict", t, 0.85, ("en", "zh")) for t in TENSORS), _flag("oscillation", TENSORS[0], 0.2),
                  _flag("noise", "whole model", 0.6)],
        # no zh: the conflict has no flag at all; a new drift; noise stays
        "nozh": [_flag("oscillation", TENSORS[0], 0.75), _flag("noise", "whole model", 0.65),
                 _flag("drift", TENSORS[2], 0.55)],
    }
    runs = [ArmRun(Arm(a, "adamw", {"lr": 1e-3}), tmp_path / f"{a}.zarr", "fresh optimizer state",
                   [("en", i) for i in range(4)], losses=[2.0, 1.9, 1.8, 1.7], lrs=[1e-3] * 4) for a in flags]
    findings = {a: Findings(store=f"{a}.zarr", n_records=4, mode="training", sources=("zh", "en", "code"), header={},
                            results={}, flags=fl) for a, fl in flags.items()}
    cos = pd.DataFrame(columns=["arm_a", "arm_b", "tensor", "first_grad_cos", "grad_cos", "update_cos",
                                "net_update_cos"])
    return WhatIf(tmp_path, "base", runs, findings, {}, cos)


def test_the_verdict_names_what_each_arm_fixes_and_what_every_arm_keeps(tmp_path):
    res = _whatif(tmp_path)
    lines = verdict_lines(res, finding_matrix(res))
    assert lines == [
        f"lowlr fixes oscillation on {TENSORS[0]} (0.80 → 0.20). "
        "Keeps noise on whole model (0.70 → 0.60); conflict (en, zh) on 3 tensors (0.90 → 0.85).",
        "nozh fixes conflict (en, zh) on 3 tensors (0.90 → -). "
        f"Keeps noise on whole model (0.70 → 0.65); oscillation on {TENSORS[0]} (0.80 → 0.75). "
        f"New: drift on {TENSORS[2]} (- → 0.55).",
        "Every arm keeps noise: the data's (or the checkpoint's), not the optimizer's.",
    ]


def test_a_finding_moved_to_another_tensor_is_kept_not_fixed(tmp_path):
    res = _whatif(tmp_path)
    moved = [_flag("conflict", "lm_head.weight", 0.95, ("en", "zh")), _flag("noise", "whole model", 0.7)]
    res.findings["nozh"] = dataclasses.replace(res.findings["nozh"], flags=moved)
    lines = verdict_lines(res, finding_matrix(res))
    assert lines[1] == ("nozh fixes oscillation on model.layers.0.mlp.down_proj.weight (0.80 → -). "
                        "Keeps noise on whole model (0.70 → 0.70); conflict (en, zh) on lm_head.weight (0.90 → 0.95).")


def test_the_report_opens_with_it_and_a_missing_flag_is_a_dash(tmp_path):
    res = _whatif(tmp_path)
    paths = write(res, tmp_path)
    md = paths["markdown"].read_text()
    assert md.index("## Verdict") < md.index("## Arms") < md.index("## Flags across arms")
    assert "- nozh fixes conflict (en, zh) on 3 tensors (0.90 → -)." in md
    row = next(line for line in md.splitlines() if line.startswith("| conflict |") and TENSORS[1] in line)
    assert row.split(" | ")[4:7] == ["0.90", "0.85", "-"]                 # nozh has no conflict flag: '-'
    assert "| 0.00 |" not in md
    html = paths["html"].read_text()
    assert html.index('id="whatif-verdict"') < html.index('id="arms-table"')
    assert re.search(r'<td class="num ok">-</td>', html) and ">0.00<" not in html
    doc = json.loads(paths["json"].read_text())
    assert doc["verdict"][-1].startswith("Every arm keeps noise:")
    conflict = next(r for r in doc["findings"] if r["kind"] == "conflict")
    assert conflict["nozh"] is None and conflict["base"] == 0.9
    arms = {a["arm"]: (a["n_findings"], a["n_flags"]) for a in doc["arms"]}
    assert arms == {"base": (3, 5), "lowlr": (2, 4), "nozh": (3, 3)}       # findings as the report groups them
    assert "| 3 (5 flags) |" in md


def test_no_finding_in_any_arm_says_so(tmp_path):
    res = _whatif(tmp_path)
    for f in res.findings.values():
        f.flags = []
    assert verdict_lines(res, finding_matrix(res)) == ["No arm has a finding at or above 0.5: nothing to fix."]


def test_no_finding_but_an_analysis_could_not_judge_is_not_nothing_to_fix(tmp_path):
    """`whatif ... --steps 6`: 2 records per source; no arm's conflict could have fired (issue 45)."""
    from gradforensics.analysis.contract.model import NotJudged

    res = _whatif(tmp_path)
    short = NotJudged("conflict", "too few records per source: zh 2, en 2, code 2; every pair not judged",
                      "≥ 4 records per source (training store)")
    for f in res.findings.values():
        f.flags = []
        f.not_judged = [short]
    (line,) = verdict_lines(res, finding_matrix(res))
    assert "nothing to fix" not in line and line.startswith("No arm has a finding at or above 0.5, but that is not")
    assert "conflict (too few records per source: zh 2, en 2, code 2" in line and "in every arm" in line
    res = _whatif(tmp_path / "again")                        # with findings: the line comes last
    next(iter(res.findings.values())).not_judged = [short]
    lines = verdict_lines(res, finding_matrix(res))
    assert lines[-1].startswith("Not judged: conflict (") and " in base." in lines[-1]
