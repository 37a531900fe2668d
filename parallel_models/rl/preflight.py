"""Checks of a PPO run's inputs that read files or ask the Hugging Face Hub (one request per
model, no retries), made by ``parallel-models-ppo`` after the config check and before the run
writes anything into ``trainer.output_dir`` (the built-in model, checkpoints, metrics):

- every prompt file (``data.path``, ``data.val_path``): each JSONL line parses and each record has
  the chat ``data.messages_key`` or a string ``data.prompt_key`` (``rl/data/prompts.py``'s
  :func:`~parallel_models.rl.data.prompts.check_record`, the check the dataset makes again when it
  tokenizes);
- every model folder the run loads (``model.path``, ``model.tokenizer``, ``critic.path``,
  ``reward.model_path``, ``reward.tokenizer``): a local folder holds a ``config.json`` (a
  tokenizer folder: tokenizer files), and a hub id can be fetched (its ``config.json``, or
  ``tokenizer_config.json``; a cached copy answers offline).

The reward function and the other names users extend are resolved by the config check itself
(``rl/config/checks.py``). Problems are reported together, one line each naming the key, as one
:class:`~parallel_models.errors.ConfigError`.
"""

from __future__ import annotations

import os

from parallel_models.errors import ConfigError

BUILTIN_PATHS = ("builtin-moe",)  # model.path values that name a model built on the spot
PROMPT_FILE_KEYS = ("path", "val_path")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _fetchable(repo_id: str, filenames: tuple[str, ...]) -> str | None:
    """None when the local hub cache holds one of ``filenames`` of ``repo_id`` or the hub lists
    one; else why not (one request, no retries: the run fetches the model itself later)."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache

    try:
        if any(isinstance(try_to_load_from_cache(repo_id, f), str) for f in filenames):
            return None
        if constants.HF_HUB_OFFLINE:
            return "not in the local cache and HF_HUB_OFFLINE is set"
        info = HfApi().model_info(repo_id)
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, bad id, gated, ...
        return _first_line(err)
    files = {s.rfilename for s in (info.siblings or [])}
    if info.siblings is not None and not files.intersection(filenames):
        return f"the repository has no {' / '.join(filenames)}"
    return None


def model_path_problem(key: str, path: str | None, needs: str = "config.json") -> str | None:
    """One line naming ``key`` when ``path`` is neither a local folder holding ``needs`` nor a hub
    id whose ``needs`` can be fetched; None when it is (or ``path`` is null / built in)."""
    if path is None or path in BUILTIN_PATHS:
        return None
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if needs == "tokenizer":
            from parallel_models.tokenizer import has_tokenizer_files

            if has_tokenizer_files(local):
                return None
            return (f"{key}: {path!r} holds no tokenizer files (tokenizer.json, "
                    "tokenizer_config.json, ...)")
        if not os.path.isfile(os.path.join(local, needs)):
            return f"{key}: {path!r} holds no {needs} (an HF model folder has one)"
        return None
    if os.path.exists(local):
        return f"{key}: {path!r} is a file; give an HF model folder or a hub id"
    if os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1:
        return f"{key}: {path!r}: no such folder"
    from parallel_models.tokenizer import TOKENIZER_FILES

    why = _fetchable(path, TOKENIZER_FILES if needs == "tokenizer" else (needs,))
    if why is None:
        return None
    return (f"{key}: {path!r} is not a local folder and could not be fetched from the Hugging "
            f"Face Hub ({why})")


def model_problems(cfg) -> list[str]:
    """:func:`model_path_problem` of every model and tokenizer the run loads."""
    wanted = [("model.path", cfg.model.path, "config.json"),
              ("model.tokenizer", cfg.model.tokenizer, "tokenizer"),
              ("critic.path", cfg.critic.path, "config.json")]
    if cfg.reward.type == "model":
        wanted += [("reward.model_path", cfg.reward.model_path, "config.json"),
                   ("reward.tokenizer", cfg.reward.tokenizer, "tokenizer")]
    problems = (model_path_problem(key, path, needs) for key, path, needs in wanted)
    return [p for p in problems if p]


def prompt_file_problems(data_cfg) -> list[str]:
    """A line for every unreadable prompt file, and for every file with bad records (the first
    one and their count)."""
    from parallel_models.rl.data.prompts import DataError, check_record, read_records

    out = []
    for key in PROMPT_FILE_KEYS:
        path = getattr(data_cfg, key)
        if path is None:
            continue
        try:
            records = read_records(path)
        except (DataError, FileNotFoundError) as err:
            out.append(f"data.{key}: {err}")
            continue
        if not records:
            out.append(f"data.{key}: {path}: no prompt records")
        bad = []
        for where, rec in records:
            try:
                check_record(where, rec, data_cfg.prompt_key, data_cfg.messages_key)
            except DataError as err:
                bad.append(str(err))
        if bad:  # one line per file: the first bad record, and how many more there are
            more = f" (and {len(bad) - 1} more of its {len(records)} records)" if len(bad) > 1 \
                else ""
            out.append(bad[0] + more)
    return out


def check_run_inputs(cfg) -> None:
    """:class:`ConfigError` listing every problem of the run's prompt files and model paths."""
    problems = prompt_file_problems(cfg.data) + model_problems(cfg)
    if problems:
        raise ConfigError("\n".join(problems) if len(problems) > 1 else problems[0])


__all__ = ["check_run_inputs", "model_path_problem", "model_problems", "prompt_file_problems"]
