"""What the documents name exists: every `eagle3-hf COMMAND`, every `--flag` (checked against that command's
parser where the command is named, else against the flags some parser of the repository defines or the engines
and launchers we document), every repository file path, and every dotted name of ours (`eagle3_hf.x.y`, a module
or a name it defines; `python -m PACKAGE.x`, a module). The documents are README.md, docs/ (less the generated
docs/cli.md) and the package's docstrings; a renamed file, function or flag fails here, not in a user's shell."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from eagle3_hf.cli import COMMANDS, command_parser
from eagle3_hf.train.arguments import build_parser as train_parser

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"docs/cli.md"}  # every command's --help: current by tests/test_cli_reference.py
# flags of the programs the documents show beside ours: SGLang's and vLLM's servers, accelerate, torchrun, pip, pytest,
# docker
EXTERNAL_FLAGS = {
    "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps", "--speculative-eagle-topk",
    "--speculative-num-draft-tokens", "--speculative-use-rejection-sampling", "--attention-backend", "--model",
    "--model-path", "--speculative-config", "--kv-transfer-config", "--enforce-eager", "--no-enable-chunked-prefill",
    "--no-enable-prefix-caching", "--config_file", "--num_processes", "--main_process_port", "--main_process_ip",
    "--machine_rank", "--nproc-per-node", "--no-deps", "--durations", "--dist", "--help", "--ipc", "--shm-size",
    "--nnodes", "--node-rank", "--master-addr", "--master-port", "--num_machines",
    "--enable-return-aux-hidden-states", "--return-aux-hidden-state-layer-ids", "--disable-radix-cache",
    "--disable-overlap-schedule", "--port", "--no-build-isolation", "--max-total-tokens", "--host", "--device",
    "--dtype", "--reasoning-parser", "--tp-size", "--tp", "--default-chat-template-kwargs", "--jinja",
}
# files of other projects that the documents cite by name (SGLang's, vLLM's, speculators', transformers', llama.cpp's)
EXTERNAL_FILES = {"llama_eagle3.py", "algos.py", "model_runner.py", "extract_hidden_states.py", "modeling_llama.py",
                  "configuration_llama.py", "arg_utils.py", "cli_args.py", "convert_hf_to_gguf.py",
                  "qwen3_dflash.py", "dflash_worker_v2.py", "dflash_utils.py", "dflash.cpp", "speculative.cpp"}
COMMAND = re.compile(r"eagle3-hf\s+(?:--debug\s+)?([a-z][\w-]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*[\w]")
PATH = re.compile(r"(?<![\w./<>-])((?:[\w.-]+/)+(?:[\w.-]+)?)")
BARE_FILE = re.compile(r"(?<![\w./<>-])([\w-]+\.(?:py|sh|yaml))\b")
URL = re.compile(r"https?://\S+")
DOTTED = re.compile(r"(?<![\w./-])eagle3_hf(?:\.[A-Za-z_]\w*)+")
RUN_MODULE = re.compile(r"python3?\s+-m\s+([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def documents() -> Iterator[tuple[str, str]]:
    """(name, text) of every document: whole Markdown pages and each docstring of the package."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        name = page.relative_to(ROOT).as_posix()
        if name not in GENERATED:
            yield name, URL.sub("", page.read_text(encoding="utf-8"))
    yield from docstrings("eagle3_hf")


def docstrings(*folders: str) -> Iterator[tuple[str, str]]:
    """(file:line, docstring) of every module, class and function under `folders`."""
    for module in sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield f"{module.relative_to(ROOT).as_posix()}:{getattr(node, 'lineno', 1)}", URL.sub("", doc)


@cache
def command_flags(name: str) -> frozenset[str]:
    parser = train_parser() if name == "train" else command_parser(name)
    return frozenset(o for action in parser._actions for o in action.option_strings)


@cache
def repository_flags() -> frozenset[str]:
    """Every option string a parser in the repository defines: the commands', and the benches', experiments' and
    scripts' (any `--name` string literal in their code), plus the Makefile's and shell scripts'. Only the
    repository's own files: a virtual environment inside the checkout (.bench-venv/) is not the repository."""
    found = set().union(*(command_flags(name) for name in COMMANDS))
    for name in repository_paths():
        path = ROOT / name
        if not name.endswith(".py") or "tests" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"--[a-z][\w-]*",
                                                                                               node.value):
                found.add(node.value)
    return frozenset(found)


