"""Checkpoints: a moment of training on disk (weights, optimizer, random state), written atomically, read verified.

A checkpoint folder stands on its own (it can be loaded without the run around it)::

    model.safetensors      the weights; a tied output head is stored once and restored as an alias
    optimizer.safetensors  the optimizer's tensors (AdamW: both moments and the step count per parameter)
    rng.safetensors        every training process's torch random state (dropout), as uint8 tensors
    state.json             the step, tokens seen, best validation loss, elapsed time, the optimizer's
                           non-tensor parts (its parameter groups), and the data position
    config.toml            a copy of the configuration
    tokenizer.json         a copy of the tokenizer
    checksums.json         written last: the size and SHA-256 of every other file

No pickle anywhere: safetensors files hold named tensors and nothing else, so loading one cannot
run code; everything that is not a tensor is JSON or TOML. The data position is just the step:
the batches of step s are a function of (seed, s) (see `tinylm.train.batches`), so numpy keeps
no state worth saving, and Python's `random` is not used.

Writing is atomic per folder: a checkpoint is written in full to ``.latest.new/``, the old
``latest/`` is renamed to ``.latest.old/``, the new one renamed into place, and the old one
deleted. A crash at any moment leaves a complete checkpoint under ``latest/`` or, for the instant
between the two renames, under ``.latest.old/``, where `find_checkpoint` looks next. A disk that
refuses the writes (full, read-only) is one line naming the checkpoint still intact, with the
half-written folder removed; a ``latest`` that is a symbolic link is replaced by a folder, and
what it pointed to is left alone.

Damage after writing is caught on reading: every load (`load_checkpoint`, hence ``--resume``,
``--init-from``, `load_run` and so eval, sample, serve and export) first checks each file against
checksums.json (`verify_checkpoint`), so a truncated, bit-flipped, missing or swapped-in file is a
one-line error naming it and the way out, never a silently wrong model; weights that are NaN or
infinite are refused too, and so are weights stored as anything but a float type (integers with
recomputed checksums pass every check before that one). Checking costs one read of the folder
(SHA-256 reads about 1 GB a second).
A checkpoint written before checksums existed (no checksums.json, and no mention of it in its
state.json) is read as it is, unchecked. ``best/`` is a copy of ``latest/``, never hard links to
it, so damage to one leaves the other to fall back on. The same tensors always give the same
bytes (`save_safetensors`): two identical runs write identical checkpoint files, and the files
are created like every other file of a run (mode 0644 under the usual umask).

Usage::

    save_checkpoint(checkpoint_path("runs/mine", "latest"), model_state=model.state_dict(), ...)
    ckpt = load_checkpoint(checkpoint_path("runs/mine", "best"))   # verified against checksums.json
    model = ckpt.build_model()                                      # on the CPU, in eval mode
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor

from tinylm.atomic import disk_writes
from tinylm.config import Config, build_config, dump_toml, load_config_file
from tinylm.errors import TinyLMError
from tinylm.jsonfile import JSONFormat, read_json_object
from tinylm.model import build_model
from tinylm.model.lora import LoraSettings, merge_adapter
from tinylm.tokenizers.base import Tokenizer, check_same_tokenizer, load_tokenizer

FORMAT_VERSION = 1  # of checkpoints and of run.json

# a checkpoint carries copies of its run's configuration and tokenizer, under the same names
CONFIG_FILE = "config.toml"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINTS = "checkpoints"  # the folder of a run that holds its checkpoints
CHECKPOINT_NAMES = ("latest", "best")

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "state.json"  # a folder without it is not a checkpoint
STATE = JSONFormat(  # {way_out}: what to load instead (`_way_out`)
    "tinylm.checkpoint", FORMAT_VERSION,
    missing="{folder} is not a complete checkpoint (no {file}); {way_out}",
    unreadable="{path} is corrupt ({error}); {way_out}",
    foreign="{folder} is not a tinylm checkpoint (its {file} has no format {name!r})",
    wrong_version="{folder} is a checkpoint of format version {found!r}; this tinylm reads version {version}",
)
CHECKSUMS_FILE = "checksums.json"  # written last: every other file's size and SHA-256
CHECKSUMS = JSONFormat(  # no version: its files and its own checksum are all it holds
    "tinylm.checksums", None,
    missing="checkpoint file {path} is missing",
    unreadable="checkpoint file {path} is corrupt ({error})",
    foreign="checkpoint file {path} is corrupt (it does not match its own checksum)",
    valid=lambda manifest: _has_own_checksum(manifest),
)
# state.json of a LoRA run's checkpoint, whose model.safetensors holds the adapter only: where the base checkpoint
# is (its absolute path, and its path from the checkpoint folder, for a run moved with its base) and the SHA-256
# of the base's weights, which must still be the ones the adapter was trained on
LORA_BASE = "lora_base"
# what a model's weights may be stored as: the float types a model trains or runs in (and float64)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ----- writing checkpoints ------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model_state: Mapping[str, Tensor],
    optimizer_state: Mapping[str, Any] | None,
    rng_state: Mapping[str, Tensor],
    state: Mapping[str, Any],
    config: Config,
    tokenizer: Tokenizer,
) -> Path:
    """Write a checkpoint folder at ``path`` atomically (see the module docstring); returns ``path``.

    ``model_state`` is a model's ``state_dict()``; ``optimizer_state`` an optimizer's (or None);
    ``rng_state`` named uint8 tensors; ``state`` anything JSON for state.json (the format, the
    optimizer's non-tensor parts, the tokenizer fingerprint and the name of the checksums file
    are added here).
    """
    path = Path(path)

    def write(folder: Path) -> None:
        tensors, aliases = _unique_tensors(model_state)
        metadata = {"format": STATE.name}
        save_safetensors(tensors, folder / MODEL_FILE, {**metadata, "aliases": json.dumps(aliases)})
        info = dict(state)
        if optimizer_state is not None:
            opt_tensors, info["optimizer"] = flatten_optimizer_state(optimizer_state)
            save_safetensors(opt_tensors, folder / OPTIMIZER_FILE, metadata)
        rng = {k: v.detach().cpu().contiguous() for k, v in rng_state.items()}
        save_safetensors(rng, folder / RNG_FILE, metadata)
        (folder / CONFIG_FILE).write_text(dump_toml(config.to_dict()), encoding="utf-8")
        tokenizer.save(folder / TOKENIZER_FILE)
        info = {**STATE.header(), "tokenizer_fingerprint": tokenizer.fingerprint(), "checksums": CHECKSUMS_FILE,
                **info}
        (folder / STATE_FILE).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        _write_checksums(folder)

    _replace_folder(path, write)
    return path


def copy_checkpoint(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Make ``target`` a copy of the checkpoint ``source``, atomically, once ``source`` is verified.

    A real copy, not hard links: a file damaged in place (a bad sector, a stray write) must not
    damage both checkpoints of a run, or the advice to fall back on the other one could not work.
    """
    source = verify_checkpoint(source)  # never make a damaged checkpoint the one to fall back on

    def write(folder: Path) -> None:
        # file by file, not copytree: its errors come back bundled in one shutil.Error, and a full disk
        # must reach `_replace_folder` as the OSError it is
        for name in sorted(os.listdir(source)):
            shutil.copy2(source / name, folder / name)
            _fsync(folder / name)

    return _replace_folder(Path(target), write)


