"""Every value-taking option and argument of every command is checked before anything runs.

The cases are generated from the command line itself: each option's type (shardlm/cli/options.py)
says what it accepts, and the test tries values outside that (0, negative, huge, not a number,
nan, inf, a file where a folder is expected, a missing folder ...). An option added without a
checked type fails `test_every_value_option_has_a_checked_type` unless it is one of the few word
choices listed in WORDS (checked by the plan builder, with their own cases in BAD_WORDS).
"""

from __future__ import annotations

import pytest
import typer

from shardlm.cli import options as o
from shardlm.cli.app import app, main

COMMAND = typer.main.get_command(app)
WORDS = {("generate", "dtype"), ("generate", "quantization"), ("generate", "device"), ("generate", "prompts"),
         ("inspect", "model"), ("plan", "model"), ("plan", "devices"), ("plan", "dtype"), ("plan", "quantization"),
         ("plan", "objective"), ("shard", "dtype"), ("consolidate", "dtype"), ("convert", "dtype"),
         ("convert", "quantization"), ("perplexity", "dtype"), ("perplexity", "quantization"),
         ("perplexity", "device"), ("generate", "verify"), ("shard", "verify"), ("reshard", "verify"),
         ("consolidate", "verify"), ("convert", "verify"), ("serve", "dtype"), ("serve", "quantization"),
         ("serve", "device"), ("serve", "verify"), ("serve", "host"), ("serve", "api_key"),
         ("serve", "served_model_name"), ("top", "url")}
"""Options that take a word from a short list (or free text) rather than a number or a path."""


def _params():
    """(command, click parameter) for every parameter that takes a value."""
    for name, command in sorted(COMMAND.commands.items()):
        for p in command.params:
            if not getattr(p, "is_flag", False) and p.name != "help":
                yield name, p


def _checked(param) -> o.Checked | None:
    """The parameter's type from shardlm/cli/options.py (its Typer parser), or None."""
    info = getattr(getattr(param, "type_descriptor", None), "parameter_info", None)
    parser = getattr(info, "parser", None) or getattr(getattr(param, "type", None), "func", None)
    return parser if isinstance(parser, o.Checked) else None


