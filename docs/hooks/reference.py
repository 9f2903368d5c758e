"""MkDocs hook: reference pages generated from the source at build time, so they cannot drift.

* ``reference/config.md`` is written from the dataclasses of ``splitlearn/config.py``
  (every field's full key, type, default and the comments beside it), the protocol
  options of ``protocols/*.py`` and the config groups of ``conf/``. Nothing is
  imported: the source is read with :mod:`ast` and :mod:`tokenize`.
* ``<!-- cli: PATH -->`` in a page becomes a table of the options that ``PATH``'s
  ``argparse`` calls declare (read with :mod:`ast` too), ``<!-- benchmarks -->`` the list
  of benchmarks in ``benchmarks/cli.py``'s docstring, ``<!-- capabilities -->`` the
  protocols' capabilities (``protocols/*.py``) and ``<!-- refusals -->`` the data plane's
  refusal reasons (``trunk.proto``).

Registered in ``mkdocs.yml`` under ``hooks:``.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
CONFIG_SOURCE = ROOT / "splitlearn" / "config.py"
PROTOCOLS_DIR = ROOT / "protocols"
CONF_DIR = ROOT / "conf"
CONFIG_PAGE = "reference/config.md"

# ---------------------------------------------------------------------------------------
# Dataclasses and their comments
# ---------------------------------------------------------------------------------------


@dataclass
class FieldDoc:
    """One dataclass field as the source declares it."""

    name: str
    annotation: str
    default: str
    comment: str
    above: bool  # the comment is a block above the field (it may cover the next ones too)
    nested: str | None  # the dataclass it holds (directly, per key, or per item)
    shape: str  # "", "dict" (``key.<name>.field``) or "list" (``key[i].field``)
    shares: str = ""  # the field whose comment block above covers this one too


@dataclass
class ClassDoc:
    """One dataclass: its name, bases, docstring and fields."""

    name: str
    bases: list[str]
    doc: str
    fields: list[FieldDoc]


def _comments(source: str) -> dict[int, str]:
    """Return each line's comment text (without ``#``), by line number."""
    found: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def _field_comment(node: ast.AnnAssign, lines: list[str],
                   comments: dict[int, str]) -> tuple[str, bool]:
    """Return the comment block above a field and the one beside it, and whether above."""
    above: list[str] = []
    number = node.lineno - 1
    while number >= 1 and lines[number - 1].strip().startswith("#"):
        above.insert(0, comments.get(number, ""))
        number -= 1
    beside = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
              if n in comments and not lines[n - 1].strip().startswith("#")]
    return " ".join(part for part in (*above, *beside) if part), bool(above) and not beside


def _default(value: ast.expr | None) -> str:
    """Render a field's default as the source gives it."""
    if value is None:
        return "required"
    if isinstance(value, ast.Name) and value.id == "MISSING":
        return "required"
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for keyword in value.keywords:
            if keyword.arg == "default_factory":
                factory = ast.unparse(keyword.value)
                return {"dict": "{}", "list": "[]"}.get(factory, "see below")
            if keyword.arg == "default":
                return _default(keyword.value)
    return ast.unparse(value)


def _nested(annotation: ast.expr, known: set[str]) -> tuple[str | None, str]:
    """Return the dataclass an annotation holds and how (directly, per key, per item)."""
    if isinstance(annotation, ast.Name) and annotation.id in known:
        return annotation.id, ""
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        inner = annotation.slice
        last = inner.elts[-1] if isinstance(inner, ast.Tuple) else inner
        if isinstance(last, ast.Name) and last.id in known:
            return last.id, {"dict": "dict", "list": "list"}.get(annotation.value.id, "")
    return None, ""


def read_dataclasses(path: Path) -> dict[str, ClassDoc]:
    """Return every ``@dataclass`` of a module, fields in source order.

    Parameters
    ----------
    path : Path
        A Python source file.

    Returns
    -------
    dict[str, ClassDoc]
        By class name.
    """
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    comments = _comments(source)
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and any(
        ast.unparse(d).split("(")[0] == "dataclass" for d in node.decorator_list)]
    known = {node.name for node in classes} | set(_CONFIG_CLASSES)
    found: dict[str, ClassDoc] = {}
    for node in classes:
        fields: list[FieldDoc] = []
        previous_end = 0
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                nested, shape = _nested(item.annotation, known)
                comment, above = _field_comment(item, lines, comments)
                previous = fields[-1] if fields else None
                shares = ""
                if (not comment and previous is not None and previous.above
                        and item.lineno == previous_end + 1):
                    # A block comment above a run of fields covers the run (the TLS files).
                    comment, above = previous.comment, True
                    shares = previous.shares or previous.name
                fields.append(FieldDoc(
                    name=item.target.id, annotation=ast.unparse(item.annotation),
                    default=_default(item.value), comment=comment, above=above,
                    shares=shares, nested=nested, shape=shape))
                previous_end = item.end_lineno or item.lineno
        found[node.name] = ClassDoc(node.name, [ast.unparse(b) for b in node.bases],
                                    ast.get_docstring(node) or "", fields)
    return found


