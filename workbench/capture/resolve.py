"""Which model and tokenizer a run uses: ``load_for_run`` reloads a recorded run's model (checked against the
recorded weights hash) as an adapter; ``tokenizer_for`` is the one rule for its tokenizer.

Used by replay, root cause and ``Run``: a run records its model's label (a checkpoint folder or a module's
class name), the weights' sha256, the dtype and the backend (``params.backend``); a run recorded from an
in-memory module can only be re-run with a module (or folder) whose weights hash the same.
"""
from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch

from workbench.capture.adapters import Adapter, adapter_for, load_adapter
from workbench.capture.preflight import check_config, check_no_remote_code, check_vocab, config_vocab
from workbench.model import file_sha256, load_tokenizer


def tokenizer_for(model=None, tokenizer=None):
    """The ``tokenizers.Tokenizer`` of a model: the one rule of recording, replay, root cause, ``Run.tokenizer``
    and the figures.

    Args:
        model: None (the bundled demo); a checkpoint folder, or a run's ``runs.model`` label (a folder, or the
            class name of an in-memory module); or a loaded model (module or adapter; its checkpoint folder).
        tokenizer: a ``tokenizers.Tokenizer`` (returned as it is) or a path to a ``tokenizer.json``.

    The rule: the tokenizer given; else the folder's ``tokenizer.json``; a folder without one is an error
    (the workbench needs the model's own tokenizer); else (the bundled demo, a label naming no folder here,
    a module without a folder) the bundled demo's tokenizer, with a warning for a live module.
    """
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    live = model is not None and not isinstance(model, (str, Path))
    folder = adapter_for(model).checkpoint_path if live else model
    if folder and (Path(folder) / "tokenizer.json").exists():
        return load_tokenizer(Path(folder) / "tokenizer.json")
    if folder and Path(folder).is_dir():
        raise FileNotFoundError(f"{folder} has no tokenizer.json: the workbench needs the model's own tokenizer to "
                                "turn text into tokens and back; pass tokenizer=PATH (CLI: --tokenizer PATH)")
    if live:
        name = type(adapter_for(model).module).__name__
        warnings.warn(f"no tokenizer given for an in-memory {name}: token texts are decoded with the bundled demo "
                      "tokenizer; pass tokenizer= to use the model's own", stacklevel=3)
    return load_tokenizer(None)


def check_folder(model, tokenizer=None, dtype: str | None = None, device_map=None, text: bool = True):
    """Before a weight is read: a model folder's config.json (types, ranges, size against the memory here,
    ``preflight.check_config``), its tokenizer (the one given, else the folder's: a folder without one is an
    error), and, when ``text`` is to be encoded, the tokenizer's vocabulary within the model's. Returns the
    tokenizer (loaded) for a folder; anything else (None, a module, an adapter) is returned as it came."""
    if model is None or not isinstance(model, (str, Path)):
        return tokenizer
    cfg = check_config(model, dtype, device_map)
    check_no_remote_code(model, cfg)
    tok = tokenizer_for(model, tokenizer)
    if text:
        check_vocab(tok, config_vocab(cfg), f"the model in {model}")
    return tok


def tokenizer_path(model=None, tokenizer=None) -> str | None:
    """The absolute path of the tokenizer.json ``tokenizer_for(model, tokenizer)`` reads; None for a tokenizer
    object or the bundled demo's fallback (provenance: ``runs.tokenizer``)."""
    if tokenizer is not None:
        return str(Path(tokenizer).absolute()) if isinstance(tokenizer, (str, Path)) else None
    live = model is not None and not isinstance(model, (str, Path))
    folder = adapter_for(model).checkpoint_path if live else model
    if folder and (Path(folder) / "tokenizer.json").is_file():
        return str((Path(folder) / "tokenizer.json").absolute())
    return None


