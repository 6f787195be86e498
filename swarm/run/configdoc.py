"""The configuration reference (docs/config.md), generated from swarm/config.py so that it cannot drift.

Every key of every section, with its type, its default and its meaning: the attribute docstring under the field,
else its trailing comment, else the comment block right above it. `python -m swarm.run.configdoc > docs/config.md`
writes it; a test fails when the file is stale or a key has no meaning.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
from pathlib import Path

from swarm import config

SOURCE = Path(config.__file__)


@dataclasses.dataclass(frozen=True)
class Key:
    section: str
    name: str
    type: str
    default: str
    meaning: str

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


def keys() -> list[Key]:
    """Every key of `Config`, in the order its sections and fields are declared."""
    text = SOURCE.read_text()
    tree = ast.parse(text)
    comments = {tok.start[0]: (tok.string.lstrip("# ").strip(), tok.line.lstrip().startswith("#"))
                for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT}
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    found = []
    for section in dataclasses.fields(config.Config):
        body = classes[section.default_factory.__name__].body
        for i, node in enumerate(body):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            found.append(Key(section.name, node.target.id, ast.get_source_segment(text, node.annotation),
                             _default(text, node), _meaning(body, i, comments)))
    return found


def _default(text: str, node: ast.AnnAssign) -> str:
    if node.value is None:
        return "required"
    if isinstance(node.value, ast.Call) and any(k.arg == "default_factory" for k in node.value.keywords):
        factory = next(k.value for k in node.value.keywords if k.arg == "default_factory")
        return ast.get_source_segment(text, factory.body) if isinstance(factory, ast.Lambda) else "[]"
    return ast.get_source_segment(text, node.value)


def _meaning(body: list[ast.stmt], i: int, comments: dict[int, tuple[str, bool]]) -> str:
    """The field's docstring, else its trailing comment, else the block of comment lines right above it."""
    node, after = body[i], body[i + 1] if i + 1 < len(body) else None
    if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
        return " ".join(after.value.value.split())
    trailing = [comments[line][0] for line in range(node.lineno, node.end_lineno + 1) if line in comments]
    if trailing:
        return " ".join(trailing)
    above, line = [], node.lineno - 1
    while line in comments and comments[line][1]:
        above.insert(0, comments[line][0])
        line -= 1
    return " ".join(above)


def reference() -> str:
    """docs/config.md."""
    out = ["# Configuration reference", "",
           "Generated from `swarm/config.py` by `python -m swarm.run.configdoc > docs/config.md` (a test checks it is "
           "current). A config file sets these keys by section; any command takes them as dotted overrides "
           "(`--inner.lr 3e-4` or `inner.lr=3e-4`). Keys marked *peer* are each peer's own business; keys "
           "marked *copy* say where this peer's copy of the run's corpus lies (the run pins the corpus's content "
           "hash instead: a joiner starts from the manifest's and may set its own); the others are the run's (a "
           "run's manifest holds them and `swarm join` takes them from it).", ""]
    section = None
    for key in keys():
        if key.section != section:
            section = key.section
            doc = " ".join((getattr(config.Config(), section).__doc__ or "").split())
            out += ["", f"## {section}", "", *([doc, ""] if doc and not doc.startswith(section.title()) else []),
                    "| key | type | default | meaning |", "|---|---|---|---|"]
        peer = (" *peer*" if config.is_per_peer(key.dotted) else
                " *copy*" if key.dotted in config.CORPUS_LOCATION_KEYS else "")
        cells = [f"`{key.dotted}`{peer}", f"`{key.type}`", f"`{key.default}`", key.meaning]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