#: Filled by :func:`config_page` before the protocols are read (their nested classes).
_CONFIG_CLASSES: dict[str, ClassDoc] = {}

# ---------------------------------------------------------------------------------------
# The config page
# ---------------------------------------------------------------------------------------

INTRO = """\
# Configuration reference

*Generated at build time from `splitlearn/config.py`, `protocols/*.py` and `conf/`
(`docs/hooks/reference.py`): every key below exists, with the default and the comment
its source gives it.*

A run's config is composed by Hydra from `conf/config.yaml` and one
option of each [config group](#config-groups) (`strategy=sglr`, `model=resnet`, ...). Any
key can be set on the command line with its full name (`strategy.num_rounds=5`); a key of
an open mapping is added with `+` (`+model.options.hidden=128`,
`'+privacy.per_device={wearable: {epsilon_max: 2}}'`, `'+planner.leak={1: 0.8}'`), and a
scenario is added with `+scenario=NAME`. Hydra's own keys work too: `hydra.run.dir=PATH`
names the run folder, `hydra.sweep.dir=PATH` a multirun's folder.

Every key is typed by the dataclasses below, and each protocol's options by its own
schema (`strategy.bulk` exists for `strategy=local_loss`, not for `splitfed_v2`): a
misspelt key or a value of the wrong type fails when the config is composed, naming the
key. What can only be checked against the model, the data or the fleet (the cut's range,
a `dataset.path` that is missing, privacy settings a protocol cannot honour, more
`strategy.min_train_nodes` than clients) is checked by `protocols.check_config` before
Ray or the trunk start.
"""


def _cell(text: str) -> str:
    """Escape text for a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _prose(text: str) -> str:
    """Escape source comments for a table cell: no emphasis, no HTML, rST spans as code."""
    text = text.replace("``", "`").replace("*", "\\*").replace("<", "&lt;")
    return _cell(text)


def _code(text: str) -> str:
    """Text in a code span, escaped for a table cell."""
    return f"`{_cell(text)}`"


def _rows(cls: ClassDoc, prefix: str, *, skip: frozenset[str] = frozenset()) -> list[str]:
    rows = []
    for field in cls.fields:
        if field.name in skip or (field.nested and field.shape == ""):
            continue
        key = f"{prefix}{field.name}"
        if field.nested:
            key += ".<name>" if field.shape == "dict" else "[i]"
            described = f"{_prose(field.comment)} (fields: [`{key}.*`](#{_anchor(key)}))"
        elif field.shares:
            described = f"See `{prefix}{field.shares}`."
        else:
            described = _prose(field.comment)
        default = field.default if field.default == "required" else _code(field.default)
        rows.append(f"| {_code(key)} | {_code(field.annotation)} | {default} "
                    f"| {described} |")
    return rows


def _anchor(key: str) -> str:
    """Return the HTML id of a key prefix's section."""
    return re.sub(r"[^a-z0-9]+", "-", key.lower()).strip("-") or "top-level"


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "`")


def _section(cls: ClassDoc, prefix: str, *, level: int = 2,
             skip: frozenset[str] = frozenset()) -> list[str]:
    """Return a section for ``cls`` at ``prefix`` and, after it, one per nested dataclass."""
    title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
    anchor = _anchor(prefix.rstrip("."))
    out = [f"{'#' * level} {title} {{#{anchor}}}", "",
           f"{_first_paragraph(cls.doc)} (`{cls.name}`)", ""]
    rows = _rows(cls, prefix, skip=skip)
    if rows:
        out += ["| key | type | default | what it is |", "| --- | --- | --- | --- |", *rows, ""]
    for field in cls.fields:
        if field.nested and field.name not in skip:
            key = f"{prefix}{field.name}"
            if field.shape == "dict":
                key += ".<name>"
            elif field.shape == "list":
                key += "[i]"
            out += _section(_CONFIG_CLASSES[field.nested], f"{key}.", level=min(level + 1, 3))
    return out


