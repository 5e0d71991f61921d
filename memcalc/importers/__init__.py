"""Read a training framework's own configuration into `RunOptions` fields, locally (nothing is downloaded).

`--deepspeed-config ds_config.json`, `--megatron-args FILE|"ARGS"` and `--torchtitan-config job.toml` each set the
same `RunOptions` fields that the equivalent explicit flags set, so an imported configuration resolves to exactly
the `Run` those flags give. Flags typed on the command line win over imported values, and the `ImportReport` says
so; every key that memcalc does not use is listed as ignored (never silently), and framework settings memcalc
does not model yet (DeepSpeed bucket sizes, ...) are recorded in the report.

Flow: `apply_imports(options, explicit)` -> the importer for the flag given returns an `Imported` (values keyed by
RunOptions field, plus deferred values that need the model, e.g. Megatron's layers per virtual stage) -> values
are merged where the user did not give the flag -> the merged options carry `import_report`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from memcalc.errors import InputError
from memcalc.options import ARCH_FIELDS, FLAG_OF, IMPORT_FIELDS, SHAPE_CHOICE_FIELDS, RunOptions

# RunOptions fields that describe the model's shape: dropped from an import when --model / --params is given.
SHAPE_FIELDS = ("model", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", *SHAPE_CHOICE_FIELDS, *ARCH_FIELDS)

# flag spelling of the RunOptions fields not in options.FLAG_OF, and of the boolean flags by value
_EXTRA_FLAGS = {
    "model": "--model", "params": "--params", "profile": "--profile", "order": "--order", "gpu": "--gpu",
    "gpus_per_node": "--gpus-per-node", "memory": "--memory",
}
_BOOL_FLAGS = {
    "sp": ("--sp", "--no-sp"),
    "master_weights": ("--master-weights", "--no-master-weights"),
    "foreach": ("--foreach", "--no-foreach"),
    "tp_overlap": ("--tp-overlap", "--no-tp-overlap"),
    "tied_embeddings": ("--tied-embeddings", "--untied-embeddings"),
    "bias": ("--bias", "--no-bias"),
    "qkv_bias": ("--qkv-bias", "--no-qkv-bias"),
}


def flag_of(field: str) -> str:
    if field in _BOOL_FLAGS:
        return _BOOL_FLAGS[field][0]
    return FLAG_OF.get(field) or _EXTRA_FLAGS.get(field) or "--" + field.replace("_", "-")


def flag_text(field: str, value: Any) -> str:
    """The command-line spelling of one option value: `--zero 3`, `--no-sp`."""
    if field in _BOOL_FLAGS:
        return _BOOL_FLAGS[field][0 if value else 1]
    return f"{flag_of(field)} {value}"


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Override(_Out):
    field: str
    flag: str
    imported: Any
    used: Any


class Ignored(_Out):
    key: str
    reason: str


class ImportReport(_Out):
    """What an import did; serialised into the estimate's JSON as `inputs.import_report`."""

    framework: str  # deepspeed | megatron | torchtitan
    source: str  # the file, or "<arguments>" for a Megatron argument string
    applied: dict[str, Any] = Field(default_factory=dict)  # RunOptions field -> value taken from the config
    equivalent_flags: str = ""  # the flags that give the same configuration
    overridden: list[Override] = Field(default_factory=list)  # explicit flags that won over imported values
    ignored: list[Ignored] = Field(default_factory=list)  # keys memcalc does not use, with why
    recorded: dict[str, Any] = Field(default_factory=dict)  # framework settings read but not modelled yet
    needs_value: list[str] = Field(default_factory=list)  # "auto"/unset values: what was assumed, which flag sets it
    notes: list[str] = Field(default_factory=list)


Deferred = Callable[[Any, RunOptions, "Imported"], None]  # (ModelSpec, merged options, imported) -> None


@dataclasses.dataclass
class Imported:
    """An importer's result before merging: values keyed by RunOptions field."""

    framework: str
    source: str
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    from_config: set[str] = dataclasses.field(default_factory=set)  # fields set by a key (not a framework default)
    deferred: list[Deferred] = dataclasses.field(default_factory=list)  # need the resolved model (layers, hidden)
    ignored: list[Ignored] = dataclasses.field(default_factory=list)
    recorded: dict[str, Any] = dataclasses.field(default_factory=dict)
    needs_value: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def set(self, field: str, value: Any, *, default: bool = False) -> None:
        self.values[field] = value
        if not default:
            self.from_config.add(field)

    def ignore(self, key: str, reason: str = "unknown to memcalc") -> None:
        self.ignored.append(Ignored(key=key, reason=reason))


