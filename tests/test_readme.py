"""The README cannot drift from the code (issue 31 item 7): its Markdown fences are well formed,
and every command block marked ``<!-- runnable -->`` (in README.md and docs/*.md) runs on the
CPU. A ``parallel-models-ppo`` command runs as written plus ``trainer.total_steps=1`` and a
temporary ``trainer.output_dir`` (the overrides come last, so they win; the figures quoted next
to the commands are from the full runs); ``.venv/bin/`` means this Python's bin folder."""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest

from tests.helpers.ppo_runs import run_ppo

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- runnable -->"
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
QUICK = ["trainer.total_steps=1", "trainer.save_every=0", "trainer.save_hf_at_end=false"]


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def runnable_blocks() -> list[tuple[str, str, str]]:
    """``(where, language, body)`` of each fenced block right after a :data:`MARKER` line."""
    out = []
    for path in DOCS:
        lines = _read(path).splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARKER:
                continue
            fence = lines[i + 1].strip() if i + 1 < len(lines) else ""
            assert fence.startswith("```"), f"{path}:{i + 1}: {MARKER} must precede a fence"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip().startswith("```"))
            out.append((f"{os.path.basename(path)}:{i + 2}", fence[3:].strip(),
                        "\n".join(lines[i + 2:end])))
    return out


def commands(body: str) -> list[list[str]]:
    """The shell commands of a bash block (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [shlex.split(line) for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("path", DOCS, ids=os.path.basename)
def test_code_fences_are_well_formed(path):
    """Fences alternate open / close, and a closing fence carries nothing after it (one that
    does leaves the rest of the page rendered as code)."""
    inside = False
    for n, line in enumerate(_read(path).splitlines(), 1):
        if not line.lstrip().startswith("```"):
            continue
        rest = line.lstrip()[3:].strip()
        if inside:
            assert rest == "", f"{path}:{n}: a closing fence with text after it: {line!r}"
        else:
            assert re.fullmatch(r"[\w+-]*", rest), f"{path}:{n}: not a fence language: {line!r}"
        inside = not inside
    assert not inside, f"{path}: a code block is never closed"


def test_readme_names_real_folders_and_explains_the_summary():
    text = _read(DOCS[0])
    assert "step_N" not in text and "checkpoints/step_000010" in text
    assert "reward_first" in text and "reward_last" in text and "fifth of the steps" in text
    assert "pip install 'parallel-models[trackers]'" not in text
    assert "-e '.[trackers]'" in text
    for family in ("Qwen3", "Gemma", "MoE"):
        assert family in text.split("\n\n")[1], f"{family} missing from the title paragraph"


def test_runnable_blocks_are_listed():
    where = [w for w, _, _ in runnable_blocks()]
    assert len(where) >= 3, where  # the main job, the MoE run, the find_digit figure
    ppo = [cmd for _, lang, body in runnable_blocks() if lang == "bash"
           for cmd in commands(body)]
    assert all(cmd[0] == ".venv/bin/parallel-models-ppo" for cmd in ppo), ppo


@pytest.mark.parametrize("where,language,body", runnable_blocks(),
                         ids=[w for w, _, _ in runnable_blocks()])
def test_runnable_block_runs(tmp_path, where, language, body):
    assert language == "bash", f"{where}: only bash blocks are run"
    for i, cmd in enumerate(commands(body)):
        assert cmd[0] == ".venv/bin/parallel-models-ppo", f"{where}: {cmd[0]} is not run here"
        proc = run_ppo([*cmd[1:], *QUICK, f"trainer.output_dir={tmp_path / str(i)}"],
                       check=False, timeout=600)
        assert proc.returncode == 0, f"{where}: {shlex.join(cmd)}\n{proc.stderr[-3000:]}"
        assert '"steps": 1' in proc.stdout, proc.stdout