def _protocol_options() -> list[tuple[str, ClassDoc]]:
    """Return (protocol name, options dataclass) for each protocol module, by name."""
    found = []
    for path in sorted(PROTOCOLS_DIR.glob("*.py")):
        for cls in read_dataclasses(path).values():
            if "StrategyConfig" in cls.bases:
                name = next(f.default.strip("'\"") for f in cls.fields if f.name == "name")
                found.append((name, cls))
    return sorted(found)


def _strategy_section() -> list[str]:
    shared = _CONFIG_CLASSES["StrategyConfig"]
    out = _section(shared, "strategy.")
    out += ["Each protocol (`strategy=NAME`, see [the protocols](../explanation/protocols.md)) "
            "adds its own options to these:", ""]
    for name, cls in _protocol_options():
        out += [f"### `strategy={name}` {{#strategy-{_anchor(name)}}}", "",
                f"{_first_paragraph(cls.doc)} (`{cls.name}`)", ""]
        rows = _rows(cls, "strategy.", skip=frozenset({"name"}))
        out += (["| key | type | default | what it is |", "| --- | --- | --- | --- |", *rows]
                if rows else ["No options beyond the shared ones."])
        out.append("")
    return out


def _yaml_comment(path: Path) -> tuple[str | None, str]:
    """Return a yaml file's ``# @package`` and its leading comment, joined."""
    package, text = None, []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        body = line.lstrip("#").strip()
        if body.startswith("@package"):
            package = body.split(None, 1)[1]
        else:
            text.append(body)
    return package, " ".join(text)


def _flatten(node: Any, prefix: str) -> list[str]:
    """Return ``key=value`` for every leaf a yaml option sets."""
    if isinstance(node, dict) and node:
        out = []
        for key, value in node.items():
            if key == "defaults":
                for entry in value:
                    if isinstance(entry, dict):
                        for name, option in entry.items():
                            if str(name).startswith("override /"):
                                out.append(f"{str(name)[len('override /'):]}={option}")
                continue
            out += _flatten(value, f"{prefix}{key}.")
        return out
    if isinstance(node, list) and node and all(isinstance(v, dict) for v in node):
        return [f"{prefix.rstrip('.')}=[{len(node)} entries]"]
    return [f"{prefix.rstrip('.')}={yaml.safe_dump(node, default_flow_style=True).strip()}"
            .replace("\n...", "")]


def _groups_section() -> list[str]:
    defaults = yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
    chosen = {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items()}
    out = ["## Config groups {#config-groups}", "",
           "Each folder of `conf/` is a group: `GROUP=OPTION` on the command line selects "
           "`conf/GROUP/OPTION.yaml`, which sets the keys listed (scenarios are added with "
           "`+scenario=NAME` and may set any key). **Bold**: the option `conf/config.yaml` "
           "selects by default.", ""]
    for folder in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        options = sorted(folder.glob("*.yaml"))
        if not options:
            continue
        group = folder.name
        packages = {_yaml_comment(p)[0] for p in options}
        package = next(iter(packages)) if len(packages) == 1 else None
        selector = f"+{group}=NAME" if group not in chosen else f"{group}=NAME"
        sets_what = ("any key (`# @package _global_`)" if package == "_global_"
                     else f"`{package or group}.*`")
        out += [f"### `{selector}` {{#group-{_anchor(group)}}}", "", f"Sets {sets_what}.", "",
                "| option | what it is | what it sets |", "| --- | --- | --- |"]
        for path in options:
            option = path.stem
            shown = f"**`{option}`**" if chosen.get(group) == option else f"`{option}`"
            content = yaml.safe_load(path.read_text()) or {}
            base = "" if package == "_global_" else f"{package or group}."
            sets = ", ".join(_code(s) for s in _flatten(content, base)
                             if not s.startswith(f"{base}name="))
            out.append(f"| {shown} | {_prose(_yaml_comment(path)[1])} | {sets} |")
        out.append("")
        for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
            for path in sorted(sub.glob("*.yaml")):
                names = ", ".join(f"`{k}`" for k in yaml.safe_load(path.read_text()))
                out += [f"`{group}/{sub.name}={path.stem}` (selected by the options above) "
                        f"defines the device presets {names}, each field of "
                        f"[`{group}.{sub.name}.<name>`](#{_anchor(f'{group}.{sub.name}.<name>')}) "
                        f"with its source (`conf/{group}/{sub.name}/{path.name}`).", ""]
    return out