def read_text(path_text: str, flag: str) -> tuple[str, str]:
    """(text, source name) of a config file; one-line InputError when it cannot be read."""
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise InputError(f"{flag} {path_text!r}: no such file")
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{flag} {path_text!r} cannot be read: {e}") from None


def default_explicit(o: RunOptions) -> set[str]:
    """Without a command line to ask: every field that differs from its default counts as given explicitly."""
    out = set()
    for f in dataclasses.fields(RunOptions):
        if f.name in IMPORT_FIELDS or f.name == "import_report":
            continue
        if getattr(o, f.name) != f.default:
            out.add(f.name)
    return out


def _importer(field: str) -> Callable[[str, RunOptions, set[str]], Imported]:
    if field == "deepspeed_config":
        from memcalc.importers.deepspeed import import_deepspeed

        return import_deepspeed
    if field == "megatron_args":
        from memcalc.importers.megatron import import_megatron

        return import_megatron
    from memcalc.importers.torchtitan import import_torchtitan

    return import_torchtitan


def _merge(imp: Imported, merged: RunOptions, o: RunOptions, explicit: set[str], report: ImportReport,
           values: dict[str, Any]) -> None:
    for field, value in values.items():
        if field in explicit:
            given = getattr(o, field)
            if given != value:
                report.overridden.append(Override(field=field, flag=flag_of(field), imported=value, used=given))
            continue
        setattr(merged, field, value)
        report.applied[field] = value


def apply_imports(o: RunOptions, explicit: set[str] | None = None) -> RunOptions:
    """A copy of `o` with the imported configuration merged in (explicit fields win) and `import_report` set.
    `explicit`: the RunOptions fields the user typed (the CLI asks click); default: those differing from defaults."""
    given = [f for f in IMPORT_FIELDS if getattr(o, f)]
    if not given:
        return o
    if len(given) > 1:
        raise InputError(f"give one of --deepspeed-config, --megatron-args, --torchtitan-config (got "
                         f"{', '.join(FLAG_OF[f] for f in given)})")
    field = given[0]
    explicit = default_explicit(o) if explicit is None else set(explicit) - set(IMPORT_FIELDS)
    imp = _importer(field)(getattr(o, field), o, explicit)
    report = ImportReport(framework=imp.framework, source=imp.source)
    merged = dataclasses.replace(o, **{f: None for f in IMPORT_FIELDS})
    values = dict(imp.values)
    shape_given = {"model", "params"} & explicit
    if shape_given:
        by = " / ".join(flag_of(f) for f in sorted(shape_given))
        dropped = [k for k in SHAPE_FIELDS if k in values]
        for k in dropped:
            v = values.pop(k)
            if k in imp.from_config and k not in explicit:
                report.overridden.append(Override(field=k, flag=by, imported=v, used=f"from {by}"))
    _merge(imp, merged, o, explicit, report, values)
    if imp.deferred:
        from memcalc.options import build_model

        model, _ = build_model(merged)
        before = dict(imp.values)
        for fn in imp.deferred:
            fn(model, merged, imp)
        later = {k: v for k, v in imp.values.items() if k not in before or before[k] != v}
        _merge(imp, merged, o, explicit, report, later)
    report.ignored = imp.ignored
    report.recorded = imp.recorded
    report.needs_value = imp.needs_value
    report.notes = imp.notes
    report.equivalent_flags = " ".join(flag_text(k, v) for k, v in report.applied.items())
    merged.import_report = report
    return merged


def as_int(value: Any, key: str, source: str) -> int:
    """An integer config value (JSON numbers like 5e8 and strings like "5e8" included)."""
    if isinstance(value, bool):
        raise InputError(f"{source}: {key} = {value!r} is not a number")
    if isinstance(value, int):
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{source}: {key} = {value!r} is not a number") from None
    if not f.is_integer():
        raise InputError(f"{source}: {key} = {value!r} is not a whole number")
    return int(f)