@cache
def repository_paths() -> frozenset[str]:
    """Tracked files and new ones git does not ignore: a local run's outputs (runs/, demo_out/) are not the
    repository's, so a document naming them must not pass because they happen to exist here."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    return frozenset(path for path in listed if path and (ROOT / path).exists())


def defined_names(body: list[ast.stmt]) -> set[str]:
    """The names a module or class body binds: definitions, assignments and imports, inside `if`/`try` too."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            names |= defined_names(node.body + node.orelse + getattr(node, "finalbody", [])
                                   + [s for h in getattr(node, "handlers", []) for s in h.body])
    return names


@cache
def repository_packages() -> frozenset[str]:
    """The repository's top-level packages (eagle3_hf, bench, ...): `python -m` of anything else is not ours."""
    return frozenset(p.split("/")[0] for p in repository_paths() if p.endswith("/__init__.py") and p.count("/") == 1)


def module_file(dotted: str) -> Path | None:
    """The repository file of module `dotted` (a.b -> a/b.py or a/b/__init__.py), or None."""
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.relative_to(ROOT).as_posix() in repository_paths():
            return path
    return None


def imported_from(body: list[ast.stmt], name: str, module: str, package: bool) -> str | None:
    """The dotted origin of `name` where the module body binds it by `from X import name` (relative X resolved)."""
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    base = module.split(".")[: len(module.split(".")) - node.level + (1 if package else 0)]
                    origin = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                    return f"{origin}.{alias.name}"
    return None