def config_page() -> str:
    """Return the markdown of the configuration reference."""
    _CONFIG_CLASSES.clear()
    _CONFIG_CLASSES.update(read_dataclasses(CONFIG_SOURCE))
    root = _CONFIG_CLASSES["Config"]
    top = ClassDoc("Config", [], root.doc, [f for f in root.fields if not f.nested])
    out = [INTRO, *_section(top, "")]
    for field in root.fields:
        if field.nested == "StrategyConfig":
            out += _strategy_section()
        elif field.nested:
            out += _section(_CONFIG_CLASSES[field.nested], f"{field.name}.")
    out += _groups_section()
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------


def _constants(tree: ast.Module) -> dict[str, Any]:
    """Return a module's top-level constants that are plain literals."""
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return found


def _evaluate(node: ast.expr, constants: dict[str, Any]) -> Any:
    """Evaluate an expression over literal constants only (ValueError otherwise)."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if not names <= set(constants) | {"sorted", "len"}:
        raise ValueError(ast.unparse(node))
    code = compile(ast.Expression(node), "<cli>", "eval")
    return eval(code, {"__builtins__": {"sorted": sorted, "len": len}}, constants)  # noqa: S307


def _text(node: ast.expr | None, constants: dict[str, Any]) -> str:
    """Render a help text: literal, or an f-string with its constants filled in."""
    if node is None:
        return ""
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                try:
                    parts.append(str(_evaluate(value.value, constants)))
                except ValueError:
                    parts.append(ast.unparse(value.value))
        return "".join(parts)
    try:
        return str(_evaluate(node, constants))
    except ValueError:
        return ast.unparse(node)


def cli_table(path: Path) -> str:
    """Return a markdown table of the options ``path``'s ``add_argument`` calls declare.

    Parameters
    ----------
    path : Path
        A module that builds an ``argparse`` parser.

    Returns
    -------
    str
        One row per argument: its flags, what it takes, its default and its help.
    """
    tree = ast.parse(path.read_text())
    constants = _constants(tree)
    # A default computed by a module function is described by that function's docstring.
    described = {node.name: (ast.get_docstring(node) or "").split("\n")[0].replace("``", "`")
                 for node in tree.body if isinstance(node, ast.FunctionDef)}
    rows = ["| argument | takes | default | what it does |", "| --- | --- | --- | --- |"]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        action = _text(keywords.get("action"), constants)
        takes = ""
        if "choices" in keywords:
            try:
                takes = " | ".join(f"`{c}`" for c in _evaluate(keywords["choices"], constants))
            except ValueError:
                takes = f"one of `{ast.unparse(keywords['choices'])}`"
        elif action not in ("store_true", "store_false"):
            takes = "`{}`".format(_text(keywords.get("metavar"), constants) or (
                ast.unparse(keywords["type"]) if "type" in keywords else "str"))
        if _text(keywords.get("nargs"), constants) in ("+", "*"):
            takes += " ..."
        default = ""
        if "default" in keywords:
            node_default = keywords["default"]
            try:
                value = _evaluate(node_default, constants)
                default = "" if value is None else f"`{value}`"
            except ValueError:
                called = ast.unparse(node_default.func) if isinstance(node_default, ast.Call) \
                    else ""
                default = described.get(called) or f"`{ast.unparse(node_default)}`"
        if _text(keywords.get("required"), constants) == "True":
            default = "required"
        helptext = _text(keywords.get("help"), constants).replace(" (default: %(default)s)", "")
        rows.append(f"| {' '.join(f'`{f}`' for f in flags)} | {_cell(takes)} | "
                    f"{_cell(default)} | {_cell(helptext)} |")
    return "\n".join(rows)


def benchmark_list() -> str:
    """Return the benchmarks ``benchmarks/cli.py``'s docstring describes, as a list."""
    doc = ast.get_docstring(ast.parse((ROOT / "benchmarks" / "cli.py").read_text())) or ""
    items = []
    for name, body in re.findall(r"``([a-z-]+)``\n((?:    .*\n?)+)", doc):
        text = " ".join(textwrap.dedent(body).split())
        text = re.sub(r":mod:`([^`]+)`", r"`\1`", text).replace("``", "`")
        items.append(f"- `{name}`: {text}")
    return "\n".join(items)


# ---------------------------------------------------------------------------------------
# Protocol capabilities
# ---------------------------------------------------------------------------------------

#: The capabilities shown, in order, with their column titles.
CAPABILITY_COLUMNS = (
    ("trunk", "trunk"), ("averages_device_weights", "averages device weights"),
    ("per_device_cuts", "per-device cuts"), ("shards_trunk", "trunk workers"),
    ("runtimes", "device runtimes"), ("sends_activations", "sends activations"),
    ("nopeek", "NoPeek"), ("error_feedback", "error feedback"),
    ("device_tail", "device tail"), ("reply_payload", "activations in the reply"),
)