def save_safetensors(tensors: Mapping[str, Tensor], path: str | os.PathLike,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (contiguous, on the CPU) as the safetensors file ``path``: the same bytes for the
    same tensors and metadata, and a file created like any other (mode 0644 under the usual umask).

    safetensors' own `save_file` makes every file private (0600), and it keeps the metadata in a
    Rust hash map, whose order changes from one map to the next (two keys come out either way
    round, even within one process), so the same weights would hash differently in every run.
    Here the header is written again with the metadata sorted; tensor offsets count from the end
    of the header, so its length may change freely.
    """
    data = save(dict(tensors), metadata=dict(metadata) if metadata else None)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the tensor data stays 8-byte aligned, as safetensors pads it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.write(memoryview(data)[8 + n :])  # the tensors, not copied once more


def _write_checksums(folder: Path) -> None:
    """checksums.json: the size and SHA-256 of every file in ``folder``, written after they are all on disk."""
    files = {name: _digest(folder / name) for name in sorted(os.listdir(folder))}
    for name in files:
        _fsync(folder / name)
    # its own checksum too, so that a damaged checksums.json blames itself, not a file it lists
    manifest = {**CHECKSUMS.header(), "files": files}
    manifest["sha256"] = _json_sha256(manifest)
    (folder / CHECKSUMS_FILE).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    _fsync(folder / CHECKSUMS_FILE)


def _digest(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _json_sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()


def _has_own_checksum(manifest: dict[str, Any]) -> bool:
    """Whether a checksums.json lists its files and matches the checksum it holds of itself."""
    body = {key: value for key, value in manifest.items() if key != "sha256"}
    return isinstance(body.get("files"), dict) and manifest.get("sha256") == _json_sha256(body)


def _replace_folder(path: Path, write) -> Path:
    """Write a folder with ``write(folder)`` beside ``path``, then swap it in (see the module docstring).

    A disk that refuses the writes (full, read-only, ...) is one line saying which checkpoint is still
    intact there, with the half-written folder already gone. A ``path`` that is a symbolic link (a user's
    ``ln -s``) is replaced by the new folder; the link goes, and the folder it pointed to is left as it was.
    """
    new = path.with_name(f".{path.name}.new")
    old = path.with_name(f".{path.name}.old")
    with disk_writes(f"checkpoint {path}", lambda: _intact(path), retry=_retry(path)):
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove(new)  # left by a crash while writing: never complete, never used
        new.mkdir()
        try:
            write(new)
        except BaseException:
            _remove(new)
            raise
        if path.exists() or path.is_symlink():
            # An .old folder still here is from a crash after its replacement was in place: stale.
            _remove(old)
            os.replace(path, old)  # a link is renamed, not followed
        os.replace(new, path)
        _fsync_dir(path.parent)
        _remove(old)
    return path


def _remove(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a folder, if there is one at ``path``."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _intact(path: Path) -> str:
    """What is still there after a failed write of the checkpoint ``path``: the one it was to replace, if any."""
    for folder in (path, path.with_name(f".{path.name}.old")):
        state = _state_json(folder)
        if state is None:
            continue
        step = state.get("step")
        where = "there" if folder == path else f"in {folder}"
        return f"the checkpoint of step {step} is intact {where}" if isinstance(step, int) else \
            f"the checkpoint there before is intact {where}"
    return "nothing half-written is left there"


def _retry(path: Path) -> str:
    """How to go on once the disk takes writes again: a run's training continues from its latest checkpoint
    (an imported run has nothing to continue: it is imported again)."""
    if path.parent.name != CHECKPOINTS or path.name not in CHECKPOINT_NAMES:
        return "try again"
    latest = path.with_name("latest")
    for folder in (latest, latest.with_name(".latest.old")):
        state = _state_json(folder)
        if state is not None and "imported_from" not in state:
            return "continue with --resume"
    return "run it again with --force"


def _state_json(folder: Path) -> dict[str, Any] | None:
    """The object in ``folder``'s state.json as it is, or None where there is none to read: what is said about a
    folder that may be half-written or damaged (`load_checkpoint` reads it checked)."""
    try:
        return read_json_object(folder / STATE_FILE)
    except TinyLMError:
        return None


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some systems cannot open a folder; the renames are still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unique_tensors(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors with shared ones (a tied head) stored once, and alias -> stored name for the rest.

    safetensors refuses two names for one piece of memory, and storing E twice would double
    the file of a tied model for nothing.
    """
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().cpu().contiguous()
    return tensors, aliases


def flatten_optimizer_state(state_dict: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """An optimizer ``state_dict()`` split into named tensors and a JSON-able rest.

    The tensors are named ``state/<i>/<name>`` for the i-th entry of ``state`` (a parameter's
    moments, momentum buffer, step count); the rest keeps the entries' keys, their non-tensor
    values, and the parameter groups (learning rate, betas, weight decay, which parameters).
    """
    tensors: dict[str, Tensor] = {}
    keys, values = [], []
    for i, (key, entry) in enumerate(state_dict["state"].items()):
        keys.append(key)
        plain = {}
        for name, value in entry.items():
            if isinstance(value, Tensor):
                tensors[f"state/{i}/{name}"] = value.detach().cpu().contiguous()
            else:
                plain[name] = value
        values.append(plain)
    rest = {"state_keys": keys, "state_values": values, "param_groups": list(state_dict["param_groups"])}
    json.dumps(rest)  # fail now, not halfway through writing, if something is not JSON
    return tensors, rest


def unflatten_optimizer_state(tensors: Mapping[str, Tensor], rest: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `flatten_optimizer_state`: an optimizer ``state_dict()`` again."""
    state: dict[Any, dict[str, Any]] = {}
    for i, key in enumerate(rest["state_keys"]):
        state[key] = dict(rest["state_values"][i])
    for name, value in tensors.items():
        _, i, tensor_name = name.split("/", 2)
        state[rest["state_keys"][int(i)]][tensor_name] = value
    groups = []
    for group in rest["param_groups"]:
        group = dict(group)
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])  # JSON has no tuples
        groups.append(group)
    return {"state": state, "param_groups": groups}


# ----- reading checkpoints ------------------------------------------------------------------------


class NoCheckpoint(TinyLMError):
    """Nothing at all where a checkpoint was asked for (not a damaged one): callers that can say why
    (a run that stopped before its first save) catch this type instead of reading the message."""



def checkpoint_path(run_dir: str | os.PathLike, name: str = "latest") -> Path:
    """Where the checkpoint ``name`` ("latest" or "best") of a run lives (whether or not it exists)."""
    if name not in CHECKPOINT_NAMES:
        raise TinyLMError(f"unknown checkpoint {name!r}; a run keeps {' and '.join(CHECKPOINT_NAMES)}")
    return Path(run_dir) / CHECKPOINTS / name


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The complete checkpoint folder at ``path``, or the one a crash mid-save left beside it, or an error."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    old = path.with_name(f".{path.name}.old")
    if (old / STATE_FILE).is_file():
        return old
    if path.is_dir():
        raise TinyLMError(f"{path} is not a complete checkpoint (no {STATE_FILE}); {_way_out(path)}")
    raise NoCheckpoint(f"no checkpoint at {path}")


def verify_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder at ``path`` (see `find_checkpoint`), once every file matches checksums.json.

    A file missing, truncated, changed by a single bit or replaced by another checkpoint's is a
    one-line `TinyLMError` that names it and says what to load instead: the run's other checkpoint
    when that one is sound, else training again. A checkpoint from before checksums (no
    checksums.json, and a state.json that does not mention one) passes unchecked.
    """
    path = find_checkpoint(path)
    damage = _damage(path)
    if damage is not None:
        raise TinyLMError(f"{damage}; {_way_out(path)}")
    return path


def _damage(path: Path) -> str | None:
    """What is wrong with the files of the checkpoint folder ``path``, or None."""
    manifest_file = path / CHECKSUMS_FILE
    if not manifest_file.is_file():
        state = _state_json(path)  # (if there is none, load_checkpoint says what is wrong with state.json)
        if state is not None and state.get("checksums"):
            return f"checkpoint file {manifest_file} is missing (its {STATE_FILE} says it was written)"
        return None  # written before checkpoints had checksums
    try:
        files = CHECKSUMS.read(manifest_file)["files"]
    except TinyLMError as e:
        return str(e)
    damaged = {name: why for name, written in files.items() if (why := _file_damage(path / name, written))}
    if len(damaged) == 1:
        ((name, why),) = damaged.items()
        return f"checkpoint file {path / name} {why}"
    if damaged:  # several at once: as likely a checksums.json copied from elsewhere as several damaged files
        return (f"checkpoint {path} does not match its {CHECKSUMS_FILE}, which may be another checkpoint's: "
                + "; ".join(f"{name} {why}" for name, why in damaged.items()))
    return None


def _file_damage(path: Path, written: Mapping[str, Any]) -> str | None:
    """How the file at ``path`` differs from what checksums.json says was ``written`` there, or None."""
    if not path.is_file():
        return "is missing"
    found = _digest(path)
    size, size_written = found["bytes"], written["bytes"]
    if size < size_written:
        return f"has {size:,} of the {size_written:,} bytes written (truncated, or another checkpoint's file)"
    if size != size_written:
        return f"has {size:,} bytes where {size_written:,} were written (another checkpoint's file?)"
    if found["sha256"] != written["sha256"]:
        return (f"is corrupt (its SHA-256 differs from the one in {CHECKSUMS_FILE}: flipped bytes, or another "
                "checkpoint's file)")
    return None


def _way_out(path: Path) -> str:
    """What to load instead of the damaged checkpoint folder ``path``: its run's other checkpoint if that
    one is sound, else nothing but a new run."""
    name = path.name.removeprefix(".").removesuffix(".old")  # .latest.old is latest, caught mid-save
    if path.parent.name != CHECKPOINTS or name not in CHECKPOINT_NAMES:
        return "use another checkpoint, or train again"
    for other in CHECKPOINT_NAMES:
        if other != name and _is_sound(path.parent / other):
            return (f"use the other checkpoint, {path.parent / other} (--checkpoint {other}, or --resume {other} "
                    "to train on), or train again with --force")
    return "the run has no other sound checkpoint: train again with --force"


def _is_sound(path: Path) -> bool:
    """Whether a complete checkpoint whose files match their checksums is at ``path`` (or beside it, mid-save)."""
    for folder in (path, path.with_name(f".{path.name}.old")):
        if (folder / STATE_FILE).is_file():
            return _damage(folder) is None
    return False


@dataclass
class Checkpoint:
    """A checkpoint folder, read: its configuration, tokenizer and state.json; tensors on demand.

    A LoRA run's checkpoint (`is_adapter`) holds only the adapter and names the checkpoint it adapts (`base`);
    `model_state` gives the adapted model's weights, the adapter merged into the base's, so everything that
    loads a checkpoint (sample, eval, serve, export) takes it as it takes any other.
    """

    path: Path
    config: Config
    tokenizer: Tokenizer
    state: dict[str, Any]
    _base: Checkpoint | None = field(default=None, repr=False, compare=False)

    @property
    def is_adapter(self) -> bool:
        """Whether this is a LoRA run's checkpoint: an adapter on a base checkpoint, not a whole model."""
        return LORA_BASE in self.state

    def base(self) -> Checkpoint:
        """The checkpoint a LoRA run's adapter adapts, found and checked to be the one it was trained on."""
        if self._base is None:
            self._base = _adapter_base(self)
        return self._base

    def adapter_state(self) -> dict[str, Tensor]:
        """A LoRA run's adapter: each target's lora_A and lora_B, by the names `tinylm.model.lora` gives them."""
        if not self.is_adapter:
            raise TinyLMError(f"{self.path} holds a whole model, not a LoRA adapter")
        return self._stored_tensors()

    @property
    def step(self) -> int:
        """Optimizer steps completed when it was saved."""
        return int(self.state["step"])

    def model_state(self) -> dict[str, Tensor]:
        """The weights, by parameter name, with aliases (a tied head) pointing at the same tensor; a LoRA run's are
        its base's with the adapter merged in (W + alpha / r * B A).

        A NaN or infinite weight is an error: such a model only ever gives NaN losses and samples
        (a run that diverged, or an imported file that was broken already).
        """
        if self.is_adapter:
            settings = LoraSettings.of(self.config.train)
            if settings is None:
                raise TinyLMError(f"{self.path} holds a LoRA adapter but its {CONFIG_FILE} sets no lora_rank; "
                                  f"{_way_out(self.path)}")
            return merge_adapter(self.base().model_state(), self._stored_tensors(), settings.scale)
        return self._stored_tensors()

    def _stored_tensors(self) -> dict[str, Tensor]:
        """model.safetensors' tensors, checked to be finite floats, with its aliases."""
        tensors, metadata = _read_safetensors(self.path / MODEL_FILE)
        for name, t in tensors.items():
            if t.dtype not in WEIGHT_DTYPES:
                # copying integers into a float parameter would "work", and give a model that is garbage
                raise TinyLMError(f"the weights in {self.path / MODEL_FILE} are not a model's: {name} holds "
                                  f"{str(t.dtype).removeprefix('torch.')} values where a model holds floating-point "
                                  f"numbers ({', '.join(str(d).removeprefix('torch.') for d in WEIGHT_DTYPES)}); "
                                  f"{_way_out(self.path)}")
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise TinyLMError(f"the weights in {self.path / MODEL_FILE} are not finite ({name} holds NaN or "
                                  f"infinite values); {_way_out(self.path)}")
        for alias, name in json.loads(metadata.get("aliases", "{}")).items():
            tensors[alias] = tensors[name]
        return tensors

    def optimizer_state(self) -> dict[str, Any] | None:
        if "optimizer" not in self.state:
            return None
        tensors, _ = _read_safetensors(self.path / OPTIMIZER_FILE)
        return unflatten_optimizer_state(tensors, self.state["optimizer"])

    def rng_state(self) -> dict[str, Tensor]:
        return _read_safetensors(self.path / RNG_FILE)[0]

    def load_weights(self, model: torch.nn.Module) -> None:
        """Copy the weights into ``model``; a checkpoint of another shape is a clear error."""
        load_weights(model, self.model_state(), self.path)

    def build_model(self, device: torch.device | str = "cpu") -> torch.nn.Module:
        """The model of this checkpoint's configuration (`GPT`, `RecurrentLM`) with its weights, in eval mode."""
        self.check_shapes()
        # the random initialisation is overwritten at once; fork_rng leaves the caller's random state alone
        with torch.random.fork_rng(devices=[]):
            model = build_model(self.config.model)
        model = model.to(device)
        self.load_weights(model)
        return model.eval()


    def check_shapes(self) -> None:
        """Refuse a configuration whose weights are not the stored ones, before any memory is allocated.

        The model is built on PyTorch's meta device (shapes, no storage) and its tensors compared
        with the safetensors header: a config.toml edited to ``d_model = 4000000`` is one line
        here, not an 8 GB allocation and then a mismatch.
        """
        if self.is_adapter:  # the base's shapes; the adapter's are checked as it is merged
            self.base().check_shapes()
            return
        stored = _stored_shapes(self.path / MODEL_FILE)
        with torch.device("meta"):
            expected = {name: tuple(t.shape) for name, t in build_model(self.config.model).state_dict().items()}
        for name, shape in expected.items():
            if name in stored and stored[name] != shape:
                raise TinyLMError(
                    f"the configuration in {self.path / CONFIG_FILE} does not fit the weights in {self.path / MODEL_FILE} "
                    f"({name}: the configuration makes it {shape}, the file holds {stored[name]}); use the "
                    "configuration they were trained with")
        missing, extra = sorted(expected.keys() - stored.keys()), sorted(stored.keys() - expected.keys())
        if missing or extra:
            what = f"no {missing[0]}" if missing else f"an unexpected {extra[0]}"
            raise TinyLMError(f"the weights in {self.path / MODEL_FILE} do not fit the configuration in "
                              f"{self.path / CONFIG_FILE} ({what}); use the configuration they were trained with")


def weights_fingerprint(path: str | os.PathLike) -> str:
    """The SHA-256 of a checkpoint folder's weights file: the one its checksums.json holds, else computed."""
    path = Path(path)
    try:
        return CHECKSUMS.read(path / CHECKSUMS_FILE)["files"][MODEL_FILE]["sha256"]
    except (TinyLMError, KeyError, TypeError):
        return _digest(path / MODEL_FILE)["sha256"]


def lora_base_record(base: Checkpoint, written_at: str | os.PathLike) -> dict[str, str]:
    """What a LoRA checkpoint written at ``written_at`` says of its ``base`` (state.json's `LORA_BASE`)."""
    where = base.path.resolve()
    sha = weights_fingerprint(where)
    where = where.with_name(where.name.removeprefix(".").removesuffix(".old"))  # caught mid-save: its final name
    record = {"path": str(where), "sha256": sha}
    try:
        record["relative"] = os.path.relpath(where, Path(written_at).resolve())
    except ValueError:  # another drive (Windows): no path between them
        pass
    return record


def _adapter_base(adapter: Checkpoint) -> Checkpoint:
    """The base checkpoint ``adapter``'s state.json names, beside it as it was (a run moved with its base) or where
    it was, once checked to be the model the adapter was trained on."""
    record = adapter.state[LORA_BASE]
    if not isinstance(record, dict) or not {"path", "sha256"} <= record.keys():
        raise TinyLMError(f"{adapter.path / STATE_FILE} names no base model for its adapter; {_way_out(adapter.path)}")
    candidates = [Path(os.path.normpath(adapter.path / record["relative"]))] if record.get("relative") else []
    candidates.append(Path(record["path"]))
    found = next((c for c in candidates
                  if (c / STATE_FILE).is_file() or (c.with_name(f".{c.name}.old") / STATE_FILE).is_file()), None)
    if found is None:
        raise TinyLMError(f"{adapter.path} is a LoRA adapter of the model {record['path']}, which is not there any "
                          "more; put that checkpoint back where it was (or beside this run as it was), or import the "
                          "adapter with the base it belongs to (tinylm import --from ADAPTER --base BASE)")
    base = load_checkpoint(found)
    if weights_fingerprint(base.path) != record["sha256"]:
        raise TinyLMError(f"{adapter.path} is a LoRA adapter of the model {base.path}, but that model has changed "
                          "since the adapter was trained on it (its weights' SHA-256 differs); put back the checkpoint "
                          "it was trained on, or train the adapter again on this one")
    if base.config.model != adapter.config.model:
        raise TinyLMError(f"{adapter.path} is a LoRA adapter of another model than {base.path} (their [model] "
                          "settings differ); use the base it was trained on")
    check_same_tokenizer(base.tokenizer, adapter.tokenizer, f"{adapter.path}'s tokenizer is not its base's "
                         f"({base.path})", "use the base the adapter was trained on")
    return base


def _stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a safetensors header (aliases included), without reading the tensors."""
    if not path.is_file():
        raise TinyLMError(f"checkpoint file {path} is missing; {_way_out(path.parent)}")
    try:
        with safe_open(path, framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    except Exception as e:  # a damaged header: the same error as reading the tensors gives
        raise _unreadable(path, e) from None
    for alias, name in aliases.items():
        if name in shapes:
            shapes[alias] = shapes[name]
    return shapes


def load_weights(model: torch.nn.Module, state: Mapping[str, Tensor], source: Path | str) -> None:
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        detail = first[1].strip() if len(first) > 1 else first[0]
        raise TinyLMError(
            f"the weights in {source} do not fit this model ({detail}): the checkpoint is from another "
            "configuration; use the configuration it was trained with (its config.toml)"
        ) from None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint folder's configuration, tokenizer and state, once its files are verified
    (see `find_checkpoint` and `verify_checkpoint`)."""
    path = verify_checkpoint(path)
    state = STATE.read(path / STATE_FILE, way_out=lambda: _way_out(path))
    config = build_config(load_config_file(path / CONFIG_FILE))
    tokenizer = load_tokenizer(path / TOKENIZER_FILE)
    check_same_tokenizer(str(state.get("tokenizer_fingerprint")), tokenizer,
                         f"{path / TOKENIZER_FILE} is not the tokenizer this checkpoint was trained with",
                         _way_out(path))
    return Checkpoint(path, config, tokenizer, state)


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """All tensors and the metadata of a safetensors file; an unreadable file is a one-line error."""
    # (checksums catch all of this first; these are the errors of a checkpoint written before them)
    if not path.is_file():
        raise TinyLMError(f"checkpoint file {path} is missing; {_way_out(path.parent)}")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types, OSError, or others for a damaged file
        raise _unreadable(path, e) from None
    return tensors, metadata


def _unreadable(path: Path, e: Exception) -> TinyLMError:
    return TinyLMError(f"checkpoint file {path} is corrupt or truncated ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:120]}); {_way_out(path.parent)}")


def has_checkpoint(path: str | os.PathLike) -> bool:
    """Whether a checkpoint was saved at ``path``, sound or not: "best" falls back to "latest" only in a run
    that never had a best one, never past a damaged one."""
    path = Path(path)
    return path.is_dir() or path.with_name(f".{path.name}.old").is_dir()
