"""What runs in a grading cage: ``python -m llmkit.course.exercises.inside answers|judge SPEC`` (SPEC: a JSON file).

``answers``: a submission's answer cells, each in a fresh namespace (the chapter's earlier names it uses, nothing of
the other cells), under the cell's time limit; after each, its answers as data (``answers.encode``), or marked as
code, one JSON line in ``answers.jsonl``. A cell that stops on a name this cage cannot give it (a helper of the
chapter's checks, a name only a printout uses) is left to the judge: its answers are rebuilt there, as code. The
chapters' checks are not in this cage (bubblewrap hides their files; the audit hook below refuses their import where
the fallback cannot): nothing here decides.

``judge``: one exercise's verdict, in a fresh process, on those answers: data decoded, code rebuilt from the statements
of the answer cell that define it (``answers.slice_for``). Before the learner's code runs, the kit's check modules in
``sys.modules`` are swapped for watched ones (``Watched``) and an audit hook (which nothing can remove) watches: an
import of the checks, a look at their frames or objects, a change to the kit's functions, from the learner's code, is
refused and makes the verdict an error that says so; the verdict's file cannot be opened but by the judge. The
verdict: ``verdict.json``. What Python 3.11 does not audit (``__subclasses__``, ``__globals__``, ``f_back``: a walk
from any object to the checks' globals) is refused on sight in the answer's source (``introspects``); a name built at
run time still gets through.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import linecache
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmkit.course.exercises.answers import NotData, decode, encode, slice_for
from llmkit.course.exercises.context import Elsewhere
from llmkit.course.exercises.core import TimeLimit, time_limit
from llmkit.course.exercises.verdict import ERROR

KIT_CHECKS = "llmkit.course.exercises"
FRAMES = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_globals", "f_locals"}
SPYING = {"sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents"}
PATHS = {"open", "os.rename", "os.replace", "os.link", "os.symlink", "os.truncate", "os.remove", "shutil.move"}


# what Python 3.11 does not audit, read from the source instead: a way from any object to the checks' globals
INTROSPECTION = {"__subclasses__", "__globals__", "__builtins__", "__closure__", "__base__", "__bases__", "__mro__", "f_globals",
                 "f_locals", "f_back", "gi_frame", "tb_frame", "cr_frame"}  # fmt: skip


def introspects(source: str) -> str | None:
    """The first of INTROSPECTION ``source`` names (an attribute, or a string such as getattr's), if any."""
    for node in ast.walk(ast.parse(source)):
        name = node.attr if isinstance(node, ast.Attribute) else node.value if isinstance(node, ast.Constant) else None
        if isinstance(name, str) and name in INTROSPECTION:
            return name
    return None


def learner_file(filename: str) -> bool:
    return filename.startswith("<answer ")


def run_source(source: str, filename: str, namespace: dict) -> None:
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks and getsource
    exec(compile(source, filename, "exec"), namespace)


def namespace_for(spec: dict, name: str) -> dict:
    """A fresh namespace: the chapter's earlier names the cell uses (those this cage can make)."""
    namespace: dict[str, Any] = {"__name__": name}
    for key, value in spec.get("context", {}).items():
        namespace[key] = decode(value)
    for key, (module, attribute, call) in spec.get("elsewhere", {}).items():
        try:
            namespace[key] = Elsewhere(module, attribute, call).make()
        except Exception:  # noqa: BLE001 -- not in this cage (a chapter's checks): the name stays undefined
            continue
    return namespace


# --- the answers ----------------------------------------------------------------------------------------------------


def answer_values(spec: dict, number: int, source: str, names: list[str]) -> dict:
    namespace = namespace_for(spec, f"answer_{spec['chapter']}_{number}")
    try:
        with time_limit(spec["cell_timeout"]):
            run_source(source, f"<answer {spec['chapter']}.{number}>", namespace)
    except TimeLimit:
        return {"error": "the cell ran over its time limit and was interrupted"}
    except NameError:  # a name of the notebook's this cage lacks: the judge rebuilds what defines the answers
        return {"answers": {name: {"code": True} for name in names}}
    except BaseException as exc:  # noqa: BLE001 -- whatever the cell raises (SystemExit too) is its own error
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    values = {}
    for name in names:
        try:
            values[name] = encode(namespace.get(name, ...))
        except NotData:
            values[name] = {"code": True}
    return {"answers": values}


def run_answers(spec: dict) -> None:
    watch(None, list(spec["modules"].values()))  # the checks are not in this cage (bubblewrap); nor importable (the fallback)
    for number, source, names in spec["cells"]:
        with open("progress", "a") as f:
            f.write(f"{number}\n")  # the grader reads which cell runs (a cell that ends the process is that one)
        line = json.dumps({"number": number, **answer_values(spec, number, source, names)})
        with open("answers.jsonl", "a") as f:
            f.write(line + "\n")


# --- the judge ------------------------------------------------------------------------------------------------------


def on_learner_stack(frame: Any) -> bool:
    while frame is not None:
        if learner_file(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def kit_object(target: Any) -> bool:
    return str(getattr(target, "__module__", "")).startswith("llmkit")


def watch(result: Path | None, extra_modules: list[str]) -> tuple[list[str], Callable[[], None]]:
    """The audit hook: (what the learner's code was refused, a function that lets the judge write ``result`` once)."""
    refused: list[str] = []
    state = {"inside": False, "writer": False}
    guarded = str(result.resolve()) if result is not None else None

    def refuse(what: str) -> None:
        refused.append(what)
        raise PermissionError(f"a graded answer may not {what}")

    def hook(event: str, args: tuple) -> None:
        if state["inside"]:
            return
        state["inside"] = True
        try:
            check(event, args, sys._getframe(1))
        finally:
            state["inside"] = False

    def check(event: str, args: tuple, caller: Any) -> None:
        if (
            event in PATHS
            and not state["writer"]
            and any(isinstance(a, str | bytes | os.PathLike) and os.path.realpath(os.fsdecode(a)) == guarded for a in args[:2])
        ):
            refuse("write the verdict's file")
        elif event == "import" and str(args[0]).startswith((KIT_CHECKS, *extra_modules)) and on_learner_stack(caller):
            refuse(f"import the kit's checks ({args[0]})")
        elif event in SPYING and on_learner_stack(caller):
            refuse(f"look through the checks' objects ({event})")
        elif event == "sys._getframe" and (learner_file(caller.f_code.co_filename) or caller.f_code.co_filename.endswith("inspect.py")):
            refuse("read the checks' frames (sys._getframe)")
        elif event == "object.__getattr__" and args[1] in FRAMES and learner_file(caller.f_code.co_filename):
            refuse(f"read the checks' frames ({args[1]})")
        elif event == "object.__setattr__" and learner_file(caller.f_code.co_filename) and kit_object(args[0]):
            refuse(f"change the kit ({getattr(args[0], '__qualname__', args[0])}.{args[1]})")

    sys.addaudithook(hook)
    return refused, lambda: state.update(writer=True)


class Watched(types.ModuleType):
    """A check module as ``sys.modules`` holds it in a judge: the kit's code reads it as ever; the learner's is refused."""

    def __init__(self, module: types.ModuleType, refused: list[str]):
        super().__init__(module.__name__)
        object.__setattr__(self, "_watched", (module, refused))

    def __getattribute__(self, name: str) -> Any:
        module, refused = object.__getattribute__(self, "_watched")
        if on_learner_stack(sys._getframe(1)):
            refused.append(f"import the kit's checks ({module.__name__})")
            raise PermissionError("a graded answer may not use the kit's checks")
        return getattr(module, name)


def judge(spec: dict) -> None:
    from llmkit.course.exercises import core

    core.EXTRA_MODULES.update({int(k): v for k, v in spec["modules"].items()})
    ex = core.chapter(spec["chapter"]).exercises[spec["number"]]
    from llmkit.course.exercises import context  # noqa: F401 -- in before the modules are watched

    result = Path("verdict.json")
    refused, may_write = watch(result, list(spec["modules"].values()))
    for name in [m for m in sys.modules if m.startswith(KIT_CHECKS) or m in spec["modules"].values()]:
        sys.modules[name] = Watched(sys.modules[name], refused)  # what an import from the learner's code gets
    sys.modules["llmkit.course"].exercises = sys.modules[KIT_CHECKS]  # type: ignore[attr-defined]
    verdict = judged(ex, spec, refused)
    may_write()
    result.write_text(json.dumps(verdict))
    os._exit(0)  # a thread the learner's code left does not keep the process


def judged(ex: Any, spec: dict, refused: list[str]) -> dict:
    ex.timeout = spec["cell_timeout"]  # the check's own limit: a verdict that says so, before the grader kills the cage
    Path("progress").write_text("judging\n")  # the grader's clock for the cell's limit starts here
    code = [name for name, value in spec["answers"].items() if value == {"code": True}]
    values = {name: decode(value) for name, value in spec["answers"].items() if name not in code}
    if code and (found := introspects(spec["source"])) is not None:
        return {"status": ERROR, "message": f"the answer reached into the kit's checks: its code reads {found}, a way into them"}
    if code:
        namespace = namespace_for(spec, f"answer_{ex.chapter}_{ex.number}")
        try:
            with time_limit(spec["cell_timeout"]):
                run_source(slice_for(spec["source"], code), f"<answer {ex.chapter}.{ex.number}>", namespace)
        except (Exception, TimeLimit) as exc:  # noqa: BLE001 -- rebuilt, the cell raised: its own error
            return {"status": ERROR, "message": f"answer cell, rebuilt alone: {type(exc).__name__}: {exc}"[:300]}
        values.update({name: namespace.get(name, ...) for name in code})
    verdict = ex.verdict(*(values[name] for name in ex.answers)).to_json()
    if refused:
        return {"status": ERROR, "message": f"the answer reached into the kit's checks: it tried to {refused[0]}"}
    return verdict


class Dropping(io.TextIOBase):
    """stdout or stderr written straight to its descriptor, whatever past the cage's cap dropped (not an error in the cell)."""

    def __init__(self, fd: int):
        self.fd = fd

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError):
            os.write(self.fd, text.encode(errors="replace"))
        return len(text)


if __name__ == "__main__":
    command, path = sys.argv[1:3]
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    sys.path[:0] = spec["paths"]
    sys.stdout, sys.stderr = Dropping(1), Dropping(2)
    {"answers": run_answers, "judge": judge}[command](spec)