def dotted_problem(dotted: str, run: bool = False) -> str | None:
    """Why `dotted` does not resolve: the longest prefix that is a module of the repository, then each further
    part a name bound in that module (followed to where it is imported from), or in the class it names. `run`:
    `python -m` needs a module itself."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is not None:
            break
    else:
        return f"no module {parts[0]}"
    if run and cut < len(parts):
        return f"no module {dotted}"
    module, body = ".".join(parts[:cut]), ast.parse(path.read_text(encoding="utf-8")).body
    for i in range(cut, len(parts)):
        if parts[i] not in defined_names(body):
            return f"{'.'.join(parts[:i])} defines no {parts[i]}"
        origin = imported_from(body, parts[i], module, path.name == "__init__.py") if module else None
        if origin and module_file(origin.split(".")[0]) and origin != ".".join(parts[:i + 1]):
            why = dotted_problem(".".join([origin, *parts[i + 1:]]))  # follow the import to its definition
            return why and f"{'.'.join(parts[:i + 1])} ({origin}): {why}"
        nested = [n for n in body if isinstance(n, ast.ClassDef) and n.name == parts[i]]
        if not nested:  # a function or a value: what it holds is not read here
            return None
        body, module = nested[0].body, ""
    return None


def command_text(text: str, match: re.Match[str]) -> str:
    """The rest of a named command: up to the inline code span's end, or the line's end (with its `\\`
    continuations), a comment, a pipe or the next command."""
    rest = text[match.end():]
    if match.start() > 0 and text[match.start() - 1] == "`":
        return rest.split("`", 1)[0]
    lines = []
    for line in rest.split("\n"):
        lines.append(line)
        if not line.rstrip().endswith("\\"):
            break
    return re.split(r"\s#\s|[|;&)]|\beagle3-hf\b", "\n".join(lines), maxsplit=1)[0]


def stale_names(name: str, text: str) -> list[str]:
    problems = []
    paths, subpackages = repository_paths(), {p.split("/")[1] for p in repository_paths() if p.count("/") >= 2
                                                and p.startswith("eagle3_hf/")}
    top = {p.split("/")[0] for p in paths if "/" in p}
    for match in COMMAND.finditer(text):
        command = match.group(1)
        if command not in COMMANDS:
            problems.append(f"{name}: `eagle3-hf {command}` is no command")
            continue
        for flag in FLAG.findall(command_text(text, match)):
            if flag not in command_flags(command):
                problems.append(f"{name}: `eagle3-hf {command}` has no {flag}")
    for flag in FLAG.findall(text):
        if flag not in repository_flags() and flag not in EXTERNAL_FLAGS:
            problems.append(f"{name}: no parser defines {flag}")
    for path in (p.rstrip(".") for p in PATH.findall(text)):  # a sentence may end on a path
        first = path.split("/")[0]
        # relative to the package (engines/vllm/vllm_env.py): a module's path; train/serve or features/ are words
        in_package = first in subpackages and path.endswith(".py")
        candidates = [path.rstrip("/")] + ([f"eagle3_hf/{path.rstrip('/')}"] if in_package else [])
        if (first in top or in_package) and not any(
                c in paths or any(p.startswith(c + "/") for p in paths) for c in candidates):
            problems.append(f"{name}: no file or folder {path}")
    run = RUN_MODULE.findall(text)
    for module in run:
        if module.split(".")[0] in repository_packages() and (why := dotted_problem(module, run=True)):
            problems.append(f"{name}: `python -m {module}`: {why}")
    for dotted in DOTTED.findall(text):
        if dotted not in run and (why := dotted_problem(dotted)):
            problems.append(f"{name}: {dotted}: {why}")
    basenames = {p.rsplit("/", 1)[-1] for p in paths}
    for bare in BARE_FILE.findall(text):
        if bare not in basenames and bare not in EXTERNAL_FILES and not bare.split(".")[0].isupper():
            problems.append(f"{name}: no file {bare}")
    return problems


def test_documents_name_only_commands_flags_and_files_that_exist():
    problems = [p for name, text in documents() for p in stale_names(name, text)]
    assert problems == []


def test_a_stale_name_is_caught():
    planted = ("Run `eagle3-hf train --data-dir features/` (see eagle3_hf/engines/command.py and vllm_eval.py), "
               "then `eagle3-hf distill --foo`; `eagle3-hf extract --engine vllm --online` and --no-such-flag.")
    found = stale_names("probe", planted)
    assert found == ["probe: `eagle3-hf train` has no --data-dir", "probe: `eagle3-hf distill` is no command",
                     "probe: `eagle3-hf extract` has no --online", "probe: no parser defines --data-dir",
                     "probe: no parser defines --foo", "probe: no parser defines --online",
                     "probe: no parser defines --no-such-flag",
                     "probe: no file or folder eagle3_hf/engines/command.py", "probe: no file vllm_eval.py"]
    assert stale_names("probe", "`eagle3-hf train --features hf --prepared-dir prepared/ --output-dir runs/o` "
                                "(eagle3_hf/scripts/train.py, evaluation/sweep.py, examples/recipes/)") == []


def test_the_benches_experiments_and_scripts_name_only_modules_that_exist():
    """Their docstrings tell how to run them (`python -m bench.x`) and what of ours they call."""
    problems = [f"{name}: {why}" for name, text in docstrings("bench", "experiments", "scripts")
                for module in RUN_MODULE.findall(text)
                if module.split(".")[0] in repository_packages() and (why := dotted_problem(module, run=True))]
    problems += [f"{name}: {why}" for name, text in docstrings("bench", "experiments", "scripts")
                 for dotted in DOTTED.findall(text) if (why := dotted_problem(dotted))]
    assert problems == []


def test_a_stale_dotted_name_is_caught():
    planted = ("The head comes from eagle3_hf.data.importers.load_verifier_head; serve features with "
               "`python -m eagle3_hf.data.vllm_endpoint`, or `python -m eagle3_hf.publish.check.run`. "
               "eagle3_hf.model.checkpoint.no_such_function and eagle3_hf.Eagle3Config.no_such_method.")
    assert stale_names("probe", planted) == [
        "probe: `python -m eagle3_hf.data.vllm_endpoint`: no module eagle3_hf.data.vllm_endpoint",
        "probe: `python -m eagle3_hf.publish.check.run`: no module eagle3_hf.publish.check.run",
        "probe: eagle3_hf.data.importers.load_verifier_head: eagle3_hf.data defines no importers",
        "probe: eagle3_hf.model.checkpoint.no_such_function: eagle3_hf.model.checkpoint defines no no_such_function",
        "probe: eagle3_hf.Eagle3Config.no_such_method: eagle3_hf.Eagle3Config "
        "(eagle3_hf.model.configuration_eagle3.Eagle3Config): eagle3_hf.model.configuration_eagle3.Eagle3Config "
        "defines no no_such_method"]
    assert stale_names("probe", "`python -m eagle3_hf.cli train`, `python -m bench.train_step`, "
                                "eagle3_hf.model.checkpoint.eagle31_options, eagle3_hf.Eagle3Config.from_verifier, "
                                "eagle3_hf.train.setup.build_drafter and eagle3_hf.cli.") == []