def run_tokenizer(info: dict, model=None, tokenizer=None):
    """The tokenizer to re-run or read a stored run with: ``tokenizer`` if given; else the tokenizer.json the run
    was recorded with (``runs.tokenizer``) when it is still there; else ``tokenizer_for`` of ``model`` (an
    override folder) or of the run's model folder. A recorded tokenizer that is gone is named in the error."""
    if tokenizer is not None:
        return tokenizer_for(None, tokenizer)
    stored = info.get("tokenizer")
    if stored and Path(stored).is_file():
        return load_tokenizer(stored)
    try:
        return tokenizer_for(model if model is not None else (info.get("model") or None))
    except FileNotFoundError:
        if stored:
            raise FileNotFoundError(f"run {info['run_id']} was recorded with the tokenizer {stored}, which is not "
                                    "there: pass --tokenizer PATH (Python: tokenizer=PATH)") from None
        raise


def run_dtype(info: dict) -> torch.dtype:
    dtype = getattr(torch, info.get("dtype") or "float32", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"run {info['run_id']} has an unknown dtype {info.get('dtype')!r}")
    return dtype


def run_backend(info: dict) -> str:
    return json.loads(info.get("params") or "{}").get("backend") or "auto"


def load_for_run(info: dict, model=None, verify: bool = True) -> Adapter:
    """The adapter to re-run the run described by ``info`` (its ``runs`` row) with.

    Args:
        model: None to reload the run's checkpoint folder; or a folder / module / adapter to use instead.
        verify: refuse a model whose weights hash differs from the recorded ``checkpoint_sha256``.
    Raises:
        ValueError: the model is not available here, or its weights differ from the recorded ones.
    """
    want = info.get("checkpoint_sha256")
    dtype = run_dtype(info)
    rid = info["run_id"]
    if model is None or isinstance(model, (str, Path)):
        path = Path(model if model is not None else (info.get("model") or ""))
        if not (path / "config.json").exists():
            if model is not None:
                raise FileNotFoundError(f"{path} is not a checkpoint folder (no config.json)")
            label = info.get("model") or "an unnamed model"
            what = (f"not a checkpoint folder here: looked for {Path(label).absolute() / 'config.json'}"
                    if Path(label).is_absolute() or "/" in label or Path(label).exists()
                    else "an in-memory module, not a checkpoint folder")
            raise ValueError(f"run {rid} was recorded from {label} ({what}); pass its checkpoint folder with "
                             "--model FOLDER (in Python: model=FOLDER, or the module itself)")
        check_config(path, info.get("dtype"))
        if verify:
            have = file_sha256(path)
            if have != want:
                raise ValueError(f"checkpoint {path} has sha256 {have[:12]}..., but run {rid} was recorded with "
                                 f"{str(want)[:12]}...: the weights changed, so a re-run would not be comparable")
        adapter = load_adapter(path, dtype=dtype, backend=run_backend(info))
        if verify:
            _ran_with(adapter, info, f"{path}'s weights as saved")
        return adapter
    adapter = adapter_for(model)
    if adapter.dtype != dtype:
        adapter = adapter_for(copy.deepcopy(adapter.module).to(dtype))  # leave the caller's module as it was
    if verify:
        ckpt = adapter.checkpoint_path
        have = adapter.state_sha256()
        ok = have == want or (ckpt is not None and Path(ckpt).is_dir() and file_sha256(ckpt) == want)
        if not ok:
            raise ValueError(f"the module passed has weights whose sha256 differs from the one run {rid} was "
                             f"recorded with ({str(want)[:12]}...)")
        _ran_with(adapter, info, "the module's weights now", have)
    return adapter


def _ran_with(adapter: Adapter, info: dict, what: str, have: str | None = None) -> None:
    """ValueError when the run's weights in memory (``weights_sha256``: a weight fault or an in-place edit leaves the
    checkpoint's files and hash as they were) are not ``adapter``'s: a re-run would explain other weights."""
    ran = info.get("weights_sha256")
    if ran and (have or adapter.state_sha256()) != ran:
        raise ValueError(f"run {info['run_id']} ran with weights changed in memory (a weight fault or an in-place "
                         f"edit: weights_sha256 {ran[:12]}...), not {what}: a re-run would not be comparable; pass "
                         "the module as it ran (model=...)")
