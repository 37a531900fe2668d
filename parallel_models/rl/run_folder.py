"""The run folder (``trainer.output_dir``) of ``parallel-models-ppo``: one run per folder.

A new run into a folder that already holds a run (its ``config.yaml``, ``checkpoints/`` or
``metrics.jsonl``) is refused, naming the folder and the choices, so two runs never mix their
checkpoints, exports and metrics:

- ``--resume``: continue that run from its latest checkpoint. The run's own saved config
  (the checkpoint's ``config.yaml``) is loaded and only the settings given now (``--config`` file
  and ``key=value`` overrides) are applied over it: layout, ``trainer.total_steps``, learning
  rates... Settings that change what the run is (``model.*``, ``data.*``, ``reward.*``,
  ``algorithm.*``) are refused, naming the keys, unless ``--force-override``. With no checkpoint
  to resume, ``--resume`` is an error (exit code 2);
- ``--resume=auto``: resume when the folder has a checkpoint, else start a new run (replacing the
  outputs of a run that never reached its first checkpoint);
- ``--overwrite``: start a new run, first removing the outputs of the old one (the names in
  :data:`RUN_OUTPUTS`; other files are left alone).

``trainer.resume: true`` in a config file means ``--resume``. Only the CLI applies these rules;
:class:`~parallel_models.rl.trainer.PPOTrainer` built in code does what its config says.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil

import yaml

from parallel_models.errors import ConfigError

logger = logging.getLogger(__name__)

# what a run writes into its folder (removed by --overwrite)
RUN_OUTPUTS = ("checkpoints", "config.yaml", "metrics.jsonl", "samples.jsonl", "tensorboard",
               "reward_curve.png", "actor_hf", "critic_hf", "final_export.json",
               "builtin_model", "builtin_moe", "rollout_weights", "wandb", "mlruns")
# entries whose presence means the folder holds a run
RUN_MARKERS = ("config.yaml", "checkpoints", "metrics.jsonl")
# sections whose settings say what the run is: changing them on --resume needs --force-override
IDENTITY_SECTIONS = ("model", "data", "reward", "algorithm")
# settings that may always differ from the saved run's
_FREE_KEYS = ("trainer.output_dir", "trainer.resume", "trainer.resume_fallback")
RESUME_MODES = ("off", "on", "auto")


def run_markers(output_dir: str) -> list[str]:
    """The entries of ``output_dir`` that show it holds a run (empty: it does not)."""
    return [name for name in RUN_MARKERS if os.path.exists(os.path.join(output_dir, name))]


def saved_run_config(output_dir: str) -> str | None:
    """The config file of the run's latest checkpoint (the settings its state was made with);
    None when the folder has no checkpoint to resume."""
    from parallel_models.rl.checkpoint_lookup import (CONFIG_FILE, checkpoint_root,
                                                      newest_checkpoint_candidate)

    folder = newest_checkpoint_candidate(checkpoint_root(output_dir))
    if folder is None:
        return None
    for path in (os.path.join(folder, CONFIG_FILE), os.path.join(output_dir, CONFIG_FILE)):
        if os.path.isfile(path):
            return path
    return None


def remove_run_outputs(output_dir: str) -> list[str]:
    """Delete what a run wrote into ``output_dir`` (:data:`RUN_OUTPUTS` and their hidden
    temporary siblings); returns the removed names."""
    removed = []
    for name in RUN_OUTPUTS:
        for path in [os.path.join(output_dir, name),
                     *glob.glob(os.path.join(output_dir, f".{name}.tmp-*"))]:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
            else:
                continue
            removed.append(os.path.basename(path))
    return removed


def given_settings(config_file: str | None, overrides: list[str]) -> list[str]:
    """The dotted keys set now, by the ``--config`` file and the ``key=value`` overrides."""
    from parallel_models.rl.config import parse_override

    keys = []
    if config_file is not None and os.path.isfile(config_file):
        with open(config_file) as f:
            data = yaml.safe_load(f) or {}
        if isinstance(data, dict):
            keys += [f"{section}.{key}" for section, values in data.items()
                     if isinstance(values, dict) for key in values]
    keys += [parse_override(text)[0].removeprefix("--") for text in overrides]
    return list(dict.fromkeys(keys))


def resumed_config(saved_file: str, now, given: list[str], force: bool):
    """The saved run's config with the settings ``given`` now (their values in ``now``) applied;
    refuses changes to :data:`IDENTITY_SECTIONS` unless ``force``."""
    from parallel_models.rl.config import PPOConfig, load_config

    saved = load_config(saved_file, validate=False).to_dict()
    current = now.to_dict()
    changed = {}
    for dotted in given:
        section, _, key = dotted.partition(".")
        if dotted in _FREE_KEYS or section not in current or key not in current[section]:
            continue
        if current[section][key] != saved.get(section, {}).get(key):
            changed[dotted] = (saved.get(section, {}).get(key), current[section][key])
    identity = {k: v for k, v in changed.items() if k.split(".")[0] in IDENTITY_SECTIONS}
    if identity and not force:
        raise ConfigError(
            f"--resume of {now.trainer.output_dir}: these settings change what the run is: "
            + "; ".join(f"{k} {a!r} in the run vs {b!r} now" for k, (a, b) in identity.items())
            + f" (the run's settings: {saved_file}); drop them, start a new run in another "
              "trainer.output_dir, or add --force-override to apply them anyway")
    if identity:
        logger.warning("--force-override: resuming %s with changed %s", now.trainer.output_dir,
                       ", ".join(identity))
    merged = {section: dict(values) for section, values in saved.items()}
    for dotted, (_, value) in changed.items():
        section, _, key = dotted.partition(".")
        merged[section][key] = value
    merged["trainer"].update(output_dir=now.trainer.output_dir, resume=True,
                             resume_fallback=now.trainer.resume_fallback)
    sources = {k: "the command line / --config" for k in changed}
    return PPOConfig.build(merged, sources, cross_checks=False, source=saved_file)


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def prepare_run(config_file: str | None, overrides: list[str], *, resume: str = "off",
                overwrite: bool = False, force_override: bool = False,
                resume_fallback: bool = False):
    """The config of this run (not yet cross-checked) after the run-folder rules above; raises
    ConfigError (exit code 2) for a folder that holds another run, ``--resume`` with nothing to
    resume, or a resume that would change what the run is."""
    from parallel_models.rl.config import load_config

    if resume not in RESUME_MODES:
        raise ConfigError(f"--resume={resume}: use --resume, --resume=auto (or no --resume)")
    now = load_config(config_file, overrides, validate=False)
    if resume_fallback:
        now.trainer.resume_fallback = True
    if resume == "off" and now.trainer.resume:
        resume = "on"  # trainer.resume: true in the config
    if resume != "off" and overwrite:
        raise ConfigError("--resume and --overwrite together: choose one (--overwrite removes "
                          "the run that --resume would continue)")
    out = now.trainer.output_dir
    markers = run_markers(out)
    saved_file = saved_run_config(out) if resume != "off" else None
    if resume == "on" and saved_file is None:
        raise ConfigError(
            f"--resume: no checkpoint to resume in {os.path.join(out, 'checkpoints')} "
            f"(trainer.output_dir={out}); check trainer.output_dir, use --resume=auto to start a "
            "new run when there is none, or run without --resume")
    if saved_file is not None:
        cfg = resumed_config(saved_file, now, given_settings(config_file, overrides),
                             force_override)
        if _is_rank0():
            logging.getLogger("parallel-models-ppo").info("resuming the run in %s with its "
                                                          "settings from %s", out, saved_file)
        return cfg
    if markers and not (overwrite or resume == "auto"):
        raise ConfigError(
            f"trainer.output_dir={out} holds another run ({', '.join(markers)}); add --resume "
            "to continue it, --overwrite to replace it, or choose another trainer.output_dir")
    now.trainer.resume = False
    return now


def clear_previous_run(cfg) -> None:
    """Remove the outputs of the run a new run replaces (``--overwrite``, or ``--resume=auto``
    over a run that never reached a checkpoint), on rank 0; called once the config and inputs
    are checked, so that a bad command line removes nothing."""
    out = cfg.trainer.output_dir
    if cfg.trainer.resume or not run_markers(out) or not _is_rank0():
        return
    removed = remove_run_outputs(out)
    logger.warning("%s: removed the outputs of the previous run there (%s)", out,
                   ", ".join(removed))
