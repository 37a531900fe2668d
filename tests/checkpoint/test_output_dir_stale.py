"""Hidden ``.OUT.tmp-*`` folders of killed conversions (issue 30 item 13): the next save into the
same parent folder removes those of processes that are gone (with a log line), never one that a
running process is writing."""

import logging
import os

from parallel_models.llama.checkpoint_utils.output_dir import AtomicOutputDir
from parallel_models.console_processes import start_main


def test_stale_temp_folders_of_killed_saves_are_removed(tmp_path, caplog):
    parent = tmp_path / "models"
    proc = start_main("tests.helpers.killed_save:main", [str(parent / "killed")])
    try:
        assert proc.wait(120) == -9  # SIGKILLed mid-save
    finally:
        proc.close()
    stale = [p for p in os.listdir(parent) if p.startswith(".killed.tmp-")]
    assert len(stale) == 1 and not (parent / "killed").exists()
    with caplog.at_level(logging.INFO, logger="parallel_models.llama.checkpoint_utils"), \
            AtomicOutputDir(str(parent / "live")) as live_tmp:  # a save in progress here
        with AtomicOutputDir(str(parent / "next")) as tmp:  # another save into the parent
            open(os.path.join(tmp, "config.json"), "w").write("{}")
        assert os.path.isdir(live_tmp), "the temporary folder of a running save was removed"
        open(os.path.join(live_tmp, "config.json"), "w").write("{}")
    assert sorted(os.listdir(parent)) == ["live", "next"]
    assert any(stale[0] in r.getMessage() and "interrupted" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