def test_every_value_option_has_a_checked_type():
    unchecked = [f"{c} {p.name}" for c, p in _params() if _checked(p) is None and (c, p.name) not in WORDS]
    assert not unchecked, f"give these options a type from shardlm/cli/options.py (or list them in WORDS): {unchecked}"


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A file, a folder, a valid manifest and a missing path for the cases."""
    root = tmp_path_factory.mktemp("opts")
    (root / "afile.txt").write_text("x")
    (root / "adir").mkdir()
    manifest = root / "m.yaml"
    assert main(["plan", "smollm2-135m", "--devices", "1xcpu-4GB", "-o", str(manifest)]) == 0
    return {"file": str(root / "afile.txt"), "dir": str(root / "adir"), "manifest": str(manifest),
            "missing": str(root / "no" / "such"), "out": str(root / "out")}


def _bad_values(kind: o.Checked, places: dict) -> list[str]:
    """Values `kind` must refuse."""
    if isinstance(kind, o.Int):
        return [str(kind.minimum - 1), str(kind.maximum + 1), str(10**30), "abc", "1.5", ""]
    if isinstance(kind, o.Float):
        return [str(kind.minimum if kind.open_min else kind.minimum - 1), str(kind.maximum * 10 + 1), "nan", "inf",
                "-inf", "abc"]
    if isinstance(kind, o.Size):
        return ["0", "512", "1e400GB", "lots", "-5MB", "2EB"]
    if isinstance(kind, o.LayerCounts):
        return ["20,x", "0,30", "", "-1"]
    if isinstance(kind, o.ExistingPath):  # ModelPath too
        return [places["missing"], places["dir"] if kind.kind == "file" else places["file"]]
    if isinstance(kind, o.NewPath):
        return [places["dir"], places["missing"] + "/x.yaml"] if kind.kind == "file" else \
            [places["file"], places["file"] + "/sub"]
    raise AssertionError(f"no bad values for {kind!r}")


def _base(command: str, places: dict) -> dict[str, str]:
    """Valid values of every required parameter of `command`, by parameter name."""
    m, out = places["manifest"], places["out"]
    return {"generate": {"prompts": "x"}, "inspect": {"model": "smollm2-135m"}, "plan": {"model": "smollm2-135m"},
            "validate": {"manifest": m}, "shard": {"model": "smollm2-135m", "manifest": m, "output": out},
            "reshard": {"source": places["dir"], "manifest": m, "output": out},
            "consolidate": {"source": places["dir"], "output": out}, "convert": {"model": "smollm2-135m", "output": out},
            "verify": {"folder": places["dir"]}}.get(command, {})


def _argv(command: str, values: dict[str, str]) -> list[str]:
    cmd = COMMAND.commands[command]
    argv = [command]
    for p in cmd.params:
        if p.name in values:
            argv += [values[p.name]] if p.param_type_name == "argument" else [p.opts[0], values[p.name]]
    return argv


def _cases(places_stub: dict):
    out = []
    for command, p in _params():
        kind = _checked(p)
        if kind is not None:
            for value in _bad_values(kind, places_stub):
                out.append((command, p.name, value))
    return out


_STUB = {k: f"<{k}>" for k in ("file", "dir", "manifest", "missing", "out")}
CASES = _cases(_STUB)


@pytest.mark.parametrize("command,name,value", CASES, ids=[f"{c}-{n}-{v}" for c, n, v in CASES])
def test_a_bad_value_is_one_line_naming_the_option_and_exit_2(command, name, value, places, capsys):
    for key, stub in _STUB.items():
        value = value.replace(stub, places[key])
    values = {**_base(command, places), name: value}
    code = main(_argv(command, values))
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err)
    assert err.startswith("error:") and "\n" not in err, err
    param = next(p for p in COMMAND.commands[command].params if p.name == name)
    assert any(opt in err for opt in param.opts) or name.upper() in err, err
    assert repr(value[:60])[1:-1] in err or value == "", err


BAD_WORDS = [
    (["generate", "x", "--dtype", "float16"], "--dtype float16 is not supported"),
    (["generate", "x", "--quantization", "int3"], "use none, int8 or int4"),
    (["generate", "x", "--device", "tpu"], "--device tpu is not supported"),
    (["generate", "   "], "empty prompt"),
    (["generate", "x", "--tp", "10"], "use --tp 9"),
    (["generate", "x", "--pp", "31"], "use --pp 30"),
    (["generate", "x", "--max-new-tokens", "10000"], "the model allows 8192"),
    (["generate", "x", "--pp", "2", "--micro-batches", "2"], "use --micro-batches 1"),
    (["plan", "smollm2-135m", "--devices", ""], "no devices given"),
    (["plan", "smollm2-135m", "--dtype", "int8"], "--dtype int8 is not supported"),
    (["plan", "smollm2-135m", "--objective", "speed"], "--objective speed is not supported"),
    (["plan", "smollm2-135m", "--max-seq-len", "100000"], "exceeds the model's 8192 positions"),
    (["plan", "nosuchmodel"], "unknown model preset"),
    (["perplexity", "--dtype", "float64"], "comma-separated list of float32, bfloat16"),
    (["generate", "x", "--verify", "sometimes"], "--verify sometimes"),
    (["shard", "smollm2-135m", "--manifest", "{manifest}", "-o", "{out}", "--verify", "maybe"], "--verify maybe"),
    (["convert", "smollm2-135m", "-o", "{out}", "--quantization", "int2"], "--quantization int2 is not supported"),
]


@pytest.mark.parametrize("argv,expect", BAD_WORDS, ids=[" ".join(a[:3]) for a, _ in BAD_WORDS])
def test_a_bad_word_is_refused_before_anything_runs(argv, expect, places, capsys):
    code = main([a.format(**places) for a in argv])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and expect in err, (code, err)


CONFLICTS = [
    (["generate", "x", "--manifest", "{manifest}", "--tp", "1"], "--tp 1 cannot be combined with --manifest"),
    (["generate", "x", "--manifest", "{manifest}", "--pp", "2"], "--pp 2 cannot be combined with --manifest"),
    (["generate", "x", "--manifest", "{manifest}", "--layers", "30"], "--layers 30 cannot be combined"),
    (["generate", "x", "--manifest", "{manifest}", "--dtype", "float32"], "--dtype float32 cannot be combined"),
    (["generate", "x", "--manifest", "{manifest}", "--memory-budget", "300MB"], "--memory-budget 300MB cannot"),
    (["generate", "x", "--manifest", "{manifest}", "--no-prefetch"], "--no-prefetch cannot be combined"),
    (["generate", "x", "--micro-batches", "2"], "only applies to pipeline parallelism"),
    (["generate", "x", "--offload-dir", "{dir}"], "only apply with --memory-budget"),
    (["generate", "x", "--device", "cuda", "--offload-dir", "{dir}", "--memory-budget", "100MB"], "drop --offload-dir"),
    (["plan", "smollm2-135m", "--devices", "2xcpu-4GB", "--cluster", "{file}"], "either --devices or --cluster"),
]


@pytest.mark.parametrize("argv,expect", CONFLICTS, ids=[" ".join(a[2:5]) for a, _ in CONFLICTS])
def test_conflicting_options_are_refused_in_one_line(argv, expect, places, capsys):
    code = main([a.format(**places) for a in argv])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and expect in err, (code, err)