def _protocol_entries() -> list[tuple[str, dict[str, str]]]:
    """Return each registered protocol's name and capabilities, read from ``protocols/``.

    The order is :data:`protocols.registry.PROTOCOLS`'s; ``**NAME`` in a ``Capabilities``
    call expands a ``dict(...)`` constant of the protocols' modules.
    """
    defaults = {f.name: f.default for f in read_dataclasses(PROTOCOLS_DIR / "spec.py")[
        "Capabilities"].fields}
    shared: dict[str, ast.Call] = {}
    entries: dict[str, tuple[str, dict[str, str]]] = {}
    for path in sorted(PROTOCOLS_DIR.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            target = ast.unparse(node.targets[0])
            call = node.value
            if ast.unparse(call.func) == "dict":
                shared[target] = call
            elif ast.unparse(call.func) == "Protocol":
                entries[f"{path.stem}.{target}"] = (ast.literal_eval(call.args[0]), _caps(call))
    for _, caps in entries.values():
        for name, call in shared.items():
            if caps.pop(f"**{name}", None) is not None:
                caps.update({k.arg: ast.unparse(k.value) for k in call.keywords if k.arg})
    registry = ast.parse((PROTOCOLS_DIR / "registry.py").read_text())
    order = [ast.unparse(n) for n in ast.walk(registry)
             if isinstance(n, ast.Attribute) and f"{ast.unparse(n)}" in entries]
    return [(entries[k][0], defaults | entries[k][1]) for k in order]


def _caps(protocol: ast.Call) -> dict[str, str]:
    """Return the keywords of the ``Capabilities(...)`` call inside a ``Protocol(...)``."""
    call = next(a for a in protocol.args if isinstance(a, ast.Call)
                and ast.unparse(a.func) == "Capabilities")
    return {(k.arg or f"**{ast.unparse(k.value)}"): ast.unparse(k.value) for k in call.keywords}


def capability_table() -> str:
    """Return the protocols' capabilities as a markdown table."""
    def shown(key: str, value: str) -> str:
        if key in ("device_tail", "reply_payload"):
            return "no" if value == "None" else {"device_tail": "`strategy.tail_cut`",
                                                 "reply_payload": "`strategy.bulk=true`"}[key]
        if value in ("True", "False"):
            return "yes" if value == "True" else "no"
        return ", ".join(ast.literal_eval(value)) if key == "runtimes" else value.strip("'\"")

    rows = ["| `strategy=` | " + " | ".join(title for _, title in CAPABILITY_COLUMNS) + " |",
            "| --- " * (len(CAPABILITY_COLUMNS) + 1) + "|"]
    for name, caps in _protocol_entries():
        rows.append(f"| `{name}` | " + " | ".join(shown(k, caps[k]) for k, _ in
                                                CAPABILITY_COLUMNS) + " |")
    return "\n".join(rows)


def refusal_table() -> str:
    """Return the data plane's refusal reasons, from ``trunk.proto``'s ``Reason`` enum."""
    proto = (ROOT / "splitlearn" / "dataplane" / "trunk.proto").read_text()
    enum = re.search(r"enum Reason \{(.*?)\}", proto, re.DOTALL)
    assert enum is not None, "trunk.proto has no enum Reason"
    rows = ["| reason | when |", "| --- | --- |"]
    for name, comment in re.findall(r"^\s*([A-Z_]+) = \d+;\s*(?://\s*(.*))?$", enum.group(1),
                                    re.MULTILINE):
        if name != "REASON_UNSPECIFIED":
            rows.append(f"| `{name}` | {_prose(comment)} |")
    return "\n".join(rows)


def render_markers(markdown: str) -> str:
    """Replace the ``<!-- cli: PATH -->``, ``benchmarks``, ``capabilities`` and ``refusals``."""
    markdown = re.sub(r"<!-- cli: (\S+) -->", lambda m: cli_table(ROOT / m.group(1)), markdown)
    markdown = markdown.replace("<!-- capabilities -->", capability_table())
    markdown = markdown.replace("<!-- refusals -->", refusal_table())
    return markdown.replace("<!-- benchmarks -->", benchmark_list())


# ---------------------------------------------------------------------------------------
# MkDocs events
# ---------------------------------------------------------------------------------------


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated configuration reference to the site's files."""
    files.append(File.generated(config, CONFIG_PAGE, content=config_page()))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Fill the generated parts of a page."""
    return render_markers(markdown)
